"""Importance weights for a sampler that is not the trainer: truncated or masked, per token or per
sequence (``model.corrections.engine_is_*``).

A rollout engine that samples apart from the trainer (vLLM) gives the sampled tokens slightly
different probabilities than the trainer's snapshot does, so the rollout is a little off-policy.
With ``rho_t = pi_snapshot(y_t) / pi_engine(y_t)`` for each response token:

- ``level: token``, ``mode: truncate`` (truncated importance sampling, TIS): ``w_t = min(rho_t, cap)``;
- ``level: token``, ``mode: mask`` (masked importance sampling, MIS): ``w_t = rho_t`` where
  ``floor <= rho_t <= cap``, else 0 (with a floor, the two-sided band of IcePop);
- ``level: sequence``: the same on the sequence's ratio ``rho = prod_t rho_t`` (the product over
  its response tokens), one weight for every token of the completion.

Each response token's advantage is multiplied by its weight. A masked token leaves the loss: it is
taken out of the response mask, as ``corrections.mask_truncated`` takes out a truncated completion, so it
counts in no token count (Dr.GRPO's constant normaliser, B x ``norm_length``, still counts every
sequence, as its definition does), gets no gradient from any term (the regression, the reference KL, the
entropy bonus) and is left out of the trust-region figures. The options are checked by
:class:`~lightning_troll.objectives.options.LossConfig`. Nothing here imports Lightning.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

__all__ = ["mismatch_weights"]


def mismatch_weights(
    log_ratio: Tensor,
    mask: Tensor,
    cap: float,
    level: Literal["token", "sequence"] = "token",
    mode: Literal["truncate", "mask"] = "truncate",
    floor: float | None = None,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """The weights ``(B, T)`` (0 outside ``mask``) for per-token log-ratios ``log_ratio``
    ``(B, T)`` of the trainer's probability of each sampled token over the sampler's, the tokens
    of ``mask`` that stay in the loss (all of them when truncating; those not masked otherwise),
    and the figures to log: ``rollout/engine_is_weight_mean`` (the mean weight over response tokens) and
    ``rollout/engine_is_capped_frac`` (truncate: the share of response tokens whose weight is the
    cap) or ``rollout/engine_is_masked_frac`` (mask: the share of response tokens masked)."""
    if level == "sequence":  # one ratio per completion, on each of its tokens
        log_ratio = torch.where(mask, log_ratio, 0.0).sum(-1, keepdim=True).expand_as(mask)
    ratio = log_ratio.exp()  # inf where a sequence's product overflows: above any cap
    tokens = mask.sum().clamp_min(1)
    if mode == "truncate":
        weights = ratio.clamp(max=cap) * mask
        figures = {"rollout/engine_is_capped_frac": float(((weights >= cap) & mask).sum() / tokens)}
        kept = mask
    else:
        keep = ratio <= cap
        if floor is not None:
            keep = keep & (ratio >= floor)
        weights = torch.where(keep, ratio, torch.zeros_like(ratio)) * mask
        figures = {"rollout/engine_is_masked_frac": float((~keep & mask).sum() / tokens)}
        kept = keep & mask
    figures["rollout/engine_is_weight_mean"] = float(weights.sum() / tokens)
    return weights, kept, figures
