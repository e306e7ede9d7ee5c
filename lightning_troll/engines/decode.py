"""KV-cached decoding for rollouts: each prompt prefilled once, finished sequences dropped.

A rollout asks for G completions of each of P prompts. transformers' ``generate`` runs the B =
P * G sequences as one batch from start to end: it prefills every prompt G times, and it keeps
decoding a finished sequence (feeding it padding) until the longest one ends. :func:`decode`
does neither:

- it prefills the P distinct prompts (left padded) once and repeats each prompt's keys and
  values G times in the cache (``DynamicCache.batch_repeat_interleave``);
- after every step it removes the sequences that just produced a stop token (or reached a
  budget of their own) from the batch, the cache (``batch_select_indices``) and the running
  tensors, so the next forward runs on the sequences still going only;
- a recorder with a ``record_rows`` hook (:class:`~lightning_troll.engines.behaviour.
  BehaviourRecorder`) sees the logits of the running sequences only, with their row numbers.

It samples from the distribution ``generate`` samples from with the same options: the float32
logits divided by the temperature, then top-k (0: off) and top-p (1: off) as transformers'
``TopKLogitsWarper`` and ``TopPLogitsWarper`` apply them, then the softmax; ``do_sample=False``
takes the argmax of the raw logits. The model's own ``generation_config`` plays no part. A
token is drawn by :func:`draw` (the inverse of the cumulative distribution at one uniform
number per sequence from torch's global generator, so seeded runs repeat) where ``generate``
calls ``torch.multinomial`` (one exponential number per sequence and vocabulary entry, a
sixth of a rollout's time on SmolLM2 on a CPU). A seed therefore gives other completions than
``generate`` would, from the same distribution; greedy decoding gives the same tokens.

Where it cannot serve a model, :func:`decode` returns None before drawing anything, and the
caller falls back to ``generate`` (:func:`cannot_decode` says why):

- encoder-decoder models, and models without a ``config``;
- a model whose cache has layers other than plain ``DynamicLayer`` ones: sliding-window
  attention (Mistral with ``sliding_window``, Gemma 2 and 3, ...), linear-attention or state
  space layers, offloaded caches; and a model whose forward returns no such cache;
- a model in training mode with gradient checkpointing (transformers switches its cache off).

Soft-capped or scaled logits are served: the model's forward applies them. GGUF models load as
ordinary llama models and are served. A model sharded with FSDP2 over several processes is
served in lock-step: every process runs the same number of forwards (a finished process runs
a one-token forward while others go on), as ``generate``'s ``synced_gpus`` does, because a
forward whose weights are not gathered all-gathers them with every other process.

Notation: P prompts, G completions per prompt, B = P * G sequences (prompt-major), S prompt
length (left padded), n sequences still running, t tokens generated so far, T response length,
V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from lightning_troll.models.loading import is_checkpointed

__all__ = [
    "Check",
    "Prefill",
    "Sampling",
    "cannot_decode",
    "choose_tokens",
    "decode",
    "draw",
    "prefill",
    "raise_failed",
    "top_k_mask",
    "top_p_mask",
]

_NEG_INF = float("-inf")


class Sampling(Protocol):
    """What decoding reads of :class:`~lightning_troll.engines.sampling.SamplingConfig`."""

    temperature: float
    top_k: int
    top_p: float
    max_new_tokens: int


def cannot_decode(model: nn.Module) -> str | None:
    """Why :func:`decode` cannot serve ``model`` (then ``generate`` samples), or None if it can."""
    config = getattr(model, "config", None)
    if config is None:
        return f"{type(model).__name__} has no config"
    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model"
    if model.training and is_checkpointed(model):
        return "it is in training mode with gradient checkpointing, which switches the cache off"
    try:
        layers = DynamicCache(config=config).layers
    except Exception as error:  # a config transformers' cache cannot read
        return f"its config does not describe a cache ({type(error).__name__}: {error})"
    odd = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
    if odd:
        return f"its cache has {', '.join(odd)} layers (sliding windows or linear attention)"
    return None


def top_k_mask(scores: Tensor, top_k: int) -> Tensor:
    """(n, V) scores with all but the ``top_k`` largest of each row set to -inf (ties with the
    k-th kept), as transformers' ``TopKLogitsWarper(top_k)`` does."""
    k = min(top_k, scores.shape[-1])
    kth = torch.topk(scores, k)[0][..., -1, None]  # (n, 1)
    return scores.masked_fill(scores < kth, _NEG_INF)  # (n, V)


