"""OldPolicyRefresh: copies the policy into the frozen snapshot every N rollouts."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

__all__ = ["OldPolicyRefresh"]


class OldPolicyRefresh(Callback):
    """Refreshes ``model.old_policy`` (the behaviour policy that samples) from ``model.policy``.

    With ``every_n_rollouts=1`` every rollout is sampled by the current policy, so the first
    minibatch of each rollout is on-policy; larger values sample several rollouts from a lagging
    snapshot. The count survives a checkpoint. The refresh is ``model.snapshot.refresh``: a copy,
    a re-quantisation, or an adapter copy (see :mod:`lightning_troll.snapshots`); a shared snapshot
    is the policy and refuses ``every_n_rollouts > 1`` before training.

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

    @torch.no_grad()
    def refresh(self, pl_module: LightningModule) -> None:
        pl_module.snapshot.refresh(pl_module.policy)
        self.refreshes += 1

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"rollouts": self.rollouts, "refreshes": self.refreshes}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rollouts = state_dict["rollouts"]
        self.refreshes = state_dict["refreshes"]
