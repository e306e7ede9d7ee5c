"""Decoding that the device runs at its pace: a static KV cache, each step a captured CUDA graph.

The dynamic loop of :mod:`~lightning_troll.engines.decode` launches every kernel of every step
from the host, and a GPU waits on those launches: at Qwen3-0.6B's shape on an H200 it decoded
1,282 tokens/s, with the device idle most of each step. :func:`graph_decode` decodes the same
completions from the same distribution with fixed shapes instead:

- the P prompts are prefilled once, by the dynamic loop's own prefill
  (:func:`~lightning_troll.engines.decode.prefill`), and their keys and values copied G times
  into transformers' ``StaticCache``, B rows of L positions allocated once;
- each one-token step of a bucket of b slots is captured once as a ``torch.cuda.CUDAGraph``
  and then replayed: one launch a step, whatever the model's depth;
- a sequence that ends stays in its slot (fed its last token, its outputs ignored) until the
  running count n falls to the next bucket's size (B, then the powers of two below it:
  B/2 for a power-of-two B), when the running slots are moved to the front of the cache and the
  step of the smaller bucket is captured, so the cost follows the running sequences;
- the host waits on the device once a step, reading the running flags together with the draw's
  and the recorder's checks (as ``_Batch.keep`` does), and once more on a step where some
  sequence ended; nothing else in a step reads from the device (the recorder's sparse rows
  are cut without reads there, :class:`~lightning_troll.engines.behaviour.BehaviourRecorder`).

Tokens are chosen outside the graph by :func:`~lightning_troll.engines.choice.choose_tokens`
from the running sequences' logits only, in the order of B, so the random stream is the dynamic
loop's: with the same seed both paths draw the same tokens up to float rounding of the logits
(the static step attends over all L positions, the unused ones masked). A recorder's
``record_rows`` sees the same rows as in the dynamic loop.

Why manual capture rather than ``torch.compile(mode="reduce-overhead")``: the cache length S + T
changes with every rollout's prompts and budget and the batch with every bucket, and each new
shape would be a compilation (tens of seconds to minutes at a real model's depth, and the
compiler of the GPU image untried here); a manual capture costs one eager forward and one
recorded one per bucket, and runs the model's forward as transformers wrote it. vLLM captures
its decode step per batch-size bucket in the same way.

Where the graphs cannot serve, :func:`graph_decode` returns None before any random draw and the
dynamic loop decodes, with a warning naming the reason (once per reason): no CUDA device, a
model :func:`~lightning_troll.engines.decode.cannot_decode` refuses, a static cache with
layers other than plain ``StaticLayer`` ones, a model that would not take the step's 4-D mask
as it is (:func:`~lightning_troll.engines.decode.no_additive_mask`: attention other than
``sdpa`` or ``eager``, or a mask of its own making), a model sharded with FSDP2 over several
processes, and a forward that cannot be captured (a host synchronisation inside it, for one). A
later bucket whose capture fails runs its steps eagerly, warned.

``capture=False`` (:func:`static_decode`) runs the same loop without graphs, on any device: the
tests run it on a CPU.

Notation: P prompts, G completions per prompt, B = P * G sequences (prompt-major), S prompt
length (left padded), T response length, L cache positions (S + T rounded up to a multiple of
16), b slots of the bucket, n sequences still running, V vocabulary, H key/value heads, D head
size.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from lightning_troll.engines.choice import Check, Sampling, choose_tokens, raise_failed
from lightning_troll.engines.decode import (
    Prefill,
    _synced,
    cannot_decode,
    no_additive_mask,
    prefill,
)

__all__ = ["DECODE_MODES", "cannot_capture", "graph_decode", "static_decode"]

DECODE_MODES = ("auto", "dynamic", "graphs")
"""Values of ``model.sampling.decode``."""

_WARNED: set[str] = set()  # the reasons already warned about, each once per process


def cannot_capture(model: nn.Module, device: torch.device) -> str | None:
    """Why :func:`graph_decode` cannot serve ``model`` on ``device``, or None if it can."""
    if device.type != "cuda":
        return "no CUDA device"
    reason = cannot_decode(model)
    if reason is not None:
        return reason
    reason = no_additive_mask(model)
    if reason is not None:
        return reason
    try:
        layers = StaticCache(config=model.config, max_cache_len=2).layers
    except Exception as error:  # a config transformers' static cache cannot read
        return f"its config does not describe a static cache ({type(error).__name__}: {error})"
    odd = sorted({type(layer).__name__ for layer in layers if type(layer) is not StaticLayer})
    if odd:
        return f"its static cache has {', '.join(odd)} layers"
    if _synced(model):
        return "it is sharded with FSDP2 over several processes"
    return None


def graph_decode(
    model: nn.Module,
    prompts: Tensor,
    prompt_mask: Tensor,
    group_size: int,
    sampling: Sampling,
    pad_id: int,
    stop_ids: Sequence[int],
    do_sample: bool = True,
    recorder: Any = None,
    budgets: Tensor | None = None,
) -> Tensor | None:
    """:func:`~lightning_troll.engines.decode.decode`'s completions, decoded under CUDA graphs
    where ``sampling.decode`` asks for them (``auto`` on a CUDA device, or ``graphs``); None
    (before any random draw) where the dynamic loop must decode instead. Arguments and result
    as :func:`~lightning_troll.engines.decode.decode`'s."""
    mode = getattr(sampling, "decode", "auto")
    if mode == "dynamic" or (mode == "auto" and prompts.device.type != "cuda"):
        return None
    reason = cannot_capture(model, prompts.device)
    if reason is not None:
        _fall_back(reason)
        return None
    args = (model, prompts, prompt_mask, group_size, sampling, pad_id, stop_ids, do_sample)
    return static_decode(*args, recorder=recorder, budgets=budgets, capture=True)


