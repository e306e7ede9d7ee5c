"""Teacher-forced passes over sampled sequences: the hidden states and logits that predict each
response token, and the behaviour policy's token log-probs and sparse rows computed from them.

A rollout's prompts repeat: a group's G completions share one prompt. With ``share_prompts`` the
hidden-state pass runs each distinct prompt of a batch once, keeps its keys and values (the KV
cache generation uses) and runs only the responses against them, copied per sequence; the
results equal a whole-sequence pass up to float rounding, for a fraction of the compute and
activation memory when prompts are long against responses. Nothing here imports Lightning.

Notation: B sequences, U distinct prompts among them, S prompt length (left padded), T response
length (right padded), V vocabulary, H hidden size, N response tokens (``response_mask.sum()``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

from lightning_troll.engines.behaviour import behaviour_rows
from lightning_troll.models.loading import is_checkpointed
from lightning_troll.objectives.chunking import (
    HiddenRows,
    check_chunk_size,
    head_logits,
    map_row_chunks,
)
from lightning_troll.rollouts.micro_batches import pass_ranges, used_columns
from lightning_troll.rollouts.packing import packed_response_hidden, packs
from lightning_troll.rollouts.prompt_cache import (
    PromptCache,
    ReadOnlyCache,
    cache_keyword,
    caches_kept,
    checkpointed_layers,
)
from lightning_troll.trust_region.sparse import SparseDistribution

__all__ = [
    "behaviour_outputs",
    "linear_head",
    "old_logit_rows",
    "position_ids",
    "response_hidden",
    "response_logits",
]


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, as generation uses them: (B, L) -> (B, L)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def response_logits(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_length: int,
    temperature: float,
) -> Tensor:
    """Teacher-forced logits that predict each response token, divided by the temperature.

    (B, S + T) -> (B, T, V). Only the last T + 1 positions go through the output layer.
    """
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids(attention_mask),
        use_cache=False,
        logits_to_keep=response_length + 1,
    )
    return out.logits[:, :-1] / temperature  # (B, T, V)


# Config fields under which a model's logits are more than ``head(last hidden state)``, with the
# value that makes them neutral (soft-capping in Gemma 2/3, a logit scale in Cohere and Granite).
_LOGIT_TRANSFORMS: dict[str, float | None] = {
    "final_logit_softcapping": None,
    "logit_scale": 1.0,
    "logits_scaling": 1.0,
}
_warned: set[str] = set()
"""Model classes already warned about falling back to full logits (one warning each)."""


def linear_head(model: nn.Module) -> nn.Module | None:
    """The output layer if the model's logits are ``head(last hidden state)``, else None.

    A model whose config sets a logit transform (soft-capping, a logit scale) or that has no
    output embeddings gets None, with a one-time warning: its log-probs must come from the full
    logits of :func:`response_logits`.
    """
    head = None
    if hasattr(model, "get_output_embeddings") and hasattr(model, "get_decoder"):
        head = model.get_output_embeddings()
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    transforms = [
        f"{name}={getattr(config, name)!r}"
        for name, neutral in _LOGIT_TRANSFORMS.items()
        if getattr(config, name, neutral) not in (neutral, None)
    ]
    if head is not None and not transforms:
        return head
    kind = type(model).__name__
    if kind not in _warned:
        _warned.add(kind)
        why = ", ".join(transforms) if transforms else "it has no output embeddings or decoder"
        warnings.warn(
            f"{kind}: logits are not a plain output layer of the last hidden state ({why}); "
            "log-probs come from the full (tokens x vocabulary) logits instead of chunks",
            UserWarning,
            stacklevel=2,
        )
    return None


def response_hidden(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_length: int,
    share_prompts: bool = False,
    packed: bool = False,
) -> Tensor:
    """The last hidden states (after the final norm) that predict each response token.

    (B, S + T) -> (B, T, H). The model's own (root) forward runs, so wrappers that act on it
    (FSDP2 gathers the root's parameters, the output layer's among them, and keeps them
    gathered until the backward pass) see an ordinary call; an empty ``logits_to_keep`` makes
    its output layer compute no logits at all. The hidden states are the output of the model's
    decoder (``get_decoder()``), taken by a forward hook, so no other layer's output is kept.

    With ``share_prompts`` each distinct prompt (ids and mask over the first S positions) runs
    once and the responses run against its cached keys and values (see the module docstring);
    gradients flow through the cache into the prompt pass. Under gradient checkpointing the
    passes use caches that are safe to replay (:mod:`~lightning_troll.rollouts.prompt_cache`).
    Where no prompt repeats, or the model returns no cache that can be indexed by sequence, or
    its checkpointed layers cannot keep one (sliding-window attention, an older transformers),
    the whole sequences run instead.

    With ``packed``, and a model whose attention keeps packed sequences apart
    (:func:`~lightning_troll.rollouts.packing.packs`), the sequences' real tokens run packed into
    one row instead (no padding; ``share_prompts`` does not apply).
    """
    captured: list[Tensor] = []

    def keep(module: nn.Module, args, output) -> None:
        hidden = getattr(output, "last_hidden_state", None)
        captured.append(output[0] if hidden is None else hidden)

    no_logits = torch.zeros(0, dtype=torch.long, device=input_ids.device)
    handle = model.get_decoder().register_forward_hook(keep)
    try:
        if packed and packs(model):
            return packed_response_hidden(
                model, input_ids, attention_mask, response_length, captured, no_logits
            )
        if share_prompts:
            hidden = _shared_prompt_hidden(
                model, input_ids, attention_mask, response_length, captured, no_logits
            )
            if hidden is not None:
                return hidden
        model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids(attention_mask),
            use_cache=False,
            logits_to_keep=no_logits,
        )
    finally:
        handle.remove()
    return captured[-1][:, -response_length - 1 : -1]  # (B, T, H)


def distinct_prompts(input_ids: Tensor, attention_mask: Tensor, prompt_length: int):
    """The distinct prompts of a batch: ``(first, inverse)``, where ``first`` (U,) indexes one
    sequence of each distinct (ids, mask) prompt and ``inverse`` (B,) maps every sequence to
    its prompt's position in ``first``."""
    prompts = torch.cat([input_ids[:, :prompt_length], attention_mask[:, :prompt_length]], -1)
    _, inverse = torch.unique(prompts, dim=0, return_inverse=True)  # (B,) in [0, U)
    positions = torch.arange(len(inverse), device=inverse.device)
    first = torch.full_like(inverse, len(inverse)).scatter_reduce(
        0, inverse, positions, reduce="amin"
    )[: int(inverse.max()) + 1]  # (U,)
    return first, inverse


