"""A reward that fails under ``reward_options.on_error: raise`` stops the run cleanly and loses nothing:
one line naming the function, the error and the completion, a checkpoint saved on the way out,
exit status 3, and the run, its reward fixed, resumes from that checkpoint.

The runs that stop are the ``lightning-troll`` command in a process of its own (its exit status
and all it writes to stderr are under test); the resume that must simply succeed runs the same
command line through the command's ``main`` in this process, which saves a start-up."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lightning_troll.training.checkpoints import check_checkpoint_file
from tests.conftest import command_here, refused_here

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # whole fits in a subprocess

BROKEN = """
from pathlib import Path

def reward(prompt, completion, row):
    calls = Path("calls.txt")
    count = int(calls.read_text()) if calls.exists() else 0
    calls.write_text(str(count + 1))
    if count >= 16:  # rollouts 1 and 2 score (8 completions each); rollout 3 fails
        raise KeyError("answer_text")
    return float(len(completion) % 3)
"""
FIXED = """
def reward(prompt, completion, row):
    return float(len(completion) % 3)
"""


def command(folder: Path, model_dir: Path, steps: int, *extra: str) -> list[str]:
    config = {
        "trainer": {"enable_progress_bar": False, "limit_val_batches": 0, "logger": False,
                    "max_steps": steps},
        "model": {"model": str(model_dir), "group_size": 4, "sampling": {"max_new_tokens": 4},
                  "optimization": {"minibatch_size": 8}, "rewards": {"my_reward:reward": 1.0}},
        "data": {"batch_size": 2, "num_train": 16, "num_val": 0},
        "checkpoint": {"every_n_rollouts": 10, "dirpath": "ckpt"},
    }  # fmt: skip
    (folder / "run.yaml").write_text(yaml.safe_dump(config))
    base = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml"), "--config", "run.yaml"]
    return [str(Path(sys.executable).parent / "lightning-troll"), *base, *extra]


WARNING = "lightning-troll: warning:"
"""How the command starts a warning of its own (not a refusal or a stop)."""


def stop_lines(stderr: str) -> list[str]:
    """What a stopped run tells its user on stderr: the failure, then where it saved (the
    library's warnings along the way, ``lightning-troll: warning: ...``, are not part of it)."""
    return [
        line
        for line in stderr.splitlines()
        if line.startswith(("lightning-troll:", "  saved", "  the last checkpoint"))
        and not line.startswith(WARNING)
    ]


def test_a_failing_reward_stops_in_one_line_saves_and_the_fixed_run_resumes(
    tmp_path, tiny_model_dir, monkeypatch
):
    """Rollouts 1 and 2 train, rollout 3's reward raises: the run stops with exit status 3, two
    lines on stderr (the failure, the checkpoint to resume from), no traceback; last.ckpt holds
    the two rollouts trained. The reward fixed, the same command resumes from it to the end."""
    (tmp_path / "my_reward.py").write_text(BROKEN)
    done = subprocess.run(command(tmp_path, tiny_model_dir, 4), cwd=tmp_path,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 3, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    told = stop_lines(done.stderr)
    assert len(told) == 2, done.stderr[-3000:]
    assert told[0].startswith(
        "lightning-troll: stopped: reward function 'my_reward:reward' on sample"
    )
    assert "raised KeyError: 'answer_text'" in told[0] and "completion " in told[0]
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    assert told[1] == (
        f"  saved {Path('ckpt') / 'last.ckpt'}: fix the cause, then resume with the same command "
        f"and --ckpt_path {Path('ckpt') / 'last.ckpt'}"
    )
    check_checkpoint_file(ckpt)
    assert torch.load(ckpt, weights_only=True)["global_step"] == 2
    (tmp_path / "my_reward.py").write_text(FIXED)
    resumed = command(tmp_path, tiny_model_dir, 4, "--ckpt_path", str(ckpt))
    command_here(resumed[1:], tmp_path, monkeypatch)  # the same command line, here
    assert torch.load(ckpt, weights_only=True)["global_step"] == 4


def test_a_reward_with_the_wrong_signature_is_refused_before_the_model_loads(
    tmp_path, monkeypatch, capsys
):
    """A reward of two arguments, through the command's main here: one error line (beside
    Lightning's seed notice), exit status 2, no checkpoint or log folder written, and the model
    never loaded (its folder is named but holds nothing)."""
    (tmp_path / "my_reward.py").write_text("def reward(prompt, completion):\n    return 1.0\n")
    empty = tmp_path / "no_model_here"
    empty.mkdir()
    stderr = refused_here(command(tmp_path, empty, 2)[1:], tmp_path, monkeypatch, capsys)
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("lightning-troll: error:")]
    assert len(lines) <= 3 and len(errors) == 1, lines
    assert "'my_reward:reward' cannot be called as fn(prompt, completion, row)" in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "my_reward.py",
        "no_model_here",
        "run.yaml",
    ]


def test_a_reward_failing_in_validation_stops_in_one_line_and_names_the_last_checkpoint(
    tmp_path, tiny_model_dir
):
    """Rollouts 1 and 2 train and are saved; the validation after them meets a failing reward:
    nothing more can be saved there (the rollout is half validated), so the run stops with exit
    status 3, no traceback, and names the checkpoint it kept."""
    (tmp_path / "my_reward.py").write_text(BROKEN)  # rollouts 1 and 2 score; the 17th call fails
    validate = ["--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "2",
                "--trainer.num_sanity_val_steps", "0", "--data.num_val", "4",
                "--data.val_batch_size", "4", "--checkpoint.every_n_rollouts", "1"]  # fmt: skip
    done = subprocess.run(command(tmp_path, tiny_model_dir, 4, *validate), cwd=tmp_path,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 3, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    told = stop_lines(done.stderr)
    assert told[0].startswith("lightning-troll: stopped: in validation: reward function "
                              "'my_reward:reward' on sample")  # fmt: skip
    ckpt = Path("ckpt") / "last.ckpt"
    assert told[1] == (
        f"  the last checkpoint, {ckpt}, is as it was: fix the cause, then resume with the same "
        f"command and --ckpt_path {ckpt}"
    )
    assert torch.load(tmp_path / ckpt, weights_only=True)["global_step"] == 2
