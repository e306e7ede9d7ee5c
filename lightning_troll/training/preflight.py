"""Checks of TrollModule's options that need no model, run before anything loads.

Each refuses a value with one line that names the option, the value and what is allowed.
No Lightning here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from lightning_troll.engines.base import EngineConfig, engine_class
from lightning_troll.engines.behaviour import BEHAVIOUR_LOGPROBS
from lightning_troll.objectives import OBJECTIVES
from lightning_troll.objectives.advantages import (
    BASELINES,
    REWARD_SCALES,
    get_advantage_estimator,
)
from lightning_troll.objectives.options import AdvantageConfig
from lightning_troll.tasks.data.prompts import PLAIN_TEMPLATE
from lightning_troll.tasks.environments.options import environment_problem

__all__ = [
    "GROUP_ESTIMATORS",
    "check_episode_prompts",
    "check_fit_data",
    "check_module_options",
    "check_rollout_split",
    "episode_rows_problem",
    "field_of",
    "task_rewards",
]

GROUP_ESTIMATORS = frozenset(BASELINES)
"""The built-in estimators: each subtracts a baseline from its prompt's group of G completions,
so G = 1 leaves no signal. An estimator of one's own may work with G = 1."""


def check_module_options(
    objective: str, advantages: Any, group_size: int, engine: Any = None
) -> None:
    """Refuses an unknown objective, estimator, reward scale, behaviour-log-prob source or
    rollout engine (or one that is not installed), and a group size that is not a whole number
    >= 1. ``advantages`` and ``engine``: the records, or the command line's dicts of them."""
    estimator = field_of(advantages, AdvantageConfig, "estimator")
    scale_rewards = field_of(advantages, AdvantageConfig, "scale_rewards")
    if objective not in OBJECTIVES:
        raise ValueError(f"model.objective must be one of {sorted(OBJECTIVES)}; got {objective!r}")
    try:
        get_advantage_estimator(estimator)
    except ValueError as error:
        raise ValueError(f"model.advantages.{error}") from None
    if scale_rewards not in (None, *REWARD_SCALES):
        raise ValueError(
            f"model.advantages.scale_rewards must be one of {sorted(REWARD_SCALES)} or null; got "
            f"{scale_rewards!r}"
        )
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"model.group_size must be an integer >= 1; got {group_size!r}")
    if group_size < 2 and estimator in GROUP_ESTIMATORS:
        raise ValueError(
            f"model.group_size={group_size}: the estimator {estimator!r} compares each completion "
            "with the others sampled for its prompt, so it needs at least 2 (8 is usual); with 1 "
            "every advantage is 0 (or undefined) and nothing trains"
        )
    behaviour_logprobs = field_of(engine, EngineConfig, "behaviour_logprobs")
    if behaviour_logprobs not in BEHAVIOUR_LOGPROBS:
        raise ValueError(
            f"model.engine.behaviour_logprobs must be one of {list(BEHAVIOUR_LOGPROBS)}; got "
            f"{behaviour_logprobs!r}"
        )
    engine_class(field_of(engine, EngineConfig, "name"))


def field_of(record: Any, kind: type, name: str) -> Any:
    """The field ``name`` of ``record``: an option record of the dataclass ``kind``, the command
    line's dict of one, or None; where the record is None, or lacks the field or holds null
    there, the default ``kind`` declares (one source of truth for it)."""
    (field,) = [f for f in dataclasses.fields(kind) if f.name == name]
    default = field.default
    if record is None:
        return default
    value = record.get(name) if isinstance(record, dict) else getattr(record, name, None)
    return default if value is None else value


def task_rewards(rewards: dict[str, float] | None, source: object) -> dict[str, float]:
    """The rewards a run trains on: ``rewards`` when given; the TinyMath reward for the built-in
    TinyMath data (``data.source: tinymath``); for any other data, a refusal saying how to name one.
    """
    if rewards is not None:
        return dict(rewards)
    if source == "tinymath":
        return {"tinymath": 1.0}
    raise ValueError(
        f"model.rewards is not set, and only the built-in TinyMath data has a reward of its own "
        f"(data.source={source!r}); name one in the config, e.g. model.rewards: "
        "{my_reward:score: 1.0} for score(prompt, completion, row) -> float in my_reward.py beside "
        "it, or a built-in: {last_number: 1.0}, {gsm8k: 1.0}, {boxed: 1.0}"
    )