def _shared_prompt_hidden(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_length: int,
    captured: list[Tensor],
    no_logits: Tensor,
) -> Tensor | None:
    """:func:`response_hidden` with each distinct prompt run once; None where it cannot help."""
    prompt_length = input_ids.shape[1] - response_length  # S
    if prompt_length < 1:
        return None
    checkpointed = None
    if model.training and is_checkpointed(model) and torch.is_grad_enabled():
        checkpointed = checkpointed_layers(model)
        if checkpointed is None:
            return None  # these checkpointed layers cannot keep a cache
    first, inverse = distinct_prompts(input_ids, attention_mask, prompt_length)
    if len(first) == len(inverse):  # no prompt repeats: nothing to share
        return None
    if checkpointed is not None:
        with caches_kept(checkpointed):
            return _replayable_passes(
                model, input_ids, attention_mask, prompt_length, first, inverse, captured, no_logits
            )
    prompt_mask = attention_mask[first, :prompt_length]  # (U, S)
    out = model(
        input_ids=input_ids[first, :prompt_length],
        attention_mask=prompt_mask,
        position_ids=position_ids(prompt_mask),
        use_cache=True,
        logits_to_keep=no_logits,
    )
    # transformers renamed the output's and the forward's past_key_values to cache (the old name
    # warns): use the name this version's output carries
    name = "cache" if "cache" in out else "past_key_values"
    cache = out.get(name)
    if cache is None or not hasattr(cache, "batch_select_indices"):
        return None
    last = captured[-1][:, -1:][inverse]  # (B, 1, H): the prompt's last state predicts token 1
    cache.batch_select_indices(inverse)  # (U, ...) -> (B, ...), differentiable copies
    model(
        input_ids=input_ids[:, prompt_length:],
        attention_mask=attention_mask,
        position_ids=position_ids(attention_mask)[:, prompt_length:],
        **{name: cache},
        use_cache=True,
        logits_to_keep=no_logits,
    )
    return torch.cat([last, captured[-1][:, :-1]], dim=1)  # (B, T, H)


