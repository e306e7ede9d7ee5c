"""Decoding that the device runs at its pace: a static KV cache, each step a captured CUDA graph.

The dynamic loop of :mod:`~lightning_troll.engines.decode` launches every kernel of every step
from the host, and a GPU waits on those launches: at Qwen3-0.6B's shape on an H200 it decoded
1,282 tokens/s, with the device idle most of each step. :func:`graph_decode` decodes the same
completions from the same distribution with fixed shapes instead:

- the P prompts are prefilled once, by the dynamic loop's own prefill
  (:func:`~lightning_troll.engines.decode.prefill`), and their keys and values copied G times
  into transformers' ``StaticCache``, B rows of L positions allocated once;
- each one-token step of a bucket of b slots is captured as a ``torch.cuda.CUDAGraph``
  and then replayed: one launch a step, whatever the model's depth; a step attends over the
  positions written so far rounded up to a span of 256
  (:class:`~lightning_troll.engines.static_batch.StaticBatch`), captured again as they widen;
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
(the static step attends over more positions than it has written, those masked). A recorder's
``record_rows`` sees the same rows as in the dynamic loop.

With ``sampling.check_every`` k > 1 the host reads the flags every k steps only, and the graph
holds the whole step (:class:`Slots`): after the forward, every one of the b slots draws its
token, the recorder writes in place (``record_slots``), the tokens land in ``responses`` at the
step a device-side counter holds, and the stop flags and checks accumulate on the device; so
between reads the host launches one graph a step and nothing else. A slot whose sequence stopped
draws on (its tokens past its stop, cut by the caller); a spare slot of a bucket writes to row B,
which is no sequence's.

Why manual capture rather than ``torch.compile(mode="reduce-overhead")``: the cache length S + T
changes with every rollout's prompts and budget and the batch with every bucket, and each new shape
would be a compilation (tens of seconds to minutes at a real model's depth, and the compiler of the
GPU image untried here); a manual capture costs one recorded forward per bucket (and one eager
warm-up a rollout), and runs the model's forward as transformers wrote it. vLLM captures its decode
step per batch-size bucket in the same way. ``sampling.compile_step`` compiles that forward with
dynamic dimensions (one or two compilations a run,
:class:`~lightning_troll.engines.static_batch.CompiledStep`) and still captures it here.

Where the graphs cannot serve, :func:`graph_decode` returns None before any random draw and the
dynamic loop decodes, with a warning naming the reason (once per reason): no CUDA device, a
model :func:`~lightning_troll.engines.decode.cannot_decode` refuses, a static cache with
layers other than plain ``StaticLayer`` ones, a model that would not take the step's 4-D mask
as it is (:func:`~lightning_troll.engines.decode.no_additive_mask`: attention other than
``sdpa``, ``eager`` or one :mod:`~lightning_troll.engines.step_attention` lends, or a mask of its
own making), a model sharded with FSDP2 over several
processes, and, at ``check_every`` 1, a forward that cannot be captured (a host synchronisation
inside it, for one). At ``check_every`` above 1 the step is first captured with the choice of its
tokens, after the first token is drawn (one capture of the first bucket, not two); where that
fails, its steps run eagerly, warned, as a later bucket's do whose capture fails.

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
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from lightning_troll.engines.choice import Check, Sampling, choose_tokens, raise_failed
from lightning_troll.engines.decode import (
    _synced,
    cannot_decode,
    no_additive_mask,
    prefill,
)
from lightning_troll.engines.static_batch import StaticBatch, compiled_step
from lightning_troll.engines.step_attention import prefix_steps

__all__ = ["DECODE_MODES", "Slots", "cannot_capture", "graph_decode", "static_decode"]

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
    draw) where the prefill gives no plain dynamic cache or, at ``check_every`` 1, the first
    capture fails."""
    device = prompts.device
    stops = torch.as_tensor(list(stop_ids), dtype=torch.long, device=device)  # (E,)
    with prefix_steps(model):  # a step attends over the positions it can see only
        first = prefill(model, prompts, prompt_mask, group_size)
        if first is None:
            _fall_back("its forward returns no plain dynamic cache")
            return None
        budget = sampling.max_new_tokens
        batch = StaticBatch.prefilled(model, first, prompt_mask, group_size, budget)
        if getattr(sampling, "compile_step", False):
            batch.step_model = compiled_step(model)
        logits = first.logits  # (B, V)
        del first  # the dynamic cache: copied into the static one
        choice = _Choice(sampling, do_sample, recorder, stops, budgets, pad_id)
        every = _reads_every(choice)
        if every > 1:  # captured with the choice of its tokens, after the first is chosen
            return _whole_steps(batch, Slots(batch, choice), logits, every, capture)
        if capture:  # before any draw: a model whose forward cannot be captured is found here
            failure = batch.capture()
            if failure is not None:
                _fall_back(f"capturing its decode step failed ({failure})")
                return None
        return _each_step(batch, logits, choice, capture)


