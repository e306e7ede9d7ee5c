"""The decoding loop's cache with reserved room (lightning_troll/engines/reserved.py) holds what
transformers' concatenating DynamicCache holds, step for step, while writing each step in place."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from lightning_troll.engines.reserved import ReservedLayer, reserve


def prefilled(prompts: int = 3, heads: int = 2, length: int = 5, layers: int = 2, seed: int = 0):
    """A DynamicCache of ``prompts`` rows as a prefill leaves it (values wider than keys)."""
    g = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    for layer in range(layers):
        keys = torch.randn(prompts, heads, length, 4, generator=g, dtype=torch.float64)
        values = torch.randn(prompts, heads, length, 6, generator=g, dtype=torch.float64)
        cache.update(keys, values, layer)
    return cache


def test_a_reserved_cache_holds_what_the_dynamic_one_holds_through_steps_drops_and_growth():
    """Repeated for groups, appended to step by step past its room (so it grows), rows
    dropped twice and two positions cropped: the keys and values, and the lengths transformers
    reads, equal the concatenating cache's exactly at every step."""
    plain, reserved = prefilled(), prefilled()
    plain.batch_repeat_interleave(4)  # 3 prompts -> 12 rows
    reserve(reserved, 4, room=3)
    assert all(type(layer) is ReservedLayer for layer in reserved.layers)
    g = torch.Generator().manual_seed(1)
    rows = 12
    drops = {2: torch.tensor([0, 3, 4, 7, 8, 9, 11]), 5: torch.tensor([1, 2, 6])}
    for step in range(7):  # 7 steps > 3 positions of room: the buffers double once
        for cache in (plain, reserved):
            assert cache.get_seq_length() == 5 + step
        for layer in range(2):
            keys = torch.randn(rows, 2, 1, 4, generator=g, dtype=torch.float64)
            values = torch.randn(rows, 2, 1, 6, generator=g, dtype=torch.float64)
            got = reserved.update(keys, values, layer)
            want = plain.update(keys, values, layer)
            for a, b in zip(got, want, strict=True):
                assert a.shape == b.shape and torch.equal(a, b)
        if step in drops:
            for cache in (plain, reserved):
                cache.batch_select_indices(drops[step])
            rows = drops[step].numel()
            for a, b in zip(reserved.layers, plain.layers, strict=True):
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert reserved.layers[0].room == 2 * 8 - 12  # 8 positions doubled to 16, 12 filled
    for cache in (plain, reserved):
        cache.crop(-2)
    for a, b in zip(reserved.layers, plain.layers, strict=True):
        assert a.get_seq_length() == b.get_seq_length() == 10
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert a.get_mask_sizes(1) == b.get_mask_sizes(1)


def test_steps_within_the_room_write_into_the_same_buffers():
    """The point of the reservation: no step within the room allocates a new buffer (the
    views' storage stays put), where a concatenating layer's storage moves at every step."""
    cache = reserve(prefilled(layers=1), 2, room=4)
    layer = cache.layers[0]
    storage = layer.keys.untyped_storage().data_ptr()
    for _ in range(4):
        cache.update(torch.zeros(6, 2, 1, 4, dtype=torch.float64),
                     torch.zeros(6, 2, 1, 6, dtype=torch.float64), 0)  # fmt: skip
        assert layer.keys.untyped_storage().data_ptr() == storage
    cache.batch_select_indices(torch.tensor([1, 4]))  # moved within the same buffers
    assert layer.keys.untyped_storage().data_ptr() == storage
    assert layer.keys.shape == (2, 2, 9, 4) and layer.room == 0
    plain = DynamicLayer()
    plain.update(torch.zeros(2, 2, 3, 4), torch.zeros(2, 2, 3, 4))
    before = plain.keys.untyped_storage().data_ptr()
    plain.update(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4))
    assert plain.keys.untyped_storage().data_ptr() != before


def test_a_reserved_layer_repeats_rows_as_a_dynamic_one_does_and_refuses_bad_counts():
    plain, reserved = prefilled(), reserve(prefilled(), 1, room=2)
    for cache in (plain, reserved):
        cache.batch_repeat_interleave(3)
    for a, b in zip(reserved.layers, plain.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert a.room == 2
    with pytest.raises(ValueError, match="repeats >= 1 and room >= 0; got 0, 5"):
        reserve(prefilled(), 0, room=5)
    with pytest.raises(ValueError, match="repeats >= 1 and room >= 0; got 2, -1"):
        reserve(prefilled(), 2, room=-1)
    with pytest.raises(ValueError, match="negative count of positions; got 1"):
        reserved.crop(1)
