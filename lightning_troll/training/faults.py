"""Faults that stop a run cleanly: one line for the user, a documented exit status, nothing lost.

A :class:`RunFault` raised during training (a checkpoint that found no room, a reward that failed
under ``model.reward_options.on_error: raise``, an environment that failed in an episode) ends the
fit; the ``lightning-troll`` command prints
its message on one line and exits with :data:`FAULT_EXIT_CODE`. A fault that strikes between two
optimiser steps' worth of state (:attr:`RunFault.resumable`: a reward fails while a rollout is
scored, or an environment fails while its episodes run, before the rollout trains) has what the
run trained saved first
(:class:`~lightning_troll.callbacks.RolloutCheckpoint`), and the command names the checkpoint to
resume from once the cause is fixed. Nothing here imports Lightning.
"""

from __future__ import annotations

from lightning_troll.tasks.environments.protocol import EnvironmentFailure
from lightning_troll.tasks.rewards.calls import RewardError

__all__ = [
    "FAULT_EXIT_CODE",
    "EngineFault",
    "EpisodeFault",
    "NonFiniteSteps",
    "RewardFault",
    "RunFault",
]

FAULT_EXIT_CODE = 3
"""The exit status of a run stopped by a :class:`RunFault` (2 is bad input found before
training; 128 + N a stop by signal N)."""


class RunFault(RuntimeError):
    """A fault during training that stops the run, told in one line (its message)."""

    resumable: bool = False
    """Whether the run's state is whole when it strikes (no optimiser step half done), so that a
    checkpoint saved then resumes the run."""
    saved: str | None = None
    """The checkpoint saved on the way out, if one was."""
    kept: str | None = None
    """Where nothing was saved on the way out, the last checkpoint of the run, if it has one."""


class RewardFault(RewardError, RunFault):
    """A reward call failed under ``reward_options.on_error: raise`` while a rollout was scored,
    before it trained (``resumable``), or while a validation was (not: the checkpoint of the last
    rollout stays as it was)."""

    def __init__(self, message: str, resumable: bool = True) -> None:
        super().__init__(message)
        self.resumable = resumable


class EpisodeFault(EnvironmentFailure, RunFault):
    """An environment failed (:class:`EnvironmentFailure`) while a rollout's episodes ran, before
    it trained (``resumable``), or while a validation's did (not: the checkpoint of the last
    rollout stays as it was)."""

    def __init__(self, message: str, resumable: bool = True) -> None:
        super().__init__(message)
        self.resumable = resumable


class NonFiniteSteps(RunFault):
    """``model.optimization.max_bad_steps`` optimiser steps in a row had a non-finite loss or
    gradient. Each was skipped before it touched the weights or the optimiser's state, so the
    state is whole (``resumable``): the checkpoint saved holds the weights of the last finite
    step."""

    resumable = True


class EngineFault(RunFault):
    """The rollout engine's own process died while a rollout was sampled
    (:class:`~lightning_troll.engines.process.EngineDied`), before it trained
    (``resumable``)."""

    resumable = True
