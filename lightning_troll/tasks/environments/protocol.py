"""The environment protocol: what a multi-turn episode asks of the world the model acts in
(``model.episodes.environment``).

An episode starts from a data row: :meth:`Environment.reset` returns the conversation the model
answers (a list of ``{"role", "content"}`` messages, or a plain prompt string for a model without
a chat template). Then, after each model turn, :meth:`Environment.step` gets the turn's text and
returns a :class:`Step`: what the model reads next (``observation``), a reward for the turn if the
environment gives one, and whether the episode is over. The episode loop
(:func:`lightning_troll.rollouts.episodes.run_episodes`) also ends an episode at ``model.episodes.max_turns``
model turns or when its token budget is spent.

A minimal environment, a guessing game::

    class Guess(Environment):
        def reset(self, row):
            self.secret = int(row["answer"])
            return [{"role": "user", "content": "Guess my number between 1 and 100."}]

        def step(self, turn):
            guess = int("".join(c for c in turn if c.isdigit()) or 0)
            if guess == self.secret:
                return Step(reward=1.0, done=True)
            return Step("Higher." if guess < self.secret else "Lower.", reward=0.0)

``model.episodes.environment: my_env:Guess`` names it by import path, found as a reward's module is
(the working directory, then beside the config, then anything importable); each episode gets a
fresh one. The built-in environment is
:class:`~lightning_troll.tasks.environments.tool_env.ToolEnvironment`, the tools of ``model.episodes.tools``.
"""

from __future__ import annotations

import contextlib
import inspect
import numbers
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_troll.tasks.data.messages import NOT_TEXT, check_messages, is_text
from lightning_troll.tasks.environments.calls import TOOL_ERROR_KINDS
from lightning_troll.tasks.rewards.calls import as_float, describe
from lightning_troll.tasks.rewards.lookup import load_by_import_path

__all__ = [
    "Environment",
    "EnvironmentFailure",
    "Step",
    "call_environment",
    "closed_on_failure",
    "is_finite_reward",
    "is_trl_environment",
    "load_environment",
    "make_environment",
    "tool_schemas_of",
]

OPTION = "model.episodes.environment"


class EnvironmentFailure(RuntimeError):
    """An environment could not be made, its ``reset``, ``step``, ``on_end`` or ``close`` raised
    or returned what the protocol does not allow, or the chat template could not render its
    episode; the message names the environment, what failed and the error. Nothing of the
    rollout it struck has trained, so a run saves its checkpoint and stops."""


def call_environment(environment: Any, method: str, *args: Any) -> Any:
    """``environment.method(*args)``; what it raises becomes an :class:`EnvironmentFailure` that
    names the environment and the method."""
    try:
        return getattr(environment, method)(*args)
    except EnvironmentFailure:
        raise
    except Exception as error:  # an environment is a user's code: it may raise anything
        raise EnvironmentFailure(
            f"the environment {type(environment).__name__}.{method} raised {describe(error)}"
        ) from error


def tool_schemas_of(environment: Any) -> Any:
    """``environment.tool_schemas``, read after its ``reset`` (which may choose the episode's
    tools); none if it has no such attribute. What reading it raises becomes an
    :class:`EnvironmentFailure` that names the environment."""
    if inspect.getattr_static(environment, "tool_schemas", None) is None:
        return ()
    try:
        return environment.tool_schemas
    except Exception as error:  # a user's property: it may raise anything
        raise EnvironmentFailure(
            f"the environment {type(environment).__name__}.tool_schemas raised {describe(error)}"
        ) from error


@contextlib.contextmanager
def closed_on_failure(still_open: Callable[[], Iterable[Any]]) -> Iterator[None]:
    """Within the block, what is raised first closes the environments ``still_open()`` names
    (each that has ``close()``), ignoring what closing raises, so that an environment holding a
    sandbox or a process frees it; then the failure goes on, unchanged."""
    try:
        yield
    except BaseException:
        for environment in still_open():
            if callable(getattr(environment, "close", None)):
                with contextlib.suppress(Exception):
                    environment.close()
        raise


def make_environment(make: Callable[..., Any], *args: Any) -> Any:
    """``make(*args)``, one episode's environment from its class or function; what it raises
    becomes an :class:`EnvironmentFailure` that names it."""
    try:
        return make(*args)
    except EnvironmentFailure:
        raise
    except Exception as error:  # as call_environment: a user's code
        name = getattr(make, "__name__", type(make).__name__)
        raise EnvironmentFailure(
            f"the environment {name} could not be made: {describe(error)}"
        ) from error


def is_finite_reward(value: object) -> bool:
    """Whether ``value`` can be a reward: a real number finite in float32 (rewards are kept in
    float32), not a bool."""
    return (
        not isinstance(value, bool)
        and isinstance(value, numbers.Real)
        and (as_float(value) is not None)
    )


