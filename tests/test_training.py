"""The training system: whole fits of a tiny model, callbacks, invariants, logging and faults."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_troll.callbacks import (
    OldPolicyRefresh,
    RolloutGeneration,
    SparsityCoverageMonitor,
    TrustRegionMonitor,
)
from lightning_troll.callbacks.refresh_options import one_step_trap
from lightning_troll.engines.sampling import SamplingConfig
from lightning_troll.objectives import ClipConfig, ClipStats, LossConfig, TrollStats
from lightning_troll.tasks.data.datamodule import PromptDataModule
from lightning_troll.tasks.rewards.options import RewardOptions
from lightning_troll.tasks.rewards.registry import RewardError
from lightning_troll.training.module import (
    AdvantageConfig,
    OptimizationConfig,
    TrollModule,
    TrustRegionConfig,
)

pytestmark = pytest.mark.slow  # whole fits: seconds each


class Recorder(Callback):
    """Keeps every rollout and the statistics of every optimiser step, per rollout."""

    def __init__(self) -> None:
        self.rollouts, self.stats = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.rollouts.append(pl_module.rollout)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.stats.append(list(pl_module.last_stats))


def sgd(lr):
    return lambda params: torch.optim.SGD(params, lr=lr)


def make_module(model_dir: Path, **kwargs) -> TrollModule:
    options = {
        "model": str(model_dir),
        "group_size": 4,
        "sampling": SamplingConfig(max_new_tokens=4),
        # an untrained model never answers right; completion length gives rewards that vary
        "rewards": {"tests.reward_helpers:length_reward": 1.0},
        "optimizer": lambda params: torch.optim.AdamW(params, lr=1e-3),
    }
    options.update(kwargs)
    return TrollModule(**options)


def make_data(model_dir: Path, **kwargs) -> PromptDataModule:
    options = {"source": "tinymath", "tokenizer": str(model_dir), "batch_size": 4, "num_train": 64}
    options.update({"num_val": 8, "val_batch_size": 8}, **kwargs)
    return PromptDataModule(**options)


def make_trainer(tmp_path: Path, max_steps: int, *extra: Callback, **kwargs) -> Trainer:
    callbacks = [
        RolloutGeneration(log_samples=2, log_samples_every_n_rollouts=1),
        OldPolicyRefresh(),
        TrustRegionMonitor(histogram_every_n_rollouts=1),
        SparsityCoverageMonitor(),
        *extra,
    ]
    options = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": max_steps,
        "logger": TensorBoardLogger(tmp_path, name="run"),
        "callbacks": callbacks,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "log_every_n_steps": 1,
        "limit_val_batches": 1,
        "val_check_interval": max_steps,
        "check_val_every_n_epoch": None,
    }
    options.update(kwargs)
    return Trainer(**options)


def fit(tmp_path, model_dir, max_steps=3, module=None, extra=(), seed=0, **trainer_kwargs):
    torch.manual_seed(seed)
    module = module or make_module(model_dir)
    recorder = Recorder()
    trainer = make_trainer(tmp_path, max_steps, recorder, *extra, **trainer_kwargs)
    trainer.fit(module, datamodule=make_data(model_dir))
    return trainer, module, recorder


def test_fit_logs_the_documented_tags(tmp_path, tiny_model_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer, _, recorder = fit(tmp_path, tiny_model_dir, max_steps=3)
    assert len(recorder.stats) == 3
    files = list(Path(trainer.logger.log_dir).glob("events.out.tfevents.*"))
    assert files
    events = EventAccumulator(str(trainer.logger.log_dir), size_guidance={"tensors": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    documented = {
        "trust_region/kl_before_mean", "trust_region/kl_before_max",
        "trust_region/kl_after_mean", "trust_region/kl_after_max", "trust_region/bound",
        "trust_region/active_frac", "trust_region/infeasible_frac", "trust_region/eta_mean",
        "trust_region/eta_max",
        "trust_region/max_violation", "sparsity/coverage_mean", "sparsity/coverage_min",
        "sparsity/coverage_max", "sparsity/support_min", "sparsity/support_mean",
        "sparsity/support_max", "reward/mean", "reward/std",
        "reward/frac_zero_std", "completion/mean_length", "completion/max_length",
        "completion/truncated_frac", "loss/policy", "loss/regression", "loss/total",
        "entropy", "grad_norm", "val/accuracy", "val/reward", "time/rollout", "time/iteration",
    }  # fmt: skip
    assert documented <= scalars, documented - scalars
    assert len(events.Scalars("reward/mean")) == 3
    for name in ("coverage", "support"):  # min <= mean <= max at every rollout
        low, mean, high = (
            [e.value for e in events.Scalars(f"sparsity/{name}_{stat}")]
            for stat in ("min", "mean", "max")
        )
        assert len(low) == len(mean) == len(high) == 3
        assert all(a <= b <= c for a, b, c in zip(low, mean, high, strict=True)), name
        assert all(a >= 1 for a in low) if name == "support" else all(c <= 1 + 1e-5 for c in high)
    bound = events.Scalars("trust_region/bound")
    assert all(e.value == pytest.approx(0.05) for e in bound)
    for sample, whole in zip(
        events.Scalars("time/rollout"), events.Scalars("time/iteration"), strict=True
    ):
        assert 0 < sample.value < whole.value
    # finite logits: every token's bound is reachable
    assert [e.value for e in events.Scalars("trust_region/infeasible_frac")] == [0.0] * 3
    assert {"trust_region/kl_after_per_token", "trust_region/kl_before_per_token"} <= set(
        events.Tags()["histograms"]
    )
    tensors = set(events.Tags()["tensors"])
    assert "samples/text_summary" in tensors
    assert "custom_scalars__config__" in tensors


def test_first_minibatch_of_each_rollout_is_on_policy_and_the_bound_holds(tmp_path, tiny_model_dir):
    module = make_module(
        tiny_model_dir,
        optimization=OptimizationConfig(epochs_per_rollout=2, minibatch_size=4),
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-2),
    )
    _, _, recorder = fit(tmp_path, tiny_model_dir, max_steps=16, module=module)
    assert len(recorder.stats) == 2 and all(len(s) == 8 for s in recorder.stats)
    for steps in recorder.stats:
        first = steps[0]
        assert isinstance(first, TrollStats)
        torch.testing.assert_close(
            first.token_ratio, torch.ones_like(first.token_ratio), rtol=0, atol=1e-5
        )
        assert first.projection.kl_before.max() < 1e-5
        for stats in steps:
            assert (stats.projection.kl_after <= 0.05 * (1 + 1e-4)).all()
    later = torch.cat([s.token_ratio for steps in recorder.stats for s in steps[4:]])
    assert (later - 1).abs().max() > 1e-3, "later minibatches are off-policy"


def test_keep_sampled_token_reaches_the_projection_and_the_cached_rows(tiny_model_dir):
    """Two tokens carry the mass (max_tokens 2); the sampled token 9 joins the cached old rows
    only with keep_sampled_token (the default)."""
    logits = torch.tensor([[5.0, 4.0] + [0.0] * 15])  # (1, V = 17)
    for keep in (True, False):
        # the official support always holds the sampled token: keep=False needs the union
        support = "official" if keep else "union"
        region = TrustRegionConfig(
            max_tokens=2, mass_delta=0.0, keep_sampled_token=keep, support=support
        )
        module = make_module(tiny_model_dir, trust_region=region)
        assert module.objective.projection.keep_token is keep
        old = module.old_rows.sparsify(logits, torch.tensor([9]))
        assert sorted(old.indices[0].tolist()) == ([0, 1, 9] if keep else [0, 1])
    assert TrustRegionConfig().keep_sampled_token is True


def test_scale_rewards_reaches_the_advantages(tiny_model_dir):
    """grpo with scale_rewards none is Dr.GRPO; with batch, the centred rewards over the batch
    std + 1e-6: group 1 (mean 0.5) -> -+0.5, group 2 flat; the batch [0, 1, 1, 1] has mean 0.75
    and sample std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5."""
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    module = make_module(
        tiny_model_dir, group_size=2, advantages=AdvantageConfig(scale_rewards="none")
    )
    torch.testing.assert_close(
        module.global_batch.advantages(rewards),
        torch.tensor([-0.5, 0.5, 0.0, 0.0], dtype=torch.float64), rtol=0, atol=0,
    )  # fmt: skip
    module.global_batch.scale_rewards = "batch"
    expected = torch.tensor([-0.5, 0.5, 0.0, 0.0], dtype=torch.float64) / (0.5 + 1e-6)
    torch.testing.assert_close(
        module.global_batch.advantages(rewards), expected, rtol=0, atol=1e-12
    )


def test_old_policy_refresh_every_n_rollouts(tmp_path, tiny_model_dir):
    refresh = OldPolicyRefresh(every_n_rollouts=2)

    class Check(Callback):
        def __init__(self):
            self.same = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            pairs = zip(
                pl_module.policy.parameters(), pl_module.old_policy.parameters(), strict=True
            )
            self.same.append(all(torch.equal(a, b) for a, b in pairs))

    check = Check()
    torch.manual_seed(0)
    module = make_module(tiny_model_dir)
    callbacks = [RolloutGeneration(), refresh, check]
    trainer = make_trainer(tmp_path, 4, callbacks=callbacks, limit_val_batches=0)
    trainer.fit(module, datamodule=make_data(tiny_model_dir))
    # rollouts 1 and 3 start from a fresh snapshot, 2 and 4 from a lagging one
    assert check.same == [True, False, True, False]
    assert refresh.refreshes == 2 and refresh.rollouts == 4
    assert all(not p.requires_grad for p in module.old_policy.parameters())
    assert not module.old_policy.training
    restored = OldPolicyRefresh(every_n_rollouts=2)
    restored.load_state_dict(refresh.state_dict())
    assert restored.rollouts == 4 and restored.refreshes == 2


@pytest.mark.parametrize(
    ("epochs", "minibatch", "every_n", "stale", "traps"),
    [
        (1, None, 1, 0, True),  # the whole rollout in one step, refreshed every rollout
        (1, 32, 1, 0, True),  # a minibatch as large as the rollout
        (1, 16, 1, 0, False),  # two minibatches: the second is off-policy
        (2, None, 1, 0, False),  # a second epoch
        (1, None, 2, 0, False),  # a snapshot that lags
        (1, None, 1, 1, False),  # data sampled by the version before
    ],
)
def test_one_step_trap_is_named_with_the_options_that_change_it(
    epochs, minibatch, every_n, stale, traps
):
    message = one_step_trap(epochs, minibatch, 32, every_n, "troll", stale)
    assert (message is not None) == traps
    if traps:
        for option in (
            f"model.optimization.minibatch_size={minibatch}",
            "model.optimization.minibatch_size below 32",
            "model.optimization.epochs_per_rollout above 1",
            "old_policy.every_n_rollouts above 1",
            "old_policy.max_staleness above 0",
            "TROLL's projection never acts",
        ):
            assert option in message, option
    clip = one_step_trap(1, None, None, 1, "clip")
    assert "the clip never acts" in clip and "one minibatch of the rollout" in clip


@pytest.mark.parametrize(
    ("epochs", "minibatch", "every_n", "stale", "traps"),
    [
        (1, None, 1, 4, True),  # stale data, but the old policy is the current weights
        (1, None, 2, 0, True),  # a lagging snapshot does not help either
        (1, 16, 1, 4, False),  # two minibatches: the second steps away from the anchor
        (2, None, 1, 4, False),  # a second epoch
    ],
)
def test_one_step_trap_under_the_proximal_anchor_names_only_what_helps(
    epochs, minibatch, every_n, stale, traps
):
    """Under ``model.corrections.anchor: proximal`` the old policy is the current weights before the
    rollout's update, so staleness and a lagging snapshot leave one step per rollout on-policy;
    the warning names only the options that change that."""
    message = one_step_trap(epochs, minibatch, 32, every_n, "troll", stale, "proximal")
    assert (message is not None) == traps
    if traps:
        assert "model.corrections.anchor='proximal'" in message
        assert "model.optimization.minibatch_size below 32" in message
        assert "or model.optimization.epochs_per_rollout above 1" in message
        assert "every_n_rollouts above" not in message and "max_staleness" not in message


def test_one_step_trap_warns_once_at_start_up(tmp_path, tiny_model_dir):
    """Three on-policy steps warn once; two minibatches per rollout do not warn."""
    with pytest.warns(UserWarning, match=r"every optimiser step is on-policy") as caught:
        fit(tmp_path / "a", tiny_model_dir, max_steps=3, limit_val_batches=0)
    assert len([w for w in caught if "on-policy" in str(w.message)]) == 1
    module = make_module(tiny_model_dir, optimization=OptimizationConfig(minibatch_size=8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path / "b", tiny_model_dir, max_steps=2, module=module, limit_val_batches=0)
    assert not [w for w in caught if "on-policy" in str(w.message)]


def eval_mode_notices(tmp_path, model_dir, module) -> list[str]:
    """Lightning's notices about modules in eval mode during a one-rollout fit of ``module``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path, model_dir, max_steps=1, module=module, limit_val_batches=0)
    return [str(w.message) for w in caught if "in eval mode" in str(w.message)]