def top_p_mask(scores: Tensor, top_p: float) -> Tensor:
    """(n, V) scores with each row's least likely tokens set to -inf, keeping the smallest set
    whose probability reaches ``top_p`` (and at least the most likely token), as transformers'
    ``TopPLogitsWarper(top_p)`` does."""
    ordered, order = torch.sort(scores, descending=False)  # (n, V) ascending
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)  # (n, V)
    drop = cumulative <= (1 - top_p)  # (n, V) in sorted order
    drop[..., -1:] = False  # the most likely token stays
    return scores.masked_fill(drop.scatter(1, order, drop), _NEG_INF)  # (n, V)


def choose_tokens(
    scores: Tensor, sampling: Sampling, do_sample: bool, defer: list[Check] | None = None
) -> Tensor:
    """The next token of each row of ``scores`` (n, V), float32 logits: the argmax, or a draw
    from the softmax at ``sampling.temperature`` after its top-k and top-p. Returns (n,).
    ``defer`` as in :func:`draw`."""
    if not do_sample:
        return scores.argmax(dim=-1)  # (n,)
    if sampling.temperature != 1.0:
        scores = scores / sampling.temperature  # (n, V)
    if sampling.top_k:
        scores = top_k_mask(scores, sampling.top_k)
    if sampling.top_p < 1.0:
        scores = top_p_mask(scores, sampling.top_p)
    return draw(scores, defer)


def draw(scores: Tensor, defer: list[Check] | None = None) -> Tensor:
    """One token per row of ``scores`` (n, V), drawn from ``softmax(scores)`` by inverting the
    cumulative distribution at a uniform number from torch's global generator. Returns (n,).

    One random number per row, where ``torch.multinomial`` draws one per row and token (its
    cost on a CPU grows with the vocabulary and runs on one thread); the cumulative sums are
    float64, so a token's share of the unit interval is its probability to ~1e-16 however
    small. Tokens at -inf are never drawn. A row holding NaN or +inf, or -inf throughout,
    raises ``RuntimeError`` (as ``torch.multinomial`` does). With ``defer``, a list, that check
    is appended to it as a :class:`Check` instead, for a caller that reads several values in one
    wait on the device (:func:`raise_failed`).
    """
    weights = (scores - scores.amax(dim=-1, keepdim=True)).exp()  # (n, V), at most 1
    cdf = weights.double().cumsum(dim=-1)  # (n, V), nondecreasing
    total = cdf[:, -1:]  # (n, 1)
    drawable = (total.isfinite() & (total > 0)).all()  # ()
    if defer is None:
        if not bool(drawable):
            raise _not_drawable()
    else:
        defer.append(Check(drawable, _not_drawable))
    uniform = torch.rand(total.shape, dtype=torch.float64, device=scores.device)  # (n, 1)
    tokens = torch.searchsorted(cdf, uniform * total, right=True)  # (n, 1) first cdf > u
    last = cdf.argmax(dim=-1, keepdim=True)  # (n, 1) the last token of positive weight
    return torch.minimum(tokens, last).squeeze(-1)  # (n,)


def _not_drawable() -> RuntimeError:
    """The error of :func:`draw` for rows that are not all distributions."""
    return RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")


@dataclass(frozen=True)
class Check:
    """A check of values on the device that a decoding step reads together with its running
    flags, in the step's one wait on the device, instead of waiting for it on its own."""

    ok: Tensor
    """() bool on the device: True where the check passes."""
    error: Callable[[], Exception]
    """Builds the error to raise where it fails."""


