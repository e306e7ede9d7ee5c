"""How a decoding step's attention runs: grouped queries read the cache as it is, PyTorch's
cuDNN attention comes last on a GPU, and a step of the static cache reads the positions it can
see only. :func:`decoding_attention` sets the first two while the decoding loops run and gives
everything back after them; the CUDA-graph path sets the third.

**Grouped queries.** A decoding step hands the model an additive 4-D mask (padding on the left,
room reserved on the right). With a mask, transformers' ``sdpa`` attention cannot ask PyTorch's
kernels for grouped queries (they would fall back to the slowest one), so versions before 5.24
repeat each key and value head for every query head of its group first: a copy of the whole
cache, two per layer and step. On one H200 at Qwen3-0.6B's shape (16 query heads on 8 key/value
heads, 64 sequences) those copies were 32% of the device's time per decoding step with
transformers 5.17 (``examples/results/gpu/eighth/profile_65.txt``), and they grow with the cache.
With a single query a step needs no copy: the G query heads of a group become G query rows of
their key/value head, ``(N, H, 1, D) -> (N, H / G, G, D)``, and a mask shared by the heads,
``(N, 1, 1, L)``, broadcasts over them. transformers 5.24 and later do this in ``sdpa`` itself;
for earlier ones :func:`grouped_query_steps` lends the model :func:`one_query_attention` (which
does it for one query and hands every other call to ``sdpa`` unchanged).

**cuDNN last.** Given an explicit mask, PyTorch (2.11 on that H200) chose cuDNN's attention, which
builds an execution plan on the host for every new shape: in the same profile its 84 calls (the
prefill, a capture's warm-up and its recording, 28 layers each) spent 755 ms on the host, 9 ms a
call, while the attention kernels of all 65 steps ran 72 ms on the device. The dynamic loop meets a
new key length at every step, and the CUDA graphs a new cache length every rollout and a new bucket
as sequences end. :func:`cudnn_attention_last` moves cuDNN behind flash attention (which takes no
mask, so a step's attention does not reach it), memory-efficient attention (which takes masks and
plans nothing) and math, among the backends the user left enabled.

**Visible positions.** The CUDA-graph path's static cache holds L positions from the first
step, those past the step masked; attention with a mask reads every position it is given, so at
Qwen3-0.6B's shape with 64 sequences and L = 1,088 a step would read 8 GB of keys and values
where the positions written so far average half of that (computed from the shapes).
:class:`~lightning_troll.engines.static_batch.StaticBatch` hands a step the mask of the positions
it can see only (widened in steps of ``SPAN``, the step captured again), and the attention lent
here cuts a one-query step's keys and values to the mask's length; :func:`prefix_steps` lends a
model ``sdpa`` with that cut where the fold is not lent (which cuts too). The cut follows a
tensor's shape, not a number held aside, so a compiled step (``sampling.compile_step``) treats
it as one more dimension.

Notation: N sequences, H query heads, G queries per key/value head, L cache positions, D head
size.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from transformers.integrations import sdpa_attention

NAME = "lightning_troll_sdpa"
"""The attention implementation :func:`grouped_query_steps` lends a model for its decoding."""

PREFIX_NAME = "lightning_troll_sdpa_prefix"
"""The one :func:`prefix_steps` lends where :data:`NAME` is not lent: ``sdpa`` over the visible
positions only."""

LENT = (NAME, PREFIX_NAME)
"""The implementations lent here: ``sdpa`` underneath, each takes an additive 4-D mask as it
is."""


def _visible(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``key`` and ``value`` (N, H', L, D) cut to the first positions ``mask`` (N, ., ., L')
    covers, where it covers fewer and there is one query (the static loop hands a step the mask
    of the positions it can see); as they are otherwise (views, nothing copied)."""
    if mask is None or query.shape[2] != 1 or key.shape[2] <= mask.shape[-1]:
        return key, value, mask
    count = mask.shape[-1]
    return key[:, :, :count], value[:, :, :count], mask


