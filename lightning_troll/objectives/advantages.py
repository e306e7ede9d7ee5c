"""Group-relative advantage estimators for G samples per prompt.

Notation: B = P * G rewards, P prompts with G samples each, laid out prompt-major (rows
``i * G .. i * G + G - 1`` belong to prompt i). Every estimator maps ``(B,)`` rewards to ``(B,)``
advantages. A group whose rewards are all equal carries no signal: its advantages are exactly 0.

    grpo          (r - mean_g) / std_g                          (GRPO)
    dr_grpo       r - mean_g                                    (Dr.GRPO: no std division)
    rloo          r - mean of the other G - 1 rewards           (RLOO)
    reinforce_pp  (r - mean_g) / std over the whole batch       (REINFORCE++-baseline)

``std`` is the sample standard deviation (Bessel's correction), and every division adds
``STD_EPS = 1e-6`` to it as the official GRPO code does (REINFORCE++'s batch whitening excepted).
Register your own with :func:`register_advantage_estimator`.

Reward scaling (``scale_rewards``, TRL's names) replaces an estimator's own scaling: the
estimator's baseline is kept (``BASELINES``: the group mean, or RLOO's leave-one-out mean) and
the result is divided by one of ``REWARD_SCALES``:

    group   std of the group's rewards + 1e-6     (GRPO's own)
    batch   std of all B rewards + 1e-6           (batch-level scaling)
    none    1                                     (Dr.GRPO's choice)

A registered estimator without an entry in ``BASELINES`` is its own baseline.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "BASELINES",
    "REWARD_SCALES",
    "STD_EPS",
    "compute_advantages",
    "flat_groups",
    "dr_grpo",
    "get_advantage_estimator",
    "grpo",
    "overflow_problem",
    "register_advantage_estimator",
    "reinforce_pp",
    "rloo",
]

AdvantageEstimator = Callable[[Tensor, int], Tensor]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}

# A group (or batch) whose reward spread is below this counts as having none.
_ZERO_STD = 1e-8
# Added to a standard deviation before dividing by it, as the official GRPO code does.
STD_EPS = 1e-6


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator: adds ``fn(rewards (B,), group_size) -> advantages (B,)`` under ``name``."""

    def add(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"an advantage estimator named {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return add


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"estimator must be one of {sorted(ADVANTAGE_ESTIMATORS)}; got {name!r}")
    return ADVANTAGE_ESTIMATORS[name]


def compute_advantages(
    name: str, rewards: Tensor, group_size: int, scale_rewards: str | None = None
) -> Tensor:
    """Advantages (B,) of rewards (B,) by the estimator ``name``.

    ``scale_rewards`` None keeps the estimator's own scaling; ``group``, ``batch`` or ``none``
    divide the estimator's baseline-subtracted rewards (``BASELINES``) by that scale instead.
    """
    estimator = get_advantage_estimator(name)
    if scale_rewards is None:
        return estimator(rewards, group_size)
    if scale_rewards not in REWARD_SCALES:
        raise ValueError(
            f"scale_rewards must be one of {sorted(REWARD_SCALES)} or None; got {scale_rewards!r}"
        )
    centred = BASELINES.get(name, estimator)(rewards, group_size)  # (B,)
    groups = _groups(rewards, group_size)  # (P, G)
    return (centred.view_as(groups) / REWARD_SCALES[scale_rewards](groups)).flatten()


def flat_groups(rewards: Tensor, group_size: int) -> Tensor:
    """(B,) rewards -> (P,) bool, True where a group's rewards have no spread: under every
    group-relative estimator its advantages are exactly 0, so it carries no gradient."""
    groups = _groups(rewards, group_size)  # (P, G)
    return (groups.amax(-1) - groups.amin(-1)) <= _ZERO_STD


