"""Options of reward functions: :class:`RewardOptions` (``model.reward_options``: keyword
arguments bound from the configuration, what a failed call scores, worker processes and their
timeout), the per-completion keywords the scorer passes, logging tags, and the length-based
``overlong`` penalty.

Besides ``(prompt, completion, row)`` a reward function may take the keyword-only parameters
``completion_tokens`` (the tokens generated for this completion, EOS included; with
``model.episodes``, the episode's whole response, the environment's tokens included) and
``max_new_tokens`` (the budget): the scorer passes them to a function whose signature names them.
Further keyword parameters are bound from the configuration (``model.reward_options.kwargs``,
e.g. ``{overlong: {buffer: 256}}``). A function may carry a ``check`` attribute, called with those
bound arguments when the scorer is built so that bad values stop the run before it starts, and a
``max_reward`` attribute, its best score (1.0 otherwise), which ``val/accuracy`` counts as full
marks (``None``: it has none, as a reward model's logit, and ``val/accuracy`` leaves it out).

:class:`~lightning_troll.tasks.rewards.registry.RewardScorer` uses these; ``overlong`` is registered
there.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "SAMPLE_KEYWORDS",
    "RewardErrorPolicy",
    "RewardOptions",
    "bind_kwargs",
    "call_arguments",
    "check_call_signatures",
    "overlong",
    "parameters",
    "reward_tag",
    "sample_keywords",
]

RewardErrorPolicy = Literal["raise", "drop"] | float | dict[str, Literal["raise", "drop"] | float]
"""``model.reward_options.on_error``: one policy, or reward names to policies."""


@dataclass(frozen=True)
class RewardOptions:
    """How the reward functions of ``model.rewards`` are called (``model.reward_options``); the
    scorer checks the values when it is built
    (:meth:`~lightning_troll.tasks.rewards.registry.RewardScorer.from_options`)."""

    kwargs: dict[str, dict[str, Any]] | None = None
    """Keyword arguments bound to reward functions by name, e.g. ``{overlong: {buffer: 256}}``
    (the last 256 tokens of the budget carry the penalty)."""
    on_error: RewardErrorPolicy = "raise"
    """A failed reward call (raised, timed out, NaN, None, ...): ``raise`` stops; ``drop`` leaves
    the completion out of the loss; a number is its score. One policy, or reward names to
    policies (the rest raise)."""
    workers: int = 0
    """Processes scoring a rollout's rewards in parallel; 0: in-process."""
    timeout: float | None = None
    """Seconds per reward call in a worker, then abandoned; null: no limit (needs workers >= 1)."""


SAMPLE_KEYWORDS = ("completion_tokens", "max_new_tokens")
"""Per-completion quantities the scorer passes to reward functions whose signature names them:
the tokens generated for the completion (EOS included) and the budget
(``sampling.max_new_tokens``)."""

_POSITIONAL = ("prompt", "completion", "row")


def reward_tag(name: str) -> str:
    """A reward's name as a logging tag: characters other than letters, digits, ``_``, ``.`` and
    ``-`` become ``_`` (``"pkg.mod:fn"`` -> ``"pkg.mod_fn"``)."""
    return re.sub(r"[^\w.\-]", "_", name)


def parameters(fn: Callable[..., Any]) -> tuple[set[str], bool]:
    """The names ``fn`` takes by keyword and whether it takes ``**kwargs``; ``(set(), False)``
    when its signature cannot be read (a builtin, say)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set(), False
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, any(p.kind == p.VAR_KEYWORD for p in params)


def bind_kwargs(
    functions: Mapping[str, Callable[..., Any]], kwargs: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Checks ``reward_options.kwargs`` against the reward functions: every name must be a
    reward, every argument one its function takes (not ``prompt``, ``completion``, ``row`` or a
    per-completion keyword), and a function's ``check`` attribute, if any, must accept the
    values."""
    bound: dict[str, dict[str, Any]] = {}
    for name, arguments in kwargs.items():
        if name not in functions:
            raise ValueError(
                f"reward_options.kwargs names {name!r}, which is not one of the rewards "
                f"{sorted(functions)}"
            )
        if not isinstance(arguments, Mapping):
            raise ValueError(
                f"reward_options.kwargs.{name} must map argument names to values; got {arguments!r}"
            )
        fn = functions[name]
        taken, any_keyword = parameters(fn)
        reserved = {*_POSITIONAL, *SAMPLE_KEYWORDS}
        allowed = sorted(taken - reserved)
        unknown = set(arguments) - set(allowed) if not any_keyword else set(arguments) & reserved
        if unknown:
            raise ValueError(
                f"reward_options.kwargs.{name}: {sorted(unknown)} is not a keyword argument the "
                f"reward {name!r} takes; it takes {allowed}"
            )
        check = getattr(fn, "check", None)
        if callable(check):
            try:
                check(**arguments)
            except ValueError as error:
                raise ValueError(f"reward_options.kwargs.{name}: {error}") from None
        bound[name] = dict(arguments)
    return bound


