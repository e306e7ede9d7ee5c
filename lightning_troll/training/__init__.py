"""Training: the LightningModule, its minibatch loop, validation, checkpoints and resume.

- :mod:`~lightning_troll.training.module`: :class:`TrollModule`, which wires policy, snapshot and
  objective to Lightning;
- :mod:`~lightning_troll.training.optimization`: the minibatch loop (``model.optimization``);
- :mod:`~lightning_troll.training.validation`: validation metrics;
- :mod:`~lightning_troll.training.resume`, :mod:`~lightning_troll.training.checkpoints`: what a
  checkpoint keeps beyond the weights, and the checks behind resuming;
- :mod:`~lightning_troll.training.preflight`: checks of the module's options before anything loads.
"""

from lightning_troll.training.module import TrollModule
from lightning_troll.training.optimization import OptimizationConfig

__all__ = ["OptimizationConfig", "TrollModule"]
