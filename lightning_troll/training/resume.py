"""TrollModule's checkpoint hooks: what it keeps beyond its weights, and what resuming restores.

A checkpoint carries, under ``"lightning_troll"``, the minibatch loop's state (its shuffle
generator and the count of bad steps in a row) and every process's global random states, so
that a resumed run shuffles and samples as the interrupted one would have. Loading one checks
that its tensors fit the model and warns of options that changed.

:class:`ResumeState` is the part of :class:`~lightning_troll.training.module.TrollModule` that does
this (the module's checkpoint hooks call it); the helpers it calls are in
:mod:`lightning_troll.training.checkpoints`.

The option records a module is built from are pickled with its hyper-parameters, and
checkpoints are loaded with ``weights_only=True``, which accepts only allow-listed classes:
:data:`CHECKPOINT_CONFIGS` lists them, and this file allows them under their present path and
under every path they had before (:mod:`lightning_troll.training.moved`), so that checkpoints
written before they moved still load.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_troll.engines.base import EngineConfig
from lightning_troll.engines.sampling import SamplingConfig
from lightning_troll.models.lora import LoraConfig
from lightning_troll.models.snapshots import SnapshotConfig
from lightning_troll.objectives import ClipConfig, CorrectionsConfig, LossConfig, TrustRegionConfig
from lightning_troll.objectives.options import AdvantageConfig
from lightning_troll.rollouts.dynamic_sampling import DynamicSamplingConfig
from lightning_troll.tasks.environments.options import EpisodesConfig
from lightning_troll.tasks.rewards.options import RewardOptions
from lightning_troll.training.checkpoints import (
    changed_options,
    check_compatible,
    restore_rng_states,
    rng_states_by_rank,
    seed_per_rank,
)
from lightning_troll.training.moved import allow_moved_records, fold_renamed_options
from lightning_troll.training.optimization import MinibatchLoop, OptimizationConfig

__all__ = ["CHECKPOINT_CONFIGS", "ResumeState"]

CHECKPOINT_CONFIGS = (
    TrustRegionConfig,
    ClipConfig,
    LossConfig,
    CorrectionsConfig,
    AdvantageConfig,
    DynamicSamplingConfig,
    EngineConfig,
    OptimizationConfig,
    SamplingConfig,
    SnapshotConfig,
    LoraConfig,
    EpisodesConfig,
    RewardOptions,
)
"""The option records TrollModule's hyper-parameters (and so its checkpoints) hold."""

REEXPORTED = {
    f"lightning_troll.{old}.{config.__name__}": config
    for config in (TrustRegionConfig, ClipConfig, LossConfig)
    for old in ("module", "objectives")
} | {"lightning_troll.module.OptimizationConfig": OptimizationConfig}
"""Paths older checkpoints name a record by that a module re-exported it under (the flat
``module`` and ``objectives``); every other old path follows from ``moved.MOVED_MODULES``."""

torch.serialization.add_safe_globals(list(CHECKPOINT_CONFIGS))
allow_moved_records(CHECKPOINT_CONFIGS, REEXPORTED)


class ResumeState:
    """What TrollModule keeps in a checkpoint beyond its weights, and restores from one: the
    minibatch loop's state and every process's global random states (set as training starts,
    once Lightning has built the dataloaders)."""

    def __init__(self, minibatch_loop: MinibatchLoop) -> None:
        self.minibatch_loop = minibatch_loop
        self._rng_to_restore: dict[str, Any] | None = None

    def save(self, checkpoint: dict[str, Any], rank: int, world: int) -> None:
        """Adds the minibatch loop's state (shuffle generator, bad-step count) and every rank's
        global RNG states.

        Only one process writes the checkpoint (or its metadata, when sharded), so the states
        of all of them are gathered first; every process runs this.
        """
        by_rank = rng_states_by_rank(rank, world)
        checkpoint["lightning_troll"] = {**self.minibatch_loop.state_dict(), "rng": by_rank}

    def load(
        self,
        checkpoint: dict[str, Any],
        own: Callable[[], dict[str, Any]],
        hparams: Mapping[str, Any],
        rank: int,
        world: int,
    ) -> None:
        """Checks the checkpoint fits this model (``own``: its state dict), warns of options
        that changed from ``hparams``, then restores what :meth:`save` added.

        The global RNG states are set in :meth:`start`, after Lightning has built the
        dataloaders, so a resumed run draws the numbers the interrupted one would have drawn.
        """
        if "state_dict" in checkpoint:  # sharded strategies load the weights elsewhere
            check_compatible(own(), checkpoint["state_dict"], f"model {hparams['model']!r}")
        stored, _ = fold_renamed_options(checkpoint.get("hyper_parameters", {}))  # 0.1's keys
        changed = changed_options(hparams, stored)
        if changed:
            rank_zero_warn(
                "resuming with other options than the checkpoint was written with (weights, "
                "snapshot and optimiser carry over; the new options apply from here on): "
                + "; ".join(changed)
            )
        state = checkpoint.get("lightning_troll", {})
        self.minibatch_loop.load_state_dict(state)
        saved = state.get("rng", {})
        self._rng_to_restore = saved.get(rank)
        missing = [r for r in range(world) if r not in saved]
        if missing:
            rank_zero_warn(
                f"the checkpoint holds no random state for global ranks {missing} (it was written "
                "by fewer processes): they sample other completions than the interrupted run "
                "would have"
            )

    def start(self, rank: int, world: int) -> None:
        """Restores the global RNG states of a checkpoint being resumed; in a new run of several
        processes, gives each its own random streams (:func:`seed_per_rank`)."""
        if self._rng_to_restore is not None:
            restore_rng_states(self._rng_to_restore)
            self._rng_to_restore = None
        elif world > 1:
            seed_per_rank(rank)
