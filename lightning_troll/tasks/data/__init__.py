"""Prompts for rollouts: the ``data`` section's DataModule, row sources, prompt records.

- :mod:`~lightning_troll.tasks.data.datamodule`: :class:`PromptDataModule`;
- :mod:`~lightning_troll.tasks.data.sources`: where rows come from (TinyMath, a file, a hub dataset);
- :mod:`~lightning_troll.tasks.data.prompts`: prompt records, batching, shuffling, files.

Importing one of its modules (``lightning_troll.tasks.data.messages``, say) does not import Lightning:
the names below are loaded from the DataModule's module when first read.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_troll.tasks.data.datamodule import (
        EpochShuffleSampler,
        PromptBatch,
        PromptDataModule,
        PromptItem,
        collate_prompts,
        read_rows,
        write_jsonl,
    )

__all__ = [
    "EpochShuffleSampler",
    "PromptBatch",
    "PromptDataModule",
    "PromptItem",
    "collate_prompts",
    "read_rows",
    "write_jsonl",
]


def __getattr__(name: str) -> Any:
    """The DataModule's names, imported on first use (module ``__getattr__``, PEP 562)."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("lightning_troll.tasks.data.datamodule"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
