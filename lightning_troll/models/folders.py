"""Model folders written whole or not at all: synced to disk, then swapped in by renames.

:func:`replace_folder` moves a complete staging folder to its final name; an existing folder
there is set aside first and removed only once the new one is in place, and put back if the
move fails, so at every moment one whole folder answers to the name. :func:`sync_tree` makes the
contents durable before such a rename, so that a power cut cannot leave the new name pointing at
files that never reached the disk. Checkpoints, exports and GGUF conversions all go through them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

__all__ = ["remove_entry", "replace_folder", "sync_directory", "sync_tree"]


def remove_entry(path: Path) -> None:
    """Removes ``path``, a folder (with everything in it), a file or a link, if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def sync_directory(directory: Path) -> None:
    """Syncs ``directory``'s entries (a rename inside it) where the file system allows it."""
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


def sync_tree(folder: Path, files: bool = True) -> None:
    """Syncs every file under ``folder`` (unless ``files`` is false), then ``folder`` itself, so
    that a rename of it that follows cannot land before its contents."""
    if files:
        for file in (f for f in folder.rglob("*") if f.is_file()):
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
    sync_directory(folder)


def replace_folder(target: Path, staging: Path, aside: Path | None = None) -> None:
    """Moves the complete ``staging`` folder to ``target``; an existing ``target`` is set aside
    first (at ``aside``, by default ``<staging name>.old`` beside it) and removed only once the
    new one is in place, and put back if the move fails."""
    old = None
    if target.exists():
        old = aside if aside is not None else target.with_name(f"{staging.name}.old")
        remove_entry(old)  # left by a swap killed between its renames: the target is whole
        target.rename(old)
    try:
        staging.rename(target)
    except BaseException:
        if old is not None:  # the previous one back in place; the move's own error is raised
            with contextlib.suppress(OSError):
                old.rename(target)
        raise
    sync_directory(target.parent)
    if old is not None:
        remove_entry(old)
