"""Model folders written whole or not at all: synced to disk, then swapped in by renames.

:func:`replace_folder` moves a complete staging folder to its final name; an existing folder
there is set aside first and removed only once the new one is in place, and put back if the
move fails, so at every moment one whole folder answers to the name. :func:`sync_tree` makes the
contents durable before such a rename, so that a power cut cannot leave the new name pointing at
files that never reached the disk. Checkpoints, exports and GGUF conversions all go through them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["replace_folder", "sync_directory", "sync_tree"]


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


def replace_folder(target: Path, staging: Path) -> None:
    """Moves the complete ``staging`` folder to ``target``; an existing ``target`` is set aside
    first (as ``<staging name>.old``) and removed only once the new one is in place, and put back
    if the move fails."""
    old = None
    if target.exists():
        old = target.with_name(f"{staging.name}.old")
        if old.exists():  # left by a swap killed between its renames: the target is whole
            shutil.rmtree(old)
        target.rename(old)
    try:
        staging.rename(target)
    except BaseException:
        if old is not None:
            old.rename(target)
        raise
    sync_directory(target.parent)
    if old is not None:
        shutil.rmtree(old)
