"""Non-finite training stops as a failing reward does: rewards whose arithmetic overflows float32
are refused at the rollout, and a run of non-finite optimiser steps saves the weights of the last
finite step; each ends in two lines (what happened; the checkpoint to resume from), exit status 3,
no traceback."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from lightning_troll.objectives.advantages import dr_grpo, overflow_problem
from lightning_troll.training.checkpoints import check_checkpoint_file
from tests.test_faults_reward import command, stop_lines

HUGE = "def reward(prompt, completion, row):\n    return {value} * (len(completion) % 2)\n"


def test_rewards_whose_spread_squared_overflows_are_named():
    """1e30 and 0 in a group: dr_grpo's advantages are finite (about 5e29), but their square,
    a variance, is not; 1e18 apart squares to 1e36, below float32's 3.4e38."""
    rewards = torch.tensor([1e30, 0.0, 0.0, 1e30])
    problem = overflow_problem(rewards, dr_grpo(rewards, 4))
    assert problem.startswith("the rewards of this rollout range from 0 to 1e+30, whose spread ")
    rewards = torch.tensor([1e18, 0.0, 0.0, 1e18])
    assert overflow_problem(rewards, dr_grpo(rewards, 4)) is None


@pytest.mark.slow
def test_rewards_that_overflow_the_advantages_stop_the_run_at_the_rollout(tmp_path, tiny_model_dir):
    (tmp_path / "my_reward.py").write_text(HUGE.format(value="1e30"))
    run = command(tmp_path, tiny_model_dir, 4, "--model.advantages.estimator", "dr_grpo")
    done = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 3, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    told = stop_lines(done.stderr)
    assert len(told) == 2, done.stderr[-3000:]
    assert told[0].startswith("lightning-troll: stopped: the rewards of this rollout range from 0 "
                              "to 1e+30"), told  # fmt: skip
    assert told[1].startswith(f"  saved {Path('ckpt') / 'last.ckpt'}: fix the cause")
    check_checkpoint_file(tmp_path / "ckpt" / "last.ckpt")


@pytest.mark.filterwarnings("ignore:non-finite loss at global step")
def test_a_run_of_non_finite_steps_saves_the_last_finite_weights_and_stops_in_two_lines(
    tmp_path, tiny_model_dir, monkeypatch, capsys
):
    """Rollouts 1 and 2 train; from rollout 3 on every loss is NaN: after
    model.optimization.max_bad_steps (3) skipped steps the run stops, exit status 3, and
    last.ckpt holds the weights of step 2, the last finite one."""
    from lightning_troll.training.module import TrollModule
    from tests.conftest import refused_here

    (tmp_path / "my_reward.py").write_text(HUGE.format(value="1.0"))
    loss_of = TrollModule.loss_of

    def poisoned(self, part):
        loss, stats = loss_of(self, part)
        return (loss * float("nan") if self.global_step >= 2 else loss), stats

    monkeypatch.setattr(TrollModule, "loss_of", poisoned)
    args = command(tmp_path, tiny_model_dir, 8)[1:]
    stderr = refused_here(args, tmp_path, monkeypatch, capsys, status=3)
    assert "Traceback" not in stderr
    told = stop_lines(stderr)
    assert told[0] == (
        "lightning-troll: stopped: 3 optimiser steps in a row had a non-finite loss "
        "(model.optimization.max_bad_steps=3), the last at global step 2; the weights are those "
        "of the last finite step: lower the learning rate or look for rewards or data that "
        "overflow"
    ), stderr[-2000:]
    assert told[1].startswith(f"  saved {Path('ckpt') / 'last.ckpt'}: fix the cause")
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    check_checkpoint_file(ckpt)
    state = torch.load(ckpt, weights_only=True)
    assert state["global_step"] == 2
    assert all(
        torch.isfinite(v).all() for v in state["state_dict"].values() if v.is_floating_point()
    )


KILLS_ENGINE = """
import multiprocessing, os, signal
from pathlib import Path

def reward(prompt, completion, row):
    calls = Path("calls.txt")
    count = int(calls.read_text()) if calls.exists() else 0
    calls.write_text(str(count + 1))
    if count == 16:  # rollout 3: the engine's process is killed, as the OOM killer would
        for child in multiprocessing.active_children():
            if child.name == "lightning-troll-engine":
                os.kill(child.pid, signal.SIGKILL)
    return float(len(completion) % 3)
"""


@pytest.mark.slow
def test_an_engine_process_killed_stops_the_run_in_two_lines_naming_the_signal(
    tmp_path, tiny_model_dir
):
    (tmp_path / "my_reward.py").write_text(KILLS_ENGINE)
    run = command(tmp_path, tiny_model_dir, 8, "--model.engine.options",
                  '{"process": true}')  # fmt: skip
    done = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 3, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    told = stop_lines(done.stderr)
    assert told[0] == (
        "lightning-troll: stopped: the 'hf' engine's process was killed by signal 9 (SIGKILL) "
        "while the rollout was sampled"
    ), done.stderr[-3000:]
    assert told[1].startswith(f"  saved {Path('ckpt') / 'last.ckpt'}: fix the cause")
    check_checkpoint_file(tmp_path / "ckpt" / "last.ckpt")
