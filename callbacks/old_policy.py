"""OldPolicyRefresh: copies the policy into the frozen snapshot every N rollouts."""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_troll.callbacks.refresh_options import (
    check_refresh,
    idle_proximal,
    one_step_trap,
    shared_cannot_lag,
)
from lightning_troll.callbacks.rollout import RolloutGeneration
from lightning_troll.models.snapshots import CopySnapshot
from lightning_troll.models.weights import full_weights

__all__ = ["OldPolicyRefresh"]


class OldPolicyRefresh(Callback):
    """Refreshes ``model.old_policy`` (the behaviour policy that samples) from ``model.policy``.

    With ``every_n_rollouts=1`` every rollout is sampled by the current policy, so the first
    minibatch of each rollout is on-policy; larger values sample several rollouts from a lagging
    snapshot. The count survives a checkpoint. The refresh is ``model.snapshot.refresh``: a copy,
    a re-quantisation, or an adapter copy (see :mod:`lightning_troll.models.snapshots`); a shared snapshot
    is the policy and refuses ``every_n_rollouts > 1`` before training.

    **Staleness.** A policy version is the weights after a rollout's optimiser steps (version 0:
    the weights the run starts with). With ``max_staleness: s`` rollout k + 1 is sampled by version
    k - s (version 0 until k exceeds s): the data is exactly ``s`` versions stale, as it is at most
    in an asynchronous trainer that lets the sampler run ``s`` rollouts ahead, so the semantics
    can be studied on one device; the behaviour policy the objective bounds is that stale sampler.
    Versions are counted in rollouts, not optimiser steps, because the sampler's weights change
    only between rollouts. The ``s`` newest versions wait on the CPU (``s`` copies of the weights,
    also in the checkpoint, so a resumed run continues exactly); a ``copy`` snapshot only. Every
    rollout logs ``rollout/policy_version`` (the version that sampled it) and
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
    It warns (once) too when ``model.loss.anchor`` is ``proximal`` but the sampler always holds
    the current weights (no staleness and a refresh every rollout into a snapshot in the policy's
    dtype, or a shared snapshot): the proximal weight is then 1 and its forward pass buys nothing.

    Args:
        every_n_rollouts: rollouts between two refreshes, >= 1.
        max_staleness: versions the sampler lags behind the trainer, >= 0; 0 samples every
            rollout with the current policy.
    """

    def __init__(self, every_n_rollouts: int = 1, max_staleness: int = 0) -> None:
        check_refresh(every_n_rollouts, max_staleness)
        self.every_n_rollouts = every_n_rollouts
        self.max_staleness = max_staleness
        self.rollouts = 0
        self.refreshes = 0
        self.version = 0
        """The policy version the snapshot holds (the one that samples the next rollout)."""
        self._waiting: deque[tuple[int, dict[str, torch.Tensor]]] = deque()
        """The versions kept for the snapshot, oldest first (those after ``version``)."""
        self._ahead_seed: int | None = None
        """The seed of the rollout asked ahead of an engine in its own process, while it is in
        flight: kept in the checkpoint, so that a resumed run samples that rollout again with it."""
        self._resumed_from: dict[str, int] = {}
        """The checkpoint's ``max_staleness`` and ``every_n_rollouts``, until the resumed fit has
        applied this one's."""

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        pl_module.log("rollout/policy_version", float(self.version), batch_size=1)
        pl_module.log("rollout/staleness", float(self.rollouts - self.version), batch_size=1)
        if self.max_staleness and hasattr(getattr(pl_module, "engine", None), "submit"):
            self._sample_ahead(trainer, pl_module)

    def _sample_ahead(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Asks an engine in its own process for the next rollout now, while this one trains:
        the next rollout is sampled by version ``rollouts + 1 - max_staleness``, which exists
        already (see :mod:`lightning_troll.engines.process`). Nothing is asked ahead of
        a rollout that dynamic sampling or episodes make; at an epoch's end the next rollout is the
        next epoch's first (:meth:`~lightning_troll.tasks.data.prompts.ResumableLoader.peek`)."""
        self._ahead_seed = None
        loader = getattr(trainer.datamodule, "train_loader", None)
        upcoming = loader.peek() if loader is not None else None
        if upcoming is None or pl_module.dynamic_sampling or pl_module.episodes is not None:
            return
        engine, collector = pl_module.engine, pl_module.collector
        version = self._due(self.rollouts + 1)
        if version > self.rollouts:  # the trainer's own weights after this rollout: not yet
            return
        if version != self.version and engine.policy_version != version:
            weights = next(w for v, w in self._waiting if v == version)
            engine.push(_named(pl_module.policy, weights, pl_module.snapshot), pl_module.device)
            engine.policy_version = version
        engine.submit(
            upcoming.prompt_ids, collector.group_size, collector.sampling, collector.pad_id,
            collector.stop_ids,
        )  # fmt: skip
        self._ahead_seed = engine.pending_seed

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.rollouts += 1
        if self.max_staleness:
            self._lagged(pl_module)
        elif self.rollouts - self.version >= self.every_n_rollouts:
            self.refresh(pl_module)
            self.version = self.rollouts

    def _lagged(self, pl_module: LightningModule) -> None:
        """Queues the version just trained; loads version ``rollouts - max_staleness`` into the
        snapshot once it exists."""
        self._waiting.append((self.rollouts, _cpu_copy(pl_module.policy)))
        self._move_to(pl_module, self._due(self.rollouts))

    def _due(self, rollouts: int) -> int:
        """The version that samples once ``rollouts`` rollouts are trained: the snapshot's while
        it is at most ``max_staleness`` behind, else the oldest kept version that is not (the
        trainer's own, ``rollouts``, when none is kept)."""
        due = rollouts - self.max_staleness
        if self.version >= due:
            return self.version
        return next((v for v, _ in self._waiting if v >= due), rollouts)

    def _move_to(self, pl_module: LightningModule, version: int) -> None:
        """Loads ``version`` into the snapshot (a kept one, or the policy's own weights) and
        drops the kept versions up to it."""
        if version == self.version:
            return
        weights = None  # the policy itself: version == rollouts
        while self._waiting and self._waiting[0][0] <= version:
            held, state = self._waiting.popleft()
            weights = _Weights(state) if held == version else None
        self.refresh(pl_module, weights, version)
        self.version = version

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A resumed run with another ``max_staleness``: the snapshot and the kept versions are
        brought to this one's (after Lightning has restored the weights and this state)."""
        stored, self._resumed_from = self._resumed_from, {}
        engine = getattr(pl_module, "engine", None)
        ahead, self._ahead_seed = self._ahead_seed, None  # handed on once, then the engine's
        if ahead is not None and hasattr(engine, "next_seed"):
            engine.next_seed = ahead  # the rollout the checkpoint had in flight
        if self.max_staleness:
            if self.version < self.rollouts and not any(
                v == self.rollouts for v, _ in self._waiting
            ):  # a run that refreshed every_n_rollouts kept none: the policy's weights are one
                self._waiting.append((self.rollouts, _cpu_copy(pl_module.policy)))
            version = self._due(self.rollouts)
        else:  # the current policy, if versions were queued or a refresh is due
            due = self._waiting or self.rollouts - self.version >= self.every_n_rollouts
            version = self.rollouts if due else self.version
        if stored.get("max_staleness", self.max_staleness) != self.max_staleness:
            rank_zero_warn(_staleness_change(self, stored["max_staleness"], version))
        every = stored.get("every_n_rollouts", self.every_n_rollouts)
        if every != self.every_n_rollouts and not self.max_staleness:
            rank_zero_warn(_every_change(self, every, version))
        self._move_to(pl_module, version)
        if not self.max_staleness:
            self._waiting.clear()

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
        engine = getattr(pl_module, "engine", None)
        if self.max_staleness and hasattr(engine, "submit"):
            _check_order(trainer.callbacks, self)
        if self.max_staleness and trainer.world_size > 1:
            raise ValueError(
                f"old_policy.max_staleness={self.max_staleness} runs in one process for now; "
                f"this run has {trainer.world_size}"
            )

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        snapshot = getattr(getattr(pl_module, "policies", None), "snapshot_config", None)
        anchor = getattr(getattr(pl_module, "loss_config", None), "anchor", "behaviour")
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

    @torch.no_grad()
    def refresh(self, pl_module: LightningModule, weights: Any = None, version: int = -1) -> None:
        """Loads ``weights`` (a module, or what has its ``state_dict``; the policy by default)
        into the snapshot; ``version``: the policy version they are, when known."""
        pl_module.snapshot.refresh(pl_module.policy if weights is None else weights)
        engine = getattr(pl_module, "engine", None)
        # it takes the new weights before its next rollout, unless it sampled ahead with them
        if engine is not None and getattr(engine, "policy_version", None) != version:
            engine.stale = True
        self.refreshes += 1

    @override
    def state_dict(self) -> dict[str, Any]:
        state = {"rollouts": self.rollouts, "refreshes": self.refreshes, "version": self.version}
        state["max_staleness"] = self.max_staleness
        state["every_n_rollouts"] = self.every_n_rollouts
        if self._ahead_seed is not None:
            state["ahead_seed"] = self._ahead_seed
        if self._waiting:
            state["waiting"] = [{"version": v, "weights": w} for v, w in self._waiting]
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rollouts = state_dict["rollouts"]
        self.refreshes = state_dict["refreshes"]
        # before staleness was kept, the snapshot held the last refresh's version
        default = self.rollouts - self.rollouts % self.every_n_rollouts
        self.version = state_dict.get("version", default)
        waiting = state_dict.get("waiting", [])
        self._waiting = deque((entry["version"], entry["weights"]) for entry in waiting)
        self._ahead_seed = state_dict.get("ahead_seed")
        keys = ("max_staleness", "every_n_rollouts")  # either unknown in older checkpoints
        self._resumed_from = {key: state_dict[key] for key in keys if key in state_dict}


def _check_order(callbacks: list[Callback], refresh: OldPolicyRefresh) -> None:
    """Refuses a ``RolloutGeneration`` listed after ``refresh``: the rollout sampled ahead is asked
    for once the current one is collected, which ``RolloutGeneration`` does in the same hook."""
    generation = [i for i, c in enumerate(callbacks) if isinstance(c, RolloutGeneration)]
    if generation and generation[0] > callbacks.index(refresh):
        raise ValueError(
            f"OldPolicyRefresh(max_staleness={refresh.max_staleness}) with an engine in its own "
            "process asks for the next rollout as soon as RolloutGeneration has collected the "
            "current one, so RolloutGeneration must come before it in trainer.callbacks; it "
            "comes after (the lightning-troll command orders them so)"
        )


def _every_change(refresh: OldPolicyRefresh, stored: int, version: int) -> str:
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


def _staleness_change(refresh: OldPolicyRefresh, stored: int, version: int) -> str:
    """The warning for a resume of ``refresh`` with another ``max_staleness`` than the checkpoint's
    ``stored``, before the snapshot moves to ``version``: what happens to the sampler."""
    s, lag = refresh.max_staleness, refresh.rollouts - refresh.version
    head = f"old_policy.max_staleness={s} differs from the checkpoint's {stored}: "
    if not s:
        dropped = [v for v, _ in refresh._waiting]
        return head + (
            f"the snapshot moves at once from version {refresh.version} to the current policy "
            f"(version {refresh.rollouts}) and the queued versions {dropped} are dropped"
        )
    if version != refresh.version:
        due = refresh.rollouts - s
        which = f"rollouts {refresh.rollouts} - {s}"
        if version != due:  # a run that refreshed every_n_rollouts kept no past versions
            which = f"the next kept after version {due} = {which}, which was not kept"
        queued = [v for v, _ in refresh._waiting if v > version]
        return head + (
            f"the snapshot moves at once from version {refresh.version} to version {version} "
            f"({which}); versions {queued} stay queued"
        )
    if lag < s:
        return head + f"the sampler's lag grows by one rollout at a time from {lag} to {s}"
    return head + f"the sampler stays at version {refresh.version}, {lag} behind"


def _cpu_copy(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy's weights now, copied to the CPU: a version kept for the snapshot."""
    return {k: v.detach().to("cpu", copy=True) for k, v in policy.state_dict().items()}


def _named(policy: torch.nn.Module, state: dict[str, torch.Tensor], snapshot: Any) -> dict:
    """Stored weights under the names an engine takes (:func:`full_weights`: the parameters), in
    the snapshot's dtypes: the weights the snapshot holds once it loads them (a ``bfloat16``
    snapshot rounds them), so that a rollout sampled ahead is sampled by the snapshot's weights."""
    held = dict(snapshot.model.named_parameters(remove_duplicate=False))
    return {name: state[name].to(held[name].dtype) for name, _ in full_weights(policy)}


class _Weights:
    """Stored weights in the place of a module: what ``Snapshot.refresh`` reads of a policy."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._state
