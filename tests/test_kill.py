"""Kill safety: checkpoints are written atomically, and a killed run resumes from the last one."""

from __future__ import annotations

import csv
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from lightning.fabric.plugins.io import torch_io
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_troll.callbacks import RolloutGeneration
from lightning_troll.training import checkpoints
from lightning_troll.training.checkpoints import check_checkpoint_file, non_atomic_saves
from tests.test_training import make_data, make_module, make_trainer

pytestmark = pytest.mark.slow  # whole fits, and processes started and killed

ROOT = Path(__file__).resolve().parents[1]


def test_model_checkpoint_saves_through_lightnings_atomic_save(
    tmp_path, tiny_model_dir, monkeypatch
):
    """ModelCheckpoint -> Trainer.save_checkpoint -> TorchCheckpointIO -> ``_atomic_save``, which
    writes to a temporary file inside an fsspec transaction and moves it into place."""
    saved = []
    atomic = torch_io._atomic_save

    def spy(checkpoint, path):
        saved.append(Path(path).name)
        atomic(checkpoint, path)

    monkeypatch.setattr(torch_io, "_atomic_save", spy)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    trainer = make_trainer(
        tmp_path, 2, callbacks=[RolloutGeneration(), checkpoints], enable_checkpointing=True,
        limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(make_module(tiny_model_dir), datamodule=make_data(tiny_model_dir))
    assert saved == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == saved


def test_saves_across_file_systems_are_flagged(tmp_path, monkeypatch):
    assert non_atomic_saves(tmp_path / "new" / "ckpt") is None  # pytest's tmp_path is in TMPDIR
    assert non_atomic_saves("s3://bucket/ckpt") is None
    # pretend tmp_path/elsewhere is another file system
    elsewhere = tmp_path / "elsewhere"
    monkeypatch.setattr(
        checkpoints, "_device", lambda path: 2 if elsewhere in (path, *path.parents) else 1
    )
    problem = non_atomic_saves(elsewhere / "ckpt")
    assert f"checkpoints in '{elsewhere / 'ckpt'}' are on another file system" in problem
    assert "Set TMPDIR" in problem


def command(tmp_path: Path, model_dir: Path, *extra: str) -> list[str]:
    config = {
        "trainer": {
            "enable_progress_bar": False,
            "limit_val_batches": 0,
            "logger": {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": "logs", "name": "run"},
            },
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {
                        "dirpath": "ckpt",
                        "filename": "{step}",
                        "every_n_train_steps": 1,
                        "save_top_k": -1,
                        "save_last": True,
                    },
                }
            ],
        },
        "model": {
            "model": str(model_dir),
            "group_size": 4,
            "sampling": {"max_new_tokens": 4},
            "optimization": {"minibatch_size": 8},  # the rollout: 2 prompts x 4 completions
        },
        "data": {"batch_size": 2, "num_train": 16, "num_val": 0},
    }
    path = tmp_path / "kill.yaml"
    path.write_text(yaml.safe_dump(config))
    base = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml"), "--config", str(path)]
    return [sys.executable, "-m", "lightning_troll.cli.command", *base, *extra]


def first_logged_step(log_dir: Path) -> int:
    with (log_dir / "metrics.csv").open() as file:
        return min(int(row["step"]) for row in csv.DictReader(file))


def test_a_killed_run_resumes_from_its_last_checkpoint(tmp_path, tiny_model_dir):
    ckpt = tmp_path / "ckpt"
    process = subprocess.Popen(
        command(tmp_path, tiny_model_dir, "--trainer.max_steps", "10000"),
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not (ckpt / "step=2.ckpt").exists():
            assert process.poll() is None, process.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "no checkpoint within 2 minutes"
            time.sleep(0.05)
    finally:
        process.kill()  # SIGKILL: no handler runs, a save may be cut off anywhere
        process.wait()
        process.stderr.close()
    assert process.returncode == -9
    written = sorted(ckpt.iterdir())
    assert all(p.suffix == ".ckpt" for p in written), "no temporary files beside the checkpoints"
    for path in written:
        check_checkpoint_file(path)  # every file there is whole
    saved = torch.load(ckpt / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]
    assert saved >= 1  # last.ckpt is written after step=N.ckpt: the kill may fall between them

    resumed = subprocess.run(
        command(
            tmp_path, tiny_model_dir, "--trainer.max_steps", str(saved + 2),
            "--ckpt_path", str(ckpt / "last.ckpt"),
        ),
        cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    final = torch.load(ckpt / "last.ckpt", map_location="cpu", weights_only=True)
    assert final["global_step"] == saved + 2
    # one optimiser step per rollout: the logger's steps (rollouts) match global steps
    assert first_logged_step(tmp_path / "logs" / "run" / "version_1") == saved
