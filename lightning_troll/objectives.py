"""Policy objectives: TROLL (trust-region projection) and PPO-style clipping, and their options.

    J_TROLL = agg_t[ pi_proj(o_t) / pi_old(o_t) * A_t ] - alpha * agg_t[ KL(pi_new || sg(pi_proj)) ]
    J_clip  = agg_t[ min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t) ]   (+ dual clip c)

Both objectives share the importance level (``token``, or ``sequence`` as in GSPO), the
aggregation over tokens and sequences (both from :mod:`lightning_troll.aggregation`), an
optional reference-KL penalty and an entropy bonus: that machinery, the two-stage computation
(row stage, aggregation stage) and the notation are in :mod:`lightning_troll.policy_objective`.
Each returns ``(loss, stats)`` with ``loss = -J`` (+ penalties) and a detached statistics record
(:mod:`lightning_troll.objective_stats`). Here: the two objectives, the registry
:func:`build_objective` picks from, and the option records of ``TrollModule``
(``model.trust_region``, ``model.clip``, ``model.loss``).

Notation as in :mod:`lightning_troll.policy_objective`: B sequences, T response positions,
V vocabulary, N response tokens, n rows of one chunk. Nothing here imports Lightning or
transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from lightning_troll.aggregation import (
    AGGREGATION_SIZES,
    AGGREGATIONS,
    IMPORTANCE_LEVELS,
    REF_KL_ESTIMATORS,
)
from lightning_troll.chunking import HiddenRows
from lightning_troll.objective_stats import ClipStats, ObjectiveStats, TrollStats
from lightning_troll.policy_objective import (
    PolicyObjective,
    TokenTerms,
    check_choice,
    token_entropy,
)
from lightning_troll.projection import TrustRegionProjection
from lightning_troll.sparse import compute_dtype
from lightning_troll.supports import check_support

__all__ = [
    "AGGREGATIONS",
    "AGGREGATION_SIZES",
    "IMPORTANCE_LEVELS",
    "OBJECTIVES",
    "REF_KL_ESTIMATORS",
    "ClipConfig",
    "ClipObjective",
    "ClipStats",
    "LossConfig",
    "ObjectiveStats",
    "PolicyObjective",
    "TrollObjective",
    "TrollStats",
    "TrustRegionConfig",
    "build_objective",
    "token_entropy",
]


# --------------------------------------------------------------------------------------------
# TrollModule's options (model.trust_region, model.clip, model.loss), given to build_objective
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrustRegionConfig:
    """TROLL's projection (used when ``objective: troll``)."""

    eps: float = 0.05
    """KL bound per token, > 0."""
    alpha: float = 1.0
    """Weight of the regression KL(pi_new || sg(pi_proj)), >= 0."""
    max_tokens: int = 256
    """The most tokens kept per distribution, >= 1 (the paper keeps 64; with the official support,
    256 keeps the loss gradient within 3% of the exact projection's on SmolLM2, 64 within 8%)."""
    mass_delta: float = 1e-5
    """Keep tokens until their mass reaches 1 - mass_delta, in [0, 1)."""
    keep_sampled_token: bool = True
    """Always add the sampled token to the sparse supports (old and projected); false keeps only
    the most probable tokens, and a sampled token outside them shares the rest bucket's mass."""
    support: Literal["union", "official", "dense"] = "official"
    """Categories the projection runs on: union (old and new kept tokens plus one lumped rest
    bucket), official (the old policy's kept tokens, both distributions renormalised there, as
    the paper describes it) or dense (the whole vocabulary, exact; the snapshot's logits are
    recomputed in the loss pass, so it needs snapshot.mode copy and costs one more forward pass
    of the snapshot per optimiser step)."""

    def __post_init__(self) -> None:
        try:
            check_support(self.support)
        except ValueError as error:
            raise ValueError(f"trust_region.{error}") from None


@dataclass(frozen=True)
class ClipConfig:
    """PPO-style ratio clipping (used when ``objective: clip``)."""

    eps_low: float = 0.2
    """Lower clip range: the ratio is clipped at 1 - eps_low; in (0, 1)."""
    eps_high: float | None = None
    """Upper clip range: 1 + eps_high, > 0; null means eps_low (symmetric)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 for negative advantages; null switches it off."""


@dataclass(frozen=True)
class LossConfig:
    """What both objectives share."""

    importance: Literal["token", "sequence"] = "token"
    """Importance ratio per token, or per sequence (GSPO)."""
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = (
        "token_mean"
    )
    """How token losses become one number; seq_mean_token_sum_norm is Dr.GRPO's."""
    norm_length: int | None = None
    """Constant length for seq_mean_token_sum_norm; null uses sampling.max_new_tokens."""
    ref_kl_coef: float = 0.0
    """Weight of a KL penalty to the initial policy (k3 estimator); 0 switches it off."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus; 0 switches it off."""
    mask_truncated: bool = False
    """Leave completions that hit sampling.max_new_tokens without EOS out of the loss (TRL's
    mask_truncated_completions, DAPO's overlong filtering); their rewards still count in their
    group's baseline."""


# --------------------------------------------------------------------------------------------
# Objectives
# --------------------------------------------------------------------------------------------


