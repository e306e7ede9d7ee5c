"""The union support: U = S_old + S_new + {token} plus one lumped rest bucket.

The projection's default support (:class:`~lightning_troll.trust_region.projection.TrustRegionProjection`,
``support='union'``). S_old is the cached old distribution (:func:`~lightning_troll.trust_region.sparse.sparsify`),
S_new the new policy's most probable tokens chosen with the same ``max_tokens`` / ``mass_delta``
rule. The rest of the vocabulary is one bucket on both sides: the new rest mass is summed from
the logits outside U; old mass outside S_old is spread uniformly over the ``V - |S_old|`` tokens
it covers, so a token of U outside S_old gets ``tail / (V - |S_old|)`` and the bucket the
remainder. Under that assumption lumping is exact: the interpolation and the KL on |U| + 1
categories equal those on V.

Notation: n rows, V vocabulary, K old kept tokens per row, k new kept tokens per row, L the union
before de-duplication. Nothing here imports Lightning or transformers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from lightning_troll.trust_region.kl_solver import project_log_probs, regression_kl
from lightning_troll.trust_region.sparse import (
    LINEAR_MASS_MIN,
    SparseDistribution,
    prefix_count,
    softmax_and_logz,
    top_tokens,
)

__all__ = ["Lumped", "lumped_problem", "union_rows", "union_support"]

_NEG_INF = float("-inf")


class _SupportLogProbs(torch.autograd.Function):
    """log pi_new on a support U and on the rest bucket, with a one-buffer backward.

    The forward receives what was computed without gradient: logZ, the softmax ``p`` (zeroed
    inside U), ``p`` on U and the rest bucket's terms (:class:`_RestMass`). It gathers the
    support; the backward writes the gradient from the saved softmax buffer, so a projection
    keeps one (n, V) buffer for its backward, as a log-softmax does:

        d a_j / d x_k    = [k = j] - p_k                  (a_j = x_j - logZ, j in U)
        d rest / d x_k   = [k not in U] p_k / R - p_k      (rest = log R, R = sum_{k not in U} p_k)

    On a row whose rest mass is too small for linear sums the buffer holds p_k / R instead of
    p_k outside U (``share`` = 1, ``scale`` = R); elsewhere ``share`` = 1 / R and ``scale`` = 1,
    so in both cases the gradient outside U is ``buffer * (g_R * share - G * scale)``.
    """

    @staticmethod
    def forward(ctx, x, logz, index, valid, p_outside, p_u, log_rest, share, scale):
        # x (n, V) logits; logz (n,); index, valid (n, L); p_outside (n, V); p_u (n, L);
        # log_rest, share, scale (n,)
        a = x.gather(-1, index).to(logz.dtype) - logz.unsqueeze(-1)  # (n, L)
        a = a.masked_fill(~valid, _NEG_INF)
        ctx.save_for_backward(index, valid, p_outside, p_u, share, scale)
        ctx.x_dtype = x.dtype
        return a, log_rest.clone()

    @staticmethod
    def backward(ctx, grad_a: Tensor, grad_rest: Tensor):
        index, valid, p_outside, p_u, share, scale = ctx.saved_tensors
        grad_a = torch.where(valid, grad_a, 0.0)  # (n, L)
        total = grad_a.sum(-1) + grad_rest  # (n,)
        # outside U: p_k (g_R / R - G)
        grad = p_outside * (grad_rest * share - total * scale).unsqueeze(-1)  # (n, V)
        inside = torch.where(valid, grad_a - p_u * total.unsqueeze(-1), 0.0)  # g_a - p G
        grad.scatter_add_(-1, index, inside)  # the buffer is 0 inside U
        return grad.to(ctx.x_dtype), *([None] * 8)


class Lumped(NamedTuple):
    """The lumped problem of n rows (see :func:`lumped_problem`)."""

    a: Tensor  # (n, L+1) log pi_new on U and the rest bucket, differentiable
    b: Tensor  # (n, L+1) log pi_old on the same categories
    a_rest: Tensor  # (n,) log pi_new of the rest bucket
    spread: Tensor  # (n, 1) log pi_old of one token outside S_old
    support: Tensor  # (n,) |U|
    token_pos: Tensor  # (n,) the sampled token's column
    in_u: Tensor  # (n,) whether U holds the sampled token


def lumped_problem(
    rule, x: Tensor, old: SparseDistribution, tokens: Tensor, dtype: torch.dtype
) -> Lumped:
    """The (|U| + 1)-category problem of each row: new log-probs (differentiable) and old.

    ``rule`` holds the support's settings (``max_tokens``, ``mass_delta``, ``keep_token``: a
    :class:`~lightning_troll.trust_region.projection.TrustRegionProjection`)."""
    vocab = x.shape[1]
    with torch.no_grad():
        index, valid, old_lp, in_old, token_pos, in_u, logz, p, p_u, rest = union_support(
            rule, x, old, tokens, dtype
        )
        support = valid.sum(-1)  # (n,) |U|
        # Old log-probs on U: kept tokens exactly, the others share the tail uniformly.
        tail = old.tail_logmass.to(dtype)  # (n,)
        outside = (vocab - old.sizes).to(dtype).clamp_min(1).log()  # log(V - |S_old|)
        spread = (tail - outside).unsqueeze(-1)  # (n, 1)
        b_u = torch.where(in_old, old_lp, torch.where(valid, spread, _NEG_INF))  # (n, L)
        n_rest = (vocab - support).to(dtype)  # tokens in the rest bucket
        b_rest = torch.where(n_rest > 0, tail + n_rest.log() - outside, _NEG_INF)  # (n,)
        b = torch.cat([b_u, b_rest.unsqueeze(-1)], dim=-1)  # (n, L+1)
    a_u, a_rest = _SupportLogProbs.apply(x, logz, index, valid, p, p_u, *rest)
    a = torch.cat([a_u, a_rest.unsqueeze(-1)], dim=-1)  # (n, L+1)
    return Lumped(a, b, a_rest, spread, support, token_pos, in_u)


def union_rows(
    rule,
    x: Tensor,
    old: SparseDistribution,
    tokens: Tensor,
    eps: Tensor,
    compiled: bool | str = False,
) -> dict:
    """The projection on the union support U plus the rest bucket: the fields of a
    :class:`~lightning_troll.trust_region.projection.ProjectionResult` for rows ``x`` (n, V), differentiable;
    ``rule`` as in :func:`lumped_problem`, ``eps`` (n,) in the compute dtype, ``compiled`` as in
    :func:`~lightning_troll.trust_region.kl_solver.solve_eta`."""
    dtype = eps.dtype
    a, b, a_rest, spread, support, token_pos, in_u = lumped_problem(rule, x, old, tokens, dtype)
    logp, eta, kl_before, kl_after = project_log_probs(a, b, eps, compiled)  # (n, L+1), (n,) x 3

    pos = token_pos.unsqueeze(-1)  # (n, 1)
    token_logp = logp.gather(-1, pos).squeeze(-1)  # (n,)
    token_a = a.gather(-1, pos).squeeze(-1)  # (n,)
    token_b = b.gather(-1, pos).squeeze(-1)  # (n,)
    # keep_token=False: some tokens may lie in the rest bucket (with keep_token U holds every
    # sampled token, so the question, a wait on the device, is not asked)
    if not rule.keep_token and not bool(in_u.all()):
        rows = (~in_u).nonzero().squeeze(-1)  # (r,)
        x_r = x[rows].to(dtype)  # (r, V)
        a_tok = x_r.gather(-1, tokens[rows].unsqueeze(-1)).squeeze(-1) - x_r.logsumexp(-1)
        share = a_tok - a_rest[rows]  # (r,) log of the token's share of the new rest mass
        token_logp = token_logp.index_put((rows,), logp[rows, -1] + share)
        token_a = token_a.index_put((rows,), a_tok)
        token_b = token_b.index_put((rows,), spread[rows, 0])
    return {
        "logprob": token_logp,
        "new_logprob": token_a,
        "old_logprob": token_b,
        "regression_kl": regression_kl(a, logp, eta),
        "kl_before": kl_before,
        "kl_after": kl_after,
        "eta": eta,
        "coverage": old.coverage.to(dtype),
        "support_size": support.to(dtype),
    }


def union_support(rule, x: Tensor, old: SparseDistribution, tokens: Tensor, dtype: torch.dtype):
    """U = S_old + S_new + {token}, de-duplicated, and the new policy's mass on and off it.

    Returns index (n, L) (entries that are not valid repeat a valid index), valid (n, L),
    old log-prob of entries from S_old (n, L), in_old (n, L), the token's position (n,) and
    whether U holds it (n,) (always, unless ``keep_token`` is False), and for
    :class:`_SupportLogProbs`: logZ (n,), softmax zeroed inside U (n, V), softmax on U (n, L)
    and the rest bucket's (log R, share, scale), each (n,).
    """
    n, vocab = x.shape
    top_val, top_idx = top_tokens(x, min(rule.max_tokens, vocab))  # (n, k)
    p, logz = softmax_and_logz(x, top_val, top_idx, dtype)  # (n, V), (n,)
    count = prefix_count(top_val.to(dtype) - logz.unsqueeze(-1), rule.mass_delta)
    new_idx = torch.where(
        torch.arange(top_idx.shape[1], device=x.device) < count.unsqueeze(-1), top_idx, -1
    )  # (n, k)

    old_idx = old.indices  # (n, K)
    parts = [old_idx, new_idx] + ([tokens.unsqueeze(-1)] if rule.keep_token else [])
    cand = torch.cat(parts, dim=-1)  # (n, L)
    pad = torch.full_like(cand[:, old_idx.shape[1] :], _NEG_INF, dtype=dtype)  # (n, k+1)
    cand_lp = torch.cat([old.logprobs.to(dtype), pad], dim=-1)  # (n, L)
    from_old = torch.arange(cand.shape[1], device=x.device) < old_idx.shape[1]  # (L,)
    # A stable sort puts repeats side by side in concatenation order, so the first of equal
    # ids comes from S_old whenever S_old holds it; padding sorts last as V.
    key, order = torch.where(cand >= 0, cand, vocab).sort(dim=-1, stable=True)  # (n, L)
    first = torch.ones_like(key, dtype=torch.bool)
    first[:, 1:] = key[:, 1:] != key[:, :-1]
    valid = first & (key < vocab)  # (n, L)
    index = torch.where(valid, key, key[:, :1])  # key[:, 0] is the smallest id: valid
    in_old = valid & from_old[order]
    old_lp = cand_lp.gather(-1, order)
    is_token = (key == tokens.unsqueeze(-1)) & valid  # (n, L)
    token_pos = is_token.to(torch.int8).argmax(-1)  # (n,)
    # New mass outside U, summed from those tokens (exact however small it is) ...
    p_u = p.gather(-1, index)  # (n, L)
    rest = p.scatter_(-1, index, 0.0).sum(-1)  # (n,)
    log_rest, scale = rest.log(), torch.ones_like(rest)  # (n,)
    share = torch.where(rest > 0, 1 / rest, 0.0)  # (n,)
    # ... and in log space where it is too small for linear sums: underflowing to 0, it would
    # make the bound look unreachable (a new policy with no mass where the old one has some).
    tiny = (rest < LINEAR_MASS_MIN) & (valid.sum(-1) < vocab)  # (n,)
    if bool(tiny.any()):
        rows = tiny.nonzero().squeeze(-1)  # (r,)
        outside = x[rows].to(dtype).scatter(-1, index[rows], _NEG_INF)  # (r, V)
        lse = outside.logsumexp(-1)  # (r,) -inf only when every logit outside U is -inf
        found = lse > _NEG_INF
        p[rows] = torch.where(found.unsqueeze(-1), (outside - lse.unsqueeze(-1)).exp(), 0.0)
        log_rest[rows] = lse - logz[rows]
        share[rows] = found.to(dtype)
        scale[rows] = log_rest[rows].exp()
    rest_terms = (log_rest, share, scale)
    return index, valid, old_lp, in_old, token_pos, is_token.any(-1), logz, p, p_u, rest_terms
