"""An environment that fails during a rollout's episodes stops the run as a failing reward does:
one line naming the environment, the method and the error, a checkpoint of what trained saved on
the way out, exit status 3, and the run, its environment fixed, resumes from that checkpoint."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from lightning_troll.training.checkpoints import check_checkpoint_file
from tests.conftest import command_here
from tests.test_faults_reward import FIXED, command, stop_lines

pytestmark = pytest.mark.slow  # two whole fits, one in a subprocess

ENVIRONMENT = """
from pathlib import Path

from lightning_troll.tasks.environments import Environment, Step


class Breaks(Environment):
    # 8 episodes a rollout: rollouts 1 and 2 start 16, rollout 3's first start fails
    def reset(self, row):
        starts = Path("starts.txt")
        count = int(starts.read_text()) if starts.exists() else 0
        starts.write_text(str(count + 1))
        if count >= 16 and BROKEN:
            raise ConnectionError("the game server went away")
        self.turns = 0
        return row["prompt"]

    def step(self, turn):
        self.turns += 1
        return Step(done=True) if self.turns == 2 else Step(" again:", reward=0.0)
"""
EPISODES = ["--model.episodes", '{"environment": "my_env:Breaks", "max_turns": 2}']


def test_a_failing_environment_stops_in_one_line_saves_and_the_fixed_run_resumes(
    tmp_path, tiny_model_dir, monkeypatch
):
    """The failing run in a console script's process; the fixed run by the command's main,
    here (a process that never imported the broken module)."""
    (tmp_path / "my_reward.py").write_text(FIXED)
    (tmp_path / "my_env.py").write_text("BROKEN = True\n" + ENVIRONMENT)
    run = command(tmp_path, tiny_model_dir, 4, *EPISODES)
    done = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 3, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    told = stop_lines(done.stderr)
    assert told[0] == (
        "lightning-troll: stopped: the environment Breaks.reset raised ConnectionError: the game "
        "server went away"
    ), done.stderr[-3000:]
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    assert told[1].startswith(f"  saved {Path('ckpt') / 'last.ckpt'}: fix the cause")
    check_checkpoint_file(ckpt)
    assert torch.load(ckpt, weights_only=True)["global_step"] == 2
    (tmp_path / "my_env.py").write_text("BROKEN = False\n" + ENVIRONMENT)
    command_here([*run[1:], "--ckpt_path", str(ckpt)], tmp_path, monkeypatch)
    assert torch.load(ckpt, weights_only=True)["global_step"] == 4