@dataclass(frozen=True)
class _Choice:
    """What choosing a step's tokens takes: the sampling options, greedy or not, the recorder
    (or None), the stop ids (E,), each sequence's own budget (B,) or None, the padding id."""

    sampling: Sampling
    do_sample: bool
    recorder: Any
    stops: Tensor
    budgets: Tensor | None
    pad_id: int


def _reads_every(choice: _Choice) -> int:
    """How many steps the loop takes between reads of which sequences stopped: ``check_every``,
    or 1 (warned) where a recorder cannot record a step that a graph holds whole."""
    every = getattr(choice.sampling, "check_every", 1)
    recorder = choice.recorder
    if every > 1 and recorder is not None and not hasattr(recorder, "record_slots"):
        _fall_back_once(
            f"model.sampling.check_every: {every} asks the CUDA-graph path to read which "
            f"sequences stopped every {every} steps, but its recorder "
            f"({type(recorder).__name__}) has no record_slots; it reads at every step"
        )
        return 1
    return every


def _each_step(batch: StaticBatch, logits: Tensor, choice: _Choice, capture: bool) -> Tensor:
    """The loop of :func:`static_decode` at ``check_every`` 1: each step's tokens are chosen
    eagerly from the running sequences' logits, as the dynamic loop chooses them, and the host
    reads which sequences stopped at every step. ``logits`` (B, V): the prefill's."""
    sampling, do_sample, recorder = choice.sampling, choice.do_sample, choice.recorder
    stops, budgets, pad_id = choice.stops, choice.budgets, choice.pad_id
    total, budget = batch.rows.numel(), sampling.max_new_tokens  # B, T
    device = logits.device
    responses = torch.full((total, budget), pad_id, dtype=torch.long, device=device)  # (B, T)
    live = torch.arange(total, device=device)  # (n,) the running slots, ascending
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
        running = ~torch.isin(tokens, stops)  # (n,)
        if budgets is not None:
            running &= budgets[rows] > steps + 1
        steps += 1
        flags = torch.cat([running, *(c.ok.unsqueeze(0) for c in checks)])  # (n + checks,)
        flags = flags.tolist()  # the step's one wait on the device
        raise_failed(checks, flags[live.numel() :])
        if not all(flags[: live.numel()]):
            live = live[running]  # (n',)
        checks = []
        if live.numel() == 0 or steps == budget:
            break
        if live.numel() <= batch.next_bucket():
            live = batch.compact(live)
        logits = _advance(batch, capture)  # (b, V)
    return responses[:, :steps]  # (B, T)


def _whole_steps(
    batch: StaticBatch, slots: Slots, logits: Tensor, every: int, capture: bool
) -> Tensor:
    """The loop of :func:`static_decode` at ``check_every`` k > 1: the first token is chosen
    eagerly from the prefill's ``logits`` (B, V) (which runs the choice's kernels and allocates
    its records before any capture); every later step, the forward with the choice of its
    tokens, their records and the stop flags, is one captured graph (``capture``) or runs
    eagerly, and the host reads the flags every k steps and at the budget's end. The first
    bucket is captured once, with its choice: where that fails, its steps run eagerly
    (warned), since a token is drawn by then."""
    budget = slots.responses.shape[1]  # T
    slots.choose(logits)  # the first token: its kernels run once before any capture
    batch.slots = slots  # stale from the start: captured with the choice at the next step
    steps = 1
    while True:
        if steps % every == 0 or steps == budget:
            running = slots.read()  # the slots whose sequences run on
            if not running or steps == budget:
                break
            if len(running) <= batch.next_bucket():
                batch.compact(torch.tensor(running, device=slots.step.device))
        _advance(batch, capture)  # the step, its tokens chosen and recorded
        steps += 1
    return slots.responses[:-1, :steps]  # (B, T)