def check_call_signatures(
    functions: Mapping[str, Callable[..., Any]], kwargs: Mapping[str, Mapping[str, Any]]
) -> None:
    """Refuses a reward function that cannot be called as the scorer calls it: ``fn(prompt,
    completion, row)`` (a batched one with lists), plus its bound keyword arguments and the
    per-completion keywords (and ``device``) its signature names. A signature that cannot be read
    (a builtin) is let through."""
    for name, fn in functions.items():
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            continue
        named = {*SAMPLE_KEYWORDS, "device"} & set(signature.parameters)
        extra = dict.fromkeys([*kwargs.get(name, {}), *named])
        try:
            signature.bind("prompt", "completion", {}, **extra)
        except TypeError as error:
            raise ValueError(
                f"model.rewards: {name!r} cannot be called as fn(prompt, completion, row) "
                f"({error}; its signature is {name.rpartition(':')[2]}{signature}); a reward "
                "takes the prompt, the completion and the data row, and keyword arguments from "
                "model.reward_options.kwargs"
            ) from None


def sample_keywords(functions: Mapping[str, Callable[..., Any]]) -> dict[str, tuple[str, ...]]:
    """name -> the per-completion keywords (``SAMPLE_KEYWORDS``) its function's signature names."""
    return {
        name: tuple(k for k in SAMPLE_KEYWORDS if k in parameters(fn)[0])
        for name, fn in functions.items()
    }


def call_arguments(
    keywords: Mapping[str, tuple[str, ...]],
    bound: Mapping[str, Mapping[str, Any]],
    size: int,
    completion_tokens: Sequence[int] | None,
    max_new_tokens: int | None,
) -> dict[str, list[dict[str, Any]]]:
    """name -> the keyword arguments of each of ``size`` calls: the bound ones plus the
    per-completion ones the function takes; refuses a per-completion value a function needs but
    was not given."""
    given = {"completion_tokens": completion_tokens, "max_new_tokens": max_new_tokens}
    if completion_tokens is not None and len(completion_tokens) != size:
        raise ValueError(
            f"completion_tokens must have one entry per completion ({size}); got "
            f"{len(completion_tokens)}"
        )
    out: dict[str, list[dict[str, Any]]] = {}
    for name, wanted in keywords.items():
        missing = [k for k in wanted if given[k] is None]
        if missing:
            raise ValueError(f"reward function {name!r} needs {missing}; none were given")
        out[name] = [dict(bound.get(name, {})) for _ in range(size)]
        for i, arguments in enumerate(out[name]):
            if "completion_tokens" in wanted:
                arguments["completion_tokens"] = int(completion_tokens[i])
            if "max_new_tokens" in wanted:
                arguments["max_new_tokens"] = int(max_new_tokens)
    return out


def overlong(
    prompt: str,
    completion: str,
    row: Mapping[str, Any],
    *,
    completion_tokens: int,
    max_new_tokens: int,
    buffer: int | None = None,
) -> float:
    """DAPO's soft overlong penalty: 0 for completions of at most ``max_new_tokens - buffer``
    tokens, then ``(max_new_tokens - buffer - completion_tokens) / buffer``, falling linearly to
    -1 at the budget (a completion cut off there gets -1).

    ``buffer`` (L in DAPO) defaults to a fifth of the budget (DAPO: 4,096 of 20,480 tokens); set
    it with ``reward_options: {kwargs: {overlong: {buffer: 256}}}``. Weigh it like any reward: the
    weight is DAPO's penalty factor.

    Use it beside a correctness reward when completions run into the token budget: it teaches
    the policy to finish before the cut instead of training on truncated answers.
    """
    if buffer is None:
        buffer = max(1, max_new_tokens // 5)
    start = max_new_tokens - buffer
    if completion_tokens <= start:
        return 0.0
    return max(-1.0, (start - completion_tokens) / buffer)


def _check_overlong(buffer: int | None = None) -> None:
    if buffer is not None and (
        isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 1
    ):
        raise ValueError(f"buffer must be null or an integer >= 1; got {buffer!r}")


overlong.check = _check_overlong  # type: ignore[attr-defined]
overlong.max_reward = 0.0  # type: ignore[attr-defined]
