"""From per-token terms to the loss: aggregation, importance ratios, reference-KL estimators.

Three registries the objectives choose from by name (``LossConfig`` in YAML):

- ``AGGREGATIONS``: ``(B, T)`` per-token values and mask -> scalar (token mean, GRPO's mean
  of sequence means, Dr.GRPO's sums over a constant length), with ``AGGREGATION_SIZES``, what
  each divides by, so that accumulated parts of a batch weigh as the whole batch;
- ``IMPORTANCE_LEVELS``: new and old token log-probs -> per-token ratios, per token or per
  sequence (GSPO);
- ``REF_KL_ESTIMATORS``: per-token estimates of KL(pi || pi_ref) (k1, k3).

Notation: B sequences, T response positions (padded); ``mask`` (B, T) marks response tokens.
Nothing here imports Lightning or transformers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "AGGREGATIONS",
    "AGGREGATION_SIZES",
    "IMPORTANCE_LEVELS",
    "REF_KL_ESTIMATORS",
    "seq_mean_token_mean",
    "seq_mean_token_sum_norm",
    "sequence_ratio",
    "token_mean",
    "token_ratio",
]

# --------------------------------------------------------------------------------------------
# Aggregation: (B, T) per-token values -> scalar
# --------------------------------------------------------------------------------------------


def token_mean(values: Tensor, mask: Tensor, norm_length: int) -> Tensor:
    """Mean over every response token of the batch (long sequences weigh more)."""
    return torch.where(mask, values, 0.0).sum() / mask.sum().clamp_min(1)


def seq_mean_token_mean(values: Tensor, mask: Tensor, norm_length: int) -> Tensor:
    """Mean over sequences of the per-sequence token mean (GRPO); empty sequences are skipped."""
    lengths = mask.sum(-1)  # (B,)
    per_seq = torch.where(mask, values, 0.0).sum(-1) / lengths.clamp_min(1)  # (B,)
    return per_seq.sum() / (lengths > 0).sum().clamp_min(1)


def seq_mean_token_sum_norm(values: Tensor, mask: Tensor, norm_length: int) -> Tensor:
    """Per-sequence token sum divided by a constant length, mean over sequences (Dr.GRPO)."""
    per_seq = torch.where(mask, values, 0.0).sum(-1) / norm_length  # (B,)
    return per_seq.mean() if per_seq.numel() else per_seq.sum()


AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, int], Tensor]] = {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum_norm": seq_mean_token_sum_norm,
}

# What each aggregation divides by: weighting the parts of an accumulated batch by
# ``size(part) / size(batch)`` reproduces the loss and gradient of the whole batch.
AGGREGATION_SIZES: dict[str, Callable[[Tensor], Tensor]] = {
    "token_mean": lambda mask: mask.sum(),
    "seq_mean_token_mean": lambda mask: (mask.sum(-1) > 0).sum(),
    "seq_mean_token_sum_norm": lambda mask: torch.tensor(mask.shape[0], device=mask.device),
}


# --------------------------------------------------------------------------------------------
# Importance level: (B, T) new and old token log-probs -> (B, T) ratios
# --------------------------------------------------------------------------------------------


def token_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """r_t = pi(o_t) / pi_old(o_t) per token."""
    return torch.where(mask, logp - old_logp, 0.0).exp()


def sequence_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO: s = exp(mean_t log r_t) per sequence, detached, times pi(o_t) / sg(pi(o_t)).

    Every token of a sequence has the value s; the gradient of a token is s * grad log pi(o_t).
    """
    log_r = torch.where(mask, logp - old_logp, 0.0)  # (B, T)
    seq = (log_r.sum(-1) / mask.sum(-1).clamp_min(1)).detach()  # (B,)
    return torch.where(mask, seq.unsqueeze(-1) + logp - logp.detach(), 0.0).exp()  # (B, T)


IMPORTANCE_LEVELS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "token": token_ratio,
    "sequence": sequence_ratio,
}

# --------------------------------------------------------------------------------------------
# Reference-KL estimators: (B, T) log pi and log pi_ref -> (B, T) per-token KL estimates
# --------------------------------------------------------------------------------------------

REF_KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    # k1 = log pi - log pi_ref (unbiased, high variance, can be negative)
    "k1": lambda logp, ref: logp - ref,
    # k3 = exp(d) - d - 1 with d = log pi_ref - log pi (unbiased, never negative)
    "k3": lambda logp, ref: torch.expm1(ref - logp) - (ref - logp),
}
