"""Checkpoints that a failed save cannot destroy: written beside their final name, synced, renamed.

Lightning's own ``TorchCheckpointIO`` writes a checkpoint to a file in the system's temporary
directory and moves it into place; where that directory is on another file system (a tmpfs
``/tmp``, say) the move is a copy over the old file, which a full disk or a kill cuts short, and
the run's only checkpoint is lost. :class:`AtomicCheckpointIO` writes to a hidden partial file in
the checkpoint's own directory (:func:`partial_path`), flushes and syncs it, then renames it over the old checkpoint (an
atomic step on every local file system) and syncs the directory. A save that fails (a full disk,
a file-size limit, a signal) removes its partial file and leaves the previous checkpoint whole;
a full disk raises :class:`SaveFailed`, which the ``lightning-troll`` command prints in one line.
Remote paths (``s3://``, ...) go through Lightning's own save; a ``file://`` path is local.

A sharded checkpoint (FSDP2's folder, which every process writes its part of and no checkpoint IO
sees) is saved as safely by :func:`save_folder_checkpoint`: into a hidden folder beside it, then
swapped in by two renames once every process has written. :func:`install_atomic_saves` puts both
in place for every save of a trainer's strategy, a user's own ``ModelCheckpoint`` included.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from lightning_troll.models.folders import (
    remove_entry,
    replace_folder,
    sync_directory,
    sync_tree,
)
from lightning_troll.training.checkpoints import aside_path
from lightning_troll.training.faults import RunFault

__all__ = [
    "AtomicCheckpointIO",
    "SaveFailed",
    "install_atomic_saves",
    "partial_path",
    "remove_partial_files",
    "save_folder_checkpoint",
    "writes_folders",
]

NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
"""Errors of a write that ran out of room: the file system, a quota, a file-size limit."""


class SaveFailed(RunFault):
    """A checkpoint could not be written (for want of space, or on another process); the
    previous one is whole."""


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
    process killed while saving leaves it behind; the next save of ``target`` overwrites it, and
    the next run's start in that folder removes it (:func:`remove_partial_files`)."""
    return target.with_name(f".{target.name}.partial")


def _locked(file: Any) -> bool:
    """Takes ``file``'s exclusive lock (held until it is closed), without waiting: False where
    another open file holds it (a save in progress), True where taken or where the system has
    no such locks."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        return True
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def remove_partial_files(folder: str | Path) -> list[Path]:
    """Removes from ``folder`` the partial files (:func:`partial_path`) of saves that a kill cut
    short, and returns them. A save holds its partial file locked while it writes, so the file of
    another run's save in progress in the same folder is left alone. (A sharded save's partial
    folder is cleared by its next save.)"""
    removed = []
    for partial in Path(folder).glob(".*.partial"):
        with contextlib.suppress(OSError), open(partial, "rb") as file:
            if partial.is_file() and _locked(file):
                partial.unlink()
                removed.append(partial)
    return removed


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves are atomic in the checkpoint's own directory
    (module docstring)."""

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        local = str(path).removeprefix("file://")
        if "://" in local:
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        target = Path(local).expanduser()
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = partial_path(target)
        writes = _Writes()
        try:
            with open(partial, "wb") as file:
                _locked(file)  # a start in this folder leaves the file of a save in progress
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
                raise SaveFailed(_no_space(target, cause, tensor_bytes(checkpoint))) from error
            raise
        sync_directory(target.parent)


def _no_space(target: Path, error: OSError, needs: int | None = None) -> str:
    """The message of a save of ``target`` that ran out of room (``needs``: its bytes, if known)."""
    free = _gib(shutil.disk_usage(target.parent).free)
    size = "" if needs is None else f"; the checkpoint needs about {_gib(needs)}"
    kept = (
        f"the previous {target.name} there is whole: free space, then resume with "
        f"--ckpt_path {target}"
        if target.exists()
        else f"there was no {target.name} there before"
    )
    return (
        f"could not save {target}: {os.strerror(error.errno)} ({free} free in "
        f"{target.parent}{size}); {kept}"
    )


def install_atomic_saves(strategy: Any) -> None:
    """Makes every save of ``strategy`` atomic: one that writes folders saves each through
    :func:`save_folder_checkpoint`; one that writes files gets an :class:`AtomicCheckpointIO`
    where it saves through Lightning's default ``TorchCheckpointIO`` (a checkpoint IO of one's own
    is kept). Calling it again changes nothing."""
    if writes_folders(strategy):
        save = strategy.save_checkpoint
        if getattr(save, "swaps_folders", False):
            return

        def save_checkpoint(checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
            target = Path(strategy.broadcast(str(filepath)))  # the first process's path
            save_folder_checkpoint(
                strategy, lambda path: save(checkpoint, path, storage_options), target
            )

        save_checkpoint.swaps_folders = True  # type: ignore[attr-defined]
        strategy.save_checkpoint = save_checkpoint
    elif type(strategy.checkpoint_io) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()


def writes_folders(strategy: Any) -> bool:
    """Whether ``strategy`` saves a folder of shards, past any checkpoint IO (FSDP2's
    distributed checkpoint, FSDP's sharded state dict)."""
    return bool(getattr(strategy, "_save_distributed_checkpoint", False)) or (
        getattr(strategy, "_state_dict_type", None) == "sharded"
    )


def _no_space_cause(error: BaseException) -> OSError | None:
    """The out-of-room ``OSError`` behind ``error`` (torch's writers wrap it), if one is."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in NO_SPACE:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _on_the_first(strategy: Any, target: Path, action: Callable[[], None]) -> None:
    """Runs ``action`` on the first process, then tells every process how it went (a barrier
    that carries the outcome): where it raised, the first process raises that, and every other
    one :class:`SaveFailed` naming it, instead of waiting at a barrier the first never reaches
    until the collective's timeout."""
    error: BaseException | None = None
    if strategy.is_global_zero:
        try:
            action()
        except BaseException as raised:  # noqa: BLE001 - told to the others, then raised
            error = raised
    outcome = strategy.broadcast(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if outcome is not None:
        raise SaveFailed(f"could not save {target}: the first process failed ({outcome})")


def save_folder_checkpoint(strategy: Any, write: Callable[[Path], None], target: Path) -> None:
    """A folder checkpoint of ``strategy`` saved as ``target`` (every process calls it):
    ``write(path)`` writes it to :func:`partial_path`, which is synced, then the first process
    renames the old ``target`` to :func:`aside_path`, the new folder to ``target``, and removes
    the old one. A save cut short (a kill, a full disk) leaves the previous ``target`` whole; one
    killed between the renames leaves it at the aside path, which the next save puts back first.
    Where a step of the first process alone fails, every process raises (:func:`_on_the_first`)."""
    partial, aside = partial_path(target), aside_path(target)

    def clear() -> None:
        if aside.exists() and not target.exists():  # a swap cut short: the previous one
            os.rename(aside, target)
        for leftover in (partial, aside):
            remove_entry(leftover)

    def swap() -> None:
        sync_tree(partial)
        replace_folder(target, partial, aside)

    _on_the_first(strategy, target, clear)
    try:
        write(partial)
    except BaseException as error:
        cause = _no_space_cause(error)
        if cause is not None:
            if strategy.is_global_zero:  # the space it held is what the user must free
                with contextlib.suppress(OSError):
                    remove_entry(partial)
            raise SaveFailed(_no_space(target, cause)) from error
        raise
    strategy.barrier("save_folder_checkpoint: written")
    _on_the_first(strategy, target, swap)
