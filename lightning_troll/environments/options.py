"""``model.episodes``: multi-turn episodes (tools, environments) instead of single completions.

A frozen record whose field docstrings become the command line's ``--help``; the rollout
collector runs its episodes (:mod:`lightning_troll.rollouts.multiturn`). Nothing here imports
torch.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

__all__ = ["EpisodesConfig", "check_tool_workers"]


def check_tool_workers(workers: int, timeout: float | None) -> None:
    """``model.episodes.tool_workers`` and ``tool_timeout``: an integer >= 0, and null or > 0
    seconds that needs a worker (a call in the trainer's own process cannot be abandoned)."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(f"model.episodes.tool_workers must be an integer >= 0; got {workers!r}")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout > 0
    ):
        raise ValueError(
            f"model.episodes.tool_timeout must be null or > 0 seconds; got {timeout!r}"
        )
    if timeout is not None and workers == 0:
        raise ValueError(
            f"model.episodes.tool_timeout={timeout!r} needs model.episodes.tool_workers >= 1: a "
            "call in the trainer's own process cannot be abandoned; set "
            "model.episodes.tool_workers, or model.episodes.tool_timeout null"
        )


@dataclass(frozen=True)
class EpisodesConfig:
    """Multi-turn episodes: the model calls tools or plays turns against an environment, and the
    loss trains on its own tokens only."""

    tools: list[str] | None = None
    """Tools by import path (``my_tools:multiply``: plain functions with type hints and a
    docstring), called by the built-in ToolEnvironment (or a subclass named in ``environment``)."""
    environment: str | None = None
    """An Environment class by import path (``my_env:Guess``); null: the ToolEnvironment of
    ``tools``."""
    max_turns: int = 4
    """Model turns per episode, >= 1."""
    tool_workers: int = 0
    """Worker processes that run the calls of ``tools``; 0 runs them in the trainer's process."""
    tool_timeout: float | None = None
    """Seconds a tool call may take in a worker before the model reads a timeout error (needs
    tool_workers >= 1); null: no limit."""

    def __post_init__(self) -> None:
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int):
            raise ValueError(f"model.episodes.max_turns must be an integer; got {self.max_turns!r}")
        if self.max_turns < 1:
            raise ValueError(f"model.episodes.max_turns must be >= 1; got {self.max_turns}")
        check_tool_workers(self.tool_workers, self.tool_timeout)
        if self.environment is None and not self.tools:
            raise ValueError(
                "model.episodes: name an environment (model.episodes.environment) or list tools "
                "(model.episodes.tools); for single completions leave model.episodes null"
            )