def test_the_frozen_snapshots_alone_raise_no_eval_mode_notice(tmp_path, tiny_model_dir):
    """The snapshot and the reference are in eval mode on purpose; the Python API stays quiet."""
    module = make_module(tiny_model_dir, loss=LossConfig(ref_kl_coef=0.1))
    assert module.ref_policy is not None and not module.old_policy.training
    assert eval_mode_notices(tmp_path, tiny_model_dir, module) == []


def test_a_policy_module_left_in_eval_mode_keeps_the_notice(tmp_path, tiny_model_dir):
    """Only the frozen copies' count is dropped: a policy layer in eval mode is still reported."""
    module = make_module(tiny_model_dir)
    frozen = len(list(module.old_policy.modules()))
    module.policy.lm_head.eval()
    notices = eval_mode_notices(tmp_path, tiny_model_dir, module)
    assert notices == [
        f"Found {frozen + 1} module(s) in eval mode at the start of training. This may lead to "
        "unexpected behavior during training. If this is intentional, you can ignore this warning."
    ]


def test_training_without_the_rollout_callback_says_what_is_missing(tmp_path, tiny_model_dir):
    trainer = make_trainer(tmp_path, 1, callbacks=[], limit_val_batches=0)
    with pytest.raises(RuntimeError, match=r"add lightning_troll.callbacks.RolloutGeneration"):
        trainer.fit(make_module(tiny_model_dir), datamodule=make_data(tiny_model_dir))