class ClipObjective(PolicyObjective):
    """PPO-style clipped surrogate (the baseline TROLL replaces).

    Args:
        eps_low: lower clip range, the ratio is clipped at ``1 - eps_low``; in (0, 1).
        eps_high: upper clip range, ``1 + eps_high``; > 0. ``None`` uses ``eps_low`` (symmetric).
        dual_clip: optional constant c > 1 bounding the loss of negative-advantage tokens at
            ``c * A`` (dual-clip PPO); ``None`` switches it off.
        **kwargs: see :class:`PolicyObjective`.
    """

    _stats_type = ClipStats

    def __init__(
        self,
        eps_low: float = 0.2,
        eps_high: float | None = None,
        dual_clip: float | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        eps_high = eps_low if eps_high is None else eps_high
        if not 0 < eps_low < 1:
            raise ValueError(f"eps_low must be in (0, 1); got {eps_low!r}")
        if not eps_high > 0:
            raise ValueError(f"eps_high must be > 0; got {eps_high!r}")
        if dual_clip is not None and not dual_clip > 1:
            raise ValueError(f"dual_clip must be None or > 1; got {dual_clip!r}")
        self.eps_low, self.eps_high, self.dual_clip = float(eps_low), float(eps_high), dual_clip

    def extra_repr(self) -> str:
        return f"eps_low={self.eps_low}, eps_high={self.eps_high}, dual_clip={self.dual_clip}"

    def _token_terms(self, rows, tokens, old) -> TokenTerms:
        x = rows.to(compute_dtype(rows))
        # log_softmax then gather: forward and backward take about 40% less time on a CPU than
        # x[token] - logsumexp(x) (one fused kernel each way instead of several passes)
        logp = torch.log_softmax(x, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return TokenTerms(logprob=logp, new_logprob=logp, regression=None)

    def _surrogate(self, ratio, adv, mask):
        low, high = 1.0 - self.eps_low, 1.0 + self.eps_high
        objective = torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)  # (B, T)
        r = ratio.detach()
        frac = lambda hit: (hit & mask).sum() / mask.sum().clamp_min(1)  # noqa: E731
        dual = torch.zeros_like(mask)
        if self.dual_clip is not None:
            objective = torch.where(
                adv < 0, torch.maximum(objective, self.dual_clip * adv), objective
            )
            dual = (adv < 0) & (r > self.dual_clip)
        return objective, {
            "clip_frac_low": frac((adv < 0) & (r < low)),
            "clip_frac_high": frac((adv > 0) & (r > high)),
            "dual_clip_frac": frac(dual),
        }


class TrollObjective(PolicyObjective):
    """TROLL: the ratio uses the projected policy, plus a regression of pi_new onto pi_proj.

    Args:
        eps: KL bound per token, > 0.
        alpha: weight of the regression term KL(pi_new || sg(pi_proj)), >= 0.
        max_tokens: the most tokens kept per row by probability, >= 1.
        mass_delta: stop keeping tokens once their mass reaches ``1 - mass_delta``, in [0, 1).
        keep_sampled_token: always add the sampled token to the projection's support (see
            :class:`~lightning_troll.projection.TrustRegionProjection`); the behaviour policy's
            cached distributions should then hold it too (``sparsify(..., keep=tokens)``).
        support: ``union``, ``official`` or ``dense`` (:mod:`lightning_troll.supports`); with
            ``dense`` the objective's ``old`` is the old policy's logit rows (an ``(N, V)``
            tensor, or :class:`~lightning_troll.chunking.HiddenRows`) instead of sparse rows.
        **kwargs: see :class:`PolicyObjective`.
    """

    _stats_type = TrollStats

    def __init__(
        self,
        eps: float = 0.05,
        alpha: float = 1.0,
        max_tokens: int = 64,
        mass_delta: float = 1e-5,
        keep_sampled_token: bool = True,
        support: str = "union",
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if not alpha >= 0:
            raise ValueError(f"alpha must be >= 0; got {alpha!r}")
        self.alpha = float(alpha)
        self.projection = TrustRegionProjection(
            eps=eps,
            max_tokens=max_tokens,
            mass_delta=mass_delta,
            keep_token=keep_sampled_token,
            support=support,
        )

    @property
    def needs_old_logits(self) -> bool:
        """Whether ``old`` must be the old policy's logit rows (``support: dense``)."""
        return self.projection.needs_old_logits

    @property
    def _regression_weight(self) -> float:  # type: ignore[override]
        return self.alpha

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}"

    def _token_terms(self, rows, tokens, old) -> TokenTerms:
        if old is None:
            raise ValueError("TrollObjective needs old: the behaviour policy's SparseDistribution")
        if isinstance(old, HiddenRows):
            with torch.no_grad():
                old = old.logits()  # (n, V)
        result = self.projection(rows, old, tokens)
        return TokenTerms(
            result.logprob,
            result.new_logprob,
            result.regression_kl,
            projection=result.detach(),
        )

    def _token_stats(self, terms: TokenTerms) -> dict:
        projected = terms.projection.eta > 0  # (N,)
        count = max(projected.numel(), 1)
        return {
            "projection": terms.projection,
            "active_frac": projected.sum() / count,
            "infeasible_frac": terms.projection.infeasible.sum() / count,
        }

    def _surrogate(self, ratio, adv, mask):
        return ratio * adv, {}


OBJECTIVES: dict[str, type[PolicyObjective]] = {"troll": TrollObjective, "clip": ClipObjective}


def build_objective(name: str, **kwargs) -> PolicyObjective:
    """An objective by name (``troll`` or ``clip``) with its keyword arguments."""
    return OBJECTIVES[check_choice("objective", name, OBJECTIVES)](**kwargs)
