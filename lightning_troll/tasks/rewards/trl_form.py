"""Reward functions written in TRL's form, used as they are.

A GRPO reward function written for TRL takes keyword arguments and scores the whole batch::

    def accuracy(completions, answer, **kwargs) -> list[float]:
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

The scorer calls the library's own form, ``fn(prompt, completion, row)`` for one completion (or
``fn(prompts, completions, rows)`` for one with ``batched = True``). :func:`is_trl_form` tells the
two apart: a function that names a parameter ``completions``, none named ``completion``, and is not
marked ``batched``, is in TRL's form, and :class:`TrlFormReward` calls it once per scoring with

- ``completions``: the completions' texts; with conversational prompts (below), each one a list of
  one message, ``[{"role": "assistant", "content": text}]``;
- ``prompts``: each row's ``prompt`` value when every row has one (a string, or a list of messages:
  conversational), as TRL passes its dataset's prompt column; else the formatted prompt texts;
- every other field of the rows as a list, one value per completion (a field some rows lack is
  None in theirs), as TRL passes its dataset's columns;
- the keyword arguments bound in ``model.reward_options.kwargs``.

What TRL passes and the scorer does not have (``completion_ids``, ``trainer_state``,
``log_metric``, ``environments``, ...) is not given: a function that requires one by name is refused before anything
runs, and one that takes ``**kwargs`` simply does not find it there. The function may be
``async def``. Its result must hold one score per completion, a finite number or None: TRL's
"does not apply", which TRL's weighted sum leaves out, scores 0 from this function, the sample
staying in (anything else is a failed call, which ``model.reward_options.on_error`` scores).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning_troll.tasks.rewards.calls import awaited

__all__ = ["TrlFormReward", "is_trl_form"]

GIVEN = ("prompts", "completions")
"""The arguments every call gives by these names; the rows' fields come beside them."""
TRL_ONLY = ("completion_ids", "trainer_state", "log_metric", "log_extra", "environments")
"""What TRL passes and the scorer has not: a function that requires one is refused."""
_NOT_COLUMNS = frozenset({*GIVEN, "prompt", "completion"})
"""Row fields that are not passed as columns (TRL passes neither prompt nor completion so)."""


def _parameters(fn: Callable[..., Any]) -> dict[str, inspect.Parameter] | None:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _from_rows(default: Any) -> Any:
    return None if default is inspect.Parameter.empty else default


def is_trl_form(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is a reward in TRL's form: it names ``completions``, not ``completion``, and
    is not marked ``batched``."""
    params = _parameters(fn)
    if params is None or getattr(fn, "batched", False):
        return False
    return "completions" in params and "completion" not in params


class TrlFormReward:
    """A reward in TRL's form (``fn(completions, **kwargs) -> list[float]``) as a batched reward
    of the scorer's: ``self(prompts, completions, rows, **bound)`` returns one score per
    completion.

    Args:
        fn: The function; :func:`is_trl_form` must hold for it.
        name: How errors name it (its import path); None: its ``__name__``.
    """

    batched = True

    def __init__(self, fn: Callable[..., Any], name: str | None = None) -> None:
        name = name or getattr(fn, "__name__", repr(fn))
        params = _parameters(fn)
        if params is None or not is_trl_form(fn):
            raise ValueError(f"model.rewards: {name!r} is not a reward in TRL's form")
        positional = [p.name for p in params.values() if p.kind == p.POSITIONAL_ONLY]
        if positional:
            raise ValueError(
                f"model.rewards: {name!r} takes {positional} by position only; a reward in TRL's "
                "form is called with keyword arguments (completions, prompts and the rows' fields)"
            )
        needs = [n for n in TRL_ONLY if n in params and params[n].default is params[n].empty]
        if needs:
            raise ValueError(
                f"model.rewards: {name!r} requires {needs}, which TRL passes and this library does "
                f"not (it passes {list(GIVEN)}, the rows' fields and model.reward_options.kwargs); "
                "give it a default, or take it from **kwargs"
                + (
                    "; an environment in TRL's form scores its episodes with get_reward here"
                    if "environments" in needs
                    else ""
                )
            )
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.max_reward = getattr(fn, "max_reward", 1.0)
        self.takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
        """Whether ``fn`` takes ``**kwargs``: every row field goes to it."""
        self.named = frozenset(
            n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        )
        """The names ``fn`` takes: without ``**kwargs``, only these row fields go to it."""
        self.required = sorted(
            n
            for n, p in params.items()
            if n not in GIVEN
            and p.default is p.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        )
        """The names ``fn`` needs besides prompts and completions: row fields or bound
        keyword arguments; a call whose rows and bound arguments lack one fails."""
        own = [p for n, p in params.items() if n not in GIVEN and p.kind != p.VAR_KEYWORD]
        rest = [p for p in params.values() if p.kind == p.VAR_KEYWORD]
        self.__signature__ = inspect.Signature(
            [
                inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY)
                for n in ("prompts", "completions", "rows")
            ]
            + [p.replace(kind=p.KEYWORD_ONLY, default=_from_rows(p.default)) for p in own]
            + rest
        )  # what reward_options.kwargs may bind: the function's own keyword arguments, each
        # optional here, since a row field can give it

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__name__})"

    def __call__(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        rows: Sequence[Mapping[str, Any]],
        **bound: Any,
    ) -> Any:
        given = [row.get("prompt") for row in rows]
        if any(p is None for p in given):
            given = list(prompts)  # the formatted prompts: the rows hold no prompt field
        if all(isinstance(p, list) for p in given):  # conversational
            texts: list = [[{"role": "assistant", "content": c}] for c in completions]
        else:
            texts = list(completions)
        fields = dict.fromkeys(key for row in rows for key in row if key not in _NOT_COLUMNS)
        given_fields = [key for key in fields if self.takes_any or key in self.named]
        columns = {key: [row.get(key) for row in rows] for key in given_fields if key not in bound}
        missing = [n for n in self.required if n not in columns and n not in bound]
        if missing:
            raise TypeError(
                f"it needs {missing}, which are neither fields of the rows ({sorted(fields)}) "
                "nor bound in model.reward_options.kwargs"
            )
        if self.takes_any or "prompts" in self.named:
            columns["prompts"] = given
        values = awaited(self.fn(completions=texts, **columns, **bound))
        if isinstance(values, list | tuple):  # None: "does not apply", which TRL's sum leaves out
            values = [0.0 if value is None else value for value in values]
        return values
