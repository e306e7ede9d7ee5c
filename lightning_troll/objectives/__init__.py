"""Objectives: TROLL and PPO-style clipping, what they share, and the advantage estimators.

    J_TROLL = agg_t[ pi_proj(o_t) / pi_old(o_t) * A_t ] - alpha * agg_t[ KL(pi_new || sg(pi_proj)) ]
    J_clip  = agg_t[ min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t) ]   (+ dual clip c)

- :mod:`~lightning_troll.objectives.troll`, :mod:`~lightning_troll.objectives.clip`: the two
  objectives; :mod:`~lightning_troll.objectives.registry` picks one by name;
- :mod:`~lightning_troll.objectives.base`: what both share (importance ratio, aggregation,
  reference-KL and entropy terms, the row stage on chunks of rows), taking the per-token inputs
  as one :class:`~lightning_troll.objectives.base.LossInputs` and returning ``(loss, stats)``;
- :mod:`~lightning_troll.objectives.stats`: the detached statistics records;
- :mod:`~lightning_troll.objectives.options`: the option records of ``model.trust_region``,
  ``model.clip`` and ``model.loss``;
- :mod:`~lightning_troll.objectives.aggregation`, :mod:`~lightning_troll.objectives.advantages`,
  :mod:`~lightning_troll.objectives.chunking`: aggregations and importance levels, advantage
  estimators, the output layer applied to a few rows at a time.

Torch only: nothing here imports Lightning or transformers.
"""

from lightning_troll.objectives.aggregation import (
    AGGREGATION_SIZES,
    AGGREGATIONS,
    IMPORTANCE_LEVELS,
    REF_KL_ESTIMATORS,
)
from lightning_troll.objectives.base import LossInputs, PolicyObjective, token_entropy
from lightning_troll.objectives.clip import ClipObjective
from lightning_troll.objectives.options import (
    ClipConfig,
    CorrectionsConfig,
    LossConfig,
    TrustRegionConfig,
)
from lightning_troll.objectives.registry import OBJECTIVES, build_objective, objective_from_records
from lightning_troll.objectives.stats import ClipStats, ObjectiveStats, TrollStats
from lightning_troll.objectives.troll import TrollObjective

__all__ = [
    "AGGREGATIONS",
    "AGGREGATION_SIZES",
    "IMPORTANCE_LEVELS",
    "OBJECTIVES",
    "REF_KL_ESTIMATORS",
    "ClipConfig",
    "ClipObjective",
    "ClipStats",
    "CorrectionsConfig",
    "LossConfig",
    "LossInputs",
    "ObjectiveStats",
    "PolicyObjective",
    "TrollObjective",
    "TrollStats",
    "TrustRegionConfig",
    "build_objective",
    "objective_from_records",
    "token_entropy",
]
