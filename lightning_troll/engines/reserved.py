"""A KV cache with room reserved for a rollout's completions, each step written in place.

transformers' ``DynamicCache`` appends a decoding step's keys and values by concatenation: every
step allocates each layer's whole cache anew and copies it there, so a step's cost grows with the
positions cached (at SmolLM2-135M's shape with 64 sequences the append took 75-94% of a step past
1,024 positions; ``examples/profile_lengths.py``). :func:`reserve` turns the prompts' prefilled
cache into one whose layers (:class:`ReservedLayer`) hold one buffer each for keys and values with
room for the whole completion, the prompts' rows repeated into it for their group: a step writes
its position in place, and attention gets views of the positions filled, the same values a
concatenated cache holds. Sequences that end are moved out by copying the running rows to the
front of the same buffers, as the dynamic cache's ``batch_select_indices`` copies them to a new
one. The buffers take from the start the memory a concatenated cache reaches when every
completion runs to its budget (what the memory check counts); on a CPU their pages are touched
only as positions are written.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["ReservedLayer", "reserve"]


class ReservedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values live in buffers with room for more positions.

    ``keys`` and ``values`` are views (rows, heads, positions, dim) of the buffers' first rows and
    filled positions, so transformers' attention and mask code read them as a dynamic layer's.
    Past the room reserved, a step doubles the buffers (a copy, as every concatenated step is).
    """

    def __init__(self, keys: Tensor, values: Tensor, repeats: int, room: int) -> None:
        super().__init__()
        self.device, self.is_initialized = keys.device, True
        self._fill(keys, values, repeats, room)

    @property
    def room(self) -> int:
        """Positions that can still be written without a new buffer."""
        return self._buffers[0].shape[-2] - self._length

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
               ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """Writes (rows, heads, t, dim) keys and values after the filled positions; returns the
        views of all filled positions."""
        new = key_states.shape[-2]
        if new > self.room:
            self._grow(self._length + new)
        end = self._length + new
        for buffer, states in zip(self._buffers, (key_states, value_states), strict=True):
            buffer[: self._rows, :, self._length : end] = states
        self._length = end
        self._view()
        return self.keys, self.values

    def batch_select_indices(self, indices: Tensor) -> None:
        """Keeps the rows at ``indices`` (ascending), moved to the front of the buffers."""
        rows = indices.numel()
        for buffer in self._buffers:
            buffer[:rows, :, : self._length] = buffer[indices, :, : self._length]
        self._rows = rows
        self._view()

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeats each row ``repeats`` times, in new buffers with the same room."""
        self._fill(self.keys, self.values, repeats, self.room)

    def crop(self, tokens_to_remove: int) -> None:
        """Forgets the last ``-tokens_to_remove`` positions (a negative count, as transformers
        asks); their room is written again."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions; got {tokens_to_remove}")
        self._length -= min(-tokens_to_remove, self._length)
        self._view()

    def reset(self) -> None:
        self._buffers = []
        super().reset()

    def _fill(self, keys: Tensor, values: Tensor, repeats: int, room: int) -> None:
        self._length, self._rows = keys.shape[-2], keys.shape[0] * repeats
        self._buffers = [_repeated(t, repeats, room) for t in (keys, values)]
        self._view()

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self._buffers[0].shape[-2])
        grown = []
        for buffer in self._buffers:
            rows, heads, _, dim = buffer.shape
            bigger = buffer.new_empty(rows, heads, capacity, dim)
            bigger[:, :, : self._length] = buffer[:, :, : self._length]
            grown.append(bigger)
        self._buffers = grown

    def _view(self) -> None:
        self.keys, self.values = (b[: self._rows, :, : self._length] for b in self._buffers)


def reserve(cache: DynamicCache, repeats: int, room: int) -> DynamicCache:
    """Replaces each plain layer of ``cache`` (P rows) by a :class:`ReservedLayer` of its rows
    repeated ``repeats`` times (P * repeats rows, as ``batch_repeat_interleave`` makes them), with
    room for ``room`` more positions; returns ``cache``."""
    if room < 0 or repeats < 1:
        raise ValueError(f"reserve needs repeats >= 1 and room >= 0; got {repeats}, {room}")
    cache.layers = [
        ReservedLayer(layer.keys, layer.values, repeats, room) for layer in cache.layers
    ]
    return cache


def _repeated(states: Tensor, repeats: int, room: int) -> Tensor:
    """(P, heads, S, dim) -> a (P * repeats, heads, S + room, dim) buffer holding each row
    ``repeats`` times in its first S positions."""
    rows, heads, length, dim = states.shape
    buffer = states.new_empty(rows * repeats, heads, length + room, dim)
    grouped = buffer.view(rows, repeats, heads, length + room, dim)
    grouped[..., :length, :] = states.unsqueeze(1)
    return buffer
