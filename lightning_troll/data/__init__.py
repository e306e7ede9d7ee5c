"""Prompts for rollouts: the ``data`` section's DataModule, row sources, prompt records.

- :mod:`~lightning_troll.data.datamodule`: :class:`PromptDataModule`;
- :mod:`~lightning_troll.data.sources`: where rows come from (TinyMath, a file, a hub dataset);
- :mod:`~lightning_troll.data.prompts`: prompt records, batching, shuffling, files.
"""

from lightning_troll.data.datamodule import (
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