def raise_failed(checks: Sequence[Check], passed: Sequence[bool]) -> None:
    """Raises the error of the first of ``checks`` whose value read from the device (in
    ``passed``, in the same order) is False."""
    for check, ok in zip(checks, passed, strict=True):
        if not ok:
            raise check.error()


class _Batch:
    """The sequences still running, and everything a decoding step needs of them.

    Attributes: ``rows`` (n,) their indices into B; ``mask`` (n, S + t) attention mask;
    ``positions`` (n,) the position of the next token; ``cache`` the keys and values, n rows.
    """

    def __init__(self, rows: Tensor, mask: Tensor, positions: Tensor, cache: DynamicCache):
        self.rows, self.mask, self.positions, self.cache = rows, mask, positions, cache

    def keep(self, running: Tensor, checks: list[Check]) -> Tensor | None:
        """Keeps the sequences where ``running`` (n,) bool is True; returns their indices (n',)
        into the n, or None where all are kept (nothing changes). ``checks`` (the draw's and
        the recorder's) are read in the same wait on the device as ``running.all()``, and the
        first that failed raises."""
        everyone, *passed = torch.stack([running.all(), *(c.ok for c in checks)]).tolist()
        raise_failed(checks, passed)
        if everyone:
            return None
        keep = running.nonzero().squeeze(-1)  # (n',)
        self.rows, self.mask = self.rows[keep], self.mask[keep]
        self.positions = self.positions[keep]
        self.cache.batch_select_indices(keep)
        return keep


