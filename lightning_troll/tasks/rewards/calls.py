"""One reward call and what became of it: a score, an error or a timeout, and the policy that
scores a failed call (``model.reward_options.on_error``).

A call is ``fn(prompt, completion, row, **keywords)`` for one completion, or, for a function with
``batched = True`` (a reward model), ``fn(prompts, completions, rows, **keywords)`` returning one
score per completion; an ``async def`` function is awaited. Its result is valid when it is a
number (or bool, or one-element tensor) finite in float32; anything else (NaN, None, a string, a list of the wrong length) is an error,
as is an exception. A call may also time out when it runs in a worker process
(:mod:`lightning_troll.tasks.rewards.workers`).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, NamedTuple

__all__ = [
    "UNLOADABLE",
    "FailurePolicy",
    "Outcome",
    "RewardError",
    "RewardWarning",
    "apply_policies",
    "as_float",
    "awaited",
    "call_batched",
    "call_one",
    "check_policies",
    "describe",
]


UNLOADABLE = "unloadable"
"""The kind of a call whose function did not unpickle in its worker: no call of it can run there,
so a failure of this kind stops the run, whatever ``on_error`` says of one call's failure."""


class RewardError(ValueError):
    """A reward function raised, or returned something that is not a finite number."""


class RewardWarning(UserWarning):
    """Reward calls failed and were scored by ``on_error`` (dropped, or given its score)."""


FailurePolicy = Literal["raise", "drop"] | float
"""What a failed call does: ``"raise"`` stops the run, ``"drop"`` leaves the completion out of the
loss, a number is the score the failed call gets (the completion stays in)."""

_FLOAT32_MAX = 3.4028234663852886e38


