"""lightning_troll: TROLL trust-region projections for RL fine-tuning of language models.

The package is cut by layer; a layer imports only the layers below it (``docs/architecture.md``):

    cli            the lightning-troll command and export
    training       TrollModule, the minibatch loop, validation, checkpoints, resume
    rollouts       sampling, behaviour log-probs, teacher-forced passes, drift, episodes
    environments   tools, the environment protocol, multi-turn conversations rendered
    rewards        the reward registry, scorer and built-in rewards
    data           the prompt DataModule, row sources, prompt records
    models         loading, the demo policies, snapshots, LoRA, quantisation, sharding
    objectives     TROLL and clipping, what they share, advantage estimators
    trust_region   the projection (torch only)

The callbacks (installed as ``lightning_troll.callbacks``) sit beside ``training``. The maths
(``trust_region``, ``objectives``) depends on torch only. The modules of the earlier flat layout
(``lightning_troll.projection``, ``lightning_troll.module``, ...) stay importable under their old
names, as the same module objects, so code and checkpoints that name them keep working.
"""

import importlib
import importlib.abc
import importlib.util
import sys

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

__version__ = "0.1.0"

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

MOVED_MODULES = {
    "sparse": "trust_region.sparse",
    "kl_solver": "trust_region.kl_solver",
    "union": "trust_region.union",
    "supports": "trust_region.supports",
    "projection": "trust_region.projection",
    "aggregation": "objectives.aggregation",
    "advantages": "objectives.advantages",
    "chunking": "objectives.chunking",
    "objective_stats": "objectives.stats",
    "policy_objective": "objectives.base",
    "lora": "models.lora",
    "quantize": "models.quantize",
    "gguf": "models.gguf",
    "smollm2": "models.smollm2",
    "snapshots": "models.snapshots",
    "sharding": "models.sharding",
    "tinymath": "models.tinymath",
    "prompts": "data.prompts",
    "sources": "data.sources",
    "reward_functions": "rewards.functions",
    "reward_options": "rewards.options",
    "rollout": "rollouts.rollout",
    "behaviour": "engines.behaviour",
    "forward": "rollouts.forward",
    "dynamic_sampling": "rollouts.dynamic_sampling",
    "drift": "rollouts.drift",
    "timing": "rollouts.timing",
    "module": "training.module",
    "optimization": "training.optimization",
    "validation": "training.validation",
    "checkpoints": "training.checkpoints",
    "resume": "training.resume",
    "preflight": "training.preflight",
    "export": "cli.export",
}
"""Old module name (``lightning_troll.<old>``) -> its place now (``lightning_troll.<new>``). The
old ``data``, ``rewards``, ``models``, ``objectives`` and ``cli`` modules are now packages that
export what those modules did."""


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``lightning_troll.<old>`` to the module at its new place (the same object)."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(f"{__name__}.{MOVED_MODULES[spec.name.rpartition('.')[2]]}")

    def exec_module(self, module) -> None:
        """Nothing to run: the module at the new place is already imported."""


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
