"""Dynamic sampling (DAPO), truncated-completion masking and per-reward logging: the group
choice and padding by hand, whole rollouts, the cap, options and the logged metrics."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_troll.objectives.advantages import flat_groups
from lightning_troll.rollouts.dynamic_sampling import cat_sequences, choose_groups, group_rows
from lightning_troll.tasks.data.datamodule import collate_prompts
from lightning_troll.tasks.data.prompts import draw_prompts
from lightning_troll.tasks.rewards.options import RewardOptions
from lightning_troll.training.module import CorrectionsConfig, DynamicSamplingConfig
from tests.test_resume import logged
from tests.test_training import Recorder, make_data, make_module, make_trainer

BUDGET = "tests.reward_helpers:used_the_budget"
LENGTH = "tests.reward_helpers:length_reward"


# --------------------------------------------------------------------------------------------
# The pieces, by hand
# --------------------------------------------------------------------------------------------


def test_choose_groups_keeps_the_first_informative_groups_in_sampling_order():
    """Round 0: groups 1 and 3 informative; round 1: 0 and 2. Target 3: groups 1 and 3 of round 0
    and group 0 of round 1 (sampling order), three informative."""
    rounds = [torch.tensor([False, True, False, True]), torch.tensor([True, False, True, False])]
    kept, informative = choose_groups(rounds, 3)
    assert [k.tolist() for k in kept] == [[1, 3], [0]]
    assert informative == 3


def test_choose_groups_fills_up_with_groups_without_spread():
    """One informative group among 2 x 3: it is kept, then the first flat groups (0 and 1 of
    round 0) fill the rollout to 3 groups."""
    rounds = [torch.tensor([False, False, False]), torch.tensor([False, True, False])]
    kept, informative = choose_groups(rounds, 3)
    assert [k.tolist() for k in kept] == [[0, 1], [1]]
    assert informative == 1
    assert group_rows(torch.tensor([0, 2]), 3).tolist() == [0, 1, 2, 6, 7, 8]


def test_cat_sequences_pads_prompts_left_and_responses_right():
    """Part 1: S = 2, T = 1; part 2: S = 1, T = 3. The result has S = 2, T = 3, pad id 0."""
    a = (torch.tensor([[5, 6, 7]]), torch.tensor([[1, 1, 1]]), torch.tensor([[True]]))
    b = (
        torch.tensor([[8, 9, 10, 11]]),
        torch.tensor([[1, 1, 1, 0]]),
        torch.tensor([[True, True, False]]),
    )
    ids, attention, response = cat_sequences([a, b], pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 0, 0], [0, 8, 9, 10, 11]]
    assert attention.tolist() == [[1, 1, 1, 0, 0], [0, 1, 1, 1, 0]]
    assert response.tolist() == [[True, False, False], [True, True, False]]
    assert cat_sequences([a], pad_id=0) is a


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # the group estimators refuse a group of one first (an estimator of one's own may not)
        (
            {"dynamic_sampling": DynamicSamplingConfig(enabled=True), "group_size": 1},
            r"model.group_size=1: the estimator 'grpo'",
        ),
        (
            {"reward_options": RewardOptions(kwargs={"nope": {}})},
            r"model.reward_options.kwargs names 'nope', which is not one",
        ),
    ],
)
def test_bad_options_are_refused_when_the_module_is_built(tiny_model_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_module(tiny_model_dir, **kwargs)


def test_dynamic_sampling_needs_groups_whatever_the_estimator():
    from lightning_troll.rollouts.dynamic_sampling import check_dynamic_sampling

    with pytest.raises(ValueError, match=r"needs model.group_size >= 2"):
        check_dynamic_sampling(DynamicSamplingConfig(enabled=True), 1)
    check_dynamic_sampling(DynamicSamplingConfig(), 1)


def test_extra_prompts_depend_only_on_seed_and_purpose(tiny_model_dir):
    data = make_data(tiny_model_dir)
    data.setup("fit")
    first = draw_prompts(data.train_items, 4, 0, "dynamic-0-3-1")
    assert first.prompts == draw_prompts(data.train_items, 4, 0, "dynamic-0-3-1").prompts
    assert first.prompts != draw_prompts(data.train_items, 4, 0, "dynamic-0-3-2").prompts
    assert len(set(first.prompts)) == 4


# --------------------------------------------------------------------------------------------
# Rollouts
# --------------------------------------------------------------------------------------------


def collect(model_dir, seed=0, more=None, **options):
    module = make_module(model_dir, **options)
    data = make_data(model_dir)
    data.setup("fit")
    torch.manual_seed(seed)
    batch = collate_prompts(data.train_items[:4])
    extra = None
    if more:
        extra = lambda r: draw_prompts(data.train_items, 4, 0, f"test-{r}")  # noqa: E731
    return module, *module.collector.collect(batch, extra)


def test_mask_truncated_leaves_truncated_completions_out_of_the_loss(tiny_model_dir):
    """The same samples (same seed) with and without the mask: truncated rows lose every token,
    the others keep theirs; rewards and advantages do not change."""
    _, plain, _ = collect(tiny_model_dir)
    _, masked, _ = collect(tiny_model_dir, corrections=CorrectionsConfig(mask_truncated=True))
    truncated = plain.truncated
    assert truncated.any() and not truncated.all()
    assert torch.equal(masked.input_ids, plain.input_ids)
    assert not masked.response_mask[truncated].any()
    assert torch.equal(masked.response_mask[~truncated], plain.response_mask[~truncated])
    assert torch.equal(masked.advantages, plain.advantages)
    assert masked.old.num_rows == int(masked.response_mask.sum()) < plain.old.num_rows


def test_dynamic_sampling_keeps_only_informative_groups(tiny_model_dir):
    """The budget reward is often equal across a group of 4; with dynamic sampling the rollout
    holds 4 groups with spread, taken in sampling order from the rounds."""
    options = {"rewards": {BUDGET: 1.0}, "dynamic_sampling": DynamicSamplingConfig(max_rounds=6)}
    _, plain, _ = collect(tiny_model_dir, seed=1, **options)
    assert flat_groups(plain.rewards, 4).any(), "the case must have groups without spread"
    module, rollout, report = collect(tiny_model_dir, seed=1, more=True, **options)
    assert len(report.rounds) > 1 and not report.capped
    assert rollout.num_sequences == 16
    assert not flat_groups(rollout.rewards, 4).any()
    assert rollout.advantages.abs().view(4, 4).sum(-1).min() > 0
    # the kept groups are the first informative ones of the rounds, in order
    informative = [s.informative for s in report.rounds]
    first = [
        (r, g) for r, flags in enumerate(informative) for g in flags.nonzero().flatten().tolist()
    ][:4]
    expected = [report.rounds[r].prompts[g * 4] for r, g in first]
    assert report.kept.prompts[::4] == expected
    # the sequences are those sampled (prompts padded to the widest round)
    for i, (r, g) in enumerate(first):
        sampled = report.rounds[r]
        rows = slice(g * 4, g * 4 + 4)
        assert module.policies.decode(rollout.tokens[i * 4 : i * 4 + 4], rollout.response_mask[i * 4 : i * 4 + 4]) == sampled.completions[rows]  # fmt: skip
        torch.testing.assert_close(rollout.rewards[i * 4 : i * 4 + 4], sampled.rewards[rows])


def test_dynamic_sampling_stops_at_the_cap_and_fills_with_flat_groups(tiny_model_dir):
    """A constant reward: no group ever has spread; after 2 extra rounds the rollout is the
    first 4 groups sampled, with zero advantages."""
    options = {
        "rewards": {"tests.reward_helpers:constant": 1.0},
        "dynamic_sampling": DynamicSamplingConfig(max_rounds=2),
    }
    _, rollout, report = collect(tiny_model_dir, more=True, **options)
    assert len(report.rounds) == 3 and report.capped
    assert report.kept.prompts == report.rounds[0].prompts
    assert torch.equal(rollout.advantages, torch.zeros(16))


# --------------------------------------------------------------------------------------------
# Whole fits
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_dynamic_sampling_fit_logs_and_warns_once(tmp_path, tiny_model_dir):
    """Two rollouts with a constant reward and a cap of 1: both capped, one warning; prompts
    sampled 8 per rollout of 4 (frac_dropped 0.5), and the per-reward means are logged."""
    module = make_module(
        tiny_model_dir,
        rewards={"tests.reward_helpers:constant": 1.0, LENGTH: 0.0},
        dynamic_sampling=DynamicSamplingConfig(enabled=True, max_rounds=1),
    )
    recorder = Recorder()
    logger = CSVLogger(tmp_path, name="run", version=0)
    trainer = make_trainer(tmp_path, 2, recorder, logger=logger, limit_val_batches=0)
    with pytest.warns(UserWarning, match=r"dynamic sampling: after .*max_rounds=1") as caught:
        trainer.fit(module, datamodule=make_data(tiny_model_dir))
    assert len([w for w in caught if "dynamic sampling" in str(w.message)]) == 1
    rows = logged(tmp_path / "run" / "version_0")
    for step in (0, 1):
        assert rows[step]["dynamic_sampling/prompts_sampled"] == 8
        assert rows[step]["dynamic_sampling/rounds"] == 1
        assert rows[step]["dynamic_sampling/frac_dropped"] == 0.5
        assert rows[step]["reward/frac_zero_std"] == 1.0
        assert rows[step]["reward/tests.reward_helpers_constant/mean"] == 0.5
        assert rows[step]["reward/tests.reward_helpers_length_reward/mean"] > 0
    assert all(r.num_sequences == 16 for r in recorder.rollouts)


@pytest.mark.slow
def test_per_reward_means_are_those_of_the_sampled_completions(tmp_path, tiny_model_dir):
    """Two rewards, weights 1 and 0.5: reward/<name>/mean is the unweighted mean of that function
    over the rollout, reward/mean the weighted total's; validation logs them under val/."""
    module = make_module(tiny_model_dir, rewards={LENGTH: 1.0, BUDGET: 0.5})
    recorder = Recorder()
    logger = CSVLogger(tmp_path, name="run", version=0)
    trainer = make_trainer(tmp_path, 1, recorder, logger=logger)
    trainer.fit(module, datamodule=make_data(tiny_model_dir))
    rollout = recorder.rollouts[0]
    lengths = rollout.response_mask.sum(-1)
    budget = (lengths >= 4).float()
    texts = module.policies.decode(rollout.tokens, rollout.response_mask)
    chars = torch.tensor([float(len(t)) for t in texts])
    row = logged(tmp_path / "run" / "version_0")[0]
    assert row["reward/tests.reward_helpers_used_the_budget/mean"] == pytest.approx(
        budget.mean().item(), abs=1e-6
    )
    assert row["reward/tests.reward_helpers_length_reward/mean"] == pytest.approx(
        chars.mean().item(), abs=1e-5
    )
    assert row["reward/mean"] == pytest.approx((chars + 0.5 * budget).mean().item(), abs=1e-5)
    metrics = trainer.callback_metrics
    assert {
        "val/reward/tests.reward_helpers_length_reward/mean",
        "val/reward/tests.reward_helpers_used_the_budget/mean",
    } <= set(metrics)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_rounds": 0}, r"model.dynamic_sampling.max_rounds must be an integer >= 1; got 0"),
        ({"max_rounds": True}, r"model.dynamic_sampling.max_rounds must be an integer >= 1"),
        ({"enabled": "yes"}, r"model.dynamic_sampling.enabled must be true or false; got 'yes'"),
    ],
)
def test_dynamic_sampling_refuses_a_bad_record(fields, message):
    with pytest.raises(ValueError, match=message):
        DynamicSamplingConfig(**fields)