@dataclass(frozen=True)
class Step:
    """What an environment answers to one model turn."""

    observation: str | Sequence[Mapping[str, Any]] | None = None
    """What the model reads before its next turn: a string (one message of ``role``) or messages
    (``{"role", "content"}``; tool results as role ``tool``); None for nothing."""
    reward: float | None = None
    """A reward for the turn, if the environment gives one."""
    done: bool = False
    """True ends the episode (its observation is then not shown)."""
    role: str = "user"
    """The role of a string ``observation``."""
    tool_calls: int = 0
    """Tool calls the turn made (an environment that runs tools counts them)."""
    tool_errors: Mapping[str, int] = field(default_factory=dict)
    """kind -> the turn's tool calls that failed that way, each kind one of
    :data:`~lightning_troll.tasks.environments.calls.TOOL_ERROR_KINDS` (each has its figure,
    ``episodes/tool_errors_<kind>``)."""
    tool_replies_cut: int = 0
    """The turn's tool replies cut at ``model.episodes.tool_reply_chars``
    (``episodes/tool_replies_cut``)."""

    def __post_init__(self) -> None:
        if self.reward is not None and not is_finite_reward(self.reward):
            raise ValueError(
                f"Step.reward must be a number finite in float32, or None; got {self.reward!r}"
            )
        if isinstance(self.observation, str) and not is_text(self.observation):
            raise ValueError(f"Step.observation {NOT_TEXT}")
        if not (self.observation is None or isinstance(self.observation, str)):
            check_messages(self.observation, "Step.observation (a string, messages or None)")
        if not isinstance(self.role, str):
            raise ValueError(f"Step.role must be a string; got {self.role!r}")
        counts = {
            "Step.tool_calls": self.tool_calls,
            "Step.tool_replies_cut": self.tool_replies_cut,
        }
        counts.update({f"Step.tool_errors[{k!r}]": v for k, v in dict(self.tool_errors).items()})
        for name, count in counts.items():
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"{name} must be an integer >= 0 (a count); got {count!r}")
        unknown = sorted(map(repr, set(self.tool_errors) - set(TOOL_ERROR_KINDS)))
        if unknown:
            raise ValueError(
                f"Step.tool_errors: {', '.join(unknown)} is not a kind of tool error; the kinds "
                f"are {', '.join(TOOL_ERROR_KINDS)}"
            )


class Environment:
    """Base class of an environment: one per episode. Subclass it and define :meth:`reset` and
    :meth:`step` (any object with those two methods will do)."""

    @property
    def tool_schemas(self) -> Sequence[Mapping[str, Any]]:
        """The JSON schemas of the tools the prompt shows the model (none here), read after each
        :meth:`reset`."""
        return ()

    def reset(self, row: Mapping[str, Any]) -> Sequence[Mapping[str, Any]] | str:
        """Starts an episode from a data row (its own copy: it may change it): the conversation
        the model answers first (messages), or a plain prompt string."""
        raise NotImplementedError(f"{type(self).__name__} must define reset(row)")

    def step(self, turn: str) -> Step:
        """Answers the model's turn (its text, the final stop token left out)."""
        raise NotImplementedError(f"{type(self).__name__} must define step(turn)")

    def on_end(self, end: str) -> float | None:
        """Called once when the episode loop, not :meth:`step`, ends the episode: ``end`` is
        ``"max_turns"`` (the turn limit), ``"max_tokens"`` (the token budget ran out inside a
        model turn, which :meth:`step` never saw) or ``"no_room"`` (:meth:`step` answered the last
        turn, but its reply did not fit in the budget). A number returned is a reward added to the
        last turn's; None (here) adds nothing. A game whose answers cost something when wrong can
        make a turn cut off by the budget cost more, so that no policy learns to prefer it."""
        return None

    def close(self) -> None:
        """Frees what the environment holds when its episode ends (nothing here)."""


def is_trl_environment(made: Any) -> bool:
    """Whether ``made`` (a class, or an object one made) is an environment in TRL's form
    (:mod:`~lightning_troll.tasks.environments.trl_env`): it has a callable ``reset``, no ``step``, and
    is not an :class:`Environment`."""
    cls = made if inspect.isclass(made) else type(made)
    return (
        not issubclass(cls, Environment)
        and callable(getattr(made, "reset", None))
        and getattr(made, "step", None) is None
    )


def load_environment(spec: str | Callable[..., Any]) -> Callable[..., Any]:
    """What makes one environment per episode: the class (or function) that ``model.episodes.environment``
    names by import path (``"my_env:Guess"``), or is. A class must define ``reset`` and ``step``,
    or be in TRL's form (``reset`` and no ``step``: :mod:`~lightning_troll.tasks.environments.trl_env`)."""
    made = spec if callable(spec) else load_by_import_path(spec, OPTION)
    if not callable(made):
        raise ValueError(
            f"{OPTION}: {spec!r} is a {type(made).__name__}; name an Environment class, or a "
            "function that returns an environment"
        )
    if inspect.isclass(made):
        missing = [
            m
            for m in ("reset", "step")
            if not callable(getattr(made, m, None))
            or (issubclass(made, Environment) and getattr(made, m) is getattr(Environment, m))
        ]  # an Environment's own reset and step only raise NotImplementedError
        if missing and not is_trl_environment(made):
            raise ValueError(
                f"{OPTION}: {spec!r} has no {' or '.join(missing)} method; an environment defines "
                "reset(row) and step(turn) (see lightning_troll.tasks.environments.Environment), or, "
                "in TRL's form, reset(**row) and its tools as methods"
            )
    return made