def one_query_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' ``sdpa`` attention, with one query of grouped heads (``query`` (N, H, 1, D)
    against ``key`` and ``value`` (N, H / G, L, D), a mask (N, 1, 1, L) or None) computed on the
    key/value heads as they are, over the positions the mask covers. Returns the
    output (N, 1, H, D) and None, as ``sdpa`` does."""
    key, value, attention_mask = _visible(query, key, value, attention_mask)
    groups = getattr(module, "num_key_value_groups", 1)
    shared = attention_mask is None or attention_mask.shape[1] == 1  # one mask for every head
    plain = kwargs.get("position_bias") is None and kwargs.get("softcap") is None
    if query.shape[2] != 1 or groups == 1 or not shared or not plain:
        return sdpa_attention.sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            is_causal=is_causal, **kwargs,
        )  # fmt: skip
    n, heads, _, size = query.shape
    rows = query.reshape(n, heads // groups, groups, size)  # (N, H / G, G, D)
    out = torch.nn.functional.scaled_dot_product_attention(
        rows, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )  # (N, H / G, G, D)
    return out.reshape(n, heads, 1, size).transpose(1, 2).contiguous(), None  # (N, 1, H, D)


def prefix_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' ``sdpa`` attention as it is, over the positions the mask covers."""
    key, value, attention_mask = _visible(query, key, value, attention_mask)
    return sdpa_attention.sdpa_attention_forward(
        module, query, key, value, attention_mask, **kwargs
    )


def sdpa_copies_groups() -> bool:
    """Whether this transformers' ``sdpa`` attention repeats key/value heads for one query."""
    return not hasattr(sdpa_attention, "pack_gqa")


@contextmanager
def grouped_query_steps(model: nn.Module, force: bool = False) -> Iterator[None]:
    """Lends ``model`` :func:`one_query_attention` while the block runs, where its attention is
    ``sdpa``, its config groups query heads on fewer key/value heads, and this transformers would
    copy them for one query (or where ``force``); gives its own implementation back after the
    block, also where it raised."""
    config = getattr(model, "config", None)
    own = getattr(config, "_attn_implementation", None)
    heads = getattr(config, "num_attention_heads", None)
    grouped = isinstance(heads, int) and getattr(config, "num_key_value_heads", heads) < heads
    if own != "sdpa" or not grouped or not (force or sdpa_copies_groups()):
        yield
        return
    with _lent(config, NAME, one_query_attention):
        yield


@contextmanager
def prefix_steps(model: nn.Module) -> Iterator[None]:
    """Lends ``model`` :func:`prefix_attention` while the block runs, where its attention is
    ``sdpa`` (where :data:`NAME` is lent, it cuts to the visible positions itself); gives its
    own back after the block, also where it raised."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    with _lent(config, PREFIX_NAME, prefix_attention):
        yield


@contextmanager
def _lent(config: Any, name: str, function: Any) -> Iterator[None]:
    """``config``'s attention implementation set to ``name``, made known to transformers as
    ``function`` with ``sdpa``'s mask (a prefill's 2-D mask becomes ``sdpa``'s), while the block
    runs; its own given back after it."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, function)
    if name not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    own = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = own


@contextmanager
def cudnn_attention_last(device: torch.device) -> Iterator[None]:
    """On a CUDA ``device``, PyTorch's attention backends in the order flash, memory-efficient,
    math, cuDNN (those enabled; cuDNN only where no other serves) while the block runs, the
    previous order and flags back after it; elsewhere nothing."""
    if device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cuda = torch.backends.cuda
    order = [
        (SDPBackend.FLASH_ATTENTION, cuda.flash_sdp_enabled()),
        (SDPBackend.EFFICIENT_ATTENTION, cuda.mem_efficient_sdp_enabled()),
        (SDPBackend.MATH, cuda.math_sdp_enabled()),
        (SDPBackend.CUDNN_ATTENTION, cuda.cudnn_sdp_enabled()),
    ]
    with sdpa_kernel([backend for backend, enabled in order if enabled], set_priority=True):
        yield


@contextmanager
def decoding_attention(model: nn.Module, device: torch.device) -> Iterator[None]:
    """:func:`grouped_query_steps` and :func:`cudnn_attention_last` together, for the decoding
    loops of ``model`` on ``device``."""
    with ExitStack() as stack:
        stack.enter_context(grouped_query_steps(model))
        stack.enter_context(cudnn_attention_last(device))
        yield
