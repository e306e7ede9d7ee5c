"""lightning_troll: TROLL trust-region projections for RL fine-tuning of language models.

The maths (``projection``, ``objectives``, ``advantages``) depends on torch only.
"""

from lightning_troll.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    register_advantage_estimator,
)
from lightning_troll.objectives import ClipObjective, TrollObjective, build_objective
from lightning_troll.projection import (
    ProjectionResult,
    SparseDistribution,
    TrustRegionProjection,
    kl_projection,
    sparsify,
)

__version__ = "0.1.0"

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ClipObjective",
    "ProjectionResult",
    "SparseDistribution",
    "TrollObjective",
    "TrustRegionProjection",
    "build_objective",
    "compute_advantages",
    "kl_projection",
    "register_advantage_estimator",
    "sparsify",
]
