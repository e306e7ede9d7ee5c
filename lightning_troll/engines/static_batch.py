"""The slots of the CUDA-graph path's static KV cache, and the one step they take.

:class:`StaticBatch` holds what :func:`~lightning_troll.engines.graph_decode.static_decode`
decodes from: transformers' ``StaticCache`` filled from the prefill, the feed of every slot, the
additive mask, the captured step; it moves the running slots into smaller buckets and captures
each bucket's step.

A step attends over the ``visible`` positions only, the first multiple of :data:`SPAN` past the
position it writes (at most L: the mask it hands the model covers those, and the attention
:mod:`~lightning_troll.engines.step_attention` lends cuts the keys to it), not all L: attention
with a mask reads every position it is handed, and the positions past the step are all masked. When
the steps reach the visible ones, :meth:`StaticBatch.widen` moves them on by :data:`SPAN` and the
step is captured again: about L / 256 captures a rollout, each a recorded forward (the first after
an eager warm-up), for a step that reads on average about half the cache where it would read all of
it. Notation as :mod:`~lightning_troll.engines.graph_decode`'s.
"""

from __future__ import annotations

import types
import warnings
import weakref
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from transformers import StaticCache

from lightning_troll.engines.decode import Prefill
from lightning_troll.engines.step_attention import LENT

__all__ = ["SPAN", "CompiledStep", "StaticBatch", "StepEnd", "compiled_step"]

SPAN = 256
"""The positions a step attends over grow in steps of this many (:meth:`StaticBatch.widen`)."""


class StepEnd(Protocol):
    """What a step of :class:`StaticBatch` may end with, in its graph: the choice of the slots'
    next tokens (:class:`~lightning_troll.engines.graph_decode.Slots`)."""

    def choose(self, logits: Tensor) -> None:
        """Acts on the step's logits (b, V), reading nothing from the device."""

    def gather(self, take: Tensor, count: int) -> None:
        """Follows a compaction: the new bucket's slots are the old ``take`` (b',), its first
        ``count`` holding the running sequences."""


class StaticBatch:
    """The b slots of the bucket decoding now, and the one step they take.

    Attributes: ``rows`` (b,) each slot's index into B (B itself for a slot that holds no
    sequence); ``tokens`` (b, 1) the ids the next step feeds; ``positions`` (b, 1) their
    positions; ``mask`` (b, 1, 1, L) the additive attention mask (0 where a slot attends, the
    dtype's lowest value elsewhere); ``slot`` the cache position the next step writes, and
    ``slot_at`` the same on the device; ``visible`` how many cache positions a step attends over
    (:meth:`widen`); ``cache`` a ``StaticCache`` whose layers view the first b rows of the
    (B, H, L, D) keys and values allocated once; ``slots`` None, or the
    :class:`~lightning_troll.engines.graph_decode.Slots` whose ``choose`` each step ends with
    (``check_every`` > 1); ``graph`` the captured step, or None (eager); ``stale`` whether the
    step changed since it was captured (a compaction, wider positions); ``warmed`` whether a
    capture succeeded (later ones need no warm-up). Every tensor a graph reads or writes keeps
    its address until the next compaction.
    """

    def __init__(self, model, cache, name, rows, positions, mask, slot, storage) -> None:
        self.model, self.cache, self.name = model, cache, name
        self.step_model: Any = model  # what a step calls: the model, or its CompiledStep
        self.rows, self.positions, self.mask, self.slot = rows, positions, mask, slot
        self.slot_at = torch.tensor(slot, device=rows.device)  # ()
        self.tokens = torch.zeros_like(positions)  # (b, 1)
        self.storage = storage  # per layer: the (B, H, L, D) keys and values
        self.visible = min(mask.shape[-1], _room(slot + 1))
        self.slots: StepEnd | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: Tensor | None = None  # (b, V) the captured step's output
        self.stale = True
        self.warmed = False  # whether a capture has succeeded after a warm-up

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

    def widen(self) -> None:
        """Where the next step writes at or past the ``visible`` positions, widens them to the
        next multiple of :data:`SPAN` (at most L): the step is then stale."""
        if self.slot < self.visible:
            return
        self.visible = min(self.mask.shape[-1], _room(self.slot + 1))
        self.graph, self.logits, self.stale = None, None, True

    def forward(self) -> Tensor:
        """One step of every slot: feeds ``tokens`` at ``positions``; returns the logits (b, V),
        float32 (the graph's output buffer when captured: read it before the next step); with
        ``slots``, their ``choose`` follows on those logits, in the graph where captured."""
        if self.graph is None:
            logits = self._step()
            if self.slots is not None:
                self.slots.choose(logits)
        else:
            self.graph.replay()
            logits = self.logits
        self.slot += 1
        return logits

    def _step(self) -> Tensor:
        """The step as a graph holds it: every position and count it moves on lives on the
        device."""
        seen = self.mask[:, 0, 0]  # (b, L), a view
        seen.index_fill_(-1, self.slot_at.view(1), 0.0)  # the position this step writes
        cuts = getattr(self.model.config, "_attn_implementation", None) in LENT
        out = self.step_model(
            input_ids=self.tokens,  # (b, 1)
            attention_mask=self.mask[..., : self.visible] if cuts else self.mask,  # (b, 1, 1, .)
            position_ids=self.positions,  # (b, 1)
            use_cache=True,
            **{self.name: self.cache},
        )
        self.positions += 1
        self.slot_at += 1
        return out.logits[:, -1].float()  # (b, V)

    def compact(self, live: Tensor) -> Tensor:
        """Moves the ``live`` slots (n,) to the front, into the smallest bucket that holds them
        (the rest of it filled with copies of the first, holding no sequence), and drops the old
        bucket's graph (the step is stale). Returns the new live slots (n,), ``arange(n)``."""
        count = live.numel()
        size = 1 << (count - 1).bit_length()  # the smallest power of two >= n
        take = torch.cat([live, live[:1].expand(size - count)])  # (b',) slots of the old bucket
        self.graph, self.logits = None, None  # the old bucket's graph and its memory go
        self.stale = True
        for layer, (keys, values) in zip(self.cache.layers, self.storage, strict=True):
            keys[:size] = layer.keys[take]  # (b', H, L, D), gathered before it is written
            values[:size] = layer.values[take]
            layer.keys, layer.values = keys[:size], values[:size]
            layer.batch_size = size
        nowhere = self.storage[0][0].shape[0]  # B: the row of a slot holding no sequence
        self.rows = self.rows[take].index_fill_(
            0, torch.arange(count, size, device=live.device), nowhere
        )  # (b',)
        self.mask = self.mask[take]  # (b', 1, 1, L)
        self.positions, self.tokens = self.positions[take], self.tokens[take]  # (b', 1)
        if self.slots is not None:
            self.slots.gather(take, count)
        return torch.arange(count, device=live.device)

    def capture(self) -> str | None:
        """Captures this bucket's step (with ``slots.choose`` after it, where ``slots`` is set)
        as a CUDA graph; returns None, or the error's first line where capture failed (no graph
        then: the steps run eagerly). The step is no longer stale either way.

        The batch's first capture runs the forward once eagerly first, on a side stream (lazy
        initialisation, as PyTorch asks before a capture); a later one (a new bucket, wider
        positions) records at once, the model's kernels having run, and where that fails it
        is tried again after a warm-up."""
        self.stale = False
        failure = self._record(warm_up=not self.warmed)
        if failure is not None and self.warmed:
            failure = self._record(warm_up=True)
        self.warmed = self.warmed or failure is None
        return failure

    def _record(self, warm_up: bool) -> str | None:
        """One try of :meth:`capture`, after an eager warm-up of the forward where ``warm_up``.
        The warm-up writes the cache position the next step writes, which that step overwrites,
        and moves the positions and counters on, which are then set back."""
        counters = [layer.cumulative_length for layer in self.cache.layers]
        positions = self.positions.clone()  # (b, 1)

        def set_back() -> None:
            self.positions.copy_(positions)
            self.slot_at.fill_(self.slot)
            for counter in counters:
                counter.fill_(self.slot)

        try:
            if warm_up:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._step()
                torch.cuda.current_stream().wait_stream(side)
                set_back()  # the warm-up moved them on
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                logits = self._step()  # (b, V), recorded, not run
                if self.slots is not None:
                    self.slots.choose(logits)
        except Exception as error:  # noqa: BLE001 - any failure: the step runs eagerly
            torch.cuda.synchronize()
            set_back()
            return _first_line(error)
        self.graph, self.logits = graph, logits
        return None