def test_clip_objective_logs_clip_statistics(tmp_path, tiny_model_dir):
    module = make_module(tiny_model_dir, objective="clip")
    trainer, _, recorder = fit(tmp_path, tiny_model_dir, max_steps=2, module=module)
    assert all(isinstance(s, ClipStats) for steps in recorder.stats for s in steps)
    assert all(r.old is None for r in recorder.rollouts), "clipping caches no sparse old policy"
    metrics = trainer.callback_metrics
    assert {"clip/active_frac", "clip/approx_kl"} <= set(metrics)
    assert not any(k.startswith("trust_region/") for k in metrics)


class KLStart(Callback):
    """Each rollout's ``trust_region/kl_start_mean``, as the monitor before it logged it."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(float(trainer.callback_metrics["trust_region/kl_start_mean"]))


@pytest.mark.parametrize(
    ("objective", "staleness", "anchor"),
    [
        ("troll", 0, "behaviour"),
        ("troll", 2, "behaviour"),
        ("clip", 2, "behaviour"),
        ("troll", 2, "proximal"),
    ],
)
def test_kl_start_is_how_stale_the_data_is(tmp_path, tiny_model_dir, objective, staleness, anchor):
    """kl_start: the policy against the old policy the objective bounds, before a rollout's first
    step. On-policy it is 0 at every rollout. With the sampler two versions behind, rollout 1 is
    sampled by the weights it starts with (0); rollouts 2 and 3 by version 0, which the policy has
    left. Under the proximal anchor the old policy is the weights the rollout starts from: 0
    whatever the staleness (the stale sampler shows in rollout/proximal_is_weight_mean)."""
    from lightning_troll.objectives import CorrectionsConfig

    module = make_module(
        tiny_model_dir,
        objective=objective,
        corrections=CorrectionsConfig(anchor=anchor),
        optimization=OptimizationConfig(minibatch_size=8),
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-2),
    )
    seen = KLStart()
    callbacks = [
        RolloutGeneration(log_samples=0),
        OldPolicyRefresh(max_staleness=staleness),
        TrustRegionMonitor(histogram_every_n_rollouts=0, kl_start=True),
        seen,
    ]
    trainer = make_trainer(tmp_path, 6, callbacks=callbacks, limit_val_batches=0)
    torch.manual_seed(0)
    trainer.fit(module, datamodule=make_data(tiny_model_dir))
    assert len(seen.values) == 3  # two steps a rollout
    assert seen.values[0] == pytest.approx(0.0, abs=1e-6)
    for value in seen.values[1:]:
        fresh = staleness == 0 or anchor == "proximal"
        assert value == pytest.approx(0.0, abs=1e-6) if fresh else value > 1e-3


def test_kl_start_is_checked():
    with pytest.raises(ValueError, match=r"kl_start must be true or false; got 'yes'"):
        TrustRegionMonitor(kl_start="yes")


@pytest.mark.parametrize("objective", ["troll", "clip"])
def test_kl_end_is_the_last_weights_against_the_behaviour_policy(
    tmp_path, tiny_model_dir, objective
):
    """One rollout of 16 sequences in two steps of 8; kl_end is computed after the second from its
    minibatch. Recomputed here from full logits (the monitor's path is chunked from hidden
    states): the lumped KL of TrustRegionConfig's rule and the sampled r log r - r + 1."""
    from lightning_troll.rollouts.rollout import response_logits
    from lightning_troll.trust_region.projection import TrustRegionProjection

    module = make_module(
        tiny_model_dir,
        objective=objective,
        optimization=OptimizationConfig(minibatch_size=8, logits_chunk_size=5),
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-2),
    )
    recorder = Recorder()
    callbacks = [
        RolloutGeneration(log_samples=0),
        OldPolicyRefresh(),
        TrustRegionMonitor(histogram_every_n_rollouts=0, kl_end=True),
        recorder,
    ]
    trainer = make_trainer(tmp_path, 2, callbacks=callbacks, limit_val_batches=0)
    torch.manual_seed(0)
    trainer.fit(module, datamodule=make_data(tiny_model_dir))
    assert len(recorder.stats) == 1 and len(recorder.stats[0]) == 2
    last = module.minibatch_loop.last_minibatch
    assert last is not None and last.num_sequences == 8 and last.old is not None
    mask = last.response_mask
    tokens = last.tokens[mask]
    with torch.no_grad():
        logits = response_logits(
            module.policy, last.input_ids, last.attention_mask, mask.shape[1], last.temperature
        )[mask]
    lumped = TrustRegionProjection(0.05, 64, 1e-5).kl_to_old(logits, last.old, tokens)
    log_ratio = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    log_ratio = log_ratio - last.old_logprobs[mask]
    sampled = log_ratio.exp() * log_ratio - log_ratio.exp() + 1
    metrics = trainer.callback_metrics
    assert float(metrics["trust_region/kl_end_mean"]) == pytest.approx(
        float(lumped.mean()), rel=1e-4
    )
    assert float(metrics["trust_region/kl_end_max"]) == pytest.approx(float(lumped.max()), rel=1e-4)
    assert float(metrics["trust_region/kl_end_sampled"]) == pytest.approx(
        float(sampled.mean()), rel=1e-4
    )
    assert float(lumped.mean()) > 1e-4, "two steps at a large learning rate move the policy"
    assert recorder.rollouts[0].old is not None  # clipping caches the sparse rows for kl_end