def check_rollout_split(minibatch_size: int | None, batch_size: int, group_size: int) -> None:
    """Refuses a ``data.batch_size`` below 1, and a minibatch larger than the rollout
    (``data.batch_size`` prompts x ``model.group_size`` completions per process: it would train
    on the whole rollout at once) or that does not divide it (the last step would be smaller,
    and a rollout would take more optimiser steps than ``trainer.max_steps`` counts on)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            f"data.batch_size must be an integer >= 1 (prompts per rollout); got {batch_size!r}"
        )
    rollout = batch_size * group_size
    if minibatch_size is not None and minibatch_size <= rollout and rollout % minibatch_size:
        divisors = [d for d in range(1, rollout + 1) if rollout % d == 0]
        steps = rollout // minibatch_size
        raise ValueError(
            f"model.optimization.minibatch_size={minibatch_size} does not divide a rollout of "
            f"{rollout} sequences (data.batch_size={batch_size} x model.group_size={group_size}): "
            f"{steps} step{'s' if steps > 1 else ''} of {minibatch_size} sequences would leave a "
            f"last one of {rollout % minibatch_size}; choose one of {divisors}"
        )
    if minibatch_size is not None and minibatch_size > rollout:
        raise ValueError(
            f"model.optimization.minibatch_size={minibatch_size} is larger than a rollout: "
            f"data.batch_size={batch_size} prompts x model.group_size={group_size} completions = "
            f"{rollout} sequences; lower it to at most {rollout} (null: the whole rollout), or "
            "raise data.batch_size"
        )


def check_fit_data(
    rewards: dict[str, float] | None,
    minibatch_size: int | None,
    group_size: int,
    data: object,
    episodes: object = None,
) -> None:
    """The module's options against the DataModule it fits on (``data``): a reward for data other
    than TinyMath (:func:`task_rewards`), a minibatch no larger than the rollout, no prompt
    formatting that episodes would not use (:func:`check_episode_prompts`)."""
    if rewards is None:
        task_rewards(None, getattr(data, "source", type(data).__name__))
    batch_size = getattr(data, "batch_size", None)
    if isinstance(batch_size, int):
        check_rollout_split(minibatch_size, batch_size, group_size)
    check_episode_prompts(
        episodes, getattr(data, "template", PLAIN_TEMPLATE), getattr(data, "system_prompt", None)
    )
    problem = episode_rows_problem(episodes)
    for split in ("train", "val") if problem is not None else ():
        for i, item in enumerate(getattr(data, f"{split}_items", None) or ()):
            why = problem(item.row)
            if why is not None:
                raise ValueError(f"data: {split} row {i}: {why}")


def episode_rows_problem(episodes: Any) -> Callable[[Mapping[str, Any]], str | None] | None:
    """What each data row must meet for ``model.episodes`` (its config, or the command's section
    of it): with several environments, a choice among them (why a row does not make one, or
    None); None where the rows need nothing."""
    if episodes is None:
        return None
    get = getattr(episodes, "get", None)
    environment = get("environment") if callable(get) else getattr(episodes, "environment", None)
    if not isinstance(environment, Mapping):
        return None
    names = list(environment)
    return lambda row: environment_problem(row, names)


def check_episode_prompts(episodes: object, template: str, system_prompt: str | None) -> None:
    """Refuses ``data.template`` and ``data.system_prompt`` with ``model.episodes``: an episode's
    environment writes its conversation from the row (its ``reset``), so neither would reach the
    model."""
    if episodes is None:
        return
    for option, value, unset in (
        ("data.system_prompt", system_prompt, None),
        ("data.template", template, PLAIN_TEMPLATE),
    ):
        if value != unset:
            raise ValueError(
                f"{option}={value!r} does not apply to model.episodes: an episode's environment "
                "writes its conversation from the data row (the built-in one from the row's "
                f"prompt, unformatted), so the model would never read it; set {option} to "
                f"{unset if unset is None else repr(unset)}, and put a system message or the "
                "wording in the rows' messages, or in the environment's reset"
            )
