"""Paired comparisons of a study's arms: per-seed differences, a paired t-test and a sign test.

Two arms run on the same seeds see the same prompts in the same order, so the comparison is
paired: :func:`paired` takes each seed's difference and tests whether their mean is 0. With few
seeds the tests say little, and :class:`Paired` reports them beside the differences, never in
their place. The t distribution's tail is the regularised incomplete beta function, computed by
its continued fraction (:func:`t_two_sided`); no SciPy needed.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Paired", "paired", "sign_test", "seeds_short", "t_two_sided"]


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1 + numerator * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= c * d
        if abs(c * d - 1) < 1e-15:
            break
    return h


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b), 0 <= x <= 1."""
    if x <= 0 or x >= 1:
        return max(0.0, min(1.0, x))
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1 - math.exp(log_front) * _beta_fraction(b, a, 1 - x) / b


def t_two_sided(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError(f"df must be >= 1; got {df}")
    if math.isinf(t):
        return 0.0
    return _incomplete_beta(df / 2, 0.5, df / (df + t * t))


def sign_test(diffs: Sequence[float]) -> float:
    """Two-sided exact sign test of the non-zero ``diffs``: the chance of a split at least as
    lopsided under a fair coin."""
    signs = [d for d in diffs if d != 0]
    n, k = len(signs), sum(d > 0 for d in signs)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(max(k, n - k), n + 1)) / 2**n
    return min(1.0, 2 * tail)


@dataclass(frozen=True)
class Paired:
    """Per-seed differences ``a - b`` and what they say together."""

    diffs: tuple[float, ...]
    mean: float
    t: float
    """The paired t statistic (inf when every difference is equal and non-zero; NaN for fewer
    than two seeds)."""
    p_t: float
    """Two-sided p of the paired t-test (n - 1 degrees of freedom)."""
    p_sign: float
    """Two-sided p of the exact sign test."""

    def text(self) -> str:
        """``+0.012 (+0.010, -0.004, +0.030); t-test p 0.41, sign test p 1.00``."""
        each = ", ".join(f"{d:+.3f}" for d in self.diffs)
        t_test = "no t-test (one seed)" if math.isnan(self.p_t) else f"t-test p {self.p_t:.2f}"
        return f"{self.mean:+.3f} ({each}); {t_test}, sign test p {self.p_sign:.2f}"


def paired(a: Sequence[float], b: Sequence[float]) -> Paired:
    """The paired comparison of ``a`` and ``b``, one value per seed in the same order."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired needs equal, non-empty lists; got {len(a)} and {len(b)} values")
    diffs = tuple(x - y for x, y in zip(a, b, strict=True))
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return Paired(diffs, mean, math.nan, math.nan, sign_test(diffs))
    sd = statistics.stdev(diffs)
    spread = sd / math.sqrt(len(diffs))
    t = mean / spread if sd > 0 else (math.inf if mean != 0 else 0.0)
    return Paired(diffs, mean, t, t_two_sided(t, len(diffs) - 1), sign_test(diffs))


def seeds_short(needed: int, got: int) -> str:
    """A study's verdict line when its rule needs ``needed`` paired seeds and ``got`` are in."""
    return f"no verdict: the rule is for {needed} paired seeds, and {got} {'is' if got == 1 else 'are'} in"
