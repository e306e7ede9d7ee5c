"""Rewards: the registry and scorer (``model.rewards``), the built-in reward functions and their
options.

- :mod:`~lightning_troll.tasks.rewards.registry`: :func:`register_reward`, import paths,
  :class:`RewardScorer`;
- :mod:`~lightning_troll.tasks.rewards.functions`: the built-ins (``tinymath``, ``gsm8k``, ``boxed``,
  ``last_number``, ``math_verify``);
- :mod:`~lightning_troll.tasks.rewards.options`: :class:`RewardOptions` (``model.reward_options``),
  ``overlong``;
- :mod:`~lightning_troll.tasks.rewards.calls` and :mod:`~lightning_troll.tasks.rewards.workers`: one call and
  what a failed one scores; calls in worker processes with a timeout;
- :mod:`~lightning_troll.tasks.rewards.reward_model`: :class:`RewardModel`, a classifier as a reward;
- :mod:`~lightning_troll.tasks.rewards.trl_form`: reward functions written for TRL, called as they are.
"""

from lightning_troll.tasks.rewards.options import RewardOptions
from lightning_troll.tasks.rewards.registry import (
    REWARD_FUNCTIONS,
    RewardError,
    RewardFunction,
    RewardOutput,
    RewardScorer,
    RewardWarning,
    boxed,
    extract_boxed,
    gsm8k,
    last_number,
    math_verify,
    overlong,
    register_reward,
    resolve_reward,
    reward_tag,
    tinymath,
)
from lightning_troll.tasks.rewards.reward_model import RewardModel

__all__ = [
    "REWARD_FUNCTIONS",
    "RewardError",
    "RewardFunction",
    "RewardModel",
    "RewardOptions",
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
