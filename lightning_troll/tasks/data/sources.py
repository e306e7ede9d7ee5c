"""Where prompt rows come from: the TinyMath generator, a local file or a hub dataset.

:class:`PromptSource` checks the ``data.*`` options that say where the rows are and how many to
take, and reads the training and validation rows as plain dicts. A local source file without a
``val_file`` is split into training and held-out rows by ``seed``. Formatting and tokenizing the
rows is :class:`~lightning_troll.tasks.data.datamodule.PromptDataModule`'s job; reading local files is in
:mod:`lightning_troll.tasks.data.prompts`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch

from lightning_troll.tasks.data.prompts import (
    check_count,
    check_file,
    looks_like_file,
    read_rows_with_lines,
    seeded_generator,
)

__all__ = ["PromptSource", "check_holdout"]


def check_holdout(source: str, num_val: int, size: int) -> None:
    """Refuses holding ``num_val`` validation rows out of the ``size`` rows of the local file
    ``source`` (no ``data.val_file``) where that leaves no training row."""
    if size == 0:
        raise ValueError(f"data.source={source!r} holds no rows (an empty file)")
    if num_val >= size:
        raise ValueError(
            f"data.num_val={num_val} would hold out every row of {source!r} ({size} rows); "
            "lower it, or give data.val_file"
        )


class PromptSource:
    """The rows of a run's prompts; the arguments are the ``data.*`` options of the same names
    (see :class:`~lightning_troll.tasks.data.datamodule.PromptDataModule`), checked here."""

    def __init__(
        self,
        source: str,
        dataset_config: str | None,
        train_split: str,
        val_split: str,
        num_train: int | None,
        num_val: int | None,
        seed: int,
        val_file: str | None,
    ) -> None:
        if not isinstance(source, str) or not source:
            raise ValueError(f"data.source must be a non-empty string; got {source!r}")
        self.kind: Literal["tinymath", "file", "hub"]
        if source == "tinymath":
            self.kind = "tinymath"
            check_count("num_train", num_train, 1, none_ok=False)
            check_count("num_val", num_val, 0, none_ok=val_file is not None)  # None: every row
        else:
            path = Path(source).expanduser()
            self.kind = "file" if path.is_file() or looks_like_file(source) else "hub"
            if self.kind == "file":
                check_file("data.source", source)
            check_count("num_train", num_train, 0, none_ok=True)
            holdout = self.kind == "file" and val_file is None
            check_count("num_val", num_val, 0, none_ok=not holdout)
        if val_file is not None:
            check_file("data.val_file", val_file)
        self.source, self.dataset_config, self.val_file = source, dataset_config, val_file
        self.train_split, self.val_split = train_split, val_split
        self.num_train, self.num_val, self.seed = num_train, num_val, seed
        self.lines: dict[str, list[int]] = {}
        """split -> the line of each row read in its file (1-based, as an editor counts), where
        the rows come from a local file."""

    def describe(self, split: str = "train") -> str:
        """The source (or validation file) of ``split``'s rows, for messages."""
        if split == "validation" and self.val_file is not None:
            return repr(self.val_file)
        return repr(self.source)

    def download(self) -> None:
        """Loads a hub dataset's splits once, so that later reads come from the cache."""
        if self.kind == "hub":
            self._load_hub(self.train_split, None)
            if self.val_file is None and self.num_val != 0:
                self._load_hub(self.val_split, None)

    def train_rows(self) -> list[dict[str, Any]]:
        """The training rows: at most ``num_train`` (TinyMath: exactly), minus held-out rows."""
        if self.kind == "tinymath":
            from lightning_troll.models.tinymath import generate_problems

            return generate_problems(self.num_train, seed=self.seed, split=self.train_split)
        if self.kind == "hub":
            return self._load_hub(self.train_split, self.num_train)
        rows, lines = read_rows_with_lines(self.source, "data.source")
        kept = list(range(len(rows)))
        if self.val_file is None:
            kept = self._holdout(len(rows))[0]
        kept = kept[: self.num_train or None]
        self.lines["train"] = [lines[i] for i in kept]
        return [rows[i] for i in kept]

    def val_rows(self) -> list[dict[str, Any]]:
        """The validation rows: from ``val_file``, the validation split, or held out of a file."""
        if self.num_val == 0:
            return []
        if self.val_file is not None:
            rows, lines = read_rows_with_lines(self.val_file, "data.val_file")
            self.lines["validation"] = lines[: self.num_val]
            return rows[: self.num_val]
        if self.kind == "tinymath":
            from lightning_troll.models.tinymath import generate_problems

            return generate_problems(self.num_val, seed=self.seed, split=self.val_split)
        if self.kind == "hub":
            return self._load_hub(self.val_split, self.num_val)
        rows, lines = read_rows_with_lines(self.source, "data.source")
        held = self._holdout(len(rows))[1]
        self.lines["validation"] = [lines[i] for i in held]
        return [rows[i] for i in held]

    def _holdout(self, size: int) -> tuple[list[int], list[int]]:
        """(train indices, validation indices) of a local file, both in file order."""
        check_holdout(self.source, self.num_val, size)
        order = torch.randperm(size, generator=seeded_generator(self.seed, "holdout")).tolist()
        return sorted(order[self.num_val :]), sorted(order[: self.num_val])

    def _load_hub(self, split: str, cap: int | None) -> list[dict[str, Any]]:
        import datasets

        try:
            data = datasets.load_dataset(self.source, self.dataset_config, split=split)
        except Exception as exc:  # not found, offline, bad config or split: say which option
            raise ValueError(
                f"data.source={self.source!r} (data.dataset_config={self.dataset_config!r}, "
                f"split {split!r}): datasets.load_dataset failed: {exc}. Local files need a "
                ".json, .jsonl or .parquet suffix"
            ) from exc
        if cap:
            data = data.select(range(min(cap, len(data))))
        return data.to_list()
