"""Environments written for TRL's ``environment_factory``, used as they are.

TRL's GRPO trainer takes an environment as a class whose public methods are the model's tools::

    class Counter:
        def reset(self, **kwargs) -> str | None:  # the data row's fields
            self.count = 0
            return None  # or a string, appended to the last user message

        def add(self, n: int) -> int:
            \"\"\"Add to the counter.

            Args:
                n: How much to add.
            \"\"\"
            self.count += n
            return self.count

        def get_reward(self) -> float:  # optional: the environment scores the episode
            return float(self.count == 10)

``model.episodes.environment: my_env:Counter`` names it as any environment. A class (or, at run
time, an object) with a ``reset`` and no ``step`` that is not an
:class:`~lightning_troll.tasks.environments.Environment` is read in this form (:func:`is_trl_environment`),
and each episode gets a :class:`TrlEnvironment` around an instance, made once and reset for every
episode it plays, as TRL does (:class:`~lightning_troll.tasks.environments.EnvironmentFactory` keeps the
pool):

- ``reset(**row)`` starts the episode: the conversation is the row's ``prompt`` (as the built-in
  :class:`~lightning_troll.tasks.environments.ToolEnvironment` takes it), and a string ``reset`` returns
  is appended to its last message, as TRL does;
- every public method but ``reset`` and ``get_reward`` is a tool (type hints and an ``Args:``
  docstring, as ``model.episodes.tools``), bound to the episode's instance, and so run in the
  trainer's process (it holds the episode's state); the functions of ``model.episodes.tools`` join
  them there;
- a turn without a tool call is the final answer, scored by ``model.rewards``; ``get_reward()``, if
  the class defines it, is the environment's reward for the episode, however it ended (the final
  answer, the turn limit or the token budget), added with weight 1 as TRL adds it.

Any of these methods may be ``async def``. What TRL gives reward functions and this library does
not, the episodes' environments (``environments``), is for ``get_reward`` to use here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning_troll.tasks.environments.protocol import (
    EnvironmentFailure,
    Step,
    is_finite_reward,
    is_trl_environment,
)
from lightning_troll.tasks.environments.tool_env import ToolEnvironment
from lightning_troll.tasks.environments.tool_workers import TOOL_REPLY_CHARS, ToolRunner
from lightning_troll.tasks.environments.tools import load_tool
from lightning_troll.tasks.rewards.calls import awaited, describe

__all__ = ["NOT_TOOLS", "TrlEnvironment", "is_trl_environment", "tool_methods"]

NOT_TOOLS = ("reset", "get_reward")
"""The public methods of an environment in TRL's form that are not tools."""


def tool_methods(instance: Any) -> list[Callable[..., Any]]:
    """The bound public methods of ``instance`` that are its tools (all but :data:`NOT_TOOLS`),
    by name; read from its class without running its properties (a user's, which may raise)."""
    return [
        getattr(instance, name)
        for name, member in inspect.getmembers_static(type(instance))
        if not name.startswith("_")
        and name not in NOT_TOOLS
        and (inspect.isfunction(member) or isinstance(member, classmethod))
    ]


class TrlEnvironment(ToolEnvironment):
    """One episode of an environment in TRL's form.

    Args:
        instance: An instance of the environment's class, which :meth:`reset` starts afresh.
        tools: ``model.episodes.tools``, offered beside the instance's methods.
        prompt_field: The row's field that holds the prompt.
        release: Called with the instance when the episode ends (:meth:`close`), once: the
            factory's pool takes it back.
        timeout: Seconds a tool call may take (``model.episodes.tool_timeout``).
        reply_chars: The most characters of a tool's reply the model reads.
    """

    def __init__(
        self,
        instance: Any,
        tools: Sequence[str | Callable[..., Any]] = (),
        prompt_field: str = "prompt",
        release: Callable[[Any], None] | None = None,
        timeout: float | None = None,
        reply_chars: int = TOOL_REPLY_CHARS,
    ) -> None:
        name = type(instance).__name__
        methods = tool_methods(instance)
        if not methods and not tools:
            raise ValueError(
                f"model.episodes.environment: {name} has no public method besides "
                f"{' and '.join(NOT_TOOLS)} to be a tool, and model.episodes.tools lists none"
            )
        own = [  # refused naming the environment, not model.episodes.tools
            load_tool(method, f"{name}.{method.__name__}", "model.episodes.environment")
            for method in methods
        ]
        runner = ToolRunner([*tools, *own], 0, timeout, reply_chars)
        super().__init__(runner, prompt_field)
        self.instance = instance
        self._release = release
        self.hidden: tuple[str, ...] = ()
        """Row fields ``reset`` is not given (the field that chose the environment)."""

    def _call(self, method: str, **arguments: Any) -> Any:
        """``instance.method(**arguments)``, awaited; what it raises is an
        :class:`EnvironmentFailure` that names the class and the method."""
        try:
            return awaited(getattr(self.instance, method)(**arguments))
        except Exception as error:  # the instance is a user's code: it may raise anything
            raise EnvironmentFailure(
                f"the environment {type(self.instance).__name__}.{method} raised {describe(error)}"
            ) from error

    def reset(self, row: Mapping[str, Any]) -> list[dict[str, Any]]:
        messages = super().reset(row)
        observation = self._call("reset", **{k: v for k, v in row.items() if k not in self.hidden})
        if observation is None:
            return messages
        if not isinstance(observation, str):
            raise EnvironmentFailure(
                f"the environment {type(self.instance).__name__}.reset returned a "
                f"{type(observation).__name__}; an environment in TRL's form returns None or a "
                "string (appended to the prompt)"
            )
        messages[-1] = {**messages[-1], "content": messages[-1]["content"] + observation}
        return messages

    def reward(self) -> float | None:
        """``get_reward()``, if the class defines it; else None."""
        if getattr(self.instance, "get_reward", None) is None:
            return None
        value = self._call("get_reward")
        if not is_finite_reward(value):
            raise EnvironmentFailure(
                f"the environment {type(self.instance).__name__}.get_reward returned {value!r}; it "
                "must return a number finite in float32"
            )
        return float(value)

    def answer(self, turn: str) -> Step:
        return Step(reward=self.reward(), done=True)

    def on_end(self, end: str) -> float | None:
        return self.reward()

    def close(self) -> None:
        """Ends the episode: the instance goes back to the pool (once), to be reset for another."""
        self.runner.close()
        release, self._release = self._release, None
        if release is not None:
            release(self.instance)