def test_records_travel_whole_to_the_objective_and_its_rows(tiny_model_dir):
    """The objective is built from its records as from their fields one by one, and a clipping
    run's cached rows follow every field of ``model.trust_region`` (a union support without the
    sampled token included, which the official support refuses)."""
    from dataclasses import asdict

    from lightning_troll.objectives import ClipObjective, TrollObjective, TrustRegionConfig
    from lightning_troll.trust_region.projection import TrustRegionProjection

    region = TrustRegionConfig(eps=0.02, max_tokens=16, support="union", keep_sampled_token=False)
    loss = LossConfig(aggregation="seq_mean_token_sum_norm", entropy_coef=0.01)
    built = TrollObjective.from_records(region, loss, max_new_tokens=12)
    by_fields = TrollObjective(**asdict(region), **{**asdict(loss), "norm_length": 12})
    assert repr(built) == repr(by_fields) and built.norm_length == 12
    assert (built.alpha, built.entropy_coef, built.aggregation) == (1.0, 0.01, loss.aggregation)
    clip = ClipObjective.from_records(ClipConfig(0.1, 0.3), LossConfig(norm_length=7), 12)
    assert (clip.eps_low, clip.eps_high, clip.norm_length) == (0.1, 0.3, 7)
    rule = TrustRegionProjection.from_config(region)
    assert (rule.eps, rule.max_tokens, rule.support, rule.keep_token) == (0.02, 16, "union", False)
    module = make_module(tiny_model_dir, objective="clip", trust_region=region)
    module.keep_old_distributions()
    assert repr(module.old_rows.rule) == repr(rule)
    data = make_data(tiny_model_dir)
    data.setup("fit")
    rollout = module.collector.collect(next(iter(data.train_dataloader())))[0]
    assert rollout.old is not None and rollout.old.indices.shape[0] == int(
        rollout.response_mask.sum()
    )


