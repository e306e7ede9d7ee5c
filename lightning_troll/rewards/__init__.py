"""Rewards: the registry and scorer (``model.rewards``), the built-in reward functions and their
options.

- :mod:`~lightning_troll.rewards.registry`: :func:`register_reward`, import paths,
  :class:`RewardScorer`;
- :mod:`~lightning_troll.rewards.functions`: the built-ins (``tinymath``, ``gsm8k``, ``boxed``,
  ``last_number``);
- :mod:`~lightning_troll.rewards.options`: keyword options (``model.reward_kwargs``), ``overlong``.
"""

from lightning_troll.rewards.registry import (
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
    overlong,
    register_reward,
    resolve_reward,
    reward_tag,
    tinymath,
)

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
    "overlong",
    "register_reward",
    "resolve_reward",
    "reward_tag",
    "tinymath",
]
