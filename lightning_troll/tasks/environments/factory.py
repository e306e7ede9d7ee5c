"""What ``model.episodes.environment`` and ``model.episodes.tools`` make of each episode: its
environment, made by :class:`EnvironmentFactory` (fresh, or from the pool of an environment in
TRL's form), or by :class:`EnvironmentChoice` where the rows choose among several."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning_troll.tasks.environments.options import (
    ENVIRONMENT_FIELD,
    check_environment_names,
    environment_problem,
)
from lightning_troll.tasks.environments.protocol import (
    Environment,
    load_environment,
    make_environment,
)
from lightning_troll.tasks.environments.tool_env import ToolEnvironment
from lightning_troll.tasks.environments.tool_workers import TOOL_REPLY_CHARS, ToolRunner
from lightning_troll.tasks.environments.trl_env import TrlEnvironment, is_trl_environment

__all__ = ["EnvironmentChoice", "EnvironmentFactory"]


class EnvironmentFactory:
    """An environment per episode, from ``model.episodes.environment`` and ``model.episodes.tools``.

    An environment of the library's protocol is made fresh for every episode. One in TRL's form is
    made once and reset often, as TRL does: an episode takes an instance from a pool, and its end
    gives the instance back for a later episode's ``reset``; an instance is made only when more
    episodes run at once than there are instances (the first, made to check the tools, starts the
    pool). An instance holding a client or a sandbox is so made a batch's worth of times per run,
    not once per episode.

    Args:
        environment: An environment class (or a function returning one), or its import path;
            None for :class:`ToolEnvironment` over ``tools``. A :class:`ToolEnvironment`
            subclass gets the tools' runner as its first argument; an environment in TRL's form
            (:mod:`~lightning_troll.tasks.environments.trl_env`) is wrapped in a
            :class:`TrlEnvironment`, the tools beside its methods.
        tools: Tools (import paths or functions); only with no ``environment``, a
            :class:`ToolEnvironment` subclass or an environment in TRL's form.
        tool_workers: Worker processes that run tool calls (``model.episodes.tool_workers``); 0 runs
            them in this process.
        tool_timeout: Seconds a tool call may take (``model.episodes.tool_timeout``); None
            waits for ever.
        tool_reply_chars: The most characters of a tool's reply the model reads
            (``model.episodes.tool_reply_chars``).
    """

    def __init__(
        self,
        environment: str | Callable[..., Any] | None = None,
        tools: Sequence[str | Callable[..., Any]] = (),
        tool_workers: int = 0,
        tool_timeout: float | None = None,
        tool_reply_chars: int = TOOL_REPLY_CHARS,
    ) -> None:
        self.make = ToolEnvironment if environment is None else load_environment(environment)
        """What each episode's environment is made with."""
        self.trl_form = inspect.isclass(self.make) and is_trl_environment(self.make)
        """Whether the class is an environment in TRL's form, its methods the tools."""
        takes_tools = inspect.isclass(self.make) and issubclass(self.make, ToolEnvironment)
        if environment is None and not tools:
            raise ValueError(
                "model.episodes.environment and model.episodes.tools are both unset; name an environment or list "
                "tools for multi-turn episodes"
            )
        if tools and not (takes_tools or self.trl_form):
            raise ValueError(
                f"model.episodes.tools lists tools, but model.episodes.environment={environment!r} is not a "
                "ToolEnvironment subclass to call them; leave model.episodes.environment null for the "
                "built-in ToolEnvironment, subclass it, or write the environment in TRL's form "
                "(reset and its tools as methods, no step)"
            )
        if takes_tools and not tools:
            raise ValueError(
                f"model.episodes.environment={environment!r} is a ToolEnvironment: list its tools in "
                "model.episodes.tools"
            )
        if self.trl_form and tool_workers:
            raise ValueError(
                f"model.episodes.tool_workers={tool_workers!r} with model.episodes.environment="
                f"{environment!r}, an environment in TRL's form: its methods hold the episode's "
                "state, so every tool call runs in the trainer's process; set "
                "model.episodes.tool_workers 0 (and model.episodes.tool_timeout null)"
            )
        if tool_workers and not tools:
            raise ValueError(
                f"model.episodes.tool_workers={tool_workers!r} with model.episodes.environment="
                f"{environment!r}, which runs no tools of model.episodes.tools: the workers "
                "would have no call to run; set model.episodes.tool_workers 0 (and "
                "model.episodes.tool_timeout null), or list the tools"
            )
        self.tools = list(tools)
        """The tools of ``model.episodes.tools``."""
        self.tool_limits = {"timeout": tool_timeout, "reply_chars": tool_reply_chars}
        """What bounds a tool call and its reply, for the runners of an environment in TRL's form."""
        self.runner = (
            ToolRunner(tools, tool_workers, tool_timeout, tool_reply_chars) if tools else None
        )
        """The tools and their workers; None without tools."""
        self.idle: list[Any] = []
        """Instances of an environment in TRL's form between episodes, to be reset for the next."""
        if self.trl_form:  # one made now, as TRL does, so that its tools are checked first
            self().close()

    @property
    def uses_tools(self) -> bool:
        """Whether the episodes offer tools (the chat template then renders their calls)."""
        return self.runner is not None or self.trl_form

    def __call__(self, row: Mapping[str, Any] | None = None) -> Environment:
        """The environment of one episode (whatever its ``row``): an idle instance in TRL's
        form, or one made now; an :class:`EnvironmentFailure` naming it where making it raises."""
        made = self.idle.pop() if self.idle else None
        if made is None:
            args = () if self.trl_form or self.runner is None else (self.runner,)
            made = make_environment(self.make, *args)
        if not is_trl_environment(made):
            return made
        return TrlEnvironment(made, self.tools, release=self._release, **self.tool_limits)

    def _release(self, instance: Any) -> None:
        """Takes back an instance in TRL's form whose episode ended."""
        self.idle.append(instance)

    def close(self) -> None:
        """Stops the tool workers, if any."""
        if self.runner is not None:
            self.runner.close()


