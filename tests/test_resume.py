"""Exact resume: a run stopped after step 3 and resumed logs what an uninterrupted run logs."""

from __future__ import annotations

import csv
import dataclasses
import os
import signal
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_troll.callbacks import (
    OldPolicyRefresh,
    RolloutCheckpoint,
    RolloutGeneration,
    TrustRegionMonitor,
)
from lightning_troll.training.module import EngineConfig, OptimizationConfig
from tests.test_training import make_data, make_module, make_trainer

pytestmark = pytest.mark.slow  # whole fits: seconds each

COMPARED = (
    "loss/total",
    "loss/policy",
    "loss/regression",
    "entropy",
    "grad_norm",
    "reward/mean",
    "reward/std",
    "completion/mean_length",
    "trust_region/kl_before_mean",
    "trust_region/kl_before_max",
    "trust_region/kl_after_mean",
    "trust_region/kl_after_max",
    "trust_region/eta_mean",
    "dynamic_sampling/prompts_sampled",
    "dynamic_sampling/rounds",
)


def logged(log_dir: Path) -> dict[int, dict[str, float]]:
    """The CSVLogger's rows, merged per step: {step: {metric: value}}."""
    steps: dict[int, dict[str, float]] = {}
    with (log_dir / "metrics.csv").open() as file:
        for row in csv.DictReader(file):
            values = {k: float(v) for k, v in row.items() if v != "" and k != "step"}
            steps.setdefault(int(row["step"]), {}).update(values)
    return steps


def train(tmp_path: Path, model_dir: Path, name: str, max_steps: int, ckpt_path=None, **options):
    """A fit with the project's callbacks, a CSV log and a checkpoint after every rollout."""
    torch.manual_seed(0)  # as seed_everything would; the resumed run must not depend on it
    every_n_rollouts = options.pop("every_n_rollouts", 1)
    max_staleness = options.pop("max_staleness", 0)
    steps_per_rollout = options.pop("steps_per_rollout", 1)
    num_train = options.pop("num_train", 16)
    module = make_module(model_dir, **options)
    logger = CSVLogger(tmp_path, name=name, version=0)
    checkpoints = ModelCheckpoint(
        dirpath=tmp_path / name / "ckpt",
        filename="{step}",
        every_n_train_steps=steps_per_rollout,
        save_top_k=-1,
    )
    callbacks = [
        RolloutGeneration(log_samples=0),
        OldPolicyRefresh(every_n_rollouts=every_n_rollouts, max_staleness=max_staleness),
        TrustRegionMonitor(histogram_every_n_rollouts=0),
        checkpoints,
    ]
    trainer = make_trainer(
        tmp_path, max_steps, callbacks=callbacks, logger=logger, enable_checkpointing=True,
        limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=make_data(model_dir, num_train=num_train), ckpt_path=ckpt_path)
    return trainer, module, logged(Path(logger.log_dir))


def weights(module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.state_dict().values()])


def assert_same_steps(expected: dict, got: dict, steps: range) -> None:
    for step in steps:
        for name in COMPARED:
            if name in expected[step]:
                assert got[step][name] == pytest.approx(expected[step][name], rel=0, abs=1e-6), (
                    step,
                    name,
                )


