"""TrollModule's checkpoint hooks: what it keeps beyond its weights, and what resuming restores.

A checkpoint carries, under ``"lightning_troll"``, the minibatch loop's state (its shuffle
generator and the count of bad steps in a row) and every process's global random states, so
that a resumed run shuffles and samples as the interrupted one would have. Loading one checks
that its tensors fit the model and warns of options that changed.

:class:`ResumeHooks` holds these hooks as a mixin of :class:`~lightning_troll.training.module.TrollModule`
(Lightning's own LightningModule is built from hook mixins the same way); the helpers it calls
are in :mod:`lightning_troll.training.checkpoints`.

The option records a module is built from are pickled with its hyper-parameters, and
checkpoints are loaded with ``weights_only=True``, which accepts only allow-listed classes:
:data:`CHECKPOINT_CONFIGS` lists them and this file allows them under their present path and
under every path they had before (:data:`MOVED_CONFIGS`: ``lightning_troll.module``, then the
flat modules ``lightning_troll.objectives``, ``optimization``, ``rollout``, ``snapshots`` and
``lora``), so that checkpoints written before they moved still load.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_troll.models.lora import LoraConfig
from lightning_troll.models.snapshots import SnapshotConfig
from lightning_troll.objectives import ClipConfig, LossConfig, TrustRegionConfig
from lightning_troll.rollouts.rollout import SamplingConfig
from lightning_troll.training.checkpoints import (
    changed_options,
    check_compatible,
    restore_rng_states,
    rng_states_by_rank,
    seed_per_rank,
)
from lightning_troll.training.optimization import MinibatchLoop, OptimizationConfig

__all__ = ["CHECKPOINT_CONFIGS", "MOVED_CONFIGS", "ResumeHooks"]

CHECKPOINT_CONFIGS = (
    TrustRegionConfig,
    ClipConfig,
    LossConfig,
    OptimizationConfig,
    SamplingConfig,
    SnapshotConfig,
    LoraConfig,
)
"""The option records TrollModule's hyper-parameters (and so its checkpoints) hold."""

MOVED_CONFIGS: tuple[tuple[type, str], ...] = (
    *(
        (config, f"lightning_troll.{old}.{config.__name__}")
        for config in (TrustRegionConfig, ClipConfig, LossConfig)
        for old in ("module", "objectives")
    ),
    (OptimizationConfig, "lightning_troll.module.OptimizationConfig"),
    (OptimizationConfig, "lightning_troll.optimization.OptimizationConfig"),
    (SamplingConfig, "lightning_troll.rollout.SamplingConfig"),
    (SnapshotConfig, "lightning_troll.snapshots.SnapshotConfig"),
    (LoraConfig, "lightning_troll.lora.LoraConfig"),
)
"""(option record, a path it had before): what older checkpoints name it by. The package's
present ``lightning_troll.objectives`` exports the first three under that name too."""

torch.serialization.add_safe_globals([*CHECKPOINT_CONFIGS, *MOVED_CONFIGS])


class ResumeHooks:
    """The checkpoint hooks of :class:`~lightning_troll.training.module.TrollModule` and ``on_train_start``,
    which sets the random states a resumed run needs once Lightning has built the dataloaders."""

    minibatch_loop: MinibatchLoop
    _rng_to_restore: dict[str, Any] | None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Adds the minibatch loop's state (shuffle generator, bad-step count) and every rank's
        global RNG states.

        Only one process writes the checkpoint (or its metadata, when sharded), so the states
        of all of them are gathered first; every process runs this hook.
        """
        world = self.trainer.world_size if self._trainer is not None else 1
        by_rank = rng_states_by_rank(self.global_rank, world)
        checkpoint["lightning_troll"] = {**self.minibatch_loop.state_dict(), "rng": by_rank}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Checks the checkpoint fits this model, then restores what ``on_save_checkpoint`` added.

        The global RNG states are set in ``on_train_start``, after Lightning has built the
        dataloaders, so a resumed run draws the numbers the interrupted one would have drawn.
        """
        if "state_dict" in checkpoint:  # sharded strategies load the weights elsewhere
            check_compatible(
                self.state_dict(), checkpoint["state_dict"], f"model {self.hparams.model!r}"
            )
        self._warn_changed_options(checkpoint.get("hyper_parameters", {}))
        state = checkpoint.get("lightning_troll", {})
        self.minibatch_loop.load_state_dict(state)
        saved = state.get("rng", {})
        self._rng_to_restore = saved.get(self.global_rank)
        ranks = self.trainer.world_size if self._trainer is not None else 1
        missing = [rank for rank in range(ranks) if rank not in saved]
        if missing:
            rank_zero_warn(
                f"the checkpoint holds no random state for global ranks {missing} (it was written "
                "by fewer processes): they sample other completions than the interrupted run "
                "would have"
            )

    def on_train_start(self) -> None:
        """Restores the global RNG states of a checkpoint being resumed; in a new run of several
        processes, gives each its own random streams (:func:`seed_per_rank`)."""
        if self._rng_to_restore is not None:
            restore_rng_states(self._rng_to_restore)
            self._rng_to_restore = None
        elif self.trainer.world_size > 1:
            seed_per_rank(self.global_rank)

    def _warn_changed_options(self, saved: dict[str, Any]) -> None:
        changed = changed_options(self.hparams, saved)
        if changed:
            rank_zero_warn(
                "resuming with other options than the checkpoint was written with (weights, "
                "snapshot and optimiser carry over; the new options apply from here on): "
                + "; ".join(changed)
            )