class Outcome(NamedTuple):
    """What one reward call gave."""

    value: float
    """The score; 0.0 when the call failed."""
    problem: str | None = None
    """What went wrong, as a sentence's end (``"raised KeyError: 'answer'"``); None when valid."""
    kind: Literal["error", "timeout", "skipped"] | None = None
    """``"timeout"`` for a call abandoned at ``model.reward_options.timeout``, ``"skipped"`` for one
    never answered because an earlier failure stops the run, else ``"error"``."""
    cause: BaseException | None = None
    """The exception the call raised in this process, if one did."""


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception (``Type`` alone when it has no message), whatever its
    own ``__str__`` does (a user's exception may raise there too)."""
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - any failure of a user's __str__
        text = "(its message could not be written)"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def short(text: str, limit: int = 80) -> str:
    """``text`` cut to ``limit`` characters, ``...`` marking the cut."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def as_float(value: Any) -> float | None:
    """A float from a bool, real number or one-element tensor, finite in float32 (rewards are
    kept in float32); None for anything else."""
    if hasattr(value, "numel") and hasattr(value, "item") and value.numel() == 1:
        value = value.item()
    if isinstance(value, numbers.Real):  # bool is an int: True -> 1.0
        try:
            value = float(value)
        except OverflowError:  # an int beyond any float
            return None
        return value if abs(value) <= _FLOAT32_MAX else None  # NaN fails this too
    return None


def _checked(value: Any) -> Outcome:
    number = as_float(value)
    if number is not None:
        return Outcome(number)
    problem = (
        f"returned {short(repr(value))} ({type(value).__name__}); a reward must be a number "
        "(or bool) finite in float32"
    )
    return Outcome(0.0, problem, "error")


def awaited(value: Any) -> Any:
    """``value``, or, where it is a coroutine (an ``async def`` function's), what it returns: run
    to its end in an event loop of its own, in a thread of its own where this thread already runs
    a loop (a notebook's)."""
    if not inspect.iscoroutine(value):
        return value
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(value)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, value).result()


def call_one(
    fn: Callable[..., Any], prompt: str, completion: str, row: Mapping[str, Any], extra: dict
) -> Outcome:
    """``fn(prompt, completion, row, **extra)``, checked."""
    try:
        value = awaited(fn(prompt, completion, row, **extra))
    except Exception as exc:  # a user's function may raise anything
        return Outcome(0.0, f"raised {describe(exc)}", "error", exc)
    return _checked(value)


def call_batched(
    fn: Callable[..., Any],
    prompts: Sequence[str],
    completions: Sequence[str],
    rows: Sequence[Mapping[str, Any]],
    extra: dict,
) -> list[Outcome]:
    """``fn(prompts, completions, rows, **extra)`` for a batched function: one outcome per
    completion; every one fails when the call raises or returns a wrong number of scores."""
    size = len(completions)
    try:
        values = awaited(fn(list(prompts), list(completions), list(rows), **extra))
    except Exception as exc:
        return [Outcome(0.0, f"raised {describe(exc)}", "error", exc)] * size
    if hasattr(values, "tolist"):
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != size:
        length = len(values) if isinstance(values, Sequence) else type(values).__name__
        problem = f"returned {short(repr(values))} ({length}) for {size} completions"
        return [Outcome(0.0, problem + "; it must return one score per completion", "error")] * size
    return [_checked(value) for value in values]


def check_policies(
    on_error: FailurePolicy | Mapping[str, FailurePolicy], names: Sequence[str]
) -> dict[str, FailurePolicy]:
    """name -> its policy, from one policy for all or a mapping of some names to theirs (the
    rest ``"raise"``); refuses an unknown policy or name."""
    given = dict(on_error) if isinstance(on_error, Mapping) else dict.fromkeys(names, on_error)
    unknown = set(given) - set(names)
    if unknown:
        raise ValueError(
            f"reward_options.on_error names {sorted(unknown)}, which are not among the rewards "
            f"{sorted(names)}"
        )
    for name, policy in given.items():
        number = isinstance(policy, numbers.Real) and not isinstance(policy, bool)
        if number and math.isfinite(policy) or policy in ("raise", "drop"):
            continue
        raise ValueError(
            f"reward_options.on_error for {name!r} must be 'raise', 'drop' or a finite number "
            f"(the score a failed call gets); got {policy!r}"
        )
    return {name: given.get(name, "raise") for name in names}


_NAMED_FAILURES = 3
"""Failed calls named in a scoring's warning."""


def apply_policies(
    outcomes: Mapping[str, Sequence[Outcome]],
    policies: Mapping[str, FailurePolicy],
    prompts: Sequence[str],
    completions: Sequence[str],
) -> tuple[dict[str, list[float]], list[bool], dict[str, int], dict[str, int]]:
    """Scores of B calls per function, each failed one as its function's policy says: returns
    ``(scores, valid, timeouts, errors)`` (name -> B scores; B flags; name -> counts) and warns
    once, naming the first few failures. Raises :class:`RewardError` on a failure whose policy
    is ``"raise"``."""
    size = len(completions)
    valid = [True] * size
    scores: dict[str, list[float]] = {}
    timeouts = dict.fromkeys(outcomes, 0)
    errors = dict.fromkeys(outcomes, 0)
    failures: list[str] = []
    for name, results in outcomes.items():
        scores[name] = column = [0.0] * size
        policy = policies.get(name, "raise")
        for i, outcome in enumerate(results):
            if outcome.problem is None:
                column[i] = outcome.value
                continue
            if outcome.kind == UNLOADABLE:
                raise RewardError(
                    f"reward function {name!r} {outcome.problem}; model.reward_options.workers 0 "
                    "scores in the trainer's process"
                )
            if policy == "raise":
                if outcome.kind == "skipped":  # the failure that stopped the scoring raises
                    continue
                raise RewardError(
                    f"reward function {name!r} on sample {i} (prompt {short(prompts[i])!r}, "
                    f"completion {short(completions[i])!r}) {outcome.problem}"
                ) from outcome.cause
            (timeouts if outcome.kind == "timeout" else errors)[name] += 1
            if policy == "drop":
                valid[i] = False
            else:
                column[i] = float(policy)
            failures.append(f"{name!r} on sample {i} {outcome.problem}, completion "
                            f"{short(completions[i], 40)!r}")  # fmt: skip
    _warn(size, valid.count(False), failures)
    return scores, valid, timeouts, errors


def _warn(size: int, dropped: int, failures: list[str]) -> None:
    if not failures:
        return
    named = "; ".join(failures[:_NAMED_FAILURES])
    more = len(failures) - _NAMED_FAILURES
    more_text = f" (and {more} more)" if more > 0 else ""
    if dropped:
        head = (
            f"RewardScorer dropped {dropped} of {size} samples whose rewards failed "
            "(on_error='drop')"
        )
    else:
        head = f"RewardScorer: {len(failures)} reward calls on {size} samples failed"
    text = f"{head}; the first: {named}{more_text}".replace("\n", "⏎")
    warnings.warn(text, RewardWarning, stacklevel=4)
