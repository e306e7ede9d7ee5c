"""Weight-only int8 quantisation for frozen inference copies (CPU and GPU alike).

Each weight matrix W (out, in) is stored as int8 ``q`` with one float32 scale per output row:
``scale = max_j |W_ij| / 127`` and ``q = round(W / scale)``, so ``|W - q * scale| <= scale / 2``.
The forward pass dequantises on the fly (``q * scale`` in the input's dtype) and runs the usual
float matmul or lookup, so no int8 kernels are needed. An embedding is quantised per row (per
token), which is the same as per output channel for a tied output layer; tied layers share one
quantised copy. No Lightning here.

Notation: O output features (rows), I input features, V vocabulary, H hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Int8Embedding", "Int8Linear", "quantize_int8_", "quantize_rows", "requantize_int8_"]


@torch.no_grad()
def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(O, I) float weight -> (O, I) int8 values and (O,) float32 scales (absmax per row)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0  # (O,)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)  # (O, I)
    return q, scale


class _Int8Weight(nn.Module):
    """Holds one quantised weight as buffers (``qweight`` int8, ``scale`` float32)."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        q, scale = quantize_rows(weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)

    @torch.no_grad()
    def requantize_(self, weight: Tensor) -> None:
        """Overwrites the buffers in place with the quantisation of ``weight``."""
        q, scale = quantize_rows(weight)
        self.qweight.copy_(q)
        self.scale.copy_(scale)

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        """The (O, I) weight ``qweight * scale`` in ``dtype``."""
        return self.qweight.to(dtype) * self.scale.to(dtype)[:, None]


class Int8Linear(_Int8Weight):
    """An ``nn.Linear`` stand-in with an int8 weight, dequantised in every forward pass."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self.register_buffer("bias", bias)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.dequantized(x.dtype), self.bias)  # (..., O)


class Int8Embedding(_Int8Weight):
    """An ``nn.Embedding`` stand-in with int8 rows; only the looked-up rows are dequantised."""

    def __init__(self, embedding: nn.Embedding, dtype: torch.dtype) -> None:
        super().__init__(embedding.weight)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.dtype = dtype

    def forward(self, ids: Tensor) -> Tensor:
        rows = F.embedding(ids, self.qweight).to(self.dtype)  # (..., H)
        return rows * self.scale[ids].to(self.dtype)[..., None]


def _quantizable(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Embedding)]


@torch.no_grad()
def quantize_int8_(model: nn.Module) -> nn.Module:
    """Replaces every ``nn.Linear`` and ``nn.Embedding`` of ``model`` in place by its int8 form.

    Layers that share a weight (tied input and output embeddings) share one quantised copy.
    Returns ``model``.
    """
    shared: dict[int, _Int8Weight] = {}
    for name, layer in _quantizable(model):
        key = id(layer.weight)
        if isinstance(layer, nn.Linear):
            new: _Int8Weight = Int8Linear(layer)
        else:
            new = Int8Embedding(layer, layer.weight.dtype)
        if key in shared:  # tied: point at the buffers already made
            new.qweight, new.scale = shared[key].qweight, shared[key].scale
        shared.setdefault(key, new)
        model.set_submodule(name, new)
    return model


@torch.no_grad()
def requantize_int8_(quantized: nn.Module, source: nn.Module) -> None:
    """Re-quantises ``quantized`` (made by :func:`quantize_int8_`) from ``source``'s weights.

    Every other parameter of ``quantized`` is copied from ``source`` as well; its buffers
    (rotary tables, masks), which training does not change, are left as they are.
    """
    layers = dict(source.named_modules())
    for name, module in quantized.named_modules():
        if isinstance(module, _Int8Weight):
            module.requantize_(layers[name].weight)
            if isinstance(module, Int8Linear) and module.bias is not None:
                module.bias.copy_(layers[name].bias)
    params = dict(source.named_parameters())
    for name, param in quantized.named_parameters():
        param.copy_(params[name])