def _groups(rewards: Tensor, group_size: int, min_size: int = 1) -> Tensor:
    """(B,) -> (P, G) in float32 or wider, after checking shape, divisibility and finiteness."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor (B,); got shape {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < min_size:
        raise ValueError(f"group_size must be an integer >= {min_size}; got {group_size!r}")
    if rewards.numel() % group_size:
        raise ValueError(
            f"group_size={group_size} must divide the number of rewards; got {rewards.numel()} "
            f"rewards (use a multiple of {group_size})"
        )
    if not bool(rewards.isfinite().all()):
        bad = (~rewards.isfinite()).nonzero().flatten().tolist()
        raise ValueError(f"rewards must be finite; got NaN or inf at rows {bad[:10]}")
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    return rewards.to(dtype).view(-1, group_size)


def _centred(groups: Tensor) -> Tensor:
    """r - group mean, exactly 0 in groups without spread."""
    flat = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) <= _ZERO_STD
    return torch.where(flat, 0.0, groups - groups.mean(-1, keepdim=True))


def _scaled(values: Tensor, std: Tensor) -> Tensor:
    return torch.where(std > _ZERO_STD, values / std.clamp_min(_ZERO_STD), 0.0)


def _std(values: Tensor, dim: int | None = None) -> Tensor:
    """Sample std over ``dim`` (all entries when None), kept for broadcasting; 0 for one value."""
    count = values.numel() if dim is None else values.shape[dim]
    if count < 2:
        shape = [1] * values.dim() if dim is None else [*values.shape[:-1], 1]
        return values.new_zeros(shape)
    if dim is None:
        return values.std().reshape([1] * values.dim())
    return values.std(dim, keepdim=True)


REWARD_SCALES: dict[str, Callable[[Tensor], Tensor]] = {
    # (P, G) rewards -> what the baseline-subtracted rewards are divided by, broadcastable
    "group": lambda groups: _std(groups, -1) + STD_EPS,  # (P, 1)
    "batch": lambda groups: _std(groups) + STD_EPS,  # (1, 1)
    "none": lambda groups: groups.new_ones(1, 1),  # (1, 1)
}


@register_advantage_estimator("grpo")
def grpo(rewards: Tensor, group_size: int) -> Tensor:
    """(r - group mean) / (group std + 1e-6), sample std; G >= 2."""
    groups = _groups(rewards, group_size, min_size=2)  # (P, G)
    return (_centred(groups) / REWARD_SCALES["group"](groups)).flatten()


@register_advantage_estimator("dr_grpo")
def dr_grpo(rewards: Tensor, group_size: int) -> Tensor:
    """r - group mean (Dr.GRPO removes the std division)."""
    return _centred(_groups(rewards, group_size)).flatten()


@register_advantage_estimator("rloo")
def rloo(rewards: Tensor, group_size: int) -> Tensor:
    """r - mean of the other G - 1 rewards = G / (G - 1) * (r - group mean); G >= 2."""
    groups = _groups(rewards, group_size, min_size=2)
    return (_centred(groups) * (group_size / (group_size - 1))).flatten()


@register_advantage_estimator("reinforce_pp")
def reinforce_pp(rewards: Tensor, group_size: int) -> Tensor:
    """REINFORCE++-baseline: r - group mean, divided by the std of those over the whole batch."""
    centred = _centred(_groups(rewards, group_size)).flatten()  # (B,)
    if centred.numel() < 2:
        return torch.zeros_like(centred)
    return _scaled(centred, centred.std())


BASELINES: dict[str, AdvantageEstimator] = {
    # estimator -> the same estimator without its own scaling, for ``scale_rewards``
    "grpo": dr_grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": dr_grpo,
}


def overflow_problem(rewards: Tensor, advantages: Tensor) -> str | None:
    """Why a rollout's rewards (B,) cannot train in float32, or None: the square of their spread
    overflows (beyond about 1.8e19 apart; a variance, and the gradient of a loss that weighs
    log-probs by such advantages, are then infinite), or the advantages (B,) are not finite."""
    finite = rewards[torch.isfinite(rewards)]
    if finite.numel():
        spread = (finite.float().max() - finite.float().min()) ** 2
        if torch.isfinite(advantages).all() and torch.isfinite(spread):
            return None
        low, high = float(finite.min()), float(finite.max())
        return (
            f"the rewards of this rollout range from {low:g} to {high:g}, whose spread squared "
            "overflows float32 (rewards are at most about 1.8e19 apart): the advantages' and the "
            "gradient's arithmetic would be infinite; scale the rewards down (the weights of "
            "model.rewards) or fix the reward"
        )
    return None if torch.isfinite(advantages).all() else "the advantages are not finite"
