"""TrollModule's objective options: ``model.trust_region``, ``model.clip``, ``model.loss``,
``model.corrections`` and ``model.advantages``.

Frozen records whose field docstrings become the command line's ``--help``; ``build_objective``
turns them into an objective. Nothing here imports torch, Lightning or transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from lightning_troll.trust_region import defaults
from lightning_troll.trust_region.supports import check_support

__all__ = [
    "IS_LEVELS",
    "IS_MODES",
    "AdvantageConfig",
    "ClipConfig",
    "CorrectionsConfig",
    "LossConfig",
    "TrustRegionConfig",
    "check_anchor",
    "check_engine_is",
]


@dataclass(frozen=True)
class AdvantageConfig:
    """How rewards become advantages (``model.advantages``)."""

    estimator: str = "grpo"
    """Advantage estimator: grpo, dr_grpo, rloo, reinforce_pp, or a registered name."""
    scale_rewards: Literal["group", "batch", "none"] | None = None
    """What baseline-subtracted rewards are divided by: ``group`` or ``batch`` (that reward std
    + 1e-6) or ``none``; null keeps the estimator's own."""


@dataclass(frozen=True)
class TrustRegionConfig:
    """TROLL's projection (used when ``objective: troll``)."""

    eps: float = defaults.EPS
    """KL bound per token, > 0."""
    alpha: float = 1.0
    """Weight of the regression KL(pi_new || sg(pi_proj)), >= 0."""
    max_tokens: int = defaults.MAX_TOKENS
    """The most tokens kept per distribution, >= 1 (the paper keeps 64; with the official support,
    256 keeps the loss gradient within 3% of the exact projection's on SmolLM2, 64 within 8%)."""
    mass_delta: float = defaults.MASS_DELTA
    """Keep tokens until their mass reaches 1 - mass_delta, in [0, 1)."""
    keep_sampled_token: bool = defaults.KEEP_TOKEN
    """Always add the sampled token to the sparse supports (old and projected); false keeps only
    the most probable tokens, and a sampled token outside them shares the rest bucket's mass
    (union support only: the official support always holds it)."""
    support: Literal["union", "official", "dense"] = defaults.SUPPORT
    """Categories the projection runs on: union (old and new kept tokens plus one lumped rest
    bucket), official (the old policy's kept tokens, both distributions renormalised there, as
    the paper describes it) or dense (the whole vocabulary, exact; the snapshot's logits are
    recomputed in the loss pass, so it needs snapshot.mode copy and costs one more forward pass
    of the snapshot per optimiser step)."""
    compile_solver: bool | Literal["auto"] = defaults.COMPILE_SOLVER
    """Run the root finder for eta* through torch.compile: each of its steps becomes a few fused
    kernels instead of some forty, which a GPU's host otherwise launches one by one; the first
    projection of every process compiles (tens of seconds), and a CPU needs a C++ compiler.
    auto (the default): compiled where the projected rows are on a GPU, eager elsewhere; a
    failed compile under auto warns and runs eagerly."""

    def __post_init__(self) -> None:
        try:
            check_support(self.support)
        except ValueError as error:
            raise ValueError(f"model.trust_region.{error}") from None
        defaults.check_keep_token(self.support, self.keep_sampled_token)


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