def _replayable_passes(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_length: int,
    first: Tensor,
    inverse: Tensor,
    captured: list[Tensor],
    no_logits: Tensor,
) -> Tensor:
    """:func:`_shared_prompt_hidden` under gradient checkpointing: the prompt pass writes a
    :class:`PromptCache` once, the responses read a :class:`ReadOnlyCache`, so the backward
    pass's replay of either computes what the first pass did."""
    name = cache_keyword(model)
    prompts = PromptCache(config=model.config)
    prompt_mask = attention_mask[first, :prompt_length]  # (U, S)
    model(
        input_ids=input_ids[first, :prompt_length],
        attention_mask=prompt_mask,
        position_ids=position_ids(prompt_mask),
        **{name: prompts},
        use_cache=False,  # the layers still write to the cache given; this skips a warning
        logits_to_keep=no_logits,
    )
    if prompts.get_seq_length() != prompt_length:
        raise RuntimeError(
            f"{type(model).__name__}: its checkpointed layers left the prompt cache with "
            f"{prompts.get_seq_length()} of {prompt_length} positions; set "
            "model.optimization.share_prompts=false"
        )
    last = captured[-1][:, -1:][inverse]  # (B, 1, H): the prompt's last state predicts token 1
    model(
        input_ids=input_ids[:, prompt_length:],
        attention_mask=attention_mask,
        position_ids=position_ids(attention_mask)[:, prompt_length:],
        **{name: ReadOnlyCache.per_sequence(prompts, inverse, model.config)},
        use_cache=False,
        logits_to_keep=no_logits,
    )
    return torch.cat([last, captured[-1][:, :-1]], dim=1)  # (B, T, H)