@torch.no_grad()
def static_decode(
    model: nn.Module,
    prompts: Tensor,
    prompt_mask: Tensor,
    group_size: int,
    sampling: Sampling,
    pad_id: int,
    stop_ids: Sequence[int],
    do_sample: bool = True,
    recorder: Any = None,
    budgets: Tensor | None = None,
    capture: bool = True,
) -> Tensor | None:
    """The completions of :func:`graph_decode` from a static cache, each bucket's step captured
    as a CUDA graph (``capture``) or run eagerly (``capture=False``, any device). Returns (B, T)
    as :func:`~lightning_troll.engines.decode.decode` does, or None (warned, before any random
    draw) where the first capture fails or the prefill gives no plain dynamic cache."""
    device = prompts.device
    stops = torch.as_tensor(list(stop_ids), dtype=torch.long, device=device)  # (E,)
    first = prefill(model, prompts, prompt_mask, group_size)
    if first is None:
        _fall_back("its forward returns no plain dynamic cache")
        return None
    budget = sampling.max_new_tokens
    batch = _StaticBatch.prefilled(model, first, prompt_mask, group_size, budget)
    logits = first.logits  # (B, V)
    del first  # the dynamic cache: copied into the static one
    if capture:
        failure = batch.capture()
        if failure is not None:
            _fall_back(f"capturing its decode step failed ({failure})")
            return None
    total = batch.rows.numel()  # B
    responses = torch.full((total, budget), pad_id, dtype=torch.long, device=device)  # (B, T)
    live = torch.arange(total, device=device)  # (n,) the running slots, ascending
    every = getattr(sampling, "check_every", 1)  # steps between reads of the running flags
    stopped = torch.zeros(total, dtype=torch.bool, device=device)  # (n,) since the last read
    checks: list[Check] = []  # read with the running flags, in one wait on the device
    steps = 0
    while True:
        everyone = live.numel() == batch.rows.numel()  # every slot runs: nothing to gather
        scores = logits if everyone else logits[live]  # (n, V)
        tokens = choose_tokens(scores, sampling, do_sample, checks)  # (n,)
        rows = batch.rows if everyone else batch.rows[live]  # (n,) into B
        if recorder is not None:
            recorder.record_rows(scores, tokens, rows, checks)
        responses[rows, steps] = tokens
        if everyone:
            batch.tokens[:, 0] = tokens
        else:
            batch.tokens[live, 0] = tokens  # finished slots keep feeding their last token
        ended = torch.isin(tokens, stops)  # (n,)
        if budgets is not None:
            ended |= budgets[rows] <= steps + 1
        stopped |= ended  # a sequence that stopped keeps sampling until the flags are read
        steps += 1
        if steps % every and steps < budget:  # not read this step: the next one is queued
            logits = batch.forward()  # (b, V)
            continue
        flags = torch.cat([~stopped, *(c.ok.unsqueeze(0) for c in checks)])  # (n + checks,)
        flags = flags.tolist()  # the one wait on the device since the last read
        raise_failed(checks, flags[live.numel() :])
        if not all(flags[: live.numel()]):
            live = live[~stopped]  # (n',)
        checks, stopped = [], stopped.new_zeros(live.numel())
        if live.numel() == 0 or steps == budget:
            break
        if live.numel() <= batch.next_bucket():
            live = batch.compact(live, capture)
        logits = batch.forward()  # (b, V)
    return responses[:, :steps]  # (B, T)


