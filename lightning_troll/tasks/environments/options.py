"""``model.episodes``: multi-turn episodes (tools, environments) instead of single completions.

A frozen record whose field docstrings become the command line's ``--help``; the rollout
collector runs its episodes (:mod:`lightning_troll.rollouts.multiturn`). Nothing here imports
torch.
"""

from __future__ import annotations

import numbers
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from lightning_troll.tasks.rewards.workers import check_timeout

__all__ = [
    "ENVIRONMENT_FIELD",
    "EpisodesConfig",
    "TOOL_FAILURES",
    "check_environment_names",
    "check_tool_failures",
    "check_tool_workers",
    "environment_problem",
]

ENVIRONMENT_FIELD = "environment"
"""The row field that names an episode's environment when ``model.episodes.environment`` names
several (TRL's multi-environment form)."""


def environment_problem(row: Mapping[str, Any], names: Collection[str]) -> str | None:
    """Why ``row`` cannot choose one of the environments ``names`` by its
    :data:`ENVIRONMENT_FIELD`; None when it can."""
    if ENVIRONMENT_FIELD not in row:
        return (
            f"the row has no field {ENVIRONMENT_FIELD!r}, which model.episodes.environment needs "
            f"to choose its environment (one of {', '.join(names)})"
        )
    if row[ENVIRONMENT_FIELD] not in names:
        return (
            f"the row's {ENVIRONMENT_FIELD!r} is {row[ENVIRONMENT_FIELD]!r}, which "
            f"model.episodes.environment does not name; it names {', '.join(names)}"
        )
    return None


TOOL_FAILURES = ("raise", "warn")
"""The values of ``model.episodes.tool_failures``."""


def check_tool_failures(policy: str, limit: float, reply_chars: int) -> None:
    """``model.episodes.tool_failures``, ``tool_failure_limit`` and ``tool_reply_chars``."""
    if policy not in TOOL_FAILURES:
        raise ValueError(
            f"model.episodes.tool_failures must be one of {', '.join(TOOL_FAILURES)}; got "
            f"{policy!r}"
        )
    if isinstance(limit, bool) or not isinstance(limit, numbers.Real) or not 0 < limit <= 1:
        raise ValueError(
            f"model.episodes.tool_failure_limit must be a share in (0, 1]; got {limit!r}"
        )
    if isinstance(reply_chars, bool) or not isinstance(reply_chars, int) or reply_chars < 1:
        raise ValueError(
            f"model.episodes.tool_reply_chars must be an integer >= 1; got {reply_chars!r}"
        )


def check_tool_workers(workers: int, timeout: float | None) -> None:
    """``model.episodes.tool_workers`` and ``tool_timeout``: an integer >= 0, and null or > 0
    seconds."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(f"model.episodes.tool_workers must be an integer >= 0; got {workers!r}")
    check_timeout("episodes.tool_timeout", timeout)


def check_environment_names(environments: Mapping[Any, Any]) -> None:
    """``model.episodes.environment`` as several environments: a non-empty mapping from names
    (strings) to what makes each environment."""
    if not environments:
        raise ValueError(
            "model.episodes.environment is an empty mapping; name one environment by import "
            "path, several as {name: import path}, or null for the ToolEnvironment of tools"
        )
    for name in environments:
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"model.episodes.environment: {name!r} cannot name an environment; names are "
                f"non-empty strings, which the rows' {ENVIRONMENT_FIELD!r} field gives"
            )


@dataclass(frozen=True)
class EpisodesConfig:
    """Multi-turn episodes: the model calls tools or plays turns against an environment, and the
    loss trains on its own tokens only."""

    tools: list[str] | None = None
    """Tools by import path (``my_tools:multiply``: plain functions with type hints and a
    docstring), called by the built-in ToolEnvironment (or a subclass named in ``environment``)."""
    environment: str | dict[str, str] | None = None
    """An Environment class by import path (``my_env:Guess``); or several by name (``{guess:
    my_env:Guess, count: counter_env:Counter}``), each row choosing its own in its
    ``environment`` field; null: the ToolEnvironment of ``tools``."""
    max_turns: int = 4
    """Model turns per episode, >= 1."""
    tool_workers: int = 0
    """Worker processes that run the calls of ``tools``; 0 runs them in the trainer's process."""
    tool_timeout: float | None = 60.0
    """Seconds a tool call may take before the model reads a timeout error: in a worker, the
    worker is killed and replaced; with tool_workers 0, a SIGALRM interrupts the call in the
    trainer's main thread (a call blocked in C code that holds off signals, or run in another
    thread, is not bounded); null: no limit."""
    tool_failures: str = "raise"
    """What a rollout does whose tool calls failed by the tools' own fault (raised, timed out,
    returned what cannot be written, or killed their worker; the model's malformed, unknown and
    badly argued calls are not counted) at a share of at least tool_failure_limit of the calls that
    ran: raise stops the run as a failing reward does (last.ckpt saved, the resume command, exit
    status 3); warn warns on the console once for each such rollout and trains on."""
    tool_failure_limit: float = 1.0
    """The share of a rollout's tool calls that ran, in (0, 1], whose failure stops the run or
    warns (tool_failures), once at least 4 calls failed; 1.0: every call that ran failed."""
    tool_reply_chars: int = 8192
    """The most characters of a tool's reply the model reads; a longer reply is cut there, a note
    of its length added, and counted in episodes/tool_replies_cut."""

    def __post_init__(self) -> None:
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int):
            raise ValueError(f"model.episodes.max_turns must be an integer; got {self.max_turns!r}")
        if self.max_turns < 1:
            raise ValueError(f"model.episodes.max_turns must be >= 1; got {self.max_turns}")
        check_tool_workers(self.tool_workers, self.tool_timeout)
        check_tool_failures(self.tool_failures, self.tool_failure_limit, self.tool_reply_chars)
        if isinstance(self.environment, Mapping):
            check_environment_names(self.environment)
        if self.environment is None and not self.tools:
            raise ValueError(
                "model.episodes: name an environment (model.episodes.environment) or list tools "
                "(model.episodes.tools); for single completions leave model.episodes null"
            )
