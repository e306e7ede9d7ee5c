"""The projection's supports besides the union: ``official`` and ``dense``.

:class:`~lightning_troll.trust_region.projection.TrustRegionProjection` projects each response token's
distribution on one of three supports (``support=``):

- ``union`` (:mod:`lightning_troll.trust_region.projection`): U = S_old + S_new + {token} plus one lumped
  rest bucket on both sides; the old tail is spread evenly over the tokens it covers.
- ``official``: the old policy's kept tokens S_old (its most probable tokens up to
  ``max_tokens`` / ``1 - mass_delta``, plus the sampled token), as the TROLL paper describes
  its sparsification. Both distributions are restricted to S_old and renormalised there: every
  token outside S_old counts as having a log-probability too low to carry mass, in the new
  policy as in the old, so the new policy's mass outside S_old is dropped from the projection
  and gets no gradient from it, and the old tail is dropped too. The importance ratio is the
  ratio of the two renormalised distributions at the sampled token (1 on-policy);
  ``ProjectionResult.logprob`` carries it on the old policy's scale (the renormalised projected
  log-prob plus log pi_old(S_old)), so that ``logprob - old_logprob`` is that ratio's log.
- ``dense``: the exact projection over the whole vocabulary, from the old policy's full logits
  (the snapshot's forward pass in the loss pass, never cached across a rollout).

Notation: n rows (response tokens), V vocabulary, K columns of the old sparse rows. Nothing
here imports Lightning or transformers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_troll.trust_region.kl_solver import project_log_probs, regression_kl
from lightning_troll.trust_region.sparse import SparseDistribution, compute_dtype

__all__ = ["SUPPORTS", "dense_rows", "kl_projection", "official_rows"]

SUPPORTS = ("union", "official", "dense")
"""The projection's supports, ``model.trust_region.support``."""

_NEG_INF = float("-inf")


def check_support(support: str) -> str:
    """``support`` if it names a support, else a one-line ``ValueError`` listing them."""
    if support not in SUPPORTS:
        raise ValueError(f"support must be one of {list(SUPPORTS)}; got {support!r}")
    return support


def misses_sampled_token(old: SparseDistribution, tokens: Tensor) -> Tensor:
    """() bool on the rows' device: whether some old row lacks its sampled token, which the
    ``official`` support needs in every row (:data:`OFFICIAL_NEEDS_TOKEN`)."""
    return ~((old.indices == tokens.unsqueeze(-1)) & old.mask).any(-1).all()


OFFICIAL_NEEDS_TOKEN = (
    "support='official' projects on the old policy's kept tokens, which must hold the sampled "
    "token: cache the old rows with sparsify(..., keep=tokens)"
)


def _token_terms(a: Tensor, b: Tensor, logp: Tensor, eta: Tensor, pos: Tensor):
    """The sampled token's projected, new and old log-probs (n,) and the regression KL (n,)
    KL(pi_new || sg(pi_proj)) of rows of (n, C) log-probs, the token in column ``pos`` (n,)."""
    pos = pos.unsqueeze(-1)  # (n, 1)
    return (
        logp.gather(-1, pos).squeeze(-1),
        a.gather(-1, pos).squeeze(-1),
        b.gather(-1, pos).squeeze(-1),
        regression_kl(a, logp, eta),
    )


def official_rows(
    x: Tensor, old: SparseDistribution, tokens: Tensor, eps: Tensor, compiled: bool | str = False
) -> dict:
    """The projection on S_old, both distributions renormalised there (see the module docstring).

    Args:
        x: ``(n, V)`` new logits, differentiable.
        old: the old policy's sparse rows; each must hold its row's sampled token (the layer
            checks it, :func:`misses_sampled_token`, not this function).
        tokens: ``(n,)`` the sampled tokens.
        eps: ``(n,)`` the bound, in the compute dtype.
        compiled: the root finder compiled (:func:`~lightning_troll.trust_region.kl_solver.solve_eta`).

    Returns:
        The fields of a :class:`~lightning_troll.trust_region.projection.ProjectionResult`.
    """
    dtype = eps.dtype
    valid = old.mask  # (n, K)
    is_token = (old.indices == tokens.unsqueeze(-1)) & valid  # (n, K)
    index = torch.where(valid, old.indices, old.indices[:, :1])  # (n, K) padding repeats a kept id
    x_s = x.gather(-1, index).to(dtype).masked_fill(~valid, _NEG_INF)  # (n, K)
    a = x_s - x_s.logsumexp(-1, keepdim=True)  # (n, K) new, renormalised on S_old
    old_lp = old.logprobs.to(dtype)  # (n, K)
    log_coverage = old_lp.logsumexp(-1)  # (n,) log pi_old(S_old)
    b = old_lp - log_coverage.unsqueeze(-1)  # (n, K) old, renormalised on S_old
    logp, eta, kl_before, kl_after = project_log_probs(a, b, eps, compiled)
    token_logp, _, token_b, regression = _token_terms(
        a, b, logp, eta, is_token.to(torch.int8).argmax(-1)
    )
    x_f = x.to(dtype)
    token_new = x_f.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - x_f.logsumexp(-1)  # (n,)
    return {
        "logprob": token_logp + log_coverage,
        "new_logprob": token_new,
        "old_logprob": token_b + log_coverage,
        "regression_kl": regression,
        "kl_before": kl_before,
        "kl_after": kl_after,
        "eta": eta,
        "coverage": log_coverage.exp(),
        "support_size": valid.sum(-1).to(dtype),
    }


def dense_rows(
    x: Tensor, old_logits: Tensor, tokens: Tensor, eps: Tensor, compiled: bool | str = False
) -> dict:
    """The exact projection over the whole vocabulary.

    Args:
        x: ``(n, V)`` new logits, differentiable.
        old_logits: ``(n, V)`` the old policy's logits at the same positions (constant).
        tokens: ``(n,)`` the sampled tokens.
        eps: ``(n,)`` the bound, in the compute dtype.
        compiled: as in :func:`official_rows`.

    Returns:
        The fields of a :class:`~lightning_troll.trust_region.projection.ProjectionResult`.
    """
    dtype = eps.dtype
    a = torch.log_softmax(x.to(dtype), dim=-1)  # (n, V)
    b = torch.log_softmax(old_logits.detach().to(dtype), dim=-1)  # (n, V)
    logp, eta, kl_before, kl_after = project_log_probs(a, b, eps, compiled)  # (n, V), (n,) x 3
    token_logp, token_a, token_b, regression = _token_terms(a, b, logp, eta, tokens)
    return {
        "logprob": token_logp,
        "new_logprob": token_a,
        "old_logprob": token_b,
        "regression_kl": regression,
        "kl_before": kl_before,
        "kl_after": kl_after,
        "eta": eta,
        "coverage": torch.ones_like(eps),
        "support_size": torch.full_like(eps, x.shape[1]),
    }


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