def test_kl_to_behaviour_is_zero_before_any_step(tiny_model_dir):
    module = make_module(tiny_model_dir, objective="clip")
    data = make_data(tiny_model_dir)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert module.collector.collect(batch)[0].old is None
    with pytest.raises(ValueError, match="keep_old_distributions"):
        module.kl_to_behaviour(module.collector.collect(batch)[0])
    module.keep_old_distributions()  # the collector built before is built again, caching them
    rollout = module.collector.collect(batch)[0]
    assert rollout.old is not None
    lumped, sampled = module.kl_to_behaviour(rollout)
    assert lumped.shape == sampled.shape == (int(rollout.response_mask.sum()),)
    assert lumped.abs().max() < 1e-5 and sampled.abs().max() < 1e-5
    # a policy with dropout, in train mode as in a training step and under autocast: still 0,
    # measured as the behaviour policy is (eval mode, full precision)
    dropped = [m for m in module.policy.modules() if hasattr(m, "attention_dropout")]
    assert dropped
    for layer in dropped:
        layer.attention_dropout = 0.5
    module.policy.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lumped, sampled = module.kl_to_behaviour(rollout)
    assert lumped.abs().max() < 1e-5 and sampled.abs().max() < 1e-5
    assert module.policy.training  # its mode comes back


