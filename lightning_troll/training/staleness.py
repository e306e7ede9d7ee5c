"""The staleness schedule: which policy version samples each rollout, and the versions kept until
they do.

A policy version is the weights after a rollout's optimiser steps (version 0: the weights the run
starts with). With ``every_n_rollouts: n`` the snapshot that samples is refreshed from the policy
once it lags ``n`` rollouts. With ``max_staleness: s`` rollout k + 1 is sampled by version
k - s (version 0 until k exceeds s): the data is exactly ``s`` versions stale, as it is at most in
an asynchronous trainer that lets the sampler run ``s`` rollouts ahead, so the semantics can be
studied on one device; the behaviour policy the objective bounds is that stale sampler. Versions
are counted in rollouts, not optimiser steps, because the sampler's weights change only between
rollouts. The ``s`` newest versions wait on the CPU (``s`` copies of the weights, also in the
checkpoint, so a resumed run continues exactly).

:class:`StalenessSchedule` owns that queue and the snapshot's version; the module holds it
(``TrollModule.staleness``), the ``OldPolicyRefresh`` callback configures it and triggers it
after every rollout, and ``RolloutGeneration`` asks it to sample the next rollout ahead once the
current one is collected (an engine in its own process). It reads nothing of the module: the
policy, the snapshot and the engine are handed to each call.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import nn

from lightning_troll.engines.base import SampleRequest
from lightning_troll.models.weights import full_weights

__all__ = ["MAX_STALENESS", "StalenessSchedule", "version_bytes"]

MAX_STALENESS = 64
"""The largest ``old_policy.max_staleness`` accepted: each version of lag keeps one more copy of
the weights on the CPU and in every checkpoint (about 28 GB at 7B parameters in float32)."""


def version_bytes(policy: nn.Module) -> int:
    """Bytes of one kept version of ``policy``'s weights (its state, in its own dtypes)."""
    return sum(t.numel() * t.element_size() for t in policy.state_dict().values())


