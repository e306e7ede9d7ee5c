"""What ``lightning-troll`` keeps off its first screen: library notices a user cannot act on.

Each filter names the notice it drops and why; anything else a library says still shows.
"""

from __future__ import annotations

import importlib.util
import logging
import warnings
from pathlib import Path

__all__ = ["OWN_CODE", "own_warning_format", "quiet_library_notices"]

OWN_CODE = (
    Path(__file__).resolve().parents[1],
    Path(importlib.util.find_spec("lightning_troll.callbacks").origin).resolve().parent,
)
"""The package's folder and its callbacks' (inside it once installed; beside it in a development
checkout): a warning raised from a file under either is the library's own."""

_RANK_ZERO_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
)


_DROPPED = (
    # an advertisement for a cloud logger, printed on every fit
    "💡 Tip:",
    # the command's own summary (callbacks/summary.py) replaces Lightning's: nothing to act on
    "Trainer already configured with model summary callbacks",
)


class _DropTips(logging.Filter):
    """Drops Lightning's info lines that start as one of ``_DROPPED``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_DROPPED)


_PLAIN_FORMAT = warnings.formatwarning


def own_warning_format(message, category, filename, lineno, line=None) -> str:
    """The library's own warnings as one line, ``lightning-troll: warning: ...``, as its errors
    are written (the file and line of the library's code say nothing to a user); any other
    warning as Python writes it."""
    try:
        own = any(Path(filename).resolve().is_relative_to(root) for root in OWN_CODE)
    except (OSError, ValueError):
        own = False
    if not own:
        return _PLAIN_FORMAT(message, category, filename, lineno, line)
    return f"lightning-troll: warning: {message}\n"


def quiet_library_notices() -> None:
    """Installs the filters and the one-line format of the library's own warnings
    (idempotent)."""
    warnings.formatwarning = own_warning_format
    # Lightning's own pytree helper calls isinstance(..., LeafSpec), which torch deprecates: a
    # notice to Lightning's developers, raised in Lightning's code on every fit.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    for name in _RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTips) for f in logger.filters):
            logger.addFilter(_DropTips())
