"""RolloutProgressBar: rollouts done / total, seconds per rollout, time left, reward and KL."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from lightning_troll.callbacks import RolloutGeneration, RolloutProgressBar
from lightning_troll.callbacks.progress import rollouts_done, steps_per_rollout, total_rollouts
from lightning_troll.training.module import OptimizationConfig


def fakes(prompts=256, group=8, minibatch=1024, epochs=1, max_steps=400, max_epochs=-1, batches=62):
    module = SimpleNamespace(
        group_size=group,
        optimization=OptimizationConfig(epochs_per_rollout=epochs, minibatch_size=minibatch),
    )
    trainer = SimpleNamespace(
        datamodule=SimpleNamespace(batch_size=prompts),
        max_steps=max_steps,
        max_epochs=max_epochs,
        num_training_batches=batches,
    )
    return trainer, module


@pytest.mark.parametrize(
    ("options", "steps", "total"),
    [
        ({}, 2, 200),  # the demo: 2048 sequences in minibatches of 1024; 400 steps
        ({"minibatch": 768}, 3, 134),  # 768 + 768 + 512 sequences; ceil(400 / 3)
        ({"minibatch": None}, 1, 400),  # the whole rollout in one step
        ({"minibatch": 4096}, 1, 400),  # larger than the rollout: one step
        ({"epochs": 2, "minibatch": 512}, 8, 50),
        ({"max_steps": -1, "max_epochs": 3}, 2, 186),  # 3 epochs of 62 rollouts
        ({"max_steps": 1000, "max_epochs": 2}, 2, 124),  # the epochs end first
    ],
)
def test_steps_per_rollout_and_total_rollouts(options, steps, total):
    trainer, module = fakes(**options)
    assert steps_per_rollout(trainer, module) == steps
    assert total_rollouts(trainer, module) == total


def test_unknown_totals_are_none():
    trainer, module = fakes(max_steps=-1, max_epochs=-1)
    assert total_rollouts(trainer, module) is None  # runs until stopped
    trainer.num_training_batches = float("inf")
    assert total_rollouts(trainer, module) is None
    trainer.max_steps = 10
    assert steps_per_rollout(trainer, SimpleNamespace()) is None  # not a TrollModule
    assert total_rollouts(trainer, SimpleNamespace()) is None


def test_total_counts_from_the_rollouts_done_so_skipped_steps_lengthen_it():
    """400 steps at 2 a rollout: 200 rollouts. After 40 rollouts that made only 79 steps (one
    skipped as non-finite), 321 steps are left: 161 rollouts more, 201 in all; the epochs'
    limit does not move with skipped steps."""
    trainer, module = fakes()
    trainer.global_step = 80
    assert total_rollouts(trainer, module, 40) == 200
    trainer.global_step = 79
    assert total_rollouts(trainer, module, 40) == 201
    trainer.global_step = 400  # done: the total is the rollouts run
    assert total_rollouts(trainer, module, 201) == 201
    trainer.global_step, trainer.max_epochs = 79, 3  # 186 rollouts of the prompt set
    assert total_rollouts(trainer, module, 40) == 186


def test_the_bars_total_grows_when_a_rollouts_steps_were_skipped():
    """The bar refreshes its total after every rollout: 40 rollouts into a run of 200 (2 steps
    each), one skipped step makes it 201, and the bar ends at 201/201, not 201/200."""
    from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

    trainer, module = fakes()
    bar = RolloutProgressBar()
    bar._train_progress_bar = Tqdm(total=200, disable=True)
    bar.rollouts, bar.total = 39, 200
    trainer.global_step, trainer.progress_bar_metrics, trainer.loggers = 80, {}, []
    bar.on_train_batch_end(trainer, module, None, None, 0)
    assert (bar.rollouts, bar.total, bar.train_progress_bar.total) == (40, 200, 200)
    trainer.global_step = 81  # the next rollout made one of its 2 steps
    bar.on_train_batch_end(trainer, module, None, None, 0)
    assert (bar.rollouts, bar.total, bar.train_progress_bar.total) == (41, 201, 201)


def test_rollouts_done_come_from_the_rollout_count_a_checkpoint_restored():
    """A resumed run's bar starts at the rollouts its checkpoint holds: the rollout callback's own
    count, which steps skipped as non-finite do not shorten, as ``global_step`` would."""
    trainer, module = fakes()  # 2 optimiser steps a rollout
    trainer.global_step, trainer.callbacks = 13, []
    assert rollouts_done(trainer, module) == 6  # no rollout callback: 13 steps // 2
    generation = RolloutGeneration()
    generation.load_state_dict({"rollouts": 7})  # one step of the 14 was skipped
    trainer.callbacks = [generation]
    assert rollouts_done(trainer, module) == 7
    trainer.callbacks = []
    assert rollouts_done(trainer, SimpleNamespace()) == 0  # not a TrollModule: unknown


@pytest.mark.slow
def test_bar_counts_rollouts_with_seconds_per_rollout_reward_and_kl(
    tmp_path, tiny_model_dir, capsys
):
    """Three rollouts of two optimiser steps each: the bar ends at 3/3 rollouts (not Lightning's
    'Epoch 0' of batches, nor it/s) and shows reward and KL; a resumed run starts at 3 of 5."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.test_training import fit, make_data, make_module, make_trainer

    options = {"optimization": OptimizationConfig(minibatch_size=8)}  # 16 sequences: 2 steps
    bar = RolloutProgressBar()
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=2)
    trainer, _, _ = fit(
        tmp_path, tiny_model_dir, max_steps=6, module=make_module(tiny_model_dir, **options),
        extra=[bar, saver], enable_progress_bar=True, enable_checkpointing=True,
    )  # fmt: skip
    assert bar.total == 3 and bar.rollouts == 3
    out = capsys.readouterr().out
    final = out.replace("\r", "\n").strip().splitlines()[-1]
    assert re.search(r"\| 3/3 rollouts \[\d\d:\d\d<00:00, +\d+\.\d\ds/rollout, ", final), final
    assert "reward/mean=" in final and "kl=" in final and "coverage=" in final
    assert "Epoch" not in out and "it/s" not in final and "v_num" not in final

    resumed = RolloutProgressBar()
    trainer = make_trainer(tmp_path, 10, resumed, enable_progress_bar=True)
    trainer.fit(
        make_module(tiny_model_dir, **options), datamodule=make_data(tiny_model_dir),
        ckpt_path=tmp_path / "ckpt" / "step=6.ckpt",
    )  # fmt: skip
    assert resumed.total == 5 and resumed.rollouts == 5
    final = capsys.readouterr().out.replace("\r", "\n").strip().splitlines()[-1]
    assert "| 5/5 rollouts [" in final
