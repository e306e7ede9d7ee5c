"""A save that fails never costs the previous checkpoint: a simulated full disk, a real file-size
limit, and a real full file system (a small tmpfs, where the tests may mount one) under the
``lightning-troll`` command, whose run stops in one line and resumes from what it kept.

A run that stops is the command in a process of its own (its exit status and all it writes to
stderr are under test); a run that must simply succeed (a probe, a resume) runs the same command
line through the command's ``main`` in this process, which saves a start-up."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch
import yaml

from lightning_troll.training.checkpoint_io import AtomicCheckpointIO, SaveFailed, partial_path
from lightning_troll.training.checkpoints import CheckpointError, check_checkpoint_file
from tests.conftest import command_here

ROOT = Path(__file__).resolve().parents[1]


def state(size: int) -> dict:
    return {"state_dict": {"w": torch.arange(size, dtype=torch.float32)}, "global_step": size}


def test_a_save_that_runs_out_of_space_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    """torch.save writes half of the new checkpoint, then the disk is full: the old file is
    untouched, the partial one is gone, and the error names the folder, the free space and the
    size needed."""
    target = tmp_path / "ckpt" / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint(state(1000), target)
    before = target.read_bytes()

    def full_disk(obj, file):
        file.write(before[: len(before) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(SaveFailed) as failed:
        io.save_checkpoint(state(2000), target)
    assert target.read_bytes() == before
    assert not partial_path(target).exists()
    message = str(failed.value)
    assert f"could not save {target}: No space left on device" in message
    assert f"free in {target.parent}; the checkpoint needs about 0.0 MiB" in message
    assert (
        f"the previous last.ckpt there is whole: free space, then resume with --ckpt_path {target}"
        in message
    )


def test_other_errors_pass_through_and_clean_up(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"

    def broken(obj, file):
        file.write(b"half")
        raise RuntimeError("pickling failed")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(RuntimeError, match="pickling failed"):
        AtomicCheckpointIO().save_checkpoint(state(10), target)
    assert list(tmp_path.iterdir()) == []


def test_a_file_url_is_saved_atomically_and_a_first_save_says_nothing_was_there(
    tmp_path, monkeypatch
):
    """A ``file://`` path is a local file: it is written beside its name and renamed (Lightning's
    own save would move it from the system's temporary directory). A first save that runs out of
    room says there was no checkpoint at that path, which holds after a resume from another."""

    target = tmp_path / "last.ckpt"
    renamed = []
    replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (renamed.append((a, b)), replace(a, b)))
    AtomicCheckpointIO().save_checkpoint(state(10), f"file://{target}")
    assert renamed == [(partial_path(target), target)]
    assert torch.load(target, weights_only=True)["global_step"] == 10

    def full_disk(obj, file):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    first = tmp_path / "other" / "last.ckpt"
    with pytest.raises(SaveFailed, match=r"there was no last\.ckpt there before$"):
        AtomicCheckpointIO().save_checkpoint(state(10), first)


def test_a_real_file_size_limit_during_a_save_keeps_the_old_checkpoint(tmp_path):
    """In a process whose files may not grow past 64 KiB (RLIMIT_FSIZE; SIGXFSZ ignored, so
    the kernel fails the write with EFBIG), a 40 KiB checkpoint saves and a 400 KiB one fails:
    the first stays whole and loadable."""
    script = textwrap.dedent(
        f"""
        import resource, signal, torch
        from pathlib import Path
        from lightning_troll.training.checkpoint_io import AtomicCheckpointIO, SaveFailed
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        target = Path({str(tmp_path / "last.ckpt")!r})
        io = AtomicCheckpointIO()
        io.save_checkpoint({{"w": torch.zeros(10_000)}}, target)
        try:
            io.save_checkpoint({{"w": torch.ones(100_000)}}, target)
        except SaveFailed as error:
            print(error)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (
        "File too large" in done.stdout and "the previous last.ckpt there is whole" in done.stdout
    )
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["w"].sum() == 0


