"""Advantage estimators: hand-computed groups, zero variance, registry and validation."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_troll.objectives.advantages import (
    ADVANTAGE_ESTIMATORS,
    BASELINES,
    REWARD_SCALES,
    STD_EPS,
    compute_advantages,
    get_advantage_estimator,
    register_advantage_estimator,
)

REWARDS = torch.tensor([1.0, 0.0, 1.0, 1.0, 3.0, 3.0, 3.0, 3.0])  # two groups of G = 4


def test_grpo_by_hand():
    """Group 1: mean 0.75, sample std sqrt(0.25) = 0.5 -> [0.5, -1.5, 0.5, 0.5]; group 2 is flat."""
    got = compute_advantages("grpo", REWARDS, 4)
    torch.testing.assert_close(got, torch.tensor([0.5, -1.5, 0.5, 0.5, 0, 0, 0, 0]))


def test_dr_grpo_by_hand():
    got = compute_advantages("dr_grpo", REWARDS, 4)
    torch.testing.assert_close(got, torch.tensor([0.25, -0.75, 0.25, 0.25, 0, 0, 0, 0]))


def test_rloo_by_hand():
    """r_i minus the mean of the other three: 1 - 2/3, 0 - 1, ..."""
    got = compute_advantages("rloo", REWARDS, 4)
    expected = torch.tensor([1 - 2 / 3, 0 - 1, 1 - 2 / 3, 1 - 2 / 3, 0, 0, 0, 0])
    torch.testing.assert_close(got, expected)


def test_reinforce_pp_by_hand():
    """Centred [0.25, -0.75, 0.25, 0.25, 0, 0, 0, 0]: batch mean 0, sample std
    sqrt((3 * 0.0625 + 0.5625) / 7) = sqrt(0.75 / 7)."""
    got = compute_advantages("reinforce_pp", REWARDS, 4)
    std = math.sqrt(0.75 / 7)
    expected = torch.tensor([0.25, -0.75, 0.25, 0.25, 0, 0, 0, 0]) / std
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_zero_variance_gives_zero_without_nan(name):
    for rewards in (torch.full((6,), 0.1), torch.zeros(6), torch.tensor([1.0, 1, 1, 0, 0, 0])):
        got = compute_advantages(name, rewards, 3)
        assert torch.equal(got, torch.zeros(6)), (name, rewards)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_advantages_sum_to_zero_per_group(name):
    rewards = torch.randn(12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    got = compute_advantages(name, rewards, 4)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got.view(3, 4).sum(-1), torch.zeros(3, dtype=torch.float64))


def test_registry_is_extensible():
    @register_advantage_estimator("test_sign")
    def sign(rewards, group_size):
        return torch.sign(rewards - 0.5)

    try:
        assert get_advantage_estimator("test_sign") is sign
        torch.testing.assert_close(
            compute_advantages("test_sign", torch.tensor([1.0, 0.0]), 2), torch.tensor([1.0, -1.0])
        )
        with pytest.raises(ValueError, match=r"'test_sign' is already registered"):
            register_advantage_estimator("test_sign")(sign)
    finally:
        ADVANTAGE_ESTIMATORS.pop("test_sign")


def test_validation():
    with pytest.raises(
        ValueError,
        match=r"estimator must be one of \['dr_grpo', 'grpo', 'reinforce_pp', 'rloo'\]; got 'ppo'",
    ):
        compute_advantages("ppo", REWARDS, 4)
    with pytest.raises(ValueError, match=r"group_size=3 must divide the number of rewards; got 8"):
        compute_advantages("grpo", REWARDS, 3)
    with pytest.raises(ValueError, match=r"group_size must be an integer >= 2; got 1"):
        compute_advantages("grpo", REWARDS, 1)
    with pytest.raises(ValueError, match=r"group_size must be an integer >= 1; got 0"):
        compute_advantages("dr_grpo", REWARDS, 0)
    with pytest.raises(ValueError, match=r"rewards must be finite; got NaN or inf at rows \[1\]"):
        compute_advantages("grpo", torch.tensor([1.0, float("nan")]), 2)
    with pytest.raises(ValueError, match=r"rewards must be a 1-D tensor"):
        compute_advantages("grpo", REWARDS.view(2, 4), 4)


# --------------------------------------------------------------------------------------------
# Reward scaling (scale_rewards)
# --------------------------------------------------------------------------------------------

R64 = REWARDS.double()
CENTRED = torch.tensor([0.25, -0.75, 0.25, 0.25, 0, 0, 0, 0], dtype=torch.float64)


def test_grpo_adds_1e_6_to_the_std():
    """G = 2, rewards 0 and 1: mean 0.5, sample std sqrt(0.5); advantages -+0.5 / (std + 1e-6).
    Without the 1e-6 they would differ by about 7e-7."""
    got = compute_advantages("grpo", torch.tensor([0.0, 1.0], dtype=torch.float64), 2)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(got, torch.tensor([-a, a], dtype=torch.float64), rtol=0, atol=1e-12)
    assert STD_EPS == 1e-6


@pytest.mark.parametrize(
    ("scale", "divisor"),
    [
        ("group", torch.tensor([0.5 + 1e-6] * 4 + [1e-6] * 4, dtype=torch.float64)),
        # all 8 rewards: mean 15/8, squared deviations 3 * 0.765625 + 3.515625 + 4 * 1.265625
        ("batch", torch.full((8,), math.sqrt(10.875 / 7) + 1e-6, dtype=torch.float64)),
        ("none", torch.ones(8, dtype=torch.float64)),
    ],
)
@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "reinforce_pp"])
def test_scale_rewards_by_hand(scale, divisor, estimator):
    """Group-mean baselines (grpo, dr_grpo, reinforce_pp) give the same centred rewards; the
    scale alone decides what they are divided by, whatever the estimator's own scaling."""
    got = compute_advantages(estimator, R64, 4, scale_rewards=scale)
    torch.testing.assert_close(got, CENTRED / divisor, rtol=0, atol=1e-12)


