"""The objectives by name: ``model.objective`` picks one of :data:`OBJECTIVES`, built from the
option records that travel whole to here (:func:`objective_from_records`)."""

from __future__ import annotations

import re
from dataclasses import fields

from lightning_troll.objectives.base import PolicyObjective, check_choice
from lightning_troll.objectives.clip import ClipObjective
from lightning_troll.objectives.options import (
    ClipConfig,
    CorrectionsConfig,
    LossConfig,
    TrustRegionConfig,
    check_anchor,
)
from lightning_troll.objectives.troll import TrollObjective

__all__ = ["OBJECTIVES", "build_objective", "objective_from_records"]


OBJECTIVES: dict[str, type[PolicyObjective]] = {"troll": TrollObjective, "clip": ClipObjective}


def build_objective(name: str, **kwargs) -> PolicyObjective:
    """An objective by name (``troll`` or ``clip``) with its keyword arguments."""
    return OBJECTIVES[check_choice("objective", name, OBJECTIVES)](**kwargs)


def objective_from_records(
    name: str,
    trust_region: TrustRegionConfig,
    clip: ClipConfig,
    loss: LossConfig,
    corrections: CorrectionsConfig,
    max_new_tokens: int,
) -> PolicyObjective:
    """The objective ``name`` from ``model.trust_region``, ``model.clip`` and ``model.loss``,
    once the records are checked against each other and against ``model.corrections`` (which
    the rollout applies, not the objective); the other objective's options are checked too (a
    bad clip range is refused in a TROLL run). An error names its option
    (``model.<section>.<field>``). ``max_new_tokens``: the length a sequence-sum aggregation
    divides by when ``loss.norm_length`` is null."""
    check_anchor(name, trust_region.support, corrections.anchor)
    sections = {"troll": ("trust_region", trust_region), "clip": ("clip", clip)}
    built = {}
    for objective, (section, record) in sections.items():
        try:
            built[objective] = OBJECTIVES[objective].from_records(record, loss, max_new_tokens)
        except ValueError as error:
            found = re.match(r"[a-z_]+", str(error))
            option = found.group() if found else ""
            owners = [s for s, r in ((section, record), ("loss", loss)) if option in _fields(r)]
            raise ValueError(
                f"model.{owners[0]}.{error}" if owners else f"model: {error}"
            ) from None
    return built[name]


def _fields(record: object) -> set[str]:
    """The field names of an option record."""
    return {f.name for f in fields(record)}
