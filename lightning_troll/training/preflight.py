"""Checks of TrollModule's options that need no model, run before anything loads.

Each refuses a value with one line that names the option, the value and what is allowed.
No Lightning here.
"""

from __future__ import annotations

from lightning_troll.objectives import OBJECTIVES
from lightning_troll.objectives.advantages import REWARD_SCALES, get_advantage_estimator
from lightning_troll.rollouts.behaviour import BEHAVIOUR_LOGPROBS

__all__ = ["check_module_options"]


def check_module_options(
    objective: str,
    estimator: str,
    scale_rewards: str | None,
    group_size: int,
    behaviour_logprobs: str,
) -> None:
    """Refuses an unknown objective, estimator, reward scale or behaviour-log-prob source, and a
    group size that is not a whole number >= 1."""
    if objective not in OBJECTIVES:
        raise ValueError(f"model.objective must be one of {sorted(OBJECTIVES)}; got {objective!r}")
    get_advantage_estimator(estimator)
    if scale_rewards not in (None, *REWARD_SCALES):
        raise ValueError(
            f"model.scale_rewards must be one of {sorted(REWARD_SCALES)} or null; got "
            f"{scale_rewards!r}"
        )
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"model.group_size must be an integer >= 1; got {group_size!r}")
    if behaviour_logprobs not in BEHAVIOUR_LOGPROBS:
        raise ValueError(
            f"model.behaviour_logprobs must be one of {list(BEHAVIOUR_LOGPROBS)}; got "
            f"{behaviour_logprobs!r}"
        )
