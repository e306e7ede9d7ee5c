"""RolloutProgressBar: training progress counted in rollouts, with seconds per rollout and ETA."""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from typing_extensions import override

from lightning_troll.callbacks.rollout import RolloutGeneration

__all__ = ["RolloutProgressBar", "rollouts_done", "steps_per_rollout", "total_rollouts"]


def steps_per_rollout(trainer: Trainer, module: LightningModule) -> int | None:
    """Optimiser steps a rollout takes: ``epochs_per_rollout`` x minibatches of its sequences.

    None when the module or the data module do not say (not a TrollModule, no ``batch_size``).
    """
    optimization = getattr(module, "optimization", None)
    prompts = getattr(trainer.datamodule, "batch_size", None)
    group = getattr(module, "group_size", None)
    if optimization is None or prompts is None or group is None:
        return None
    sequences = prompts * group  # per process: each process splits its own rollout
    size = optimization.minibatch_size
    minibatches = 1 if size is None or size >= sequences else math.ceil(sequences / size)
    return optimization.epochs_per_rollout * minibatches


def rollouts_done(trainer: Trainer, module: LightningModule) -> int:
    """Rollouts a fit has done, a resumed run's earlier part included: the count
    :class:`RolloutGeneration` keeps in its checkpoint state, or, without that callback, the
    optimiser steps over the steps per rollout (short by one rollout for each rollout's worth
    of steps skipped as non-finite)."""
    for callback in trainer.callbacks:
        if isinstance(callback, RolloutGeneration):
            return callback.rollouts
    per = steps_per_rollout(trainer, module)
    return trainer.global_step // per if per else 0


def total_rollouts(
    trainer: Trainer, module: LightningModule, done: int | None = None
) -> int | None:
    """The rollouts a fit runs in all (those of a resumed run's earlier part included):
    ``max_steps`` over the steps per rollout, or ``max_epochs`` x the rollouts per epoch,
    whichever is smaller; None when neither is known.

    Given the rollouts ``done`` so far, the steps limit counts from there: ``done`` plus the
    steps still to run over the steps per rollout, so that steps skipped as non-finite (which
    do not count towards ``max_steps``) lengthen the total.
    """
    limits = []
    per = steps_per_rollout(trainer, module)
    if trainer.max_steps >= 0 and per:
        if done is None:
            limits.append(math.ceil(trainer.max_steps / per))
        else:
            left = max(0, trainer.max_steps - trainer.global_step)
            limits.append(done + math.ceil(left / per))
    batches = trainer.num_training_batches
    if trainer.max_epochs is not None and trainer.max_epochs >= 0 and math.isfinite(batches):
        limits.append(trainer.max_epochs * int(batches))
    return min(limits) if limits else None


class RolloutProgressBar(TQDMProgressBar):
    """One bar for the whole fit, counted in rollouts (Lightning's training batches):

    ``Training  37%|███▋      | 74/200 rollouts [01:05<01:51, 0.88s/rollout, reward=0.47, ...]``

    rollouts done / total, elapsed < remaining, seconds per rollout (averaged over this run),
    and the metrics logged with ``prog_bar=True`` (reward, KL after projection or clip's
    estimate, coverage). A resumed run starts at the rollouts its checkpoint holds.

    Args:
        refresh_rate: rollouts between redraws of the bar.
    """

    TRAIN_BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} rollouts [{elapsed}<{remaining}, {rate_inv_fmt}{postfix}]"

    def __init__(self, refresh_rate: int = 1) -> None:
        super().__init__(refresh_rate=refresh_rate)
        self.rollouts = 0
        """Rollouts done, counting those of the checkpoint a run resumed from."""
        self.total: int | None = None

    @override
    def init_train_tqdm(self) -> Tqdm:
        bar = super().init_train_tqdm()
        bar.unit, bar.bar_format = "rollout", self.TRAIN_BAR_FORMAT
        return bar

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.rollouts = rollouts_done(trainer, pl_module)
        self.total = total_rollouts(trainer, pl_module, self.rollouts)
        bar = self.train_progress_bar
        bar.reset(total=self.total)
        bar.initial = bar.n = self.rollouts  # the rate counts this run's rollouts only
        bar.set_description(self.train_description)

    @override
    def on_train_epoch_start(self, trainer: Trainer, *_: Any) -> None:
        """The bar spans the fit; epochs of the prompt set do not restart it."""

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.rollouts += 1
        bar = self.train_progress_bar
        total = total_rollouts(trainer, pl_module, self.rollouts)
        if total != self.total:  # steps skipped as non-finite: one more rollout
            self.total = bar.total = total
        if self._should_update(self.rollouts, bar.total):
            bar.n = self.rollouts
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # redraws

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    @override
    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)  # the log folder's version: not progress
        return metrics