def test_drift_from_behaviour_gives_the_sampled_tokens_log_ratios(tiny_model_dir):
    """After the weights move, the log-ratio of each sampled token is its new log-prob less the
    cached one, and the sampled KL estimate is r log r - r + 1 of it."""
    from lightning_troll.rollouts.drift import drift_from_behaviour
    from lightning_troll.rollouts.forward import response_logits

    module = make_module(tiny_model_dir, objective="clip")
    module.keep_old_distributions()
    data = make_data(tiny_model_dir)
    data.setup("fit")
    rollout = module.collector.collect(next(iter(data.train_dataloader())))[0]
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    lumped, log_ratio = drift_from_behaviour(
        module.policy, rollout, module.old_rows.rule, module.optimization.logits_chunk_size
    )
    mask = rollout.response_mask
    with torch.no_grad():
        logits = response_logits(
            module.policy,
            rollout.input_ids,
            rollout.attention_mask,
            mask.shape[1],
            rollout.temperature,
        )
    new = logits[mask].float().log_softmax(-1).gather(-1, rollout.tokens[mask].unsqueeze(-1))
    expected = new.squeeze(-1) - rollout.old_logprobs[mask].float()
    assert log_ratio.abs().max() > 1e-2  # the noise moved the policy
    torch.testing.assert_close(log_ratio, expected, rtol=1e-4, atol=1e-5)
    same_lumped, sampled = module.kl_to_behaviour(rollout)
    ratio = log_ratio.exp()
    torch.testing.assert_close(same_lumped, lumped)
    torch.testing.assert_close(sampled, ratio * log_ratio - ratio + 1)


