"""OldPolicyRefresh: copies the policy into the frozen snapshot every N rollouts."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

__all__ = ["OldPolicyRefresh", "one_step_trap"]


class OldPolicyRefresh(Callback):
    """Refreshes ``model.old_policy`` (the behaviour policy that samples) from ``model.policy``.

    With ``every_n_rollouts=1`` every rollout is sampled by the current policy, so the first
    minibatch of each rollout is on-policy; larger values sample several rollouts from a lagging
    snapshot. The count survives a checkpoint. The refresh is ``model.snapshot.refresh``: a copy,
    a re-quantisation, or an adapter copy (see :mod:`lightning_troll.models.snapshots`); a shared snapshot
    is the policy and refuses ``every_n_rollouts > 1`` before training.

    At the start of a fit it warns (once) when the configuration makes every optimiser step
    on-policy: one epoch, one minibatch per rollout and a refresh every rollout leave the policy
    equal to the behaviour policy at every step, so the trust region (or the clip) never acts.

    Args:
        every_n_rollouts: rollouts between two refreshes, >= 1.
    """

    def __init__(self, every_n_rollouts: int = 1) -> None:
        if isinstance(every_n_rollouts, bool) or every_n_rollouts < 1:
            raise ValueError(
                f"OldPolicyRefresh: every_n_rollouts must be an integer >= 1; got {every_n_rollouts!r}"
            )
        self.every_n_rollouts = every_n_rollouts
        self.rollouts = 0
        self.refreshes = 0

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.rollouts += 1
        if self.rollouts % self.every_n_rollouts == 0:
            self.refresh(pl_module)

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        snapshot = getattr(pl_module, "snapshot", None)
        if self.every_n_rollouts > 1 and not getattr(snapshot, "can_lag", True):
            raise ValueError(
                f"OldPolicyRefresh: every_n_rollouts={self.every_n_rollouts} needs a snapshot "
                "that can lag behind the policy, but model.snapshot.mode='shared' makes the "
                "snapshot the policy itself; use every_n_rollouts=1 or model.snapshot.mode='copy'"
            )

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        optimization = getattr(pl_module, "optimization", None)
        group_size = getattr(pl_module, "group_size", None)
        prompts = getattr(trainer.datamodule, "batch_size", None)
        if optimization is None or group_size is None:
            return
        sequences = None if prompts is None else prompts * group_size  # per rollout and process
        message = one_step_trap(
            optimization.epochs_per_rollout,
            optimization.minibatch_size,
            sequences,
            self.every_n_rollouts,
            getattr(pl_module, "objective_name", "troll"),
        )
        if message is not None:
            rank_zero_warn(message)

    @torch.no_grad()
    def refresh(self, pl_module: LightningModule) -> None:
        pl_module.snapshot.refresh(pl_module.policy)
        engine = getattr(pl_module, "engine", None)
        if engine is not None:  # it takes the new weights before its next rollout
            engine.stale = True
        self.refreshes += 1

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"rollouts": self.rollouts, "refreshes": self.refreshes}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rollouts = state_dict["rollouts"]
        self.refreshes = state_dict["refreshes"]


def one_step_trap(
    epochs_per_rollout: int,
    minibatch_size: int | None,
    rollout_sequences: int | None,
    every_n_rollouts: int,
    objective: str = "troll",
) -> str | None:
    """The warning for a configuration whose every optimiser step is on-policy, else None.

    One epoch over a rollout taken as one minibatch (``minibatch_size`` null, or at least the
    ``rollout_sequences``), with the snapshot refreshed after every rollout, makes one step per
    rollout from the very policy that sampled it: the importance ratios are 1, the projection (or
    the clip) never acts, and the update is a plain policy gradient.
    """
    one_minibatch = minibatch_size is None or (
        rollout_sequences is not None and minibatch_size >= rollout_sequences
    )
    if epochs_per_rollout != 1 or not one_minibatch or every_n_rollouts != 1:
        return None
    acts = "TROLL's projection" if objective == "troll" else "the clip"
    size = f"{rollout_sequences} sequences" if rollout_sequences is not None else "the rollout"
    smaller = f"below {rollout_sequences}" if rollout_sequences is not None else "to a number"
    return (
        f"every optimiser step is on-policy: model.optimization.epochs_per_rollout=1 and "
        f"model.optimization.minibatch_size={minibatch_size} (one minibatch of {size}) take one "
        "step per rollout, and old_policy.every_n_rollouts=1 refreshes the snapshot after each, "
        f"so the policy equals the behaviour policy at every step, {acts} never acts and the "
        "update is a plain policy gradient. For off-policy steps set "
        f"model.optimization.minibatch_size {smaller} (data.batch_size x model.group_size "
        "sequences make a rollout), model.optimization.epochs_per_rollout above 1, or "
        "old_policy.every_n_rollouts above 1"
    )