@torch.no_grad()
def decode(
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
    """``group_size`` completions of each prompt, or None where ``generate`` must sample.

    Args:
        model: a causal LM (eval mode; sharded weights gathered by the caller).
        prompts: (P, S) prompt ids, left padded.
        prompt_mask: (P, S) 1 at prompt tokens, 0 at padding.
        group_size: G, completions per prompt.
        sampling: temperature, top_k, top_p and max_new_tokens.
        pad_id: the id written after a completion's stop token.
        stop_ids: the tokens that end a completion (any of them).
        do_sample: False decodes greedily.
        recorder: None, or an object whose ``record_rows(logits (n, V), tokens (n,), rows (n,),
            checks)`` sees each step's raw float32 logits of the running sequences, the tokens
            chosen from them and their indices into B, and may add its own :class:`Check` to the
            step's ``checks`` (a list) rather than wait on the device for it.
        budgets: None, or (B,) each sequence's own most tokens (at most
            ``sampling.max_new_tokens``): a sequence that reaches its own leaves the batch
            as one that produced a stop token does.

    Returns:
        (B, T) generated tokens, prompt-major, ``pad_id`` after each stop token; T is the
        longest completion (at most ``sampling.max_new_tokens``). None (before any random draw)
        where :func:`cannot_decode` names a reason or the model returns no plain dynamic cache.
    """
    if cannot_decode(model) is not None:
        return None
    device = prompts.device
    stops = torch.as_tensor(list(stop_ids), dtype=torch.long, device=device)  # (E,)
    first = prefill(model, prompts, prompt_mask, group_size)
    if first is None:
        return None
    name, cache, logits = first.name, first.cache, first.logits  # logits (B, V)
    cache.batch_repeat_interleave(group_size)  # P -> B rows
    total = prompts.shape[0] * group_size  # B
    batch = _Batch(
        rows=torch.arange(total, device=device),  # (B,)
        mask=prompt_mask.repeat_interleave(group_size, dim=0),  # (B, S)
        positions=first.following.repeat_interleave(group_size),  # (B,)
        cache=cache,
    )
    budget = sampling.max_new_tokens
    responses = torch.full((total, budget), pad_id, dtype=torch.long, device=device)  # (B, T)
    synced = _synced(model)
    steps = 0
    while steps < budget:
        if logits is not None:
            checks: list[Check] = []  # read with the stop check, in one wait on the device
            tokens = choose_tokens(logits, sampling, do_sample, checks)  # (n,)
            if recorder is not None:
                recorder.record_rows(logits, tokens, batch.rows, checks)
            responses[batch.rows, steps] = tokens
            running = ~torch.isin(tokens, stops)  # (n,)
            if budgets is not None:
                running &= budgets[batch.rows] > steps + 1
            kept = batch.keep(running, checks)  # (n',) or None: all run on
            if kept is not None:  # indexing only then: one wait on the device fewer a step
                tokens = tokens[kept]  # (n',)
            steps += 1
        going = batch.rows.numel() > 0 and steps < budget
        if synced:
            going = _anyone(going, device)
        if not going:
            break
        logits = _step(model, batch, tokens, name) if batch.rows.numel() else _idle(model, prompts)
    return responses[:, :steps]  # (B, T)


@dataclass(frozen=True)
class Prefill:
    """The P prompts after their one forward: what both decoding loops start from."""

    cache: DynamicCache
    """The prompts' keys and values, P rows (each loop repeats them G times its own way)."""
    name: str
    """The keyword the model's forward takes the cache by (transformers renamed it)."""
    logits: Tensor
    """(B, V) float32 logits of each sequence's first token, each prompt's repeated G times."""
    following: Tensor
    """(P,) the position of each prompt's next token (left padding skipped)."""


def prefill(
    model: nn.Module, prompts: Tensor, prompt_mask: Tensor, group_size: int
) -> Prefill | None:
    """Each of the (P, S) left-padded ``prompts`` through ``model`` once, keeping the cache and
    the last position's logits only; None (before any random draw) where the forward returns no
    plain dynamic cache. :func:`decode` and :func:`~lightning_troll.engines.graph_decode.
    static_decode` both start here."""
    first_positions = _positions(prompt_mask)  # (P, S)
    out = model(
        input_ids=prompts,
        attention_mask=prompt_mask,
        position_ids=first_positions,
        use_cache=True,
        logits_to_keep=1,
    )
    name = "cache" if "cache" in out else "past_key_values"  # transformers renamed it
    cache = out.get(name)
    if not _plain_dynamic(cache):
        return None
    logits = out.logits[:, -1].float().repeat_interleave(group_size, dim=0)  # (B, V)
    return Prefill(cache, name, logits, first_positions[:, -1] + 1)  # following (P,)


def _step(model: nn.Module, batch: _Batch, tokens: Tensor, name: str) -> Tensor:
    """One forward of the running sequences' last tokens (n,); returns the next logits (n, V)."""
    batch.mask = torch.cat([batch.mask, batch.mask.new_ones(batch.mask.shape[0], 1)], dim=-1)
    out = model(
        input_ids=tokens.unsqueeze(-1),  # (n, 1)
        attention_mask=batch.mask,  # (n, S + t)
        position_ids=batch.positions.unsqueeze(-1),  # (n, 1)
        use_cache=True,
        **{name: batch.cache},
    )
    batch.positions = batch.positions + 1
    return out.logits[:, -1].float()  # (n, V)


def _idle(model: nn.Module, prompts: Tensor) -> None:
    """A one-token forward for a process whose sequences have all ended while another process's
    go on, so both run as many forwards (and gather sharded weights as often)."""
    model(input_ids=prompts[:1, -1:], use_cache=False, logits_to_keep=1)


def _positions(mask: Tensor) -> Tensor:
    """Positions that skip left padding, as ``generate`` makes them: (P, S) -> (P, S)."""
    return (mask.long().cumsum(-1) - 1).clamp_min(0)


def _plain_dynamic(cache: object) -> bool:
    """True for a ``DynamicCache`` whose layers are all filled plain ``DynamicLayer`` ones."""
    layers = getattr(cache, "layers", None)
    return (
        isinstance(cache, DynamicCache)
        and bool(layers)
        and all(type(layer) is DynamicLayer and layer.is_initialized for layer in layers)
    )


def _synced(model: nn.Module) -> bool:
    """True where the model is FSDP2-sharded across several processes, which must then run the
    same number of forwards."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _anyone(going: bool, device: torch.device) -> bool:
    """Whether any process still has sequences to decode (``going`` is this one's say)."""
    flag = torch.tensor([float(going)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
