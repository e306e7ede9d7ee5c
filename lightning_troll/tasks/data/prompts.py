"""Prompt records, their batching and shuffling, and local prompt files (json, jsonl, parquet).

The pieces of :mod:`lightning_troll.tasks.data.datamodule` that need no DataModule: :class:`PromptBatch` is what a
training step receives, :class:`EpochShuffleSampler` makes the order depend on (seed, epoch)
only, and :func:`read_rows` / :func:`write_jsonl` read and write local prompt files.
"""

from __future__ import annotations

import hashlib
import json
import string
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, DistributedSampler

__all__ = [
    "FILE_SUFFIXES",
    "PLAIN_TEMPLATE",
    "EpochShuffleSampler",
    "PromptBatch",
    "PromptItem",
    "ResumableLoader",
    "collate_prompts",
    "draw_prompts",
    "read_rows",
    "shared_in_order",
    "write_jsonl",
]

FILE_SUFFIXES = (".json", ".jsonl", ".parquet")
PLAIN_TEMPLATE = "{prompt}"
"""``data.template``'s default: the prompt as it is."""
# Suffixes that mean "a data file" even though this module cannot read them.
_OTHER_DATA_SUFFIXES = (".csv", ".tsv", ".txt", ".arrow", ".gz", ".zst", ".xlsx")


@dataclass
class PromptBatch:
    """The P prompts of one rollout (or one validation batch)."""

    prompts: list[str]
    """Formatted prompt texts, P of them."""
    prompt_ids: list[list[int]]
    """Unpadded token ids of each prompt, as the tokenizer gives them (BOS included if it adds one)."""
    rows: list[dict[str, Any]]
    """Copies of the dataset rows, the gold answer under ``"answer"`` and the prompt under
    ``"prompt"`` (:meth:`~lightning_troll.tasks.data.formatting.PromptFormatter.kept`)."""
    samples: int = 0
    """Validation batches: completions to sample per prompt besides the greedy one
    (``data.val_samples``, for pass@k); 0 for none."""
    counted: list[bool] | None = None
    """Validation batches: whether each prompt counts in the figures (false for the copies that
    pad a validation set shared out over processes, :func:`shared_in_order`); ``None``: all do."""

    def __len__(self) -> int:
        return len(self.prompts)


class PromptItem(NamedTuple):
    """One prepared prompt."""

    text: str
    ids: list[int]
    row: dict[str, Any]
    counted: bool = True
    """False for a copy that only pads a validation set shared out over processes."""


def collate_prompts(items: Sequence[PromptItem], samples: int = 0) -> PromptBatch:
    """Stacks prepared prompts into a :class:`PromptBatch` (lists, no padding; rows copied)."""
    return PromptBatch(
        prompts=[item.text for item in items],
        prompt_ids=[list(item.ids) for item in items],
        rows=[dict(item.row) for item in items],
        samples=samples,
        counted=None if all(item.counted for item in items) else [item.counted for item in items],
    )


def shared_in_order(
    items: Sequence[PromptItem], rank: int = 0, replicas: int = 1
) -> tuple[list[PromptItem], DistributedSampler | None]:
    """Validation rows shared out over ``replicas`` processes in order: process ``rank`` takes
    every ``replicas``-th row from its own. Where the rows do not share out evenly, uncounted
    copies of the first rows (``PromptItem.counted`` false) make up the difference, so that every
    process runs as many batches (generation under FSDP2 needs every process at every step);
    validation answers them and leaves them out of its figures. One process: the rows as they
    are, no sampler."""
    if replicas == 1:
        return list(items), None
    extra = (-len(items)) % replicas
    padded = [*items, *(items[i % len(items)]._replace(counted=False) for i in range(extra))]
    return padded, DistributedSampler(padded, replicas, rank, shuffle=False)


def draw_prompts(items: Sequence[PromptItem], count: int, seed: int, purpose: str) -> PromptBatch:
    """``count`` prompts drawn without replacement from ``items``, in an order that depends only
    on ``(seed, purpose)`` (dynamic sampling's extra rounds name the rank, rollout and round)."""
    order = torch.randperm(len(items), generator=seeded_generator(seed, purpose))[:count]
    return collate_prompts([items[i] for i in order.tolist()])


def seeded_generator(seed: int, purpose: str) -> torch.Generator:
    """A generator seeded by a stable hash of ``(seed, purpose)``.

    Hashing, because torch's CPU generator keeps only the low 32 bits of its seed: packing
    ``(seed, epoch)`` into one integer would make different seeds give the same order.
    """
    digest = hashlib.blake2b(f"{seed}-{purpose}".encode(), digest_size=4).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


