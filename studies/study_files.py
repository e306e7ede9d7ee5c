"""Writing a study's files: whole or not at all, and one process at a time."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["locked", "write_atomic"]


def write_atomic(path: Path, text: str) -> None:
    """Writes ``text`` beside ``path`` (a name of this process's own), then moves it into
    place."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(text)
    partial.replace(path)


@contextmanager
def locked(folder: Path) -> Iterator[None]:
    """Holds ``folder``'s write lock: processes that share a study's folder (one per seed, or per
    objective) read, merge and write its records one at a time, so none drops another's run or
    writes into the file another is writing."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".records.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