def test_gradient_accumulation_equals_the_whole_minibatch(tmp_path, tiny_model_dir):
    weights = []
    for micro in (None, 3):  # 16 sequences in parts of 3, 3, 3, 3, 3, 1
        module = make_module(
            tiny_model_dir,
            optimizer=sgd(0.5),
            optimization=OptimizationConfig(micro_batch_size=micro, gradient_clip_norm=None),
        )
        fit(tmp_path / str(micro), tiny_model_dir, max_steps=1, module=module, limit_val_batches=0)
        weights.append(torch.cat([p.detach().flatten() for p in module.policy.parameters()]))
    initial = make_module(tiny_model_dir).policy
    moved = weights[0] - torch.cat([p.detach().flatten() for p in initial.parameters()])
    assert moved.abs().max() > 1e-4
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=1e-6)


def test_non_finite_loss_skips_the_step_then_stops(tmp_path, tiny_model_dir):
    module = make_module(tiny_model_dir, optimization=OptimizationConfig(max_bad_steps=2))
    before = [p.detach().clone() for p in module.policy.parameters()]
    loss_of = module.loss_of

    def poisoned(rollout):
        loss, stats = loss_of(rollout)
        return loss * math.nan, stats

    module.loss_of = poisoned
    skipped = pytest.warns(RuntimeWarning, match=r"non-finite loss .* skipped, weights untouched")
    stopped = pytest.raises(RuntimeError, match=r"2 optimiser steps in a row had a non-finite loss")
    with skipped, stopped:
        fit(tmp_path, tiny_model_dir, max_steps=5, module=module, limit_val_batches=0)
    for old, new in zip(before, module.policy.parameters(), strict=True):
        assert torch.equal(old, new)


def test_a_failing_reward_names_the_function_and_sample(tmp_path, tiny_model_dir):
    module = make_module(tiny_model_dir, rewards={"tests.reward_helpers:raises": 1.0})
    with pytest.raises(RewardError, match=r"tests\.reward_helpers:raises.*sample 0"):
        fit(tmp_path, tiny_model_dir, max_steps=1, module=module, limit_val_batches=0)


def test_dropped_rewards_leave_the_loss(tmp_path, tiny_model_dir):
    module = make_module(
        tiny_model_dir,
        rewards={"tests.reward_helpers:none_for_even_lengths": 1.0},
        reward_options=RewardOptions(on_error="drop"),
    )
    with pytest.warns(UserWarning, match=r"drop"):
        _, _, recorder = fit(
            tmp_path, tiny_model_dir, max_steps=2, module=module, limit_val_batches=0
        )
    dropped = 0
    for rollout in recorder.rollouts:
        kept = rollout.response_mask.any(-1)
        dropped += int((~kept).sum())
        texts = module.policies.decode(rollout.tokens[kept], rollout.response_mask[kept])
        assert all(len(t) % 2 == 1 for t in texts), "even-length completions left the loss"
        assert torch.isfinite(rollout.advantages).all()
        # a dropped completion takes the mean reward of its group's valid ones (all 1.0 here)
        expected = kept.view(-1, 4).any(-1).float().repeat_interleave(4)
        assert torch.equal(rollout.rewards[~kept], expected[~kept])
    assert dropped > 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"advantages": AdvantageConfig("ppo")},
            r"^model.advantages.estimator must be one of .*; got 'ppo'",
        ),
        ({"objective": "kl"}, r"model.objective must be one of \['clip', 'troll'\]; got 'kl'"),
        ({"group_size": 0}, r"model.group_size must be an integer >= 1; got 0"),
        (
            {"advantages": AdvantageConfig(scale_rewards="std")},
            r"model.advantages.scale_rewards must be one of \['batch', 'group', 'none'\] or null; got 'std'",
        ),
        (
            {"trust_region": TrustRegionConfig(eps=-1.0)},
            r"^model.trust_region.eps must be a finite number > 0",
        ),
        (  # the other objective's options are checked too, not only when it is chosen
            {"clip": ClipConfig(eps_low=-1.0)},
            r"^model.clip.eps_low must be in \(0, 1\); got -1",
        ),
        (
            {"loss": LossConfig(entropy_coef=-1.0)},
            r"^model.loss.entropy_coef must be a finite number >= 0",
        ),
        ({"rewards": {"no_such_reward": 1.0}}, r"no_such_reward"),
    ],
)
def test_bad_module_options_fail_before_training(tiny_model_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_module(tiny_model_dir, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"epochs_per_rollout": 0}, r"model\.optimization\.epochs_per_rollout must be >= 1; got 0"),
        ({"minibatch_size": 0}, r"model\.optimization\.minibatch_size must be null or >= 1; got 0"),
        (
            {"gradient_clip_norm": -1.0},
            r"model\.optimization\.gradient_clip_norm must be null or > 0",
        ),
    ],
)
def test_bad_optimization_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OptimizationConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": 0}, r"temperature must be a finite number > 0; got 0$"),
        # infinite: uniform sampling, and every log-prob -log V whatever the weights
        ({"temperature": math.inf}, r"temperature must be a finite number > 0; got inf$"),
        ({"temperature": True}, r"temperature must be a finite number > 0; got True$"),
        ({"top_p": math.nan}, r"top_p must be in \(0, 1\]; got nan$"),
        ({"top_k": True}, r"top_k must be an integer >= 0 \(0 = off\); got True$"),
        ({"top_k": 2.5}, r"top_k must be an integer >= 0 \(0 = off\); got 2.5$"),
        ({"max_new_tokens": 0}, r"max_new_tokens must be an integer >= 1; got 0$"),
        ({"max_new_tokens": 8.0}, r"max_new_tokens must be an integer >= 1; got 8.0$"),
    ],
)
def test_bad_sampling_options(kwargs, message):
    with pytest.raises(ValueError, match=r"^model\.sampling\." + message):
        SamplingConfig(**kwargs)