class EpochShuffleSampler(DistributedSampler):
    """A permutation of ``range(size)`` that depends only on ``(seed, epoch)``, shared out so
    that the global batch does not depend on the number of processes.

    The permutation is cut into global batches of ``batch_size * replicas`` indices (a last
    partial one is dropped); process ``rank`` takes the ``rank``-th block of ``batch_size`` of
    each. Batch k of every process together is batch k of a single-process run with
    ``batch_size * replicas`` prompts, in the same order. Lightning calls ``set_epoch`` before
    every epoch, so epoch k is ordered the same way in every run and after a resume; being a
    ``DistributedSampler``, it is not wrapped in Lightning's own (which would reshuffle).
    """

    def __init__(
        self, size: int, seed: int, batch_size: int = 1, rank: int = 0, replicas: int = 1
    ) -> None:
        if not 0 <= rank < replicas or batch_size < 1:
            raise ValueError(
                f"EpochShuffleSampler: need 0 <= rank < replicas and batch_size >= 1; got "
                f"rank={rank}, replicas={replicas}, batch_size={batch_size}"
            )
        super().__init__(range(size), num_replicas=replicas, rank=rank, shuffle=False)
        self.size, self.seed, self.epoch, self.batch_size = size, seed, 0, batch_size
        self.batches = size // (batch_size * replicas)
        """Batches per epoch, the same on every process."""

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        if self.num_replicas == 1:
            return self.size
        return self.batches * self.batch_size

    def __iter__(self) -> Iterator[int]:
        generator = seeded_generator(self.seed, f"epoch-{self.epoch}")
        order = torch.randperm(self.size, generator=generator)
        if self.num_replicas == 1:
            return iter(order.tolist())
        width = self.batch_size
        mine = order[: self.batches * width * self.num_replicas].view(
            self.batches, self.num_replicas, width
        )[:, self.rank]  # (batches, batch_size)
        return iter(mine.flatten().tolist())


