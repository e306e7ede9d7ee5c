"""Reward functions: the registry of them by name, and the scorer of a rollout with several.

A reward function is any callable ``fn(prompt, completion, row) -> float``: ``prompt`` is the
formatted prompt text, ``completion`` the generated text (prompt excluded) and ``row`` the
dataset row the prompt came from (the DataModule stores the gold answer under ``"answer"``, and
the unformatted prompt under ``"prompt"`` where the row has no such field).
Built-ins, registered by name (defined in :mod:`~lightning_troll.tasks.rewards.functions`,
``overlong`` in :mod:`~lightning_troll.tasks.rewards.options`):

    tinymath  1.0 if ``tinymath.answer_of(completion)`` equals ``row["answer"]``
    gsm8k     the number after the last ``####``, compared numerically with the gold answer
    boxed     the content of the last ``\\boxed{...}``, compared after normalisation
    last_number  the last number in the completion, compared numerically with the gold answer
    math_verify  the answers parsed by Hugging Face's math-verify and compared symbolically
    overlong  DAPO's soft overlong penalty: 0, then falling linearly to -1 over the last
              ``buffer`` tokens of the completion budget

A function may take more keyword parameters: per-completion ones the scorer passes and others
bound from the configuration (see :mod:`lightning_troll.tasks.rewards.options`).

Add your own with :func:`register_reward`, or name any function by import path (``"pkg.mod:fn"``);
one in TRL's form, ``fn(completions, **kwargs) -> list[float]``, is called as it is (``trl_form``).
:class:`RewardScorer` runs a weighted set of them over B = P * G completions, ``(B,)`` tensors out.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_troll.tasks.rewards.calls import (
    FailurePolicy,
    Outcome,
    RewardError,
    RewardWarning,
    apply_policies,
    call_batched,
    call_one,
    check_policies,
)
from lightning_troll.tasks.rewards.functions import (
    boxed,
    extract_boxed,
    gsm8k,
    last_number,
    math_verify,
    tinymath,
)
from lightning_troll.tasks.rewards.lookup import (
    find_attribute,
    import_reward_module,
    split_import_path,
)
from lightning_troll.tasks.rewards.options import (
    RewardOptions,
    bind_kwargs,
    call_arguments,
    check_call_signatures,
    overlong,
    parameters,
    reward_tag,
    sample_keywords,
)
from lightning_troll.tasks.rewards.trl_form import TrlFormReward, is_trl_form
from lightning_troll.tasks.rewards.workers import RewardWorkers, WorkersFailed, check_picklable

__all__ = [
    "REWARD_FUNCTIONS",
    "RewardError",
    "RewardFunction",
    "RewardOutput",
    "RewardScorer",
    "RewardWarning",
    "boxed",
    "extract_boxed",
    "gsm8k",
    "last_number",
    "math_verify",
    "overlong",
    "register_reward",
    "resolve_reward",
    "reward_tag",
    "tinymath",
]


class RewardFunction(Protocol):
    """Scores one completion: a finite float (or bool), higher is better."""

    def __call__(self, prompt: str, completion: str, row: Mapping[str, Any]) -> float: ...


REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "tinymath": tinymath,
    "gsm8k": gsm8k,
    "boxed": boxed,
    "last_number": last_number,
    "overlong": overlong,
    "math_verify": math_verify,
}
"""Reward functions by name: the built-ins, and those added with :func:`register_reward`."""


def register_reward(name: str) -> Callable[[RewardFunction], RewardFunction]:
    """Decorator: adds ``fn(prompt, completion, row) -> float`` to the registry under ``name``."""

    def add(fn: RewardFunction) -> RewardFunction:
        if name in REWARD_FUNCTIONS:
            raise ValueError(f"a reward function named {name!r} is already registered")
        REWARD_FUNCTIONS[name] = fn
        return fn

    return add


def resolve_reward(spec: str | Callable[..., Any]) -> RewardFunction:
    """A reward function from a registry name, an import path, or a callable (returned as is).

    Import paths: ``"package.module:function"`` or ``"package.module.function"``; the part after
    ``:`` may be dotted (``"package.module:Class.method"``).
    """
    if callable(spec) and not isinstance(spec, str):
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(
            f"a reward must be a registered name, an import path or a callable; got {spec!r}"
        )
    if spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[spec]
    parts = split_import_path(spec)
    if parts is None:
        raise ValueError(
            f"model.rewards: unknown reward {spec!r}; registered rewards are "
            f"{sorted(REWARD_FUNCTIONS)}, or give an import path 'module:function' of a function "
            "fn(prompt, completion, row) -> float (module.py in the working directory or beside "
            "the config)"
        )
    module_name, attr_path = parts
    # the working directory first, then beside the configs, then anything importable (lookup.py)
    module, place = import_reward_module(module_name, spec)
    obj = find_attribute(module, attr_path, spec, place)
    if inspect.isclass(obj) or not callable(obj):
        what = "a class" if inspect.isclass(obj) else f"a {type(obj).__name__}, not callable"
        raise ValueError(
            f"reward {spec!r} is {what}; point at a function (or callable object) "
            "fn(prompt, completion, row) -> float"
        )
    return obj


@dataclass(frozen=True)
class RewardOutput:
    """Rewards of B completions; every tensor is (B,) and detached."""

    total: Tensor
    """(B,) float32 weighted sum over the functions; 0.0 where ``valid`` is False."""
    per_function: dict[str, Tensor]
    """name -> (B,) float32 unweighted reward of that function (0.0 where ``valid`` is False)."""
    valid: Tensor
    """(B,) bool; False where some function failed and ``on_error="drop"`` dropped the sample."""
    timeouts: dict[str, int] = field(default_factory=dict)
    """name -> calls of that function abandoned at the timeout (every function listed)."""
    errors: dict[str, int] = field(default_factory=dict)
    """name -> calls of that function that raised, returned a non-number or lost their worker."""


def _unique_name(fn: Callable[..., Any], taken: Mapping[str, Any]) -> str:
    """``fn.__name__``, with ``_2``, ``_3``, ... appended while another function holds it."""
    base = getattr(fn, "__name__", type(fn).__name__)
    name, n = base, 1
    while name in taken and taken[name] is not fn:
        n += 1
        name = f"{base}_{n}"
    return name


def _build(spec: str | Callable[..., Any]) -> RewardFunction:
    """A reward function from its spec: ``reward_model:<folder or hub name>`` is a
    :class:`~lightning_troll.tasks.rewards.reward_model.RewardModel`; anything else is resolved."""
    if isinstance(spec, str) and spec.startswith(REWARD_MODEL_PREFIX):
        from lightning_troll.tasks.rewards.reward_model import RewardModel

        return RewardModel(spec[len(REWARD_MODEL_PREFIX) :])
    fn = resolve_reward(spec)
    require = getattr(fn, "require", None)
    if callable(require):
        try:
            require()
        except ImportError as error:
            raise ValueError(str(error)) from None
    return TrlFormReward(fn, spec if isinstance(spec, str) else None) if is_trl_form(fn) else fn


REWARD_MODEL_PREFIX = "reward_model:"
"""``rewards: {"reward_model:<folder or hub name>": 1.0}`` scores with a sequence classifier."""


class RewardScorer:
    """Several reward functions with weights: ``total = sum_k weight_k * reward_k``.

    Args:
        rewards: Reward functions (registry names, import paths, ``reward_model:<model>`` or
            callables) to weights, or a list of them (weight 1 each). Weights must be finite; 0
            logs a reward without training on it, a negative weight makes it a penalty.
        on_error: What a call that raises, times out, or returns None, NaN, inf or a non-number
            does: ``"raise"`` (default) raises :class:`RewardError` naming the function, the
            sample and the problem; ``"drop"`` marks that sample invalid (``valid[i] = False``,
            total 0.0); a number is the score the failed call gets (the sample stays valid).
            One policy for every function, or a mapping of names to policies (the rest raise).
            Failed calls that do not raise are counted (``timeouts``, ``errors``) and the first
            few named in one warning per call.
        kwargs: Keyword arguments bound to functions by name, e.g. ``{"overlong": {"buffer":
            256}}``; each name must be one of ``rewards`` and each argument one its function takes.
        workers: Worker processes that score (:mod:`~lightning_troll.tasks.rewards.workers`), the calls
            of one scoring in parallel across them; 0 scores in this process. Batched functions
            (reward models) always score in this process.
        timeout: Seconds a call may take in a worker before it is abandoned (and its worker
            replaced); None waits for ever. Needs ``workers`` >= 1.
        none_ok: ``rewards`` may name no function: every sample then scores 0 (with
            ``model.episodes``, the environment's turn rewards alone score an episode).

    :meth:`from_options` builds one from a :class:`~lightning_troll.tasks.rewards.options.RewardOptions`
    record (``model.reward_options``); errors name the options as that record's fields.
    """

    def __init__(
        self,
        rewards: Mapping[str, float] | Sequence[str],
        on_error: FailurePolicy | Mapping[str, FailurePolicy] = "raise",
        kwargs: Mapping[str, Mapping[str, Any]] | None = None,
        workers: int = 0,
        timeout: float | None = None,
        *,
        none_ok: bool = False,
    ) -> None:
        if isinstance(rewards, str) or callable(rewards):
            rewards = [rewards]
        items = (
            list(rewards.items()) if isinstance(rewards, Mapping) else [(r, 1.0) for r in rewards]
        )
        if not items and not none_ok:
            raise ValueError(
                "rewards must name at least one reward function; got none (none only with "
                "model.episodes, whose environment's turn rewards then score an episode alone)"
            )
        self.functions: dict[str, RewardFunction] = {}
        """name -> reward function; a callable is named by its ``__name__``."""
        self.weights: dict[str, float] = {}
        for spec, weight in items:
            name = spec if isinstance(spec, str) else _unique_name(spec, self.functions)
            if name in self.functions:
                raise ValueError(f"rewards lists {name!r} twice; give each function once")
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
                raise ValueError(f"the weight of reward {name!r} must be a number; got {weight!r}")
            if not math.isfinite(weight):
                raise ValueError(f"the weight of reward {name!r} must be finite; got {weight!r}")
            self.functions[name] = _build(spec)
            self.weights[name] = float(weight)
        if isinstance(on_error, str) and on_error not in ("raise", "drop"):
            raise ValueError(
                f"reward_options.on_error must be 'raise', 'drop' or a number; got {on_error!r}"
            )
        self.on_error = on_error
        self.policies = check_policies(on_error, list(self.functions))
        """name -> what a failed call of that function does."""
        best = {name: getattr(fn, "max_reward", 1.0) for name, fn in self.functions.items()}
        self.best: dict[str, float | None] = {
            name: None if value is None else float(value) for name, value in best.items()
        }
        """name -> the function's best score (its ``max_reward`` attribute, else 1.0); None for
        one that has none (a reward model's logit), which ``val/accuracy`` leaves out."""
        self.kwargs = bind_kwargs(self.functions, kwargs or {})
        """name -> keyword arguments bound to that function."""
        check_call_signatures(self.functions, self.kwargs)
        self.sample_keywords = sample_keywords(self.functions)
        """name -> the per-completion keywords (``SAMPLE_KEYWORDS``) its signature names."""
        if timeout is not None and workers == 0:
            raise ValueError(
                f"model.reward_options.timeout={timeout!r} needs model.reward_options.workers >= 1: "
                "a call in the trainer's own process cannot be abandoned"
            )
        self.workers = None if workers == 0 else RewardWorkers(workers, timeout)
        """The worker processes, or None to score in this process."""
        if self.workers is not None:
            for name, fn in self.functions.items():
                if not getattr(fn, "batched", False):
                    check_picklable(name, fn)

    @classmethod
    def from_options(
        cls,
        rewards: Mapping[str, float] | Sequence[str],
        options: RewardOptions,
        none_ok: bool = False,
    ) -> RewardScorer:
        """The scorer of ``rewards`` called as ``options`` (``model.reward_options``) says;
        ``none_ok``: no functions is allowed (a scorer that gives every sample 0)."""
        return cls(
            rewards, options.on_error, options.kwargs, options.workers, options.timeout,
            none_ok=none_ok,
        )  # fmt: skip

    @property
    def full_marks(self) -> float:
        """The best total a completion can get from the functions that have a best score: sum of
        weight * best score over those with a positive weight (a negative weight's best is its
        function at 0)."""
        return sum(
            w * best
            for name, w in self.weights.items()
            if w > 0 and (best := self.best[name]) is not None
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.weights!r}, on_error={self.on_error!r})"

    def close(self) -> None:
        """Stops the worker processes, if any (the next call starts them again)."""
        if self.workers is not None:
            self.workers.close()

    def __call__(
        self,
        prompts: list[str],
        completions: list[str],
        rows: list[Mapping[str, Any]],
        completion_tokens: Sequence[int] | None = None,
        max_new_tokens: int | None = None,
        device: Any = None,
    ) -> RewardOutput:
        """Scores sample i = (prompts[i], completions[i], rows[i]); all three lists have length B.

        ``completion_tokens`` (B,) and ``max_new_tokens`` go to the functions that take them;
        a function that takes them raises ``ValueError`` when they are not given. ``device`` (the
        policy's) goes to batched functions that take it: a reward model scores there.
        """
        size = len(completions)
        if len(prompts) != size or len(rows) != size:
            raise ValueError(
                f"prompts, completions and rows must have the same length; got {len(prompts)}, "
                f"{size} and {len(rows)}"
            )
        arguments = call_arguments(
            self.sample_keywords, self.kwargs, size, completion_tokens, max_new_tokens
        )  # name -> B keyword dicts
        outcomes = self._outcomes(prompts, completions, rows, arguments, device)
        scores, valid, timeouts, errors = apply_policies(
            outcomes, self.policies, prompts, completions
        )
        valid_t = torch.tensor(valid, dtype=torch.bool)  # (B,)
        per_function = {
            name: torch.tensor(column, dtype=torch.float32).masked_fill(~valid_t, 0.0)
            for name, column in scores.items()
        }  # name -> (B,)
        total = torch.zeros(size, dtype=torch.float64)  # (B,)
        for name, column in scores.items():
            total += self.weights[name] * torch.tensor(column, dtype=torch.float64)
        total = total.masked_fill(~valid_t, 0.0).to(torch.float32)
        return RewardOutput(total, per_function, valid_t, timeouts, errors)

    def _outcomes(self, prompts, completions, rows, arguments, device) -> dict[str, list[Outcome]]:
        """name -> the outcome of each of its B calls: batched functions in this process, the
        rest in the workers (all at once) or here, in order."""
        outcomes: dict[str, list[Outcome]] = {}
        calls: list = []
        samples = list(zip(prompts, completions, rows, strict=True))
        for name, fn in self.functions.items():
            if getattr(fn, "batched", False):
                extra = dict(self.kwargs.get(name, {}))
                if "device" in parameters(fn)[0]:
                    extra["device"] = device
                outcomes[name] = call_batched(fn, prompts, completions, rows, extra)
            elif self.workers is not None:
                key, payload = f"{name}@{id(fn)}", check_picklable(name, fn)
                calls += [(key, payload, fn, *s, arguments[name][i]) for i, s in enumerate(samples)]
            else:
                outcomes[name] = results = []
                for i, sample in enumerate(samples):
                    results.append(call_one(fn, *sample, arguments[name][i]))
                    if results[-1].problem is not None and self.policies.get(name) == "raise":
                        break  # it raises: the other samples need not be scored
        if calls:
            stop = frozenset(
                c[0] for c in calls if self.policies.get(c[0].rsplit("@", 1)[0]) == "raise"
            )
            try:
                done = iter(self.workers.run(calls, stop))
            except WorkersFailed as error:  # no call failed: the scoring cannot run at all
                raise RewardError(str(error)) from error
            for name, fn in self.functions.items():
                if not getattr(fn, "batched", False):
                    outcomes[name] = [next(done) for _ in samples]
        return {name: outcomes[name] for name in self.functions}
