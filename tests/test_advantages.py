"""Advantage estimators: hand-computed groups, zero variance, registry and validation."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_troll.advantages import (
    ADVANTAGE_ESTIMATORS,
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
