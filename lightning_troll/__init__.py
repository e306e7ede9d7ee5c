"""lightning_troll: TROLL trust-region projections for RL fine-tuning of language models.

The package has eight rooms, cut by layer; a layer imports only the layers below it
(``docs/architecture.md``):

    cli            the lightning-troll command and export
    training       TrollModule, the minibatch loop, validation, checkpoints, resume
    rollouts       the rollout pipeline: the collector, teacher-forced passes, drift, episodes
    engines        what samples completions: the HF engine and its decoding, the engine
                   process, vLLM
    tasks          what a user brings: prompts and the DataModule (tasks.data), rewards
                   (tasks.rewards), tools and environments (tasks.environments)
    models         loading, the demo policies, snapshots, LoRA, quantisation, sharding
    objectives     TROLL and clipping, what they share, advantage estimators
    trust_region   the projection (torch only)

The callbacks (installed as ``lightning_troll.callbacks``) sit beside ``training``. The maths
(``trust_region``, ``objectives``) depends on torch only. Modules that moved are listed in
``CHANGELOG.md``; checkpoints and configs that name them by their old paths still load
(``lightning_troll.training.moved``).
"""

from lightning_troll.objectives import ClipObjective, LossInputs, TrollObjective, build_objective
from lightning_troll.objectives.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    register_advantage_estimator,
)
from lightning_troll.trust_region.projection import (
    ProjectionResult,
    SparseDistribution,
    TrustRegionProjection,
    kl_projection,
    sparsify,
)

__version__ = "0.2.0"  # CHANGELOG.md; pyproject.toml reads it from here

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ClipObjective",
    "LossInputs",
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