class ResumableLoader(DataLoader):
    """A DataLoader that resumes mid-epoch where a checkpoint left it.

    Lightning keeps the ``state_dict`` of a loader that has one in the fit loop's part of a
    checkpoint and hands it back through ``load_state_dict`` before training resumes; it then
    iterates the loader from the start of the interrupted epoch. The state is the epoch and the
    batches already trained on in it, read from ``position`` (the trainer's own counts: the loader
    cannot count them itself, Lightning fetches a batch ahead). The first pass over that epoch
    after ``load_state_dict`` skips those batches, so the resumed run sees the batches the
    interrupted one would have seen next. Batches are skipped after sampling (and sharding under
    DDP), so this holds for any sampler.

    Args:
        position: returns (epoch, batches finished in it); None: the loader never resumes.
        *args, **kwargs: those of :class:`~torch.utils.data.DataLoader`.
    """

    def __init__(
        self, *args: Any, position: Callable[[], tuple[int, int]] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.position = position
        self._resume_at: tuple[int, int] | None = None
        self._live: _Lookahead | None = None
        self._next: tuple[int, _Lookahead] | None = None
        """The next epoch's pass, built early by :meth:`peek` at the end of this one."""

    def state_dict(self) -> dict[str, int]:
        """The epoch and the batches finished in it (zeros without ``position``)."""
        epoch, batches = self.position() if self.position is not None else (0, 0)
        return {"epoch": epoch, "batches": batches}

    def load_state_dict(self, state_dict: Mapping[str, int]) -> None:
        """Makes the next pass over ``state_dict["epoch"]`` skip its finished batches."""
        self._resume_at = (int(state_dict["epoch"]), int(state_dict["batches"]))

    def __iter__(self) -> Iterator[Any]:
        ready, self._next = self._next, None
        epoch = getattr(self.sampler, "epoch", None)
        if ready is not None and ready[0] == epoch and self._resume_at is None:
            self._live = ready[1]  # the pass peek() began, for the epoch it began it for
        else:
            self._live = _Lookahead(self._batches())
        return self._live

    def peek(self) -> Any:
        """The batch the loader yields next, without taking it; what samples a rollout ahead
        reads it (:mod:`~lightning_troll.engines.process`). At the end of a pass, the
        next epoch's first batch: the pass over the next epoch is begun here, and the next
        ``iter()`` for that epoch continues it, so the batches are the ones it would yield
        anyway. None before the first pass, and at a pass's end where the sampler's order is not
        fixed by its epoch (a sampler without ``epoch`` and ``set_epoch``)."""
        if self._live is None:
            return None
        upcoming = self._live.peek()
        epoch = getattr(self.sampler, "epoch", None)
        if upcoming is not None or epoch is None or not hasattr(self.sampler, "set_epoch"):
            return upcoming
        if self._next is None:
            self.sampler.set_epoch(epoch + 1)
            try:
                ahead = _Lookahead(self._batches())
                ahead.peek()  # the sampler's order is drawn here, at the next epoch
            finally:
                self.sampler.set_epoch(epoch)
            self._next = (epoch + 1, ahead)
        return self._next[1].peek()

    def _batches(self) -> Iterator[Any]:
        # A generator: runs on the first next(), after Lightning has called set_epoch.
        iterator = super().__iter__()
        resume, self._resume_at = self._resume_at, None
        epoch = getattr(self.sampler, "epoch", 0)
        if resume is not None and resume[0] == epoch and 0 < resume[1] < len(self):
            for _ in range(resume[1]):
                next(iterator)
        yield from iterator


class _Lookahead:
    """An iterator that can show its next item without giving it."""

    def __init__(self, iterator: Iterator[Any]) -> None:
        self.iterator, self.ahead = iterator, []

    def __iter__(self) -> _Lookahead:
        return self

    def __next__(self) -> Any:
        return self.ahead.pop() if self.ahead else next(self.iterator)

    def peek(self) -> Any:
        if not self.ahead:
            try:
                self.ahead.append(next(self.iterator))
            except StopIteration:
                return None
        return self.ahead[0]


def write_jsonl(path: str | Path, rows: Iterable[Mapping[str, Any]]) -> Path:
    """Writes one JSON object per line (UTF-8), creating parent folders; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as file:
        for row in rows:
            file.write(json.dumps(dict(row), ensure_ascii=False) + "\n")
    return path


def read_rows(path: str | Path, option: str | None = None) -> list[dict[str, Any]]:
    """Rows of a local file: ``.jsonl`` (one object a line), ``.json`` (a list of objects, or
    JSON lines) or ``.parquet``. Errors name ``option`` (``data.source``), the file and the line."""
    return read_rows_with_lines(path, option)[0]


def read_rows_with_lines(
    path: str | Path, option: str | None = None
) -> tuple[list[dict[str, Any]], list[int]]:
    """:func:`read_rows` and, per row, where it is in the file: its line (JSON lines), or its
    1-based place in the list (a ``.json`` list, ``.parquet``)."""
    path = Path(path).expanduser()
    where = f"{option}={str(path)!r}" if option else str(path)
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        return rows, list(range(1, len(rows) + 1))
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ValueError(
            f"{where}, line {line}, column {column}: not UTF-8 text (byte "
            f"0x{raw[exc.start]:02x}); save the file as UTF-8"
        ) from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            pass  # perhaps JSON lines under a .json name
        else:
            if not isinstance(data, list) or not all(isinstance(row, dict) for row in data):
                raise ValueError(f"{where}: expected a list of objects (or JSON lines)")
            return data, list(range(1, len(data) + 1))
    rows, lines = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}, line {number}: not valid JSON ({exc.msg})") from exc
            if not isinstance(row, dict):
                raise ValueError(f"{where}, line {number}: expected an object, got {row!r:.60}")
            rows.append(row)
            lines.append(number)
    return rows, lines


def looks_like_file(source: str) -> bool:
    """A file name or path rather than a hub name (``owner/name`` has exactly one ``/``)."""
    return (
        source.lower().endswith(FILE_SUFFIXES + _OTHER_DATA_SUFFIXES)
        or source.startswith(("/", "./", "../", "~"))
        or "\\" in source
        or source.count("/") >= 2
    )


def check_file(option: str, value: str) -> None:
    path = Path(value).expanduser()
    allowed = "give a .json, .jsonl or .parquet file"
    if option == "data.source":
        allowed += ", the built-in 'tinymath', or a hub dataset name"
    if path.is_dir():
        raise ValueError(f"{option}: {value!r} is a folder, not a file; {allowed}")
    if not path.is_file():
        raise ValueError(f"{option}: file {value!r} does not exist; {allowed}")
    if path.suffix.lower() not in FILE_SUFFIXES:
        raise ValueError(f"{option}: cannot read {path.suffix!r} files ({value!r}); {allowed}")


def template_fields(template: str) -> set[str]:
    """The row fields a format string uses: ``"Q: {question}"`` -> ``{"question"}``."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"data.template={template!r} is not a valid format string: {exc}") from exc
    fields = set()
    for _, name, _, _ in parsed:
        if name is None:
            continue
        root = name.split(".")[0].split("[")[0]
        if not root or root.isdigit():
            raise ValueError(
                f"data.template={template!r} has a positional field {{{name}}}; name a row field, "
                "e.g. 'Question: {question}' ({prompt} is the data.prompt_field value)"
            )
        fields.add(root)
    return fields


def check_count(option: str, value: int | None, minimum: int, none_ok: bool) -> None:
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = f"an integer >= {minimum}" + (" or None" if none_ok else "")
        raise ValueError(f"data.{option} must be {allowed}; got {value!r}")