class CompiledStep:
    """``model``'s forward compiled with ``torch.compile`` for the static loop's steps, its
    dimensions dynamic from the start (the batch, the visible positions and the cache's length
    change with buckets, spans and rollouts), one per model for the life of the process
    (:func:`compiled_step`): a run compiles a step of each kind once or twice, not every
    rollout. Called as the model is, with keyword arguments. Where compiling (or running what
    it compiled) fails outside a CUDA graph's capture, it warns once and calls the model itself
    from then on; inside a capture, the failure is the capture's (:meth:`StaticBatch.capture`
    tries again after a warm-up, which compiles outside it).

    Each model compiles a function of its own (a copy of :func:`_call`'s code): the compiler
    keeps its compilations by function, and past ``torch._dynamo.config.recompile_limit`` of them
    runs a function uncompiled without a word, so one function shared by every model a process
    samples from would stop compiling after a few models."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        self._compiled: Any = None
        self.failure: str | None = None
        own = types.FunctionType(_call.__code__.replace(), _call.__globals__, _call.__name__)
        try:
            self._compiled = torch.compile(own, dynamic=True)
        except Exception as error:  # noqa: BLE001 - a platform torch.compile does not serve
            self._fail(model, error)

    def __call__(self, **inputs: Any) -> Any:
        model = self._model()
        if self.failure is None:
            try:
                return self._compiled(model, **inputs)
            except Exception as error:  # noqa: BLE001 - any failure: the step runs uncompiled
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise
                self._fail(model, error)
        return model(**inputs)

    def _fail(self, model: nn.Module, error: Exception) -> None:
        """Keeps the failure and warns of it: the steps run uncompiled from now on."""
        self.failure = _first_line(error)
        warnings.warn(
            f"model.sampling.compile_step: compiling the decoding step of "
            f"{type(model).__name__} failed ({self.failure}); its steps run uncompiled",
            stacklevel=3,
        )


def _call(model: nn.Module, **inputs: Any) -> Any:
    """``model(**inputs)``: what :class:`CompiledStep` compiles."""
    return model(**inputs)


_COMPILED: weakref.WeakKeyDictionary[nn.Module, CompiledStep] = weakref.WeakKeyDictionary()


def compiled_step(model: nn.Module) -> CompiledStep:
    """``model``'s :class:`CompiledStep`, made at the first call and kept while the model
    lives."""
    step = _COMPILED.get(model)
    if step is None:
        step = _COMPILED[model] = CompiledStep(model)
    return step


def _first_line(error: Exception) -> str:
    """``error``'s type and the first line of its message, for a warning."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def _room(positions: int) -> int:
    """``positions`` rounded up to a multiple of :data:`SPAN`."""
    return -(-positions // SPAN) * SPAN
