"""KV-cached decoding for rollouts: each prompt prefilled once, finished sequences dropped.

A rollout asks for G completions of each of P prompts. transformers' ``generate`` runs the B =
P * G sequences as one batch from start to end: it prefills every prompt G times, and it keeps
decoding a finished sequence (feeding it padding) until the longest one ends. :func:`decode`
does neither:

- it prefills the P distinct prompts (left padded) once and repeats each prompt's keys and
  values G times into a cache with room for the completions, which each step writes in place
  (:func:`~lightning_troll.engines.reserved.reserve`) where ``DynamicCache`` would copy every
  layer's whole cache to append one position;
- after every step it removes the sequences that just produced a stop token (or reached a
  budget of their own) from the batch, the cache (``batch_select_indices``) and the running
  tensors, so the next forward runs on the sequences still going only;
- a recorder with a ``record_rows`` hook (:class:`~lightning_troll.engines.behaviour.
  BehaviourRecorder`) sees the logits of the running sequences only, with their row numbers.

It samples as :mod:`~lightning_troll.engines.choice` chooses tokens: from the distribution
``generate`` samples from with the same options, by another draw (a seed gives other
completions than ``generate`` would; greedy decoding gives the same tokens).

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

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from lightning_troll.engines.choice import Check, Sampling, choose_tokens, raise_failed
from lightning_troll.engines.reserved import reserve
from lightning_troll.engines.step_attention import LENT
from lightning_troll.models.loading import is_checkpointed

__all__ = ["Prefill", "cannot_decode", "decode", "no_additive_mask", "prefill"]

_ADDITIVE_ATTENTION = ("sdpa", "eager", *LENT)  # attention that takes an additive 4-D mask as given


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


def no_additive_mask(model: nn.Module) -> str | None:
    """Why ``model``'s forward would not hand an additive 4-D attention mask to its attention as
    it is, or None where it would: its attention is ``sdpa`` or ``eager`` and its modelling
    module builds masks with transformers' ``create_causal_mask`` (which passes a 4-D mask
    through; a model that builds its own from a 2-D one would misread it)."""
    attention = getattr(model.config, "_attn_implementation", None)
    if attention not in _ADDITIVE_ATTENTION:
        return f"its attention implementation {attention!r} takes no 4-D mask"
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    if not hasattr(sys.modules.get(type(base).__module__), "create_causal_mask"):
        return f"{type(base).__name__} builds its own attention mask"
    return None


class _Batch:
    """The sequences still running, and everything a decoding step needs of them.

    Attributes: ``rows`` (n,) their indices into B; ``mask`` the attention mask the steps hand
    the model, (n, S + t) 0/1 or, where ``additive``, (n, 1, 1, S + t) additive (built once,
    extended a column a step);
    ``positions`` (n,) the position of the next token; ``cache`` the keys and values, n rows;
    ``additive`` which of the two ``mask`` is.
    """

    def __init__(self, rows: Tensor, mask: Tensor, positions: Tensor, cache: DynamicCache,
                 additive: bool = False) -> None:  # fmt: skip
        self.rows, self.mask, self.positions, self.cache = rows, mask, positions, cache
        self.additive = additive

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
            chosen from them and their indices into B, and may add its own
            :class:`~lightning_troll.engines.choice.Check` to the step's ``checks`` (a list)
            rather than wait on the device for it.
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
    budget = sampling.max_new_tokens
    most = budget if budgets is None else int(budgets.max())  # the longest a completion can be
    reserve(cache, group_size, most - 1)  # P -> B rows, room for the steps after the first
    total = prompts.shape[0] * group_size  # B
    mask = prompt_mask.repeat_interleave(group_size, dim=0)  # (B, S)
    additive = no_additive_mask(model) is None
    if additive:
        mask = _additive(mask, cache.layers[0].keys.dtype)  # (B, 1, 1, S)
    batch = _Batch(
        rows=torch.arange(total, device=device),  # (B,)
        mask=mask,
        positions=first.following.repeat_interleave(group_size),  # (B,)
        cache=cache,
        additive=additive,
    )
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
    seen = batch.mask[..., :1]  # (n, 1) or (n, 1, 1, 1): the column the step's token adds
    seen = torch.zeros_like(seen) if batch.additive else torch.ones_like(seen)
    batch.mask = torch.cat([batch.mask, seen], dim=-1)  # (n, S + t) or (n, 1, 1, S + t)
    out = model(
        input_ids=tokens.unsqueeze(-1),  # (n, 1)
        attention_mask=batch.mask,
        position_ids=batch.positions.unsqueeze(-1),  # (n, 1)
        use_cache=True,
        **{name: batch.cache},
    )
    batch.positions = batch.positions + 1
    return out.logits[:, -1].float()  # (n, V)


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """(n, K) 0/1 attention mask -> (n, 1, 1, K) additive one in ``dtype``: 0 where a token is
    seen, the dtype's lowest value elsewhere. transformers hands a 4-D mask to sdpa and eager
    attention as it is; from a 2-D one it builds its own, and for sdpa reads from the device
    whether it may skip it, a wait at every step."""
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return additive.masked_fill_(mask == 0, torch.finfo(dtype).min)[:, None, None, :]


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
