"""OldPolicyRefresh: copies the policy into the frozen snapshot every N rollouts."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_troll.callbacks.refresh_options import (
    check_refresh,
    check_staleness_world,
    check_versions_fit,
    idle_proximal,
    one_step_trap,
    rollouts_of_run,
    shared_cannot_lag,
)
from lightning_troll.models.snapshots import CopySnapshot
from lightning_troll.training.memory_check import available_bytes
from lightning_troll.training.staleness import StalenessSchedule, version_bytes

__all__ = ["OldPolicyRefresh"]


class OldPolicyRefresh(Callback):
    """Refreshes ``model.old_policy`` (the behaviour policy that samples) from ``model.policy``.

    With ``every_n_rollouts=1`` every rollout is sampled by the current policy, so the first
    minibatch of each rollout is on-policy; larger values sample several rollouts from a lagging
    snapshot. The count survives a checkpoint. The refresh is ``model.snapshot.refresh``: a copy,
    a re-quantisation, or an adapter copy (see :mod:`lightning_troll.models.snapshots`); a shared snapshot
    is the policy and refuses ``every_n_rollouts > 1`` before training.

    **Staleness.** With ``max_staleness: s`` every rollout is sampled by the policy version ``s``
    rollouts old (:mod:`~lightning_troll.training.staleness`, whose
    :class:`~lightning_troll.training.staleness.StalenessSchedule` this callback configures, hands
    to the module as ``model.staleness`` and triggers after every rollout); a ``copy`` snapshot
    only. The ``s`` kept versions cost ``s`` copies of the weights on the CPU and in every
    checkpoint: the start of a fit prints that figure (a warning where the run's length never
    reaches the lag), and refuses a lag that the host's free memory cannot hold (``s`` at most
    :data:`~lightning_troll.training.staleness.MAX_STALENESS`, checked with the other options).
    Every rollout logs ``rollout/policy_version`` (the version that sampled it) and
    ``rollout/staleness`` (the trainer's version minus that one).

    **Another staleness on resume.** The checkpoint keeps ``max_staleness``; a run resumed with
    another value ``s'`` warns once and goes on from there. Lower: the snapshot moves at once to
    the version now due, ``rollouts - s'``, taken from the queue (with ``s' = 0`` the current
    policy, and the queue is emptied). Higher: the lag grows by one rollout at a time until it
    reaches ``s'``, as at a fresh run's start. A version that was never kept (a run that
    refreshed ``every_n_rollouts``) is replaced by the next one kept, or the current policy.
    Another ``every_n_rollouts`` warns once too: the snapshot is refreshed whenever it lags that
    many rollouts or more, at once if it already does.

    At the start of a fit it warns (once) when the configuration makes every optimiser step
    on-policy: one epoch, one minibatch per rollout and a refresh every rollout leave the policy
    equal to the behaviour policy at every step, so the trust region (or the clip) never acts.
    It warns (once) too when ``model.corrections.anchor`` is ``proximal`` but the sampler always holds
    the current weights (no staleness and a refresh every rollout into a snapshot in the policy's
    dtype, or a shared snapshot): the proximal weight is then 1 and its forward pass buys nothing.

    Args:
        every_n_rollouts: rollouts between two refreshes, >= 1.
        max_staleness: versions the sampler lags behind the trainer, >= 0; 0 samples every
            rollout with the current policy.
    """

    def __init__(self, every_n_rollouts: int = 1, max_staleness: int = 0) -> None:
        check_refresh(every_n_rollouts, max_staleness)
        self.schedule = StalenessSchedule(every_n_rollouts, max_staleness)
        """What this callback triggers; the module holds it from ``setup`` on."""

    @property
    def every_n_rollouts(self) -> int:
        return self.schedule.every_n_rollouts

    @property
    def max_staleness(self) -> int:
        return self.schedule.max_staleness

    @property
    def rollouts(self) -> int:
        return self.schedule.rollouts

    @property
    def refreshes(self) -> int:
        return self.schedule.refreshes

    @property
    def version(self) -> int:
        """The policy version the snapshot holds (the one that samples the next rollout)."""
        return self.schedule.version

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        pl_module.log("rollout/policy_version", float(self.version), batch_size=1)
        pl_module.log("rollout/staleness", float(self.schedule.staleness), batch_size=1)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        engine = getattr(pl_module, "engine", None)
        self.schedule.after_rollout(pl_module.policy, pl_module.snapshot, engine)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A resumed run with other options: the snapshot and the kept versions are brought to
        this run's (after Lightning has restored the weights and the schedule's state)."""
        schedule = self.schedule
        stored, schedule.resumed_from = schedule.resumed_from, {}
        engine = getattr(pl_module, "engine", None)
        ahead, schedule.ahead_seed = schedule.ahead_seed, None  # handed on once, then the engine's
        if ahead is not None and hasattr(engine, "next_seed"):
            engine.next_seed = ahead  # the rollout the checkpoint had in flight
        policy, snapshot = getattr(pl_module, "policy", None), getattr(pl_module, "snapshot", None)
        version = schedule.resume_version(policy)
        if stored.get("max_staleness", self.max_staleness) != self.max_staleness:
            rank_zero_warn(_staleness_change(schedule, stored["max_staleness"], version))
        every = stored.get("every_n_rollouts", self.every_n_rollouts)
        if every != self.every_n_rollouts and not self.max_staleness:
            rank_zero_warn(_every_change(schedule, every, version))
        schedule.move_to(version, policy, snapshot, engine)
        if not self.max_staleness:
            schedule.waiting.clear()

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        snapshot = getattr(pl_module, "snapshot", None)
        if self.every_n_rollouts > 1 and not getattr(snapshot, "can_lag", True):
            raise ValueError(shared_cannot_lag(self.every_n_rollouts))
        if self.max_staleness:
            policies = getattr(pl_module, "policies", None)
            check_refresh(
                self.every_n_rollouts,
                self.max_staleness,
                getattr(policies, "snapshot_config", None),
                getattr(policies, "lora", None),
            )
            if not isinstance(snapshot, CopySnapshot):  # a snapshot built apart from its options
                raise ValueError(
                    f"old_policy.max_staleness={self.max_staleness} needs a copy snapshot; got a "
                    f"{type(snapshot).__name__}"
                )
        pl_module.staleness = self.schedule  # the module holds it; RolloutGeneration reads it
        check_staleness_world(self.max_staleness, trainer.world_size)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.max_staleness:
            self._check_versions(trainer, pl_module)
        snapshot = getattr(getattr(pl_module, "policies", None), "snapshot_config", None)
        anchor = getattr(getattr(pl_module, "corrections", None), "anchor", "behaviour")
        message = idle_proximal(anchor, self.every_n_rollouts, self.max_staleness, snapshot)
        if message is not None:
            rank_zero_warn(message)
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
            self.max_staleness,
            anchor,
        )
        if message is not None:
            rank_zero_warn(message)

    def _check_versions(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Prints what the kept versions cost (warns where the run never reaches the lag);
        refuses a lag the host cannot hold (:func:`~lightning_troll.callbacks.refresh_options.check_versions_fit`)."""
        optimization = getattr(pl_module, "optimization", None)
        prompts = getattr(trainer.datamodule, "batch_size", None)
        group_size = getattr(pl_module, "group_size", None)
        run_rollouts = None
        if optimization is not None and isinstance(prompts, int) and group_size:
            run_rollouts = rollouts_of_run(
                trainer.max_steps, optimization.epochs_per_rollout, optimization.minibatch_size,
                prompts * group_size,
            )  # fmt: skip
        cost = check_versions_fit(
            self.max_staleness, version_bytes(pl_module.policy),
            available_bytes(torch.device("cpu")), run_rollouts,
        )  # fmt: skip
        (rank_zero_warn if "not below the run's" in cost else rank_zero_info)(cost)

    def refresh(self, pl_module: LightningModule, weights: Any = None, version: int = -1) -> None:
        """Loads ``weights`` (the policy by default) into the module's snapshot now."""
        engine = getattr(pl_module, "engine", None)
        self.schedule.refresh(pl_module.policy, pl_module.snapshot, engine, weights, version)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.schedule.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.schedule.load_state_dict(state_dict)


def _every_change(refresh: StalenessSchedule, stored: int, version: int) -> str:
    """The warning for a resume of ``refresh`` with another ``every_n_rollouts`` than the
    checkpoint's ``stored``, before the snapshot moves to ``version``."""
    head = f"old_policy.every_n_rollouts={refresh.every_n_rollouts} differs from the checkpoint's "
    if version != refresh.version:
        return head + (
            f"{stored}: the snapshot moves at once from version {refresh.version} to the current "
            f"policy (version {version}), which it lagged by {version - refresh.version} "
            f"rollout{'s' if version - refresh.version != 1 else ''}"
        )
    return head + (
        f"{stored}: the snapshot stays at version {refresh.version} and is refreshed once it lags "
        f"{refresh.every_n_rollouts} rollouts"
    )


def _staleness_change(refresh: StalenessSchedule, stored: int, version: int) -> str:
    """The warning for a resume of ``refresh`` with another ``max_staleness`` than the checkpoint's
    ``stored``, before the snapshot moves to ``version``: what happens to the sampler."""
    s, lag = refresh.max_staleness, refresh.rollouts - refresh.version
    head = f"old_policy.max_staleness={s} differs from the checkpoint's {stored}: "
    if not s:
        dropped = [v for v, _ in refresh.waiting]
        return head + (
            f"the snapshot moves at once from version {refresh.version} to the current policy "
            f"(version {refresh.rollouts}) and the queued versions {dropped} are dropped"
        )
    if version != refresh.version:
        due = refresh.rollouts - s
        which = f"rollouts {refresh.rollouts} - {s}"
        if version != due:  # a run that refreshed every_n_rollouts kept no past versions
            which = f"the next kept after version {due} = {which}, which was not kept"
        queued = [v for v, _ in refresh.waiting if v > version]
        return head + (
            f"the snapshot moves at once from version {refresh.version} to version {version} "
            f"({which}); versions {queued} stay queued"
        )
    if lag < s:
        return head + f"the sampler's lag grows by one rollout at a time from {lag} to {s}"
    return head + f"the sampler stays at version {refresh.version}, {lag} behind"
