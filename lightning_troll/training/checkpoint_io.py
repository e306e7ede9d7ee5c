"""Checkpoints that a failed save cannot destroy: written beside their final name, synced, renamed.

Lightning's own ``TorchCheckpointIO`` writes a checkpoint to a file in the system's temporary
directory and moves it into place; where that directory is on another file system (a tmpfs
``/tmp``, say) the move is a copy over the old file, which a full disk or a kill cuts short, and
the run's only checkpoint is lost. :class:`AtomicCheckpointIO` writes to a hidden partial file in
the checkpoint's own directory (:func:`partial_path`), flushes and syncs it, then renames it over the old checkpoint (an
atomic step on every local file system) and syncs the directory. A save that fails (a full disk,
a file-size limit, a signal) removes its partial file and leaves the previous checkpoint whole;
a full disk raises :class:`SaveFailed`, which the ``lightning-troll`` command prints in one line.
Remote paths (``s3://``, ...) go through Lightning's own save.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from lightning_troll.training.faults import RunFault

__all__ = ["AtomicCheckpointIO", "SaveFailed", "install_atomic_saves", "partial_path"]

NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
"""Errors of a write that ran out of room: the file system, a quota, a file-size limit."""


class SaveFailed(RunFault):
    """A checkpoint could not be written for want of space; the previous one is whole."""


def _gib(size: float) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**28 else f"{size / 2**20:.1f} MiB"


def tensor_bytes(value: Any) -> int:
    """The bytes of every tensor in a checkpoint's (nested) dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


class _Writes:
    """A file's ``write`` for ``torch.save`` that keeps the first ``OSError`` a write raised."""

    def __init__(self) -> None:
        self.file: Any = None
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.file.write(data)
        except OSError as error:
            self.error = self.error or error
            raise

    def flush(self) -> None:
        self.file.flush()


def partial_path(target: Path) -> Path:
    """Where a save of ``target`` is written before its rename: a hidden file beside it. A
    process killed while saving leaves it behind; the next save of ``target`` overwrites it."""
    return target.with_name(f".{target.name}.partial")


def _sync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # a file system that cannot open directories: the rename stands
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves are atomic in the checkpoint's own directory
    (module docstring)."""

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        target = Path(path).expanduser()
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = partial_path(target)
        writes = _Writes()
        try:
            with open(partial, "wb") as file:
                writes.file = file
                torch.save(checkpoint, writes)
                file.flush()
                os.fsync(file.fileno())
            os.replace(partial, target)
        except BaseException as error:
            partial.unlink(missing_ok=True)
            # torch's zip writer reports a failed write as its own RuntimeError: the OSError
            # behind it is the one the writes met
            cause = error if isinstance(error, OSError) else writes.error
            if cause is not None and cause.errno in NO_SPACE:
                raise SaveFailed(self._no_space(target, checkpoint, cause)) from error
            raise
        _sync_directory(target.parent)

    @staticmethod
    def _no_space(target: Path, checkpoint: dict[str, Any], error: OSError) -> str:
        free = shutil.disk_usage(target.parent).free
        kept = (
            f"the previous {target.name} there is whole: free space, then resume with "
            f"--ckpt_path {target}"
            if target.exists()
            else "no checkpoint was written before"
        )
        return (
            f"could not save {target}: {os.strerror(error.errno)} ({_gib(free)} free in "
            f"{target.parent}; the checkpoint needs about {_gib(tensor_bytes(checkpoint))}); {kept}"
        )


def install_atomic_saves(strategy: Any) -> None:
    """Gives ``strategy`` an :class:`AtomicCheckpointIO` where it saves through Lightning's
    default ``TorchCheckpointIO``; a checkpoint IO of one's own is kept."""
    if type(strategy.checkpoint_io) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()