@pytest.mark.parametrize(
    ("case", "options"),
    [
        # 16 prompts / 4 per rollout: 4 rollouts an epoch, step 3 stops mid-epoch
        ("mid_epoch", {}),
        # 12 prompts: 3 rollouts an epoch, step 3 ends epoch 0; the snapshot, refreshed every
        # 2 rollouts, lags behind the policy there
        ("epoch_end_lagging_snapshot", {"num_train": 12, "every_n_rollouts": 2}),
        # 2 optimiser steps per rollout (global_step counts them): stop after rollout 3 of 6
        (
            "minibatches",
            {"steps_per_rollout": 2, "optimization": OptimizationConfig(minibatch_size=8)},
        ),
        # extra prompts drawn by dynamic sampling (a reward often equal across a group)
        (
            "dynamic_sampling",
            {"rewards": {"tests.reward_helpers:used_the_budget": 1.0}, "dynamic_sampling": True},
        ),
        # a sampler 2 versions behind: the 2 versions waiting travel in the checkpoint
        ("stale_sampler", {"max_staleness": 2}),
        # the engine in its own process samples each rollout ahead: the checkpoint after rollout
        # 3 keeps the seed of rollout 4, asked for while rollout 3 trained
        (
            "sampled_ahead",
            {"max_staleness": 1, "engine": EngineConfig(options={"process": True})},
        ),
    ],
)
def test_resume_continues_like_an_uninterrupted_run(case, options, tmp_path, tiny_model_dir):
    per = options.get("steps_per_rollout", 1)
    total, stop = 6 * per, 3 * per
    uninterrupted, whole, expected = train(
        tmp_path, tiny_model_dir, "whole", total, **dict(options)
    )
    if case == "mid_epoch":  # a run that stopped at max_steps=3, as a user would resume it
        train(tmp_path, tiny_model_dir, "first", stop, **dict(options))
        ckpt = tmp_path / "first" / "ckpt" / f"step={stop}.ckpt"
    else:  # the uninterrupted run's own checkpoint after rollout 3, as after a crash
        ckpt = tmp_path / "whole" / "ckpt" / f"step={stop}.ckpt"
    trainer, resumed, got = train(
        tmp_path, tiny_model_dir, "resumed", total, ckpt_path=ckpt, **dict(options)
    )
    assert trainer.global_step == total
    # the logger's step counts rollouts (Lightning's batches), global_step optimiser steps
    assert sorted(expected) == list(range(6))
    assert sorted(got) == [3, 4, 5], "the resumed run logs from the rollout after the checkpoint"
    assert_same_steps(expected, got, range(3, 6))
    if case == "dynamic_sampling":  # the resumed rollouts drew extra prompts
        assert sum(got[step]["dynamic_sampling/rounds"] for step in range(3, 6)) > 0
    torch.testing.assert_close(weights(resumed), weights(whole), rtol=0, atol=0)
    for kind in (RolloutGeneration, OldPolicyRefresh, TrustRegionMonitor):
        states = [
            next(c for c in t.callbacks if isinstance(c, kind)).state_dict()
            for t in (uninterrupted, trainer)
        ]
        waiting = [state.pop("waiting", []) for state in states]
        assert states[0] == states[1], kind.__name__  # counters and reward history carried over
        assert [w["version"] for w in waiting[0]] == [w["version"] for w in waiting[1]]
        for mine, theirs in zip(*waiting, strict=True):
            for name, value in mine["weights"].items():
                assert torch.equal(theirs["weights"][name], value), name


class SaveInsideRollout(Callback):
    """Writes a checkpoint before the ``at``-th optimiser step, inside a rollout."""

    def __init__(self, path: Path, at: int) -> None:
        self.path, self.at, self.steps = path, at, 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps += 1
        if self.steps == self.at:
            trainer.save_checkpoint(self.path)


