"""A model's weights as a plain transformers model of its architecture names them: full, merged,
float.

Engines that hold their own copy of the behaviour policy (vLLM) load these: a LoRA model gives
its base weights with the active adapter merged in (``W + scale * B @ A``, computed, nothing in
the model changes); an int8 snapshot (:mod:`lightning_troll.models.quantize`) gives its weights
dequantised; a sharded (FSDP2) weight is gathered into its full tensor. A tied weight is given
under each name that holds it (a tied output head's weight as ``lm_head.weight`` and as the input
embedding's), as the engine's loader looks for either. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from lightning_troll.models.quantize import Int8Embedding, Int8Linear

__all__ = ["carries_adapter", "full_weights", "ties_an_adapted_embedding"]


def _full(tensor: Tensor) -> Tensor:
    """The whole tensor of a (possibly FSDP2-sharded) weight, detached."""
    full_tensor = getattr(tensor, "full_tensor", None)  # a DTensor's gather
    return (full_tensor() if full_tensor is not None else tensor).detach()


def _unwrap(model: nn.Module) -> tuple[nn.Module, str | None]:
    """(the transformers model inside a peft model, the active adapter) or (model, None)."""
    if hasattr(model, "peft_config") and hasattr(model, "base_model"):
        adapter = model.active_adapter
        adapter = adapter[0] if isinstance(adapter, list | tuple) else adapter
        return model.base_model.model, adapter
    return model, None


def _is_lora(module: nn.Module) -> bool:
    return hasattr(module, "base_layer") and (
        hasattr(module, "lora_A") or hasattr(module, "lora_embedding_A")
    )


def carries_adapter(module: nn.Module, adapter: str | None) -> bool:
    """Whether the peft layer ``module`` holds LoRA weights of ``adapter``: a linear layer's in
    ``lora_A``, an embedding's in ``lora_embedding_A``."""
    return adapter is not None and any(
        adapter in getattr(module, where, {}) for where in ("lora_A", "lora_embedding_A")
    )


def ties_an_adapted_embedding(model: nn.Module) -> bool:
    """Whether ``model`` ties its output layer to an input embedding that carries a LoRA adapter.

    The policy's output layer then keeps the embedding's base weight (the adapter adds to the
    embedding lookup only), and :func:`full_weights` gives ``lm_head.weight`` so; an engine that
    ties the two layers itself (vLLM skips a tied ``lm_head.weight``) would compute its output
    from the merged embedding instead, and sample from another policy.
    """
    base, adapter = _unwrap(model)
    if not getattr(getattr(base, "config", None), "tie_word_embeddings", False):
        return False
    return carries_adapter(base.get_input_embeddings(), adapter)


@torch.no_grad()
def full_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``(name, weight)`` pairs of ``model`` under plain transformers names, one at a time.

    LoRA layers give ``prefix.weight`` (and ``prefix.bias``) of their base layer with the active
    adapter's update added; their adapter weights are not given. Int8 layers give their weight
    dequantised to float32. Buffers (rotary tables, masks) are not given.
    """
    base, adapter = _unwrap(model)
    done: list[str] = []  # prefixes whose whole subtree was given already
    for prefix, module in base.named_modules(remove_duplicate=False):
        if any(prefix.startswith(d + ".") for d in done):
            continue
        dot = f"{prefix}." if prefix else ""
        if _is_lora(module):
            layer = module.base_layer
            weight = _full(layer.weight)
            if carries_adapter(module, adapter):
                weight = weight + _full(module.get_delta_weight(adapter)).to(weight.dtype)
            yield f"{dot}weight", weight
            if getattr(layer, "bias", None) is not None:
                yield f"{dot}bias", _full(layer.bias)
            done.append(prefix)
            continue
        if isinstance(module, Int8Linear | Int8Embedding):
            yield f"{dot}weight", module.dequantized(torch.float32)
            bias = getattr(module, "bias", None)
            if bias is not None:
                yield f"{dot}bias", _full(bias)
            done.append(prefix)
            continue
        for name, parameter in module.named_parameters(recurse=False):
            yield f"{dot}{name}", _full(parameter)
