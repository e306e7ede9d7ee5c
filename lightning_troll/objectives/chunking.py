"""Chunks of response rows: the output layer applied to a few rows of hidden states at a time.

Per response token the loss and the cached old distributions need only a handful of numbers
computed from that token's logit row (a log-prob, an entropy, a sparse top-K). Computing them
from ``(n, H)`` hidden states ``n`` rows at a time bounds the logits held at once to ``(n, V)``
instead of ``(N, V)``. Nothing here imports Lightning or transformers.

Notation: N response tokens (rows), n rows of one chunk, H hidden size, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from lightning_troll.trust_region.replay import Replay

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "HiddenRows",
    "check_chunk_size",
    "head_logits",
    "map_row_chunks",
    "row_chunks",
]

T = TypeVar("T")

DEFAULT_CHUNK_SIZE = 1024
"""Rows per chunk by default: (1024, 151936) float32 logits take 622 MB."""


def check_chunk_size(size: int | None, option: str) -> None:
    """Raises ``ValueError`` naming ``option`` unless ``size`` is None or an integer >= 1."""
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(f"{option} must be null (no chunks) or an integer >= 1; got {size!r}")


def row_chunks(n: int, size: int | None) -> list[slice]:
    """Consecutive slices of at most ``size`` rows covering ``range(n)``; one slice when ``size``
    is None or ``n`` is 0 (so an empty batch still makes one, empty, chunk)."""
    if size is None or n <= size:
        return [slice(0, n)]
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def head_logits(head: Callable[[Tensor], Tensor], hidden: Tensor, temperature: float) -> Tensor:
    """``head(hidden) / temperature``: ``(n, H)`` hidden states -> ``(n, V)`` logits."""
    logits = head(hidden)  # (n, V)
    return logits if temperature == 1 else logits / temperature


@dataclass(frozen=True)
class HiddenRows:
    """Logit rows held as hidden states: ``head(hidden) / temperature`` made on demand, so a
    chunk of rows (:meth:`select`) costs ``(n, V)`` logits only when :meth:`logits` is called."""

    hidden: Tensor
    """(N, H) hidden states (the output layer's input)."""
    head: Callable[[Tensor], Tensor]
    """The output layer, ``(n, H) -> (n, V)``."""
    temperature: float = 1.0

    @property
    def num_rows(self) -> int:
        return self.hidden.shape[0]

    def select(self, rows: Tensor | slice) -> HiddenRows:
        return HiddenRows(self.hidden[rows], self.head, self.temperature)

    def logits(self) -> Tensor:
        """(N, V) the rows' logits."""
        return head_logits(self.head, self.hidden, self.temperature)


def map_row_chunks(fn: Callable[..., T], rows: Tensor, size: int | None, *per_row: Any) -> list[T]:
    """``fn(rows[s], *(a[s] for a in per_row))`` for every chunk ``s`` of :func:`row_chunks`.

    ``per_row`` holds tensors indexed by row or objects with a ``select(rows)`` method (a
    ``SparseDistribution``), or None (passed on as None). With several chunks and autograd
    recording, each call runs under ``torch.utils.checkpoint``: the forward keeps only the
    chunk's inputs and outputs, and the backward recomputes one chunk at a time, so no more than
    one chunk's ``(n, V)`` intermediates exist at once. ``fn`` must be deterministic; what it
    computes through :func:`~lightning_troll.trust_region.replay.replayed` (the projection's
    eta*) the recomputation takes from the forward pass.
    """
    chunks = row_chunks(rows.shape[0], size)
    checkpointed = len(chunks) > 1 and torch.is_grad_enabled()
    results = []
    for part in chunks:
        args = [rows[part], *(_take(a, part) for a in per_row)]
        if checkpointed:
            replay = Replay()
            results.append(checkpoint(fn, *args, use_reentrant=False, context_fn=replay.contexts))
        else:
            results.append(fn(*args))
    return results


def _take(value: Any, part: slice) -> Any:
    """``value``'s rows ``part``: tensors are sliced, other objects asked to ``select``."""
    if value is None:
        return None
    return value[part] if isinstance(value, Tensor) else value.select(part)
