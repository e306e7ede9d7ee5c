"""Values a checkpointed chunk computed in its forward pass, handed back when the backward pass
recomputes the chunk.

A chunk of the loss that runs under activation checkpointing
(:func:`~lightning_troll.objectives.chunking.map_row_chunks`) runs twice: in the forward pass, and
again in the backward pass to rebuild its graph. The second run computes exactly what the first
did. Where that is a value without a gradient whose reading waits on the device (the root
finder's eta*, and the counts of rows that fix tensor shapes), :func:`replayed` hands back the
first run's value: the recomputation then neither waits on the device nor repeats the root
finder's work, and every value it computes is the one the forward pass used.

Outside a checkpointed chunk :func:`replayed` just computes. Nothing here imports Lightning or
transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, TypeVar

__all__ = ["Replay", "replayed"]

T = TypeVar("T")

_ACTIVE: ContextVar[_Scope | None] = ContextVar("lightning_troll_replay", default=None)


class Replay:
    """The values one chunk's forward pass recorded, in order; :meth:`contexts` is the
    ``context_fn`` of :func:`torch.utils.checkpoint.checkpoint` (``use_reentrant=False``)."""

    def __init__(self) -> None:
        self.values: list[Any] = []

    def contexts(self) -> tuple[_Scope, _Scope]:
        """The forward pass's context, which records, and the recomputation's, which replays
        (it may be entered more than once, as a backward pass with ``retain_graph`` does)."""
        return _Scope(self, replaying=False), _Scope(self, replaying=True)


class _Scope:
    """Makes a :class:`Replay` the one :func:`replayed` uses, recording or replaying."""

    def __init__(self, replay: Replay, replaying: bool) -> None:
        self.replay, self.replaying, self.position = replay, replaying, 0
        self._tokens: list = []

    def __enter__(self) -> _Scope:
        self.position = 0
        self._tokens.append(_ACTIVE.set(self))
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.reset(self._tokens.pop())

    def take(self, compute: Callable[[], T]) -> T:
        values = self.replay.values
        if not self.replaying:
            values.append(compute())
            return values[-1]
        if self.position >= len(values):
            raise RuntimeError(
                "a recomputed chunk asked for more values than its forward pass computed "
                f"({len(values)}): the function run under checkpoint must be deterministic"
            )
        self.position += 1
        return values[self.position - 1]


def replayed(compute: Callable[[], T]) -> T:
    """``compute()``; inside a checkpointed chunk, its value from the chunk's forward pass when
    the backward pass recomputes the chunk. ``compute`` must be deterministic and its value
    need no gradient (a count, or a tensor computed under ``torch.no_grad``)."""
    scope = _ACTIVE.get()
    return compute() if scope is None else scope.take(compute)
