"""The objectives by name: ``model.objective`` picks one of :data:`OBJECTIVES`, built from the
option records that travel whole to here (:func:`objective_from_records`)."""

from __future__ import annotations

import re
from dataclasses import asdict

from lightning_troll.objectives.base import PolicyObjective, check_choice
from lightning_troll.objectives.clip import ClipObjective
from lightning_troll.objectives.options import (
    ClipConfig,
    LossConfig,
    TrustRegionConfig,
    check_anchor,
)
from lightning_troll.objectives.troll import TrollObjective

__all__ = ["OBJECTIVES", "ROLLOUT_OPTIONS", "build_objective", "objective_from_records"]


OBJECTIVES: dict[str, type[PolicyObjective]] = {"troll": TrollObjective, "clip": ClipObjective}


def build_objective(name: str, **kwargs) -> PolicyObjective:
    """An objective by name (``troll`` or ``clip``) with its keyword arguments."""
    return OBJECTIVES[check_choice("objective", name, OBJECTIVES)](**kwargs)


ROLLOUT_OPTIONS = ("mask_truncated", "engine_is_cap", "engine_is_level", "engine_is_mode",
                   "engine_is_floor", "anchor", "anchor_is_cap")  # fmt: skip
"""The fields of :class:`LossConfig` that the rollout applies (masks, the engine's and the stale
sampler's corrections), not the objective."""


def objective_from_records(
    name: str,
    trust_region: TrustRegionConfig,
    clip: ClipConfig,
    loss: LossConfig,
    max_new_tokens: int,
) -> PolicyObjective:
    """The objective ``name`` from ``model.trust_region``, ``model.clip`` and ``model.loss``,
    once the records are checked against each other; the other objective's options are checked
    too (a bad clip range is refused in a TROLL run). An error names its option
    (``model.<section>.<field>``). ``max_new_tokens``: the length a sequence-sum aggregation
    divides by when ``loss.norm_length`` is null."""
    check_anchor(name, trust_region.support, loss.anchor)
    shared = {k: v for k, v in asdict(loss).items() if k not in ROLLOUT_OPTIONS}
    shared["norm_length"] = loss.norm_length or max_new_tokens
    sections = {"troll": ("trust_region", trust_region), "clip": ("clip", clip)}
    built = {}
    for objective, (section, record) in sections.items():
        specific = asdict(record)
        try:
            built[objective] = build_objective(objective, **specific, **shared)
        except ValueError as error:
            found = re.match(r"[a-z_]+", str(error))
            option = found.group() if found else ""
            where = section if option in specific else "loss" if option in shared else None
            raise ValueError(f"model.{where}.{error}" if where else f"model: {error}") from None
    return built[name]