@torch.no_grad()
def behaviour_outputs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_mask: Tensor,
    temperature: float,
    sparsify_fn: Callable[[Tensor, Tensor], SparseDistribution] | None,
    chunk_size: int | None = None,
    share_prompts: bool = False,
    max_tokens: int | None = None,
    packed: bool = False,
) -> tuple[Tensor, SparseDistribution | None]:
    """The behaviour policy's token log-probs (B, T) and, if asked, sparse distributions.

    With ``chunk_size`` (response tokens per chunk) and a model whose logits are a plain output
    layer (:func:`linear_head`), the hidden states are computed once and the output layer runs
    on ``chunk_size`` response tokens at a time, so at most ``(chunk_size, V)`` logits exist at
    once; otherwise (or with ``chunk_size=None``) the ``(B, T, V)`` logits are computed whole.
    Both give the same results up to float rounding. ``share_prompts`` is
    :func:`response_hidden`'s (the chunked path only), and so is ``packed``. With ``max_tokens``
    the sequences run in consecutive parts of at most that many tokens
    (:func:`~lightning_troll.rollouts.micro_batches.consecutive_parts`), each without the
    columns it does not use.

    Logits of ``-inf`` (a vocabulary masked by the model) are accepted: those tokens have no
    mass, and the sparse projection handles them. Raises ``FloatingPointError`` if the logits at a
    response token hold NaN or ``+inf``, are ``-inf`` everywhere or at the sampled token: a
    rollout cached from them would train on garbage.
    """
    check_chunk_size(chunk_size, "chunk_size")
    length = response_mask.shape[1]
    prompt_length = input_ids.shape[1] - length  # S
    ranges = pass_ranges(attention_mask, prompt_length, max_tokens, packed, model)
    if len(ranges) > 1:
        outputs = []
        for part in ranges:
            start, keep = used_columns(attention_mask[part], prompt_length)
            columns = slice(start, prompt_length + keep)
            args = (input_ids[part, columns], attention_mask[part, columns])
            outputs.append(behaviour_outputs(model, *args, response_mask[part, :keep],
                                             temperature, sparsify_fn, chunk_size, share_prompts,
                                             packed=packed))  # fmt: skip
        logprobs = torch.cat(
            [nn.functional.pad(lp, (0, length - lp.shape[1])) for lp, _ in outputs]
        )
        return logprobs, None if outputs[0][1] is None else SparseDistribution.cat(
            [old for _, old in outputs]
        )
    tokens = input_ids[:, -length:][response_mask]  # (N,)
    head = None if chunk_size is None and not packed else linear_head(model)
    if head is None:
        logits = response_logits(model, input_ids, attention_mask, length, temperature)
        rows, fn = logits[response_mask], partial(behaviour_rows, sparsify_fn=sparsify_fn)
    else:
        hidden = response_hidden(model, input_ids, attention_mask, length, share_prompts, packed)
        rows = hidden[response_mask]  # (N, H)
        fn = partial(_behaviour_hidden, head=head, temperature=temperature, sparsify_fn=sparsify_fn)
    parts = map_row_chunks(fn, rows, chunk_size, tokens)
    bad = torch.cat([p[2] for p in parts]).nonzero()  # (bad rows, 1)
    if bad.numel():
        seq, pos = response_mask.nonzero()[bad[0, 0]].tolist()
        raise FloatingPointError(
            f"the behaviour policy's logits hold NaN or +inf (or -inf at the sampled token) at "
            f"{bad.shape[0]} response tokens (first: sequence {seq}, position {pos}); the "
            "snapshot's weights are not finite, so no rollout is cached from them"
        )
    logp = torch.cat([p[0] for p in parts])  # (N,)
    old_logprobs = logp.new_zeros(response_mask.shape).index_put((response_mask,), logp)
    sparse = [p[1] for p in parts]  # sparsify_fn may decline (None), as it does for clipping
    old = None if sparse[0] is None else SparseDistribution.cat(sparse)
    return old_logprobs, old


def _behaviour_hidden(hidden: Tensor, tokens: Tensor, *, head, temperature, sparsify_fn):
    return behaviour_rows(head_logits(head, hidden, temperature), tokens, sparsify_fn=sparsify_fn)


@torch.no_grad()
def old_logit_rows(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_mask: Tensor,
    temperature: float,
    chunked: bool,
    share_prompts: bool = False,
    packed: bool = False,
) -> HiddenRows | Tensor:
    """The snapshot's logit rows at the response tokens (``response_mask``, (B, T)), for the dense
    projection: as (N, H) hidden states with the output layer (:class:`HiddenRows`, logits made
    chunk by chunk) when ``chunked`` and the model has a plain linear output layer, else as
    (N, V) logits. No gradient: the old policy is a constant. ``share_prompts`` and ``packed``
    are :func:`response_hidden`'s."""
    length = response_mask.shape[1]
    head = linear_head(model) if chunked else None
    if head is None:
        logits = response_logits(model, input_ids, attention_mask, length, temperature)
        return logits[response_mask]  # (N, V)
    hidden = response_hidden(model, input_ids, attention_mask, length, share_prompts, packed)
    return HiddenRows(hidden[response_mask], head, temperature)  # (N, H)
