"""The ratios a KL bound allows a token against those clipping allows: ``drift_anatomy.py
--boundary``'s table, which needs no checkpoint.

For a token of probability p under the behaviour policy whose ratio moves to r (the other tokens
scaled to keep the sum, as the lumped distribution does), :func:`moved_kl` is the KL that costs;
:func:`allowed_ratios` the ratios a bound eps allows; :func:`boundary_table` both against clip's
range, per probability.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def moved_kl(p: float, ratio: float) -> float:
    """KL(new || old) when a token of old probability ``p`` takes ``min(p * ratio, 1)`` and every
    other token is scaled by one factor to keep the sum: the two-point KL of the token against
    the rest, which such a scaling leaves exact."""
    if not (0 < p < 1 and ratio >= 0):
        raise ValueError(f"need 0 < p < 1 and ratio >= 0; got p={p!r}, ratio={ratio!r}")
    q = min(p * ratio, 1.0)

    def term(a: float, b: float) -> float:
        return a * math.log(a / b) if a > 0 else 0.0

    return term(q, p) + term(1.0 - q, 1.0 - p)


def allowed_ratios(p: float, eps: float) -> tuple[float, float]:
    """The smallest and largest ratio ``moved_kl(p, ratio) <= eps`` allows (bisection; the
    largest is ``1 / p`` when even all the mass on the token stays within eps)."""
    if not eps > 0:
        raise ValueError(f"eps must be > 0; got {eps!r}")

    def edge(inside: float, outside: float) -> float:  # moved_kl rises from inside to outside
        for _ in range(200):
            middle = (inside + outside) / 2
            inside, outside = (middle, outside) if moved_kl(p, middle) <= eps else (inside, middle)
        return inside

    low = 0.0 if moved_kl(p, 0.0) <= eps else edge(1.0, 0.0)
    high = 1.0 / p if moved_kl(p, 1.0 / p) <= eps else edge(1.0, 1.0 / p)
    return low, high


BOUNDARY_PROBS = (0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99)


def boundary_table(
    low: float, high: float, bounds: Sequence[float], probs: Sequence[float] = BOUNDARY_PROBS
) -> str:
    """Per token probability: the KL at clip's range [low, high] and the ratios each bound
    allows, in Markdown. A token whose ratio cannot reach ``high`` (p * high > 1) is not clipped
    upward: its KL there is that of all the mass on it, and the cell says so."""
    head = " | ".join(f"ratios eps {e:g} allows" for e in bounds)
    lines = [
        f"| p under pi_old | KL at ratio {low:g} | KL at ratio {high:g} | {head} |",
        "| ---: | ---: | ---: |" + " --- |" * len(bounds),
    ]
    for p in probs:
        up = f"{moved_kl(p, high):.4f}" + (" (p -> 1)" if p * high > 1 else "")
        cells = " | ".join("{:.3f} - {:.3f}".format(*allowed_ratios(p, e)) for e in bounds)
        lines.append(f"| {p:g} | {moved_kl(p, low):.4f} | {up} | {cells} |")
    return "\n".join(lines) + "\n"