@dataclass(frozen=True)
class CorrectionsConfig:
    """What the rollout corrects before either objective sees it (``model.corrections``): which
    completions leave the loss, the weights for a sampler apart from the trainer, and the policy
    the update is drawn around when the sampler is stale."""

    mask_truncated: bool = False
    """Leave completions that hit sampling.max_new_tokens without EOS (episodes: those the token
    budget cut off) out of the loss (TRL's mask_truncated_completions, DAPO's overlong
    filtering); their rewards still count in their group's baseline."""
    engine_is_cap: float | None = None
    """Importance weights for a rollout engine that samples apart from the trainer
    (model.engine.name: vllm): each response token's advantage is multiplied by
    p_snapshot / p_engine, the snapshot's probability of the sampled token over the engine's,
    truncated at this cap, a finite number >= 1 (or masked above it: engine_is_mode), per token or
    per sequence (engine_is_level), as TRL and verl offer; null: off."""
    engine_is_level: Literal["token", "sequence"] = "token"
    """What engine_is_cap weighs: each token by its own ratio (token), or every token of a
    completion by the product of its ratios (sequence)."""
    engine_is_mode: Literal["truncate", "mask"] = "truncate"
    """truncate: a ratio above engine_is_cap counts as the cap (TIS); mask: a token whose ratio
    is above it (or below engine_is_floor) leaves the loss, the others keep their ratio (MIS)."""
    engine_is_floor: float | None = None
    """With engine_is_mode mask, ratios below this (in (0, 1]) are masked too: the two-sided band
    of IcePop; null: no lower bound."""

    anchor: Literal["behaviour", "proximal"] = "behaviour"
    """What the trust region (or the clip) is drawn around when the sampler is stale
    (old_policy.max_staleness): behaviour, the policy that sampled the rollout; proximal, the
    current weights before this rollout's update (one more forward pass per rollout), with each
    token's advantage weighted by min(p_proximal / p_behaviour, anchor_is_cap): AReaL's
    decoupled objective, truncating the weight at the cap where AReaL drops the tokens above it.
    proximal takes trust_region.support union or official, not dense (the dense support
    recomputes the old logits from the sampler's snapshot in the loss pass). Where the sampler
    always holds the current weights (old_policy.max_staleness 0 and every_n_rollouts 1 with
    snapshot.dtype same, or snapshot.mode shared) the proximal policy is the sampler and the
    weight is 1 up to rounding: the extra pass buys nothing (warned at the start of a fit)."""
    anchor_is_cap: float = 2.0
    """With anchor proximal: the cap of the proximal-over-behaviour weight, a finite number >= 1."""

    def __post_init__(self) -> None:
        check_engine_is(
            self.engine_is_cap, self.engine_is_level, self.engine_is_mode, self.engine_is_floor
        )
        if self.anchor not in ANCHORS:
            raise ValueError(
                f"model.corrections.anchor must be one of {list(ANCHORS)}; got {self.anchor!r}"
            )
        if not _finite_cap(self.anchor_is_cap):
            raise ValueError(
                f"model.corrections.anchor_is_cap must be a finite number >= 1; got {self.anchor_is_cap!r} "
                "(the proximal-over-behaviour weight is always capped: a large cap such as 100 "
                "hardly truncates it; 1 weighs every token at most 1)"
            )
        default = type(self).__dataclass_fields__["anchor_is_cap"].default
        if self.anchor == "behaviour" and self.anchor_is_cap != default:
            raise ValueError(
                f"model.corrections.anchor_is_cap={self.anchor_is_cap} caps the weight of "
                "model.corrections.anchor 'proximal', but the anchor is 'behaviour', which has no such "
                "weight; set model.corrections.anchor 'proximal' or leave the cap out"
            )


ANCHORS = ("behaviour", "proximal")
IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask")


def check_engine_is(cap: float | None, level: str, mode: str, floor: float | None) -> None:
    """Refuses a combination of ``corrections.engine_is_*`` options that cannot mean anything, in one
    line naming the option."""
    if cap is not None and not _finite_cap(cap):
        raise ValueError(
            "model.corrections.engine_is_cap must be a finite number >= 1 (weights above it are truncated or "
            f"masked), or null to switch the correction off; got {cap!r}"
        )
    if level not in IS_LEVELS:
        raise ValueError(
            f"model.corrections.engine_is_level must be one of {list(IS_LEVELS)}; got {level!r}"
        )
    if mode not in IS_MODES:
        raise ValueError(
            f"model.corrections.engine_is_mode must be one of {list(IS_MODES)}; got {mode!r}"
        )
    if cap is None and (level != "token" or mode != "truncate" or floor is not None):
        raise ValueError(
            "model.corrections.engine_is_level, engine_is_mode and engine_is_floor shape the weights of "
            f"model.corrections.engine_is_cap, which is null (off); got engine_is_level={level!r}, "
            f"engine_is_mode={mode!r}, engine_is_floor={floor!r}; set the cap"
        )
    if floor is not None:
        if isinstance(floor, bool) or not (isinstance(floor, int | float) and 0 < floor <= 1):
            raise ValueError(
                f"model.corrections.engine_is_floor must be in (0, 1] or null; got {floor!r}"
            )
        if mode != "mask":
            raise ValueError(
                f"model.corrections.engine_is_floor={floor} masks the ratios below it, so it needs "
                f"model.corrections.engine_is_mode 'mask'; got {mode!r}"
            )


def _finite_cap(cap: object) -> bool:
    """Whether ``cap`` is a cap of importance weights: a finite number >= 1 (not a bool)."""
    if isinstance(cap, bool) or not isinstance(cap, int | float):
        return False
    return math.isfinite(cap) and cap >= 1


def check_anchor(objective: str, support: str, anchor: str) -> None:
    """Refuses ``corrections.anchor: proximal`` with TROLL's dense support: the dense projection reads
    the old logits from the snapshot (the stale sampler) in the loss pass, while the proximal
    anchor's old log-probs are the current weights' before the update, which are not kept
    during it; the loss would mix two old policies."""
    if objective == "troll" and support == "dense" and anchor == "proximal":
        raise ValueError(
            "model.corrections.anchor='proximal' does not work with model.trust_region.support='dense': "
            "the dense projection recomputes the old logits from the sampler's snapshot in the "
            "loss pass, so it would bound the update around the stale sampler while the ratio's "
            "old log-probs are the proximal weights' (not kept during the update); use "
            "model.trust_region.support 'union' or 'official' with the proximal anchor, or "
            "model.corrections.anchor 'behaviour' with the dense support"
        )
