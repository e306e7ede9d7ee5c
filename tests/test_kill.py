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

from lightning_troll.callbacks import RolloutCheckpoint, RolloutGeneration
from lightning_troll.training.checkpoint_io import AtomicCheckpointIO
from lightning_troll.training.checkpoints import check_checkpoint_file
from tests.test_training import make_data, make_module, make_trainer

pytestmark = pytest.mark.slow  # whole fits, and processes started and killed

ROOT = Path(__file__).resolve().parents[1]


def test_every_checkpoint_callback_saves_through_the_atomic_io(
    tmp_path, tiny_model_dir, monkeypatch
):
    """With RolloutCheckpoint in the trainer, ModelCheckpoint's saves and its own go through
    AtomicCheckpointIO (written beside their final name, then renamed), none through Lightning's
    save to the temporary directory; a trainer without it keeps Lightning's."""
    saved, lightnings = [], []
    save = AtomicCheckpointIO.save_checkpoint

    def spy(self, checkpoint, path, storage_options=None):
        saved.append(Path(path).name)
        save(self, checkpoint, path, storage_options)

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", spy)
    monkeypatch.setattr(torch_io, "_atomic_save", lambda c, p: lightnings.append(Path(p).name))
    every = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    last = RolloutCheckpoint(every_n_rollouts=0, dirpath=str(tmp_path / "last"))
    trainer = make_trainer(
        tmp_path, 2, callbacks=[RolloutGeneration(), every, last], enable_checkpointing=True,
        limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(make_module(tiny_model_dir), datamodule=make_data(tiny_model_dir))
    assert saved == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "last.ckpt"] and not lightnings
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == saved[:2]
    for path in (*(tmp_path / "ckpt").iterdir(), tmp_path / "last" / "last.ckpt"):
        check_checkpoint_file(path)
    plain = make_trainer(tmp_path, 1, callbacks=[RolloutGeneration()], enable_checkpointing=False)
    plain.strategy.connect(make_module(tiny_model_dir))
    assert type(plain.strategy.checkpoint_io) is torch_io.TorchCheckpointIO


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
    written = sorted(p for p in ckpt.iterdir() if not p.name.startswith("."))
    assert all(p.suffix == ".ckpt" for p in written), "no temporary files beside the checkpoints"
    hidden = [p.name for p in ckpt.iterdir() if p.name.startswith(".")]
    # a save the kill cut short leaves only its own partial file, which the next save overwrites
    assert all(name.endswith(".ckpt.partial") for name in hidden), hidden
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
