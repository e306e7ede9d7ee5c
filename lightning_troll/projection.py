"""Differentiable KL trust-region projection of token distributions (TROLL).

Per response token, with ``a = log pi_new`` (differentiable) and ``b = log pi_old`` (fixed),
the projection solves

    minimise KL(pi || pi_new)   subject to   KL(pi || pi_old) <= eps

whose solution is the geometric interpolation

    log pi_eta = (a + eta * b) / (1 + eta) - logZ(eta)

with ``eta* = 0`` when ``KL(pi_new || pi_old) <= eps`` (the identity) and otherwise the root of
``KL(pi_eta || pi_old) = eps``; the KL falls monotonically in ``eta``. The root is found by a
safeguarded Newton iteration in ``log eta`` and the gradient flows through ``eta*`` by implicit
differentiation (the exact gradient, not the "eta held fixed" shortcut).

No root exists when pi_new gives zero probability to tokens that hold ``1 - exp(-eps)`` or more
of pi_old's mass: every interpolation keeps those zeros, so its KL to pi_old never falls below
``-log pi_old(supp(pi_new)) >= eps``. Such a row is *infeasible*
(:attr:`ProjectionResult.infeasible`): it gets the limit ``eta* = inf``, pi_old restricted to
pi_new's support, as a constant (no gradient through its log-probs), and its KL after projection
is that floor, at or above the bound. Finite logits give every token some probability (the
sparse layer sums a rest mass too small for linear sums in log space), so only logits of -inf in
the new policy make a row infeasible (see :mod:`lightning_troll.kl_solver`).

:func:`sparsify` keeps, per row, the most probable tokens of a distribution; the sparse layer
:class:`TrustRegionProjection` runs the projection on the union of the old and new supports plus
one lumped "rest" bucket, so its cost is ``O(N * K)`` after one pass over the vocabulary.

Notation (shape comments below use these letters):

    N   rows (response tokens)          V   vocabulary size
    K   kept tokens per row (old)       k   kept tokens per row (new), <= max_tokens
    L   union support U = S_old + S_new + {token}, before de-duplication
    C   categories of a projection problem (V dense, L + 1 sparse)
    M   rows whose bound is violated (the only rows the root finder sees)

Nothing here imports Lightning or transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
from torch import Tensor, nn

from lightning_troll.kl_solver import kl_terms, project_log_probs
from lightning_troll.sparse import (
    LINEAR_MASS_MIN,
    SparseDistribution,
    check_sparsity,
    check_tokens,
    compute_dtype,
    prefix_count,
    softmax_and_logz,
    sparsify,
    top_tokens,
)

__all__ = [
    "ProjectionResult",
    "SparseDistribution",
    "TrustRegionProjection",
    "kl_projection",
    "sparsify",
]

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class ProjectionResult:
    """Per-row output of :class:`TrustRegionProjection`; masked rows hold zeros."""

    logprob: Tensor
    """(N,) projected log-probability of the token, differentiable."""
    new_logprob: Tensor
    """(N,) unprojected log-probability of the token under the new policy, differentiable."""
    old_logprob: Tensor
    """(N,) log-probability of the token under the old (sparse) distribution."""
    regression_kl: Tensor
    """(N,) KL(pi_new || stopgrad(pi_proj)) on the support plus rest bucket, differentiable."""
    kl_before: Tensor
    """(N,) KL(pi_new || pi_old) before projection."""
    kl_after: Tensor
    """(N,) KL(pi_proj || pi_old) after projection: <= eps up to solver tolerance, except on
    infeasible rows, where it is the smallest KL any interpolation reaches (>= eps)."""
    eta: Tensor
    """(N,) the dual variable eta* (0 where the bound was already met, inf on infeasible rows)."""
    coverage: Tensor
    """(N,) old-policy mass covered by its kept tokens."""
    support_size: Tensor
    """(N,) number of tokens |U| the projection ran on (the rest bucket not counted)."""

    @property
    def infeasible(self) -> Tensor:
        """(N,) bool: rows whose bound no interpolation reaches (eta* = inf)."""
        return self.eta.isinf()

    def detach(self) -> ProjectionResult:
        return ProjectionResult(**{f.name: getattr(self, f.name).detach() for f in fields(self)})


def _check_eps(eps: float) -> None:
    if not (isinstance(eps, (int, float)) and eps > 0):  # also rejects NaN
        raise ValueError(f"eps must be a number > 0 (the KL bound); got {eps!r}")


def kl_projection(new_logits: Tensor, old_logits: Tensor, eps: float | Tensor) -> Tensor:
    """Exact dense projection of ``softmax(new_logits)`` onto ``KL(. || softmax(old_logits)) <= eps``.

    Args:
        new_logits: ``(..., V)`` logits of the new policy; the result is differentiable in them,
            with the exact gradient through eta*.
        old_logits: ``(..., V)`` logits of the old policy (treated as constant).
        eps: the KL bound, a float or a tensor broadcastable to ``(...)``, every entry > 0.

    Returns:
        ``(..., V)`` projected log-probabilities, in float32 (float64 for float64 inputs). Rows
        with ``KL(new || old) <= eps`` are returned unchanged (the log-softmax of new_logits);
        rows no interpolation brings within ``eps`` (infeasible: new has no mass on tokens
        holding ``1 - exp(-eps)`` or more of old's) get old restricted to new's support, as a
        constant.
    """
    if new_logits.shape != old_logits.shape or new_logits.dim() < 1:
        raise ValueError(
            "new_logits and old_logits must have the same shape (..., V); got "
            f"{tuple(new_logits.shape)} and {tuple(old_logits.shape)}"
        )
    if new_logits.device != old_logits.device:
        raise ValueError(
            f"new_logits and old_logits must be on one device; got {new_logits.device} and "
            f"{old_logits.device}"
        )
    dtype = compute_dtype(new_logits)
    compute_dtype(old_logits)
    batch_shape, vocab = new_logits.shape[:-1], new_logits.shape[-1]
    eps_t = torch.as_tensor(eps, dtype=dtype, device=new_logits.device)
    try:
        eps_t = eps_t.expand(batch_shape).reshape(-1)
    except RuntimeError:
        raise ValueError(
            f"eps must be a float or a tensor broadcastable to {tuple(batch_shape)}; got shape "
            f"{tuple(eps_t.shape)}"
        ) from None
    if not bool((eps_t > 0).all()):
        raise ValueError(f"eps must be > 0 everywhere; got minimum {eps_t.min().item()!r}")
    a = torch.log_softmax(new_logits.to(dtype).reshape(-1, vocab), dim=-1)  # (M, V)
    b = torch.log_softmax(old_logits.detach().to(dtype).reshape(-1, vocab), dim=-1)  # (M, V)
    logp = project_log_probs(a, b, eps_t)[0]
    return logp.reshape(new_logits.shape)


# --------------------------------------------------------------------------------------------
# The sparse layer
# --------------------------------------------------------------------------------------------


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


class _Lumped(NamedTuple):
    """The lumped problem of n rows (see :meth:`TrustRegionProjection._lumped`)."""

    a: Tensor  # (n, L+1) log pi_new on U and the rest bucket, differentiable
    b: Tensor  # (n, L+1) log pi_old on the same categories
    a_rest: Tensor  # (n,) log pi_new of the rest bucket
    spread: Tensor  # (n, 1) log pi_old of one token outside S_old
    support: Tensor  # (n,) |U|
    token_pos: Tensor  # (n,) the sampled token's column
    in_u: Tensor  # (n,) whether U holds the sampled token


class TrustRegionProjection(nn.Module):
    """Projects each row's new token distribution onto ``KL(. || pi_old) <= eps``, sparsely.

    The projection runs on the support ``U = S_old + S_new + {token}`` plus one rest bucket: S_old
    is the cached old distribution (:func:`sparsify`), S_new the new policy's most probable tokens
    chosen with the same ``max_tokens`` / ``mass_delta`` rule. Old mass outside S_old is spread
    uniformly over the ``V - |S_old|`` tokens it covers; the new rest mass is summed from the
    logits outside U. With ``max_tokens >= V`` and ``mass_delta = 0`` this equals
    :func:`kl_projection`. Rows whose bound no interpolation reaches get the limit eta* = inf
    (:attr:`ProjectionResult.infeasible`).

    With ``keep_token=False`` the sampled token joins U only if S_old or S_new holds it; otherwise
    it lies in the rest bucket, and the bucket's projected mass is shared out in proportion to the
    new policy: ``log pi_proj(token) = log pi_proj(rest) + log pi_new(token) - log pi_new(rest)``
    (the new policy's own log-prob wherever the projection is the identity).

    Args:
        eps: the KL bound per token, > 0 (0.05 in the paper).
        max_tokens: the most tokens kept per row by probability, >= 1 (64 in the paper).
        mass_delta: stop keeping tokens once their mass reaches ``1 - mass_delta``, in [0, 1).
        keep_token: always add the sampled token to the support U.
    """

    def __init__(
        self,
        eps: float = 0.05,
        max_tokens: int = 64,
        mass_delta: float = 1e-5,
        keep_token: bool = True,
    ) -> None:
        super().__init__()
        _check_eps(eps)
        check_sparsity(max_tokens, mass_delta)
        if not isinstance(keep_token, bool):
            raise ValueError(f"keep_token must be True or False; got {keep_token!r}")
        self.eps = float(eps)
        self.max_tokens = max_tokens
        self.mass_delta = float(mass_delta)
        self.keep_token = keep_token

    def extra_repr(self) -> str:
        return (
            f"eps={self.eps}, max_tokens={self.max_tokens}, mass_delta={self.mass_delta}, "
            f"keep_token={self.keep_token}"
        )

    def forward(
        self,
        new_logits: Tensor,
        old: SparseDistribution,
        tokens: Tensor,
        mask: Tensor | None = None,
    ) -> ProjectionResult:
        """Projects every row (or every row where ``mask`` is True).

        Args:
            new_logits: ``(N, V)`` logits of the policy being trained.
            old: the old policy's sparse distributions, one row per row of ``new_logits``.
            tokens: ``(N,)`` the sampled token of each row.
            mask: optional ``(N,)`` bool; rows where it is False are skipped (their results are 0
                and they get no gradient), so padding never produces NaNs.
        """
        self._check_inputs(new_logits, old, tokens, mask)
        if mask is None:
            return self._project_rows(new_logits, old, tokens)
        rows = mask.nonzero().squeeze(-1)  # (n,)
        part = self._project_rows(new_logits[rows], old.select(rows), tokens[rows])
        n = new_logits.shape[0]
        return ProjectionResult(
            **{
                f.name: getattr(part, f.name).new_zeros(n).index_put((rows,), getattr(part, f.name))
                for f in fields(part)
            }
        )

    def _check_inputs(
        self, new_logits: Tensor, old: SparseDistribution, tokens: Tensor, mask: Tensor | None
    ) -> None:
        if new_logits.dim() != 2:
            raise ValueError(f"new_logits must be (N, V); got shape {tuple(new_logits.shape)}")
        n, vocab = new_logits.shape
        compute_dtype(new_logits)
        if old.num_rows != n or old.vocab_size != vocab:
            raise ValueError(
                f"old must have one row per row of new_logits and their vocabulary: (N, V) = "
                f"({n}, {vocab}); got {old.num_rows} rows over a vocabulary of {old.vocab_size}"
            )
        if old.indices.device != new_logits.device:
            raise ValueError(
                f"old is on {old.indices.device} but new_logits on {new_logits.device}"
            )
        check_tokens(tokens, n, vocab, new_logits.device, "tokens")
        if mask is not None and (mask.shape != (n,) or mask.dtype != torch.bool):
            raise ValueError(
                f"mask must be a ({n},) bool tensor; got {tuple(mask.shape)} {mask.dtype}"
            )

    @torch.no_grad()
    def kl_to_old(self, new_logits: Tensor, old: SparseDistribution, tokens: Tensor) -> Tensor:
        """(N,) KL(pi_new || pi_old) between the lumped distributions the projection works on (the
        support U plus the rest bucket): :meth:`forward`'s ``kl_before``, without projecting.

        Arguments as in :meth:`forward` (no mask); no gradient.
        """
        self._check_inputs(new_logits, old, tokens, None)
        lumped = self._lumped(new_logits, old, tokens, compute_dtype(new_logits))
        return kl_terms(lumped.a, lumped.b)[2]

    def _lumped(
        self, x: Tensor, old: SparseDistribution, tokens: Tensor, dtype: torch.dtype
    ) -> _Lumped:
        """The (|U| + 1)-category problem of each row: new log-probs (differentiable) and old."""
        vocab = x.shape[1]
        with torch.no_grad():
            index, valid, old_lp, in_old, token_pos, in_u, logz, p, p_u, rest = self._support(
                x, old, tokens, dtype
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
        return _Lumped(a, b, a_rest, spread, support, token_pos, in_u)

    def _project_rows(self, x: Tensor, old: SparseDistribution, tokens: Tensor) -> ProjectionResult:
        dtype = compute_dtype(x)
        n = x.shape[0]
        a, b, a_rest, spread, support, token_pos, in_u = self._lumped(x, old, tokens, dtype)
        eps = torch.full((n,), self.eps, dtype=dtype, device=x.device)
        logp, eta, kl_before, kl_after = project_log_probs(a, b, eps)  # (n, L+1), (n,) x 3

        pos = token_pos.unsqueeze(-1)  # (n, 1)
        p_new = a.exp()  # (n, L+1)
        gap = torch.where(p_new > 0, a - logp.detach(), 0.0)  # (n, L+1)
        token_logp = logp.gather(-1, pos).squeeze(-1)  # (n,)
        token_a = a.gather(-1, pos).squeeze(-1)  # (n,)
        token_b = b.gather(-1, pos).squeeze(-1)  # (n,)
        if not bool(in_u.all()):  # keep_token=False: some tokens lie in the rest bucket
            rows = (~in_u).nonzero().squeeze(-1)  # (r,)
            x_r = x[rows].to(dtype)  # (r, V)
            a_tok = x_r.gather(-1, tokens[rows].unsqueeze(-1)).squeeze(-1) - x_r.logsumexp(-1)
            share = a_tok - a_rest[rows]  # (r,) log of the token's share of the new rest mass
            token_logp = token_logp.index_put((rows,), logp[rows, -1] + share)
            token_a = token_a.index_put((rows,), a_tok)
            token_b = token_b.index_put((rows,), spread[rows, 0])
        return ProjectionResult(
            logprob=token_logp,
            new_logprob=token_a,
            old_logprob=token_b,
            regression_kl=(p_new * gap).sum(-1),
            kl_before=kl_before,
            kl_after=kl_after,
            eta=eta,
            coverage=old.coverage.to(dtype),
            support_size=support.to(dtype),
        )

    def _support(self, x: Tensor, old: SparseDistribution, tokens: Tensor, dtype: torch.dtype):
        """U = S_old + S_new + {token}, de-duplicated, and the new policy's mass on and off it.

        Returns index (n, L) (entries that are not valid repeat a valid index), valid (n, L),
        old log-prob of entries from S_old (n, L), in_old (n, L), the token's position (n,) and
        whether U holds it (n,) (always, unless ``keep_token`` is False), and for
        :class:`_SupportLogProbs`: logZ (n,), softmax zeroed inside U (n, V), softmax on U (n, L)
        and the rest bucket's (log R, share, scale), each (n,).
        """
        n, vocab = x.shape
        top_val, top_idx = top_tokens(x, min(self.max_tokens, vocab))  # (n, k)
        p, logz = softmax_and_logz(x, top_val, top_idx, dtype)  # (n, V), (n,)
        count = prefix_count(top_val.to(dtype) - logz.unsqueeze(-1), self.mass_delta)
        new_idx = torch.where(
            torch.arange(top_idx.shape[1], device=x.device) < count.unsqueeze(-1), top_idx, -1
        )  # (n, k)

        old_idx = old.indices  # (n, K)
        parts = [old_idx, new_idx] + ([tokens.unsqueeze(-1)] if self.keep_token else [])
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