class _StaticBatch:
    """The b slots of the bucket decoding now, and the one step they take.

    Attributes: ``rows`` (b,) each slot's index into B; ``tokens`` (b, 1) the ids the next step
    feeds; ``positions`` (b, 1) their positions; ``mask`` (b, 1, 1, L) the additive attention
    mask (0 where a slot attends, the dtype's lowest value elsewhere); ``slot`` the cache position
    the next step writes; ``cache`` a ``StaticCache`` whose layers view the first b rows of the
    (B, H, L, D) keys and values allocated once; ``graph`` the captured step, or None (eager).
    Every tensor a graph reads or writes keeps its address until the next compaction.
    """

    def __init__(self, model, cache, name, rows, positions, mask, slot, storage) -> None:
        self.model, self.cache, self.name = model, cache, name
        self.rows, self.positions, self.mask, self.slot = rows, positions, mask, slot
        self.tokens = torch.zeros_like(positions)  # (b, 1)
        self.storage = storage  # per layer: the (B, H, L, D) keys and values
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: Tensor | None = None  # (b, V) the captured step's output

    @classmethod
    def prefilled(cls, model, first: Prefill, prompt_mask, group, budget):
        """The B slots after the prefill: the (P, S) prompts' keys and values of ``first.cache``
        (a filled ``DynamicCache``) repeated ``group`` times into a static cache of L
        positions."""
        length = prompt_mask.shape[1]  # S
        positions = -(-(length + budget) // 16) * 16  # L: S + T, aligned for attention kernels
        cache = StaticCache(config=model.config, max_cache_len=positions)
        storage = []
        for layer, filled in zip(cache.layers, first.cache.layers, strict=True):
            keys = filled.keys.repeat_interleave(group, dim=0)  # (B, H, S, D)
            values = filled.values.repeat_interleave(group, dim=0)
            layer.lazy_initialization(keys, values)  # (B, H, L, D) zeros
            layer.keys[:, :, :length] = keys
            layer.values[:, :, :length] = values
            layer.cumulative_length.fill_(length)
            storage.append((layer.keys, layer.values))
        dtype = storage[0][0].dtype
        visible = prompt_mask.repeat_interleave(group, dim=0).bool()  # (B, S)
        lowest = torch.finfo(dtype).min
        shape = (visible.shape[0], 1, 1, positions)  # (B, 1, 1, L)
        mask = torch.full(shape, lowest, dtype=dtype, device=visible.device)
        mask[:, 0, 0, :length].masked_fill_(visible, 0.0)
        following = first.following.unsqueeze(-1).repeat_interleave(group, dim=0)  # (B, 1)
        rows = torch.arange(visible.shape[0], device=visible.device)  # (B,)
        return cls(model, cache, first.name, rows, following, mask, length, storage)

    def next_bucket(self) -> int:
        """The size of the next smaller bucket: the largest power of two below b (0 at b = 1)."""
        size = self.rows.numel()
        return 1 << (size - 1).bit_length() - 1 if size > 1 else 0

    def forward(self) -> Tensor:
        """One step of every slot: feeds ``tokens`` at ``positions``; returns the logits (b, V),
        float32 (the graph's output buffer when captured: read it before the next step)."""
        self.mask[:, :, :, self.slot] = 0.0  # the position this step writes becomes visible
        if self.graph is None:
            logits = self._run()
        else:
            self.graph.replay()
            logits = self.logits
        self.positions += 1
        self.slot += 1
        return logits

    def _run(self) -> Tensor:
        out = self.model(
            input_ids=self.tokens,  # (b, 1)
            attention_mask=self.mask,  # (b, 1, 1, L)
            position_ids=self.positions,  # (b, 1)
            use_cache=True,
            **{self.name: self.cache},
        )
        return out.logits[:, -1].float()  # (b, V)

    def compact(self, live: Tensor, capture: bool) -> Tensor:
        """Moves the ``live`` slots (n,) to the front, into the smallest bucket that holds them
        (the rest of it filled with copies of the first, never read), and captures its step
        where ``capture`` asks (eagerly if that fails, warned). Returns the new live slots
        (n,), ``arange(n)``."""
        count = live.numel()
        size = 1 << (count - 1).bit_length()  # the smallest power of two >= n
        take = torch.cat([live, live[:1].expand(size - count)])  # (b',) slots of the old bucket
        self.graph, self.logits = None, None  # the old bucket's graph and its memory go
        for layer, (keys, values) in zip(self.cache.layers, self.storage, strict=True):
            keys[:size] = layer.keys[take]  # (b', H, L, D), gathered before it is written
            values[:size] = layer.values[take]
            layer.keys, layer.values = keys[:size], values[:size]
            layer.batch_size = size
        self.rows, self.mask = self.rows[take], self.mask[take]  # (b',), (b', 1, 1, L)
        self.positions, self.tokens = self.positions[take], self.tokens[take]  # (b', 1)
        if capture:
            failure = self.capture()
            if failure is not None:
                _fall_back(f"capturing its decode step for {size} slots failed ({failure}); "
                           "those steps run eagerly")  # fmt: skip
        return torch.arange(count, device=live.device)

    def capture(self) -> str | None:
        """Captures this bucket's step as a CUDA graph, after one eager warm-up of it on a side
        stream; returns None, or the error's first line where capture failed (no graph then).
        Both write the cache position the next step writes, which that step overwrites."""
        counters = [layer.cumulative_length for layer in self.cache.layers]
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._run()
            torch.cuda.current_stream().wait_stream(side)
            for counter in counters:
                counter.fill_(self.slot)  # the warm-up moved it on
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                logits = self._run()  # (b, V), recorded, not run
        except Exception as error:  # noqa: BLE001 - any failure: the step runs eagerly
            torch.cuda.synchronize()
            for counter in counters:
                counter.fill_(self.slot)
            return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
        self.graph, self.logits = graph, logits
        return None


def _fall_back(reason: str) -> None:
    """Warns, once per reason, that the dynamic loop decodes instead of the CUDA graphs."""
    if reason in _WARNED:
        return
    _WARNED.add(reason)
    warnings.warn(
        f"model.sampling.decode: CUDA-graph decoding cannot serve this model ({reason}); the "
        "dynamic decoding loop samples instead",
        stacklevel=3,
    )