@pytest.fixture
def small_file_system(tmp_path):
    """A tmpfs of 1 MiB mounted at tmp_path/disk (root only); skipped where it cannot be."""
    mount = tmp_path / "disk"
    mount.mkdir()

    def mount_with(size: int) -> Path:
        done = subprocess.run(
            [
                "mount",
                "-t",
                "tmpfs",
                "-o",
                f"size={size}",
                f"troll-{uuid.uuid4().hex[:6]}",
                str(mount),
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        return mount

    yield mount_with
    subprocess.run(["umount", str(mount)], capture_output=True)


def fit_command(tmp_path: Path, model_dir: Path, checkpoints: Path, steps: int, *extra: str):
    config = {
        "trainer": {"enable_progress_bar": False, "limit_val_batches": 0, "logger": False,
                    "max_steps": steps},
        "model": {"model": str(model_dir), "group_size": 4, "sampling": {"max_new_tokens": 4},
                  "optimization": {"minibatch_size": 8}},
        "data": {"batch_size": 2, "num_train": 16, "num_val": 0},
        "checkpoint": {"every_n_rollouts": 1, "dirpath": str(checkpoints)},
    }  # fmt: skip
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    base = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml"), "--config", str(path)]
    return [sys.executable, "-m", "lightning_troll.cli.command", *base, *extra]


@pytest.mark.slow
def test_a_full_disk_stops_the_run_in_one_line_and_the_kept_checkpoint_resumes(
    tmp_path, tiny_model_dir, small_file_system, monkeypatch
):
    """The checkpoints' file system holds one checkpoint and a half: the first save succeeds,
    the second finds no room. The run stops with exit status 3 and one line on stderr naming the
    folder; last.ckpt is the first save, whole; copied elsewhere, it resumes."""
    probe = tmp_path / "probe"
    command_here(fit_command(tmp_path, tiny_model_dir, probe, 1)[3:], tmp_path, monkeypatch)
    size = (probe / "last.ckpt").stat().st_size
    disk = small_file_system(int(size * 1.5))
    done = subprocess.run(fit_command(tmp_path, tiny_model_dir, disk, 3), cwd=tmp_path,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 3, done.stderr[-2000:]
    lines = [
        line
        for line in done.stderr.splitlines()
        if line.startswith("lightning-troll:") and "lightning-troll: warning:" not in line
    ]
    assert len(lines) == 1 and lines[0].startswith(
        f"lightning-troll: stopped: could not save {disk}"
    )
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in disk.iterdir()) == ["last.ckpt"]
    check_checkpoint_file(disk / "last.ckpt")
    kept = torch.load(disk / "last.ckpt", weights_only=True)
    assert kept["global_step"] == 1
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "last.ckpt").write_bytes((disk / "last.ckpt").read_bytes())
    resume = fit_command(tmp_path, tiny_model_dir, elsewhere, 2, "--ckpt_path",
                         str(elsewhere / "last.ckpt"))  # fmt: skip
    command_here(resume[3:], tmp_path, monkeypatch)  # after python -m ...command
    assert torch.load(elsewhere / "last.ckpt", weights_only=True)["global_step"] == 2


@pytest.mark.slow
def test_a_full_disk_under_the_logs_stops_the_run_in_one_line(
    tmp_path, tiny_model_dir, small_file_system, monkeypatch
):
    """The run's logs (TensorBoard's writer thread) fill their file system while the checkpoints
    live on another: one line naming the log folder and the checkpoint that is whole, exit status
    3, no traceback from the writer thread; the checkpoint resumes."""
    disk = small_file_system(24 * 1024)
    checkpoints = tmp_path / "ckpt"
    command = fit_command(tmp_path, tiny_model_dir, checkpoints, 12, "--trainer.logger", "true",
                          "--trainer.default_root_dir", str(disk))  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "Exception in thread" not in done.stderr
    lines = [
        line
        for line in done.stderr.splitlines()
        if line.startswith("lightning-troll:") and "lightning-troll: warning:" not in line
    ]
    kept = checkpoints / "last.ckpt"
    assert len(lines) == 1 and lines[0].startswith(
        f"lightning-troll: stopped: no space left on the device of {disk / 'lightning_logs'}"
    )
    assert lines[0].endswith(
        f"the last checkpoint, {kept}, is whole: resume with --ckpt_path {kept}"
    )
    step = torch.load(kept, weights_only=True)["global_step"]
    assert 1 <= step < 12
    resume = fit_command(tmp_path, tiny_model_dir, checkpoints, step + 1, "--ckpt_path", str(kept))
    command_here(resume[3:], tmp_path, monkeypatch)  # after python -m ...command
    assert torch.load(kept, weights_only=True)["global_step"] == step + 1


# -- a sharded checkpoint's folder -----------------------------------------------------------------


class FolderStrategy:
    """What :func:`install_atomic_saves` and :func:`save_folder_checkpoint` use of a strategy:
    one process that writes a folder of shard files (as FSDP2 does), raising ``fail`` after the
    first shard."""

    is_global_zero = True
    _save_distributed_checkpoint = True

    def __init__(self, tag: str, fail: BaseException | None = None) -> None:
        self.tag, self.fail = tag, fail
        self.barriers: list[str] = []
        self.broadcasts: list[object] = []

    def barrier(self, name: str) -> None:
        self.barriers.append(name)

    def broadcast(self, value):
        self.broadcasts.append(value)
        return value

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        path = Path(filepath)
        path.mkdir(parents=True)
        for i in range(2):
            (path / f"__{i}_0.distcp").write_text(self.tag)
            if self.fail is not None:
                raise self.fail
        (path / ".metadata").write_text(self.tag)
        (path / "meta.pt").write_text(self.tag)


def folder_tags(folder: Path) -> set[str]:
    return {f.read_text() for f in folder.iterdir()}


def save_folder(strategy: FolderStrategy, target: Path) -> None:
    """A save as every checkpoint callback makes it (``Trainer.save_checkpoint``), with the
    atomic saves installed as the command line and ``RolloutCheckpoint`` install them."""
    from lightning_troll.training.checkpoint_io import install_atomic_saves

    install_atomic_saves(strategy)
    strategy.save_checkpoint({}, target, storage_options=None)


def test_a_folder_checkpoint_is_swapped_in_whole_and_a_failed_one_leaves_the_old(tmp_path):
    """Every save of a strategy that writes folders (a user's ModelCheckpoint's too, which
    ``RolloutCheckpoint`` never sees) goes beside the target and is swapped in."""
    from lightning_troll.training.checkpoint_io import install_atomic_saves

    target = tmp_path / "last.ckpt"
    first = FolderStrategy("first")
    install_atomic_saves(first)
    installed = first.save_checkpoint
    install_atomic_saves(first)  # again: wrapped once
    assert first.save_checkpoint is installed
    first.save_checkpoint({}, target)
    assert folder_tags(target) == {"first"} and sorted(p.name for p in tmp_path.iterdir()) == [
        "last.ckpt"
    ]
    # every process waits for the others at each step: the first's steps alone tell how they went
    assert len(first.barriers) == 1 and first.broadcasts == [str(target), None, None]
    save_folder(FolderStrategy("second"), target)
    assert folder_tags(target) == {"second"} and [p.name for p in tmp_path.iterdir()] == [
        "last.ckpt"
    ]
    check_checkpoint_file(target)  # a whole folder passes the resume check
    with pytest.raises(KeyboardInterrupt):  # killed while writing a shard
        save_folder(FolderStrategy("third", KeyboardInterrupt()), target)
    assert folder_tags(target) == {"second"}
    full = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(SaveFailed, match=r"could not save .*last.ckpt: No space left on device .*"
                       r"the previous last.ckpt there is whole: free space, then resume with "
                       r"--ckpt_path"):  # fmt: skip
        wrapped = RuntimeError("the writer failed")  # as torch's writers report it
        wrapped.__cause__ = full
        save_folder(FolderStrategy("fourth", wrapped), target)
    assert folder_tags(target) == {"second"}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # the partial one's space freed
    # killed between the two renames: the old folder waits aside; the resume check names it,
    # and the next save puts it back before it writes
    target.rename(tmp_path / ".last.ckpt.old")
    with pytest.raises(
        CheckpointError, match=r"\.last\.ckpt\.old holds the checkpoint saved before"
    ):
        check_checkpoint_file(target)
    save_folder(FolderStrategy("fifth"), target)
    assert folder_tags(target) == {"fifth"} and [p.name for p in tmp_path.iterdir()] == [
        "last.ckpt"
    ]


def test_a_folder_that_lacks_a_part_is_refused_at_resume(tmp_path):
    target = tmp_path / "last.ckpt"
    FolderStrategy("x").save_checkpoint({}, target)
    (target / "meta.pt").unlink()
    with pytest.raises(
        CheckpointError, match=r"not a whole sharded checkpoint \(it lacks 'meta.pt'\)"
    ):
        check_checkpoint_file(target)


def _swap_on_two_processes(rank: int, port: int, target: str, outcomes: str) -> None:
    """One of two gloo processes saving a folder checkpoint, where the first process cannot
    rename the written folder into place; writes what it raised to ``outcomes``/<rank>."""
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_troll.training import checkpoint_io

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=timedelta(seconds=20),
    )  # fmt: skip

    class TwoProcesses:
        is_global_zero = rank == 0

        def barrier(self, name: str) -> None:
            dist.barrier()

        def broadcast(self, value):
            box = [value]
            dist.broadcast_object_list(box, src=0)
            return box[0]

    def write(path: Path) -> None:
        path.mkdir(exist_ok=True)
        (path / f"__{rank}_0.distcp").write_text("new")

    if rank == 0:
        real_rename = os.rename

        def rename(source, destination):
            if Path(source).name.startswith(".") and Path(source).name.endswith(".partial"):
                raise PermissionError(errno.EACCES, "Permission denied", str(source))
            real_rename(source, destination)

        checkpoint_io.os.rename = rename
    try:
        checkpoint_io.save_folder_checkpoint(TwoProcesses(), write, Path(target))
        outcome = "saved"
    except BaseException as error:  # noqa: BLE001 - the outcome under test
        outcome = f"{type(error).__name__}: {error}"
    Path(outcomes, str(rank)).write_text(outcome)
    dist.destroy_process_group()


def test_a_swap_that_fails_on_the_first_process_stops_every_process_at_once(tmp_path):
    """Two gloo processes: the first cannot rename the written folder into place. It raises its
    own error; the second raises SaveFailed naming it, at once, where it had waited at a barrier
    the first never reached until the collective's timeout. The previous folder stays whole."""
    import torch.multiprocessing as mp

    from lightning_troll.training.checkpoint_io import partial_path as partial
    from tests.test_multinode import free_port

    target = tmp_path / "last.ckpt"
    target.mkdir()
    (target / "__0_0.distcp").write_text("old")
    outcomes = tmp_path / "outcomes"
    outcomes.mkdir()
    mp.spawn(_swap_on_two_processes, args=(free_port(), str(target), str(outcomes)), nprocs=2)
    first, second = ((outcomes / str(rank)).read_text() for rank in range(2))
    assert first.startswith("PermissionError: [Errno 13] Permission denied"), first
    assert second.startswith(
        f"SaveFailed: could not save {target}: the first process failed (PermissionError: "
    ), second
    assert folder_tags(target) == {"old"}  # the written folder waits beside it, for the next
    assert folder_tags(partial(target)) == {"new"}  # save to clear