class StalenessSchedule:
    """The versions a lagging sampler needs, the version the snapshot holds, and the refresh.

    Args:
        every_n_rollouts: rollouts between two refreshes, >= 1.
        max_staleness: versions the sampler lags behind the trainer, >= 0.
    """

    def __init__(self, every_n_rollouts: int = 1, max_staleness: int = 0) -> None:
        self.every_n_rollouts = every_n_rollouts
        self.max_staleness = max_staleness
        self.rollouts = 0
        """Rollouts trained: the trainer's policy version."""
        self.refreshes = 0
        self.version = 0
        """The policy version the snapshot holds (the one that samples the next rollout)."""
        self.waiting: deque[tuple[int, dict[str, torch.Tensor]]] = deque()
        """The versions kept for the snapshot, oldest first (those after ``version``)."""
        self.ahead_seed: int | None = None
        """The seed of the rollout asked ahead of an engine in its own process, while it is in
        flight: kept in the checkpoint, so that a resumed run samples that rollout again with it."""
        self.resumed_from: dict[str, int] = {}
        """The checkpoint's ``max_staleness`` and ``every_n_rollouts``, until the resumed fit has
        applied this schedule's."""

    @property
    def staleness(self) -> int:
        """How many versions the snapshot lags the trainer."""
        return self.rollouts - self.version

    def due(self, rollouts: int) -> int:
        """The version that samples once ``rollouts`` rollouts are trained: the snapshot's while
        it is at most ``max_staleness`` behind, else the oldest kept version that is not (the
        trainer's own, ``rollouts``, when none is kept)."""
        due = rollouts - self.max_staleness
        if self.version >= due:
            return self.version
        return next((v for v, _ in self.waiting if v >= due), rollouts)

    def after_rollout(self, policy: nn.Module, snapshot: Any, engine: Any) -> None:
        """A rollout's optimiser steps are done: keep the version just trained (with
        staleness) and move the snapshot to the version now due, or refresh it when it lags
        ``every_n_rollouts``."""
        self.rollouts += 1
        if self.max_staleness:
            self.waiting.append((self.rollouts, cpu_copy(policy)))
            self.move_to(self.due(self.rollouts), policy, snapshot, engine)
        elif self.rollouts - self.version >= self.every_n_rollouts:
            self.refresh(policy, snapshot, engine)
            self.version = self.rollouts

    def sample_ahead(self, upcoming: Any, collector: Any, policy: nn.Module, snapshot: Any,
                     engine: Any) -> None:  # fmt: skip
        """Asks an engine in its own process for the rollout of ``upcoming`` prompts now, while
        the current one trains: it is sampled by version ``rollouts + 1 - max_staleness``, which
        exists already when the lag is at least one."""
        self.ahead_seed = None
        version = self.due(self.rollouts + 1)
        if version > self.rollouts:  # the trainer's own weights after this rollout: not yet
            return
        if version != self.version and engine.policy_version != version:
            weights = next(w for v, w in self.waiting if v == version)
            engine.push(_named(policy, weights, snapshot), next(policy.parameters()).device)
            engine.policy_version = version
        engine.submit(SampleRequest(upcoming.prompt_ids, collector.group_size, collector.sampling,
                                    collector.pad_id, collector.stop_ids))  # fmt: skip
        self.ahead_seed = engine.pending_seed

    def move_to(self, version: int, policy: nn.Module, snapshot: Any, engine: Any) -> None:
        """Loads ``version`` into the snapshot (a kept one, or the policy's own weights) and
        drops the kept versions up to it."""
        if version == self.version:
            return
        weights = None  # the policy itself: version == rollouts
        while self.waiting and self.waiting[0][0] <= version:
            held, state = self.waiting.popleft()
            weights = _Weights(state) if held == version else None
        self.refresh(policy, snapshot, engine, weights, version)
        self.version = version

    def resume_version(self, policy: nn.Module) -> int:
        """On a fit's start, after a checkpoint's state was loaded: the version the snapshot must
        hold under this schedule's options (a lagging run that kept no version of the current
        policy keeps it now)."""
        if self.max_staleness:
            if self.version < self.rollouts and not any(
                v == self.rollouts for v, _ in self.waiting
            ):
                self.waiting.append((self.rollouts, cpu_copy(policy)))
            return self.due(self.rollouts)
        due = self.waiting or self.rollouts - self.version >= self.every_n_rollouts
        return self.rollouts if due else self.version

    @torch.no_grad()
    def refresh(self, policy: nn.Module, snapshot: Any, engine: Any, weights: Any = None,
                version: int = -1) -> None:  # fmt: skip
        """Loads ``weights`` (a module, or what has its ``state_dict``; the policy by default)
        into the snapshot; ``version``: the policy version they are, when known. The engine
        takes the new weights before its next rollout, unless it sampled ahead with them."""
        snapshot.refresh(policy if weights is None else weights)
        if engine is not None and getattr(engine, "policy_version", None) != version:
            engine.stale = True
        self.refreshes += 1

    def state_dict(self) -> dict[str, Any]:
        state = {"rollouts": self.rollouts, "refreshes": self.refreshes, "version": self.version}
        state["max_staleness"] = self.max_staleness
        state["every_n_rollouts"] = self.every_n_rollouts
        if self.ahead_seed is not None:
            state["ahead_seed"] = self.ahead_seed
        if self.waiting:
            state["waiting"] = [{"version": v, "weights": w} for v, w in self.waiting]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rollouts = state["rollouts"]
        self.refreshes = state["refreshes"]
        # before staleness was kept, the snapshot held the last refresh's version
        default = self.rollouts - self.rollouts % self.every_n_rollouts
        self.version = state.get("version", default)
        self.waiting = deque((e["version"], e["weights"]) for e in state.get("waiting", []))
        self.ahead_seed = state.get("ahead_seed")
        keys = ("max_staleness", "every_n_rollouts")  # either unknown in older checkpoints
        self.resumed_from = {key: state[key] for key in keys if key in state}


def cpu_copy(policy: nn.Module) -> dict[str, torch.Tensor]:
    """The policy's weights now, copied to the CPU: a version kept for the snapshot."""
    return {k: v.detach().to("cpu", copy=True) for k, v in policy.state_dict().items()}


def _named(policy: nn.Module, state: dict[str, torch.Tensor], snapshot: Any) -> dict:
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