def test_nan_in_the_snapshot_stops_before_caching(tmp_path, tiny_model_dir):
    from lightning_troll.rollouts.rollout import behaviour_outputs

    module = make_module(tiny_model_dir)
    ids = torch.tensor([[1, 5, 6, 2], [1, 7, 8, 2]])
    mask = torch.ones_like(ids)
    response = torch.tensor([[True, True], [True, False]])
    logp, old = behaviour_outputs(
        module.old_policy, ids, mask, response, 1.0, module.old_rows.sparsify
    )
    assert torch.isfinite(logp).all() and old.num_rows == 3
    with torch.no_grad():
        module.old_policy.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"NaN or \+inf .* at 3 response tokens"):
        behaviour_outputs(module.old_policy, ids, mask, response, 1.0, module.old_rows.sparsify)


def test_gradient_checkpointing_gives_the_same_step(tmp_path, tiny_model_dir):
    weights = []
    for checkpointing in (False, True):
        module = make_module(
            tiny_model_dir,
            optimizer=sgd(0.5),
            optimization=OptimizationConfig(
                gradient_clip_norm=None, gradient_checkpointing=checkpointing
            ),
        )
        assert module.policy.is_gradient_checkpointing == checkpointing
        assert not module.old_policy.is_gradient_checkpointing
        fit(tmp_path / str(checkpointing), tiny_model_dir, max_steps=1, module=module,
            limit_val_batches=0)  # fmt: skip
        weights.append(torch.cat([p.detach().flatten() for p in module.policy.parameters()]))
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=1e-6)


def test_bf16_mixed_precision_keeps_the_projection_in_float32(tmp_path, tiny_model_dir):
    _, _, recorder = fit(
        tmp_path, tiny_model_dir, max_steps=2, precision="bf16-mixed", limit_val_batches=0,
        module=make_module(tiny_model_dir, optimization=OptimizationConfig(minibatch_size=8)),
    )  # fmt: skip
    for steps in recorder.stats:
        for stats in steps:
            assert stats.projection.kl_after.dtype == torch.float32
            assert (stats.projection.kl_after <= 0.05 * (1 + 1e-4)).all()
            assert torch.isfinite(stats.loss)
    assert recorder.rollouts[0].old.logprobs.dtype == torch.float32


def test_a_tokenizer_larger_than_the_policy_vocabulary_is_refused(tmp_path, tiny_model_dir):
    from lightning_troll.models.loading import tiny_causal_lm
    from lightning_troll.models.tinymath import build_tokenizer

    tokenizer = build_tokenizer()
    small = tiny_causal_lm(vocab_size=len(tokenizer) - 3, eos_token_id=2, pad_token_id=0)
    small.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"has 14 output tokens but its tokenizer has 17"):
        make_module(tmp_path)