class Prompts(Callback):
    def __init__(self) -> None:
        self.seen: list[list[str]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append(list(batch.prompts))


def test_a_checkpoint_inside_a_rollout_resamples_that_rollout(tmp_path, tiny_model_dir):
    """Two optimiser steps per rollout; saved before step 4 (rollout 2's second): the resumed run
    starts with rollout 2's prompts again, from the weights after step 3, and carries on."""
    options = {"optimization": OptimizationConfig(minibatch_size=8)}
    path, original = tmp_path / "inside.ckpt", Prompts()
    callbacks = [RolloutGeneration(), SaveInsideRollout(path, at=4), original]
    trainer = make_trainer(tmp_path, 6, callbacks=callbacks, limit_val_batches=0)
    torch.manual_seed(0)
    trainer.fit(make_module(tiny_model_dir, **options), datamodule=make_data(tiny_model_dir))
    assert torch.load(path, map_location="cpu", weights_only=True)["global_step"] == 3
    resumed = Prompts()
    trainer = make_trainer(
        tmp_path, 6, callbacks=[RolloutGeneration(), resumed], limit_val_batches=0
    )
    module = make_module(tiny_model_dir, **options)
    trainer.fit(module, datamodule=make_data(tiny_model_dir), ckpt_path=path)
    assert resumed.seen[0] == original.seen[1]
    assert resumed.seen[1] == original.seen[2]
    assert trainer.global_step == 7  # 3 saved + 2 rollouts; the stop comes at a rollout's end
    assert all(torch.isfinite(p).all() for p in module.policy.parameters())


def test_seed_per_rank_gives_each_rank_its_own_repeatable_streams():
    """From one shared state, every rank gets other torch, Python and NumPy numbers; the same
    rank from the same state gets the same numbers again (a run repeats)."""
    import random

    import numpy as np

    from lightning_troll.training.checkpoints import seed_per_rank

    def draws(rank: int) -> tuple:
        torch.manual_seed(7)  # what seed_everything leaves on every process
        random.seed(7)
        np.random.seed(7)
        seed_per_rank(rank)
        return tuple(torch.rand(4).tolist()), random.random(), float(np.random.rand())

    zero, one, two = draws(0), draws(1), draws(2)
    assert draws(0) == zero and draws(1) == one
    for a, b in ((zero, one), (zero, two), (one, two)):
        assert all(x != y for x, y in zip(a, b, strict=True))  # torch, Python and NumPy each
    torch.manual_seed(7)
    assert tuple(torch.rand(4).tolist()) not in {zero[0], one[0]}  # rank 0 is reseeded too
    with pytest.raises(ValueError, match="rank must be >= 0; got -1"):
        seed_per_rank(-1)


# -- RolloutCheckpoint: last.ckpt between rollouts, on a stop signal too --------------------------
class SignalDuring(Callback):
    """Sends ``signum`` to this process ``times`` times before the ``at``-th optimiser step (inside
    a rollout, where a checkpoint must not be written), or as the ``at``-th validation starts."""

    def __init__(self, signum: int, at: int, times: int = 1, during: str = "rollout") -> None:
        self.signum, self.at, self.times, self.during = signum, at, times, during
        self.seen = {"rollout": 0, "validation": 0}

    def _count(self, during: str) -> None:
        self.seen[during] += 1
        if during == self.during and self.seen[during] == self.at:
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._count("rollout")

    def on_validation_start(self, trainer, pl_module):
        self._count("validation")


@pytest.fixture
def restore_signal_handlers():
    """Lightning leaves SIGINT ignored after a KeyboardInterrupt; put every handler back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield saved
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def train_with_last(
    tmp_path, model_dir, name, max_steps, ckpt_path=None, every=0, extra=(), validate=False
):
    """A fit whose only checkpoint is RolloutCheckpoint's last.ckpt; one step per rollout; with
    ``validate``, a validation after every second rollout."""
    torch.manual_seed(0)
    module = make_module(model_dir)
    logger = CSVLogger(tmp_path, name=name, version=0)
    last = RolloutCheckpoint(every_n_rollouts=every, dirpath=str(tmp_path / name / "ckpt"))
    callbacks = [
        RolloutGeneration(log_samples=0),
        OldPolicyRefresh(),
        TrustRegionMonitor(histogram_every_n_rollouts=0),
        last,
        *extra,
    ]
    trainer = make_trainer(
        tmp_path, max_steps, callbacks=callbacks, logger=logger, enable_checkpointing=True,
        limit_val_batches=1 if validate else 0, val_check_interval=2,
    )  # fmt: skip
    trainer.fit(module, datamodule=make_data(model_dir), ckpt_path=ckpt_path)
    return trainer, module, last, logged(Path(logger.log_dir))


@pytest.mark.parametrize(
    ("signum", "during"),
    [(signal.SIGINT, "rollout"), (signal.SIGTERM, "rollout"), (signal.SIGTERM, "validation")],
)
def test_a_stop_signal_saves_after_the_rollout_and_resumes_exactly(
    signum, during, tmp_path, tiny_model_dir, restore_signal_handlers
):
    """Ctrl-C or SIGTERM during rollout 2's step, or during the validation after it: the rollout
    (or validation) finishes, last.ckpt is written and the fit ends cleanly; resumed, it logs
    rollouts 3-4 as an uninterrupted run does and ends with the same weights."""
    validate = during == "validation"
    _, whole, _, expected = train_with_last(tmp_path, tiny_model_dir, "whole", 4, validate=validate)
    stop = SignalDuring(signum, at=1 if validate else 2, during=during)
    trainer, _, last, _ = train_with_last(
        tmp_path, tiny_model_dir, "stopped", 4, extra=[stop], validate=validate
    )
    assert trainer.global_step == 2 and last.stopped_by == signum
    assert last.last_model_path == str(tmp_path / "stopped" / "ckpt" / "last.ckpt")
    assert torch.load(last.last_model_path, weights_only=True)["global_step"] == 2
    for s, handler in restore_signal_handlers.items():  # the fit's handlers are gone
        assert signal.getsignal(s) == handler
    _, resumed, _, got = train_with_last(
        tmp_path, tiny_model_dir, "resumed", 4, ckpt_path=last.last_model_path, validate=validate
    )
    assert sorted(step for step in got if "loss/total" in got[step]) == [2, 3]
    assert_same_steps(expected, got, range(2, 4))
    torch.testing.assert_close(weights(resumed), weights(whole), rtol=0, atol=0)


def test_a_run_stopped_between_validations_validates_only_where_it_was_scheduled(
    tmp_path, tiny_model_dir, restore_signal_handlers
):
    """Validations after rollouts 2 and 4 (val_check_interval 2). SIGTERM in rollout 3: the fit
    stops after it without the validation Lightning runs on the way out of a stop; resumed, it
    validates after rollout 4 as the uninterrupted run does. The stopped and resumed logs
    together hold the uninterrupted run's validation points and no other."""
    _, _, _, whole = train_with_last(tmp_path, tiny_model_dir, "whole", 4, validate=True)
    stop = SignalDuring(signal.SIGTERM, at=3)
    trainer, _, last, stopped = train_with_last(
        tmp_path, tiny_model_dir, "stopped", 4, extra=[stop], validate=True
    )
    assert trainer.global_step == 3 and last.stopped_by == signal.SIGTERM
    _, _, _, resumed = train_with_last(
        tmp_path, tiny_model_dir, "resumed", 4, ckpt_path=last.last_model_path, validate=True
    )
    validated = lambda log: sorted(s for s in log if "val/accuracy" in log[s])  # noqa: E731
    assert len(validated(whole)) == 2
    assert validated(stopped) == validated(whole)[:1]
    assert validated(resumed) == validated(whole)[1:]
    for step in validated(whole):
        log = stopped if step in stopped and "val/accuracy" in stopped[step] else resumed
        assert log[step]["val/accuracy"] == whole[step]["val/accuracy"]


def test_a_second_ctrl_c_stops_at_once_and_keeps_the_last_checkpoint(
    tmp_path, tiny_model_dir, restore_signal_handlers
):
    """Two Ctrl-C inside rollout 3: Lightning's KeyboardInterrupt exit, nothing written inside
    the rollout; last.ckpt is the one saved after rollout 2 (every_n_rollouts=1)."""
    stop = SignalDuring(signal.SIGINT, at=3, times=2)
    with pytest.raises(SystemExit) as exited:
        train_with_last(tmp_path, tiny_model_dir, "stopped", 5, every=1, extra=[stop])
    assert exited.value.code == 1
    path = tmp_path / "stopped" / "ckpt" / "last.ckpt"
    assert torch.load(path, weights_only=True)["global_step"] == 2
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]