class EnvironmentChoice:
    """Several environments by name, each row choosing its own in its ``environment`` field, as
    TRL's ``environment_factory`` takes a dict: a run mixes tasks, each episode offered only its
    environment's tools. An environment in TRL's form is not given the field in ``reset``.

    Args:
        environments: name -> an environment class, a function returning one, or its import
            path (``model.episodes.environment`` as a mapping); each is made as
            :class:`EnvironmentFactory` makes it, with the same tools and workers.
        tools: Tools offered beside each environment's own (as :class:`EnvironmentFactory`).
        tool_workers: As :class:`EnvironmentFactory`.
        tool_timeout: As :class:`EnvironmentFactory`.
        tool_reply_chars: As :class:`EnvironmentFactory`.
    """

    def __init__(
        self,
        environments: Mapping[str, str | Callable[..., Any]],
        tools: Sequence[str | Callable[..., Any]] = (),
        tool_workers: int = 0,
        tool_timeout: float | None = None,
        tool_reply_chars: int = TOOL_REPLY_CHARS,
    ) -> None:
        check_environment_names(environments)
        self.factories = {
            name: EnvironmentFactory(make, tools, tool_workers, tool_timeout, tool_reply_chars)
            for name, make in environments.items()
        }
        """name -> the factory of that environment."""

    @property
    def uses_tools(self) -> bool:
        """Whether any environment offers tools (the chat template then renders their calls)."""
        return any(f.uses_tools for f in self.factories.values())

    def __call__(self, row: Mapping[str, Any] | None = None) -> Environment:
        """The environment ``row`` names in its ``environment`` field; a ``ValueError`` that
        names the option and the names where it names none of them."""
        problem = environment_problem(row or {}, list(self.factories))
        if problem is not None:
            raise ValueError(f"model.episodes.environment: {problem}")
        made = self.factories[row[ENVIRONMENT_FIELD]]()
        if isinstance(made, TrlEnvironment):
            made.hidden = (ENVIRONMENT_FIELD,)  # TRL keeps the field from reset(**row)
        return made

    def close(self) -> None:
        """Stops every environment's tool workers."""
        for factory in self.factories.values():
            factory.close()
