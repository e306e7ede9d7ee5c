"""Where :class:`~lightning_troll.engines.behaviour.BehaviourRecorder` keeps a rollout's record
while it samples: :class:`Store`, the records of a loop that drops finished sequences, in large
blocks on a CPU; :class:`SlotRecord`, the record of a loop whose slots keep fixed places (the
CUDA-graph path capturing its whole step), written in place; and :func:`not_finite`, the error
for bad logits.

Notation: B sequences, T response positions, K sparse columns per row, b slots.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_troll.trust_region.sparse import SparseDistribution

__all__ = ["SlotRecord", "Store", "not_finite"]

_NEG_INF = float("-inf")


class SlotRecord:
    """What :meth:`~lightning_troll.engines.behaviour.BehaviourRecorder.record_slots` keeps: each field (B + 1, T) or
    (B + 1, T, K), written in place at every step's (row, step) places; row B takes the writes
    of slots that hold no sequence. Positions never written keep the values
    :meth:`~lightning_troll.engines.behaviour.BehaviourRecord.cat` pads with. ``bad`` (B + 1,) marks the rows whose logits were ever
    bad, ``first_bad`` (B + 1,) the step at which each first was."""

    def __init__(
        self, shape: tuple[int, int], logp: Tensor, sparse: SparseDistribution | None
    ) -> None:
        size = (shape[0] + 1, shape[1])  # (B + 1, T)
        self.logprobs = logp.new_zeros(size)
        self.indices = self.sparse_logprobs = self.tail_logmass = None
        self.vocab_size = 0
        if sparse is not None:
            width = (*size, sparse.indices.shape[1])  # (B + 1, T, K)
            self.indices = sparse.indices.new_full(width, -1)
            self.sparse_logprobs = sparse.logprobs.new_full(width, _NEG_INF)
            self.tail_logmass = sparse.tail_logmass.new_full(size, _NEG_INF)
            self.vocab_size = sparse.vocab_size
        self.bad = torch.zeros(size[0], dtype=torch.bool, device=logp.device)
        self.first_bad = torch.zeros(size[0], dtype=torch.long, device=logp.device)

    def write(
        self,
        rows: Tensor,
        step: Tensor,
        logp: Tensor,
        sparse: SparseDistribution | None,
        bad: Tensor,
    ) -> None:
        """One step's values (b,) or (b, K) at (``rows``, ``step``), and its bad rows."""
        at = (rows, step.expand_as(rows))
        self.logprobs.index_put_(at, logp)
        if sparse is not None:
            self.indices.index_put_(at, sparse.indices)
            self.sparse_logprobs.index_put_(at, sparse.logprobs)
            self.tail_logmass.index_put_(at, sparse.tail_logmass)
        seen = self.bad[rows]  # (b,)
        self.first_bad.index_put_((rows,), torch.where(bad & ~seen, step, self.first_bad[rows]))
        self.bad.index_put_((rows,), seen | bad)

    def not_finite(self) -> FloatingPointError:
        """The error for the sequences whose logits were bad, at the first step one was."""
        bad = self.bad[:-1]  # (B,)
        return not_finite(bad, None, int(self.first_bad[:-1][bad].min()))

    def fields(self, responses: Tensor) -> tuple[Any, ...]:
        """The fields of :class:`~lightning_troll.engines.behaviour.BehaviourRecord` for the
        (B, T') generated tokens ``responses``: the first T' steps of the B rows."""
        rows, steps = responses.shape

        def cut(field: Tensor | None) -> Tensor | None:
            return None if field is None else field[:rows, :steps]

        fields = (self.logprobs, self.indices, self.sparse_logprobs, self.tail_logmass)
        return (*(cut(field) for field in fields), self.vocab_size)


class Store:
    """Copies a step's record into a few large blocks, one per dtype, where it is on a CPU.

    There glibc serves a step's few hundred KB of record from its heap, often from the space a
    vocabulary-sized temporary of the step (the logits and what is computed from them) has just
    freed; the record left there splits that space too small for the next step's temporaries,
    which take new space above. Kept as they came, the records grew the heap by about 10 MiB a
    step at SmolLM2's vocabulary with 64 sequences, nearly all of it free but held: 3,385 MiB
    after 300 steps, 198 MiB in use; in blocks 197 MiB (``examples/profile_heap.py``,
    ``examples/results/smollm2/heap.json``). Blocks of ``_BLOCK_BYTES`` are above glibc's largest
    threshold for serving from the heap, so they are mappings of their own, given back with the
    record. On other devices tensors are kept as they are (their allocator keeps small blocks
    apart from large ones).
    """

    def __init__(self) -> None:
        self._blocks: dict[torch.dtype, tuple[Tensor, int]] = {}  # dtype -> (block, used)

    def keep(self, values: Tensor) -> Tensor:
        """``values``, or a copy of it in a block (a view the same shape) on a CPU."""
        if values.device.type != "cpu":
            return values
        count = values.numel()
        block, used = self._blocks.get(values.dtype, (None, 0))
        if block is None or used + count > block.numel():
            size = max(count, _BLOCK_BYTES // values.element_size())
            block, used = values.new_empty(size), 0
        kept = block[used : used + count].view(values.shape)
        kept.copy_(values)
        self._blocks[values.dtype] = (block, used + count)
        return kept


_BLOCK_BYTES = 64 * 2**20


def not_finite(bad: Tensor, rows: Tensor | None, step: int) -> FloatingPointError:
    """The error for generation step ``step``'s logits, bad where ``bad`` (n,) is True; ``rows``
    (n,) their indices into B (None: all B)."""
    first = bad.nonzero()[0, 0]
    return FloatingPointError(
        f"the behaviour policy's logits hold NaN or +inf (or -inf at the sampled token) at "
        f"generation step {step} for {int(bad.sum())} sequences (first: "
        f"{int(first if rows is None else rows[first])}); the snapshot's weights are not "
        "finite, so no rollout is cached from them"
    )
