"""Shared prompts under gradient checkpointing: a prompt's keys and values that checkpointed
layers can write once and the responses only read.

transformers' checkpointed decoder layers drop the KV cache, because a layer that writes to it
would write a second time when the backward pass replays it. A layer whose cache is only read
may keep it (``_can_checkpoint_with_cache``). Here both passes of
:func:`~lightning_troll.rollouts.forward.response_hidden` are made safe to replay:

- :class:`PromptCache` takes the prompt pass's keys and values once; a replayed layer finds its
  entry filled and stores nothing.
- :class:`ReadOnlyCache` holds each prompt's keys and values, copied per sequence; the response
  pass reads them and gets the prompt's, then its own, and nothing is stored, so a replay reads
  exactly what the first pass read.

The keys and values a layer made inside its checkpointed region keep their autograd history
(non-reentrant checkpointing), so the responses' gradients reach the prompt pass as without
checkpointing. Only plain full-attention layers (``DynamicLayer``) qualify; a model with
sliding-window or other layers runs whole sequences instead.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["PromptCache", "ReadOnlyCache", "cache_keyword", "caches_kept", "checkpointed_layers"]


class PromptCache(DynamicCache):
    """The prompt pass's keys and values, stored on the first call per layer only."""

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx < len(self.layers) and self.layers[layer_idx].is_initialized:
            return key_states, value_states  # the backward pass replays the layer
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class ReadOnlyCache(DynamicCache):
    """Keys and values that the responses read: each call returns the stored ones followed by
    the call's own, and stores nothing."""

    reading = False

    @classmethod
    def per_sequence(cls, prompts: PromptCache, inverse: Tensor, config) -> ReadOnlyCache:
        """The prompts' keys and values, row ``inverse[b]`` for sequence b (differentiable)."""
        cache = cls(config=config)
        for index, layer in enumerate(prompts.layers):
            cache.update(layer.keys[inverse], layer.values[inverse], index)
        cache.reading = True
        return cache

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        if not self.reading:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        return (
            torch.cat([layer.keys, key_states], dim=-2),
            torch.cat([layer.values, value_states], dim=-2),
        )


def checkpointed_layers(model: nn.Module) -> list[nn.Module] | None:
    """The model's checkpointed decoder layers, if this transformers lets them keep a cache and
    the model's cache would be of plain full-attention layers; None otherwise."""
    layers = [
        m
        for m in model.modules()
        if getattr(m, "gradient_checkpointing", False) and hasattr(m, "_can_checkpoint_with_cache")
    ]
    config = getattr(model, "config", None)
    if not layers or config is None:
        return None
    probe = PromptCache(config=config)
    if any(type(layer) is not DynamicLayer for layer in probe.layers):
        return None  # sliding-window, chunked or linear-attention layers
    return layers


@contextlib.contextmanager
def caches_kept(layers: list[nn.Module]) -> Iterator[None]:
    """Lets the checkpointed ``layers`` keep the cache they are given, for the block only."""
    name = "_can_checkpoint_with_cache"
    before = [layer.__dict__.get(name) for layer in layers]  # None: the class's value
    for layer in layers:
        setattr(layer, name, True)
    try:
        yield
    finally:
        for layer, value in zip(layers, before, strict=True):
            if value is None:
                delattr(layer, name)
            else:
                setattr(layer, name, value)


def cache_keyword(model: nn.Module) -> str:
    """The name under which the model's forward takes a cache (transformers renamed
    ``past_key_values`` to ``cache``)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model  # past wrappers
    parameters = inspect.signature(decoder.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"
