"""Slow, obviously-correct reference implementations for the tests (float64, loops per row)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def interpolate(a: Tensor, b: Tensor, eta: float) -> Tensor:
    """log pi_eta for one row of log-probs: normalise((a + eta b) / (1 + eta))."""
    z = (a + eta * b) / (1 + eta)
    return z - torch.logsumexp(z, 0)


def kl(logp: Tensor, logq: Tensor) -> float:
    """KL(p || q) for one row, terms with p = 0 dropped."""
    p = logp.exp()
    keep = p > 0
    return float((p[keep] * (logp[keep] - logq[keep])).sum())


def project_row(a: Tensor, b: Tensor, eps: float) -> tuple[Tensor, float]:
    """Projection of one row by plain bisection on eta over [0, 1e12]: 200 halvings."""
    if kl(a, b) <= eps:
        return a.clone(), 0.0
    lo, hi = 0.0, 1.0
    while kl(interpolate(a, b, hi), b) > eps:
        lo, hi = hi, hi * 2
        assert hi < 1e12, "no bracket"
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if kl(interpolate(a, b, mid), b) > eps:
            lo = mid
        else:
            hi = mid
    return interpolate(a, b, hi), hi


def dense_projection(new_logits: Tensor, old_logits: Tensor, eps: float) -> Tensor:
    """(N, V) -> (N, V) projected log-probs, row by row."""
    a = torch.log_softmax(new_logits.double(), -1)
    b = torch.log_softmax(old_logits.double(), -1)
    return torch.stack([project_row(a[i], b[i], eps)[0] for i in range(a.shape[0])])


def lumped_row(
    new_logits: Tensor, old_idx: list[int], old_lp: list[float], tail: float, support: list[int]
) -> tuple[Tensor, Tensor]:
    """The (|U| + 1)-category problem of one row, spelled out.

    new: log-probs of the support tokens and log of the summed mass of all other tokens.
    old: the kept log-probs where kept, the tail spread evenly over the V - |S_old| tokens it
    covers elsewhere, and the remainder of the tail in the rest bucket.
    """
    vocab = new_logits.shape[0]
    logp = torch.log_softmax(new_logits.double(), 0)
    outside = [k for k in range(vocab) if k not in set(support)]
    new_rest = torch.logsumexp(logp[outside], 0) if outside else torch.tensor(-math.inf)
    a = torch.cat([logp[support], new_rest.reshape(1)])
    old = dict(zip(old_idx, old_lp, strict=True))
    covered = vocab - len(old_idx)
    b = [old[k] if k in old else tail - math.log(covered) for k in support]
    rest = tail + math.log(len(outside) / covered) if outside else -math.inf
    return a, torch.tensor(b + [rest], dtype=torch.float64)


def top_tokens(logits: Tensor, max_tokens: int, mass_delta: float) -> list[int]:
    """Most probable tokens of one row until their mass reaches 1 - mass_delta (<= max_tokens)."""
    p = torch.softmax(logits.double(), 0)
    order = torch.argsort(p, descending=True).tolist()
    kept, mass = [], 0.0
    for k in order[:max_tokens]:
        if kept and mass_delta > 0 and mass >= 1 - mass_delta:
            break
        kept.append(k)
        mass += float(p[k])
    return kept
