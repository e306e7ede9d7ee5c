"""What ``lightning-troll`` keeps off its first screen: library notices a user cannot act on.

Each filter names the notice it drops and why; anything else a library says still shows.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["quiet_library_notices"]

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


def quiet_library_notices() -> None:
    """Installs the filters (idempotent)."""
    # Lightning's own pytree helper calls isinstance(..., LeafSpec), which torch deprecates: a
    # notice to Lightning's developers, raised in Lightning's code on every fit.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    for name in _RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTips) for f in logger.filters):
            logger.addFilter(_DropTips())
