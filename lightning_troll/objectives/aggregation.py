"""From per-token terms to the loss: aggregation, importance ratios, reference-KL estimators.

Three registries the objectives choose from by name (``LossConfig`` in YAML):

- ``AGGREGATIONS``: ``(B, T)`` per-token values and mask -> scalar (token mean, GRPO's mean
  of sequence means, Dr.GRPO's sums over a constant length), with ``AGGREGATION_SIZES``, what
  each divides by, so that accumulated parts of a batch weigh as the whole batch;
- ``IMPORTANCE_LEVELS``: new and old token log-probs -> per-token ratios, per token or per
  sequence (GSPO);
- ``REF_KL_ESTIMATORS``: per-token estimates of KL(pi || pi_ref) (k1, k3).

:class:`ResponseTokens` takes the response tokens' values out of ``(B, T)`` tensors and puts them
back.

Notation: B sequences, T response positions (padded); ``mask`` (B, T) marks response tokens.
Nothing here imports Lightning or transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "AGGREGATIONS",
    "AGGREGATION_SIZES",
    "IMPORTANCE_LEVELS",
    "K3_LOG_RATIO_LIMIT",
    "K3_MAX",
    "REF_KL_ESTIMATORS",
    "SEQUENCE_LOG_RATIO_MAX",
    "TOKEN_LOG_RATIO_MAX",
    "ResponseTokens",
    "k3",
    "seq_mean_token_mean",
    "seq_mean_token_sum_norm",
    "sequence_ratio",
    "token_mean",
    "token_ratio",
]


@dataclass(frozen=True)
class ResponseTokens:
    """The N response tokens of a ``(B, T)`` mask as one flat index, in the mask's row-major order
    (that of ``values[mask]``).

    Finding them is one wait on the device; taking values out (:meth:`take`) and putting them
    back (:meth:`scatter`) then needs none, in the forward pass or the backward. Indexing with
    the boolean mask itself would wait every time, and on a GPU each wait stalls the queue.
    """

    mask: Tensor
    """(B, T) bool, True at response tokens."""
    index: Tensor
    """(N,) int64 positions of the response tokens in ``mask.flatten()``."""

    @classmethod
    def of(cls, mask: Tensor) -> ResponseTokens:
        return cls(mask, mask.flatten().nonzero().squeeze(-1))

    @property
    def count(self) -> int:
        """N, known on the host."""
        return self.index.shape[0]

    def take(self, values: Tensor) -> Tensor:
        """(B, T, ...) -> (N, ...): the response tokens' values, ``values[mask]``."""
        return values.flatten(0, 1)[self.index]

    def scatter(self, values: Tensor) -> Tensor:
        """(N,) -> (B, T): the values at the response tokens, zeros elsewhere."""
        flat = values.new_zeros(self.mask.numel()).index_put((self.index,), values)
        return flat.view(self.mask.shape)


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


# A token's log-ratio is clamped from above before exp at the k3 limit: exp(89) overflows float32
# to inf, and inf in the forward pass is a NaN gradient in the backward one (0 * inf), which
# would skip the whole optimiser step for one token the old policy all but excluded (a token a
# stale or mismatched sampler drew at probability below 1e-38). Below the clamp nothing changes.
TOKEN_LOG_RATIO_MAX = 20.0


def token_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """r_t = pi(o_t) / pi_old(o_t) per token; a log-ratio above ``TOKEN_LOG_RATIO_MAX`` counts
    as that (exp(20) ~ 4.9e8) and its token gets no gradient."""
    return torch.where(mask, logp - old_logp, 0.0).clamp(max=TOKEN_LOG_RATIO_MAX).exp()


# GSPO's log-ratio is clamped from above before exp (as GSPO's reference implementation does),
# so one far off-policy sequence cannot overflow the loss: exp(10) ~ 2.2e4.
SEQUENCE_LOG_RATIO_MAX = 10.0


def sequence_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO: s = exp(mean_t log r_t) per sequence, detached, times pi(o_t) / sg(pi(o_t)).

    Every token of a sequence has the value s; the gradient of a token is s * grad log pi(o_t).
    The log of each token's ratio is clamped at ``SEQUENCE_LOG_RATIO_MAX`` (a token above it gets
    the value exp(10) and no gradient).
    """
    log_r = torch.where(mask, logp - old_logp, 0.0)  # (B, T)
    seq = (log_r.sum(-1) / mask.sum(-1).clamp_min(1)).detach()  # (B,)
    log_s = (seq.unsqueeze(-1) + logp - logp.detach()).clamp(max=SEQUENCE_LOG_RATIO_MAX)  # (B, T)
    return torch.where(mask, log_s, 0.0).exp()  # (B, T)


IMPORTANCE_LEVELS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "token": token_ratio,
    "sequence": sequence_ratio,
}

# --------------------------------------------------------------------------------------------
# Reference-KL estimators: (B, T) log pi and log pi_ref -> (B, T) per-token KL estimates
# --------------------------------------------------------------------------------------------

# k3 is clamped as verl's "low_var_kl" is: the log-ratio to [-20, 20], the estimate to at most 10,
# so a token the reference policy finds very unlikely cannot dominate the penalty.
K3_LOG_RATIO_LIMIT = 20.0
K3_MAX = 10.0


def k3(logp: Tensor, ref: Tensor) -> Tensor:
    """k3 = exp(d) - d - 1 with d = log pi_ref - log pi clamped to [-20, 20], then at most 10.

    Unbiased where nothing is clamped, never negative; (B, T) -> (B, T).
    """
    d = (ref - logp).clamp(-K3_LOG_RATIO_LIMIT, K3_LOG_RATIO_LIMIT)  # (B, T)
    return (torch.expm1(d) - d).clamp(max=K3_MAX)


REF_KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    # k1 = log pi - log pi_ref (unbiased, high variance, can be negative)
    "k1": lambda logp, ref: logp - ref,
    "k3": k3,
}