class Slots:
    """The choice of a step's tokens as a CUDA graph can hold it, for ``check_every`` > 1:
    every one of the bucket's b slots draws (a slot whose sequence stopped, or that holds
    none, too: its token lands past its stop, or in row B of ``responses``, which is no
    sequence's), and nothing is read from the device or allocated after the first step.

    Attributes: ``responses`` (B + 1, T) the tokens at (row, step); ``step`` () the response
    position the next choice writes; ``stopped`` (b,) slots whose sequence stopped (or that hold
    none); ``limit`` (b,) each slot's own budget; ``oks`` the step's checks, each (), and-ed over
    the steps since the last read (None before the first step), with their ``errors``.
    """

    def __init__(self, batch: StaticBatch, choice: _Choice) -> None:
        total, budget = batch.rows.numel(), choice.sampling.max_new_tokens  # B, T
        device, budgets = batch.rows.device, choice.budgets
        self.batch, self.sampling, self.do_sample = batch, choice.sampling, choice.do_sample
        self.recorder, self.stops = choice.recorder, choice.stops
        shape = (total + 1, budget)  # row B: no sequence's
        self.responses = torch.full(shape, choice.pad_id, dtype=torch.long, device=device)
        self.step = torch.zeros((), dtype=torch.long, device=device)
        self.stopped = torch.zeros(total, dtype=torch.bool, device=device)
        own = torch.full((total,), budget, dtype=torch.long, device=device)
        self.limit = own if budgets is None else budgets.clone()  # (b,)
        self.oks: list[Tensor] | None = None
        self.errors: list[Any] = []

    def choose(self, logits: Tensor) -> None:
        """Chooses and records every slot's token from its logits (b, V) and feeds it to the
        next step; marks the slots whose sequence stopped; moves ``step`` on."""
        batch, checks = self.batch, []
        tokens = choose_tokens(logits, self.sampling, self.do_sample, checks)  # (b,)
        shape = (self.responses.shape[0] - 1, self.responses.shape[1])  # (B, T)
        if self.recorder is not None:
            self.recorder.record_slots(logits, tokens, batch.rows, self.step, shape, checks)
        self.responses.index_put_((batch.rows, self.step.expand_as(batch.rows)), tokens)
        batch.tokens[:, 0] = tokens
        # a stop token drawn: compared one by one, whose shapes a graph keeps (isin's may not)
        ended = (tokens.unsqueeze(-1) == self.stops).any(-1)  # (b,)
        self.stopped |= ended | (self.limit <= self.step + 1)
        if self.oks is None:  # the first step, eager: the checks' running values start here
            self.oks = [check.ok.clone() for check in checks]
            self.errors = [check.error for check in checks]
        else:
            for ok, check in zip(self.oks, checks, strict=True):
                ok &= check.ok
        self.step += 1

    def read(self) -> list[int]:
        """The slots whose sequences run on, after the one wait on the device since the last
        read (which raises the first failed check's error)."""
        size = self.stopped.numel()
        flags = torch.cat([~self.stopped, *(ok.unsqueeze(0) for ok in self.oks)]).tolist()
        raise_failed([Check(ok, error) for ok, error in zip(self.oks, self.errors, strict=True)],
                     flags[size:])  # fmt: skip
        for ok in self.oks:
            ok.fill_(True)
        return [slot for slot, running in enumerate(flags[:size]) if running]

    def gather(self, take: Tensor, count: int) -> None:
        """The per-slot state of the bucket ``take`` (b',) makes, its first ``count`` slots
        running and the rest holding no sequence."""
        self.limit = self.limit[take]
        self.stopped = torch.arange(take.numel(), device=take.device) >= count


def _advance(batch: StaticBatch, capture: bool) -> Tensor:
    """``batch``'s next step (its logits (b, V)), its positions widened where it needs them and
    captured again where it is stale (``capture``), eagerly where that fails (warned once)."""
    batch.widen()
    if capture and batch.stale:
        _capture_or_warn(batch)
    return batch.forward()


def _capture_or_warn(batch: StaticBatch) -> None:
    """Captures ``batch``'s step; where that fails, warns (once per reason) that its steps run
    eagerly."""
    failure = batch.capture()
    if failure is not None:
        _fall_back_once(
            f"model.sampling.decode: capturing the CUDA-graph path's decode step for "
            f"{batch.rows.numel()} slots failed ({failure}); those steps run eagerly"
        )


def _fall_back(reason: str) -> None:
    """Warns, once per reason, that the dynamic loop decodes instead of the CUDA graphs."""
    _fall_back_once(
        f"model.sampling.decode: CUDA-graph decoding cannot serve this model ({reason}); the "
        "dynamic decoding loop samples instead"
    )


def _fall_back_once(message: str) -> None:
    """Warns ``message``, once per process."""
    if message in _WARNED:
        return
    _WARNED.add(message)
    warnings.warn(message, stacklevel=4)