def test_scale_rewards_keeps_rloo_leave_one_out_baseline():
    """RLOO's baseline (the mean of the other three) divided by the group std + 1e-6."""
    loo = torch.tensor([1 - 2 / 3, -1, 1 - 2 / 3, 1 - 2 / 3, 0, 0, 0, 0], dtype=torch.float64)
    got = compute_advantages("rloo", R64, 4, scale_rewards="group")
    expected = loo / torch.tensor([0.5 + 1e-6] * 4 + [1e-6] * 4, dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    none = compute_advantages("rloo", R64, 4, scale_rewards="none")
    assert torch.equal(none, compute_advantages("rloo", R64, 4))  # RLOO's own: no scaling
    torch.testing.assert_close(none, loo, rtol=0, atol=1e-12)


def test_scale_rewards_reproduces_the_estimators_own_choices():
    rewards = torch.randn(24, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    same = [("grpo", "group", "grpo"), ("dr_grpo", "none", "dr_grpo"), ("grpo", "none", "dr_grpo"),
            ("dr_grpo", "group", "grpo"), ("reinforce_pp", "none", "dr_grpo")]  # fmt: skip
    for estimator, scale, equals in same:
        got = compute_advantages(estimator, rewards, 4, scale_rewards=scale)
        torch.testing.assert_close(got, compute_advantages(equals, rewards, 4), rtol=0, atol=0)
    assert set(BASELINES) == {"grpo", "dr_grpo", "rloo", "reinforce_pp"}
    assert set(REWARD_SCALES) == {"group", "batch", "none"}


def test_scale_rewards_divides_a_registered_estimator_and_refuses_unknown_scales():
    @register_advantage_estimator("test_twice")
    def twice(rewards, group_size):
        return 2 * rewards

    try:
        got = compute_advantages("test_twice", torch.tensor([1.0, 3.0]), 2, scale_rewards="batch")
        torch.testing.assert_close(got, torch.tensor([2.0, 6.0]) / (math.sqrt(2) + 1e-6))
    finally:
        ADVANTAGE_ESTIMATORS.pop("test_twice")
    message = r"scale_rewards must be one of \['batch', 'group', 'none'\] or None; got 'std'"
    with pytest.raises(ValueError, match=message):
        compute_advantages("grpo", REWARDS, 4, scale_rewards="std")
    one = compute_advantages("dr_grpo", torch.tensor([1.0]), 1, scale_rewards="batch")
    assert torch.equal(one, torch.zeros(1)), "a single reward has no spread"


def test_a_dropped_reward_grows_grpo_advantages_and_shrinks_rloo_ones_as_the_docs_say():
    """Rewards 1, 0, 0 and a dropped one, filled with the others' mean 1/3 (docs/rewards.md):
    GRPO gives the 1 an advantage of 1.41 (1.15 over the three alone), RLOO 0.89 (1 alone)."""
    from lightning_troll.rollouts.samples import filled_rewards
    from lightning_troll.tasks.rewards.registry import RewardOutput

    scored = RewardOutput(torch.tensor([1.0, 0.0, 0.0, 5.0]), {}, torch.tensor([1, 1, 1, 0]) > 0)
    filled = filled_rewards(scored, 4)
    assert filled.tolist() == pytest.approx([1.0, 0.0, 0.0, 1 / 3])
    three = torch.tensor([1.0, 0.0, 0.0])
    assert compute_advantages("grpo", filled, 4)[0].item() == pytest.approx(1.41, abs=0.005)
    assert compute_advantages("grpo", three, 3)[0].item() == pytest.approx(1.15, abs=0.005)
    assert compute_advantages("rloo", filled, 4)[0].item() == pytest.approx(8 / 9)
    assert compute_advantages("rloo", three, 3)[0].item() == pytest.approx(1.0)