def test_a_new_run_never_writes_over_another_runs_last_ckpt(tmp_path, tiny_model_dir):
    """Two runs share a checkpoint folder (a fixed dirpath; a logger without version folders
    does the same): the second saves to last-v1.ckpt and warns, the first's last.ckpt stays as
    it was; a run resumed from that last.ckpt goes on writing it."""
    folder = tmp_path / "shared" / "ckpt"

    def step_of(name: str) -> int:
        return torch.load(folder / name, map_location="cpu", weights_only=False)["global_step"]

    train_with_last(tmp_path, tiny_model_dir, "shared", 2)
    before = (folder / "last.ckpt").read_bytes()
    with pytest.warns(UserWarning, match=r"holds another run's checkpoint, which this run did "
                      r"not resume from \(--ckpt_path\): this run saves to .*last-v1\.ckpt"):  # fmt: skip
        _, _, last, _ = train_with_last(tmp_path, tiny_model_dir, "shared", 1)
    assert Path(last.path).name == "last-v1.ckpt" and step_of("last-v1.ckpt") == 1
    assert (folder / "last.ckpt").read_bytes() == before
    _, _, last, _ = train_with_last(
        tmp_path, tiny_model_dir, "shared", 3, ckpt_path=folder / "last.ckpt"
    )
    assert Path(last.path).name == "last.ckpt" and step_of("last.ckpt") == 3
    assert sorted(p.name for p in folder.iterdir()) == ["last-v1.ckpt", "last.ckpt"]


def test_rollout_checkpoint_rejects_a_negative_interval():
    with pytest.raises(
        ValueError, match=r"checkpoint.every_n_rollouts must be an integer >= 0; got -1"
    ):
        RolloutCheckpoint(every_n_rollouts=-1)


def test_changed_options_name_real_changes_and_not_fields_newer_than_the_checkpoint():
    """Resuming warns about options that differ from the checkpoint's; an option record that
    gained a field since (stored without it) differs only where the new field is set."""
    from lightning_troll.objectives.options import LossConfig
    from lightning_troll.training.checkpoints import changed_options

    old = {k: v for k, v in dataclasses.asdict(LossConfig()).items() if k != "entropy_coef"}
    stored = {"loss": old, "group_size": 8, "_instantiator": "x"}
    same = {"loss": LossConfig(), "group_size": 8, "_instantiator": "y"}
    assert changed_options(same, stored) == []
    assert changed_options({"loss": dict(old, entropy_coef=None)}, stored) == []  # a plain dict
    assert changed_options({"group_size": 4}, stored) == ["model.group_size: 8 -> 4"]
    (line,) = changed_options({"loss": LossConfig(entropy_coef=0.01)}, stored)
    assert line == "model.loss.entropy_coef: (not stored) -> 0.01"
    (line,) = changed_options({"loss": LossConfig(aggregation="seq_mean_token_mean")}, stored)
    assert line == f"model.loss.aggregation: {old['aggregation']!r} -> 'seq_mean_token_mean'"
    lines = changed_options({"loss": {"aggregation": old["aggregation"]}}, stored)  # some gone
    assert lines and all(line.endswith(" -> (not given)") for line in lines)
