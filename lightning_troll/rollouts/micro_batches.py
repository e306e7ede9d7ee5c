"""Which sequences of a rollout go through one forward pass together: micro-batches sized by a
token budget, so that a forward's activations do not grow with the completions' length.

A forward's memory and time follow the tokens it holds. Padded, a part of ``n`` sequences holds
``n x (longest prompt + longest response)`` positions (the columns no sequence of the part uses
are cut, :meth:`~lightning_troll.rollouts.rollout.Rollout.trimmed`); packed into one row
(:mod:`~lightning_troll.rollouts.packing`), it holds their real tokens only. :func:`token_parts`
fills parts up to ``max_tokens`` of that cost, longest sequences first, so that sequences of
like length share a part and padding stays small; a sequence longer than the budget goes alone
(a sequence is never split). This is verl's dynamic batch size, without its balancing across
processes: :func:`split_to` only evens out how many parts each process runs, because a sharded
model's forward gathers weights with every other process and all of them must run as many.

Notation: B sequences, S prompt length (left padded), T response length (right padded).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_troll.models.sharding import is_sharded

__all__ = [
    "ACTIVATION_BUDGET",
    "as_many_as_every_process",
    "activation_bytes",
    "consecutive_parts",
    "lengths_of",
    "part_cost",
    "pass_ranges",
    "resolve_tokens",
    "split_to",
    "token_parts",
    "used_columns",
]

ACTIVATION_BUDGET = {"cpu": 2 * 2**30, "cuda": 8 * 2**30}
"""``model.optimization.micro_batch_tokens: auto``: the bytes of activations one forward may keep
for its backward pass, by the device's type (any other device takes CUDA's), turned into tokens by
the model's :func:`activation_bytes`. On a CPU that is 1,165 tokens of SmolLM2-135M in float32,
where forwards of about 1,000 tokens trained fastest (parts of 816 tokens 44-48 s, of 1,632 57 s,
of 3,264 67 s, for the same tokens; docs/benchmarks.md, "Cost against completion length"), and
the whole minibatch of TinyMath's demo, whose forwards are cheap; on a GPU it is 5,349 tokens of
Qwen3-0.6B in bfloat16 and 1,493 of Qwen3-4B (not yet measured on a GPU)."""
FALLBACK_TOKENS = 4096
"""``auto`` for a model whose config does not say its layers, hidden size and MLP width."""


def activation_bytes(model: nn.Module) -> int | None:
    """An estimate of the activations one token keeps for the backward pass through ``model``:
    ``layers x (16 hidden + 4 MLP width)`` values in the weights' dtype (what a decoder layer
    keeps, attention probabilities left out; SmolLM2-135M in float32 measured 2.3 MB a token
    against 1.8 MB estimated). None where the config does not say its sizes."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(config, "num_hidden_layers", None)
    hidden = getattr(config, "hidden_size", None)
    if not (isinstance(layers, int) and isinstance(hidden, int)):
        return None
    width = getattr(config, "intermediate_size", None) or 4 * hidden
    size = next(model.parameters()).element_size()
    return layers * (16 * hidden + 4 * width) * size


def resolve_tokens(value: int | str | None, model: nn.Module) -> int | None:
    """``micro_batch_tokens`` for ``model``: ``auto`` is its device's :data:`ACTIVATION_BUDGET`
    over its :func:`activation_bytes` (at least 64 tokens); a number or None as it is."""
    if value != "auto":
        return value
    per_token = activation_bytes(model)
    if per_token is None:
        return FALLBACK_TOKENS
    device = next(model.parameters()).device.type
    budget = ACTIVATION_BUDGET.get(device, ACTIVATION_BUDGET["cuda"])
    return max(64, budget // per_token)


def lengths_of(attention_mask: Tensor, prompt_length: int) -> tuple[Tensor, Tensor]:
    """(B, S + T) attention mask -> each sequence's prompt and response tokens, (B,) each: the
    columns from its first prompt token to column S, and from column S to its last real one."""
    mask = attention_mask.bool()
    columns = torch.arange(mask.shape[1], device=mask.device)  # (S + T,)
    first = torch.where(mask, columns, mask.shape[1]).amin(-1)  # (B,)
    last = torch.where(mask, columns, -1).amax(-1)  # (B,)
    prompt = (prompt_length - first).clamp(0, prompt_length)
    response = (last + 1 - prompt_length).clamp_min(0)
    return prompt, response


def used_columns(attention_mask: Tensor, prompt_length: int) -> tuple[int, int]:
    """The columns some sequence uses: ``(start, keep)``, the first prompt column that is not
    left padding in every row, and the response columns up to every row's last token (>= 1)."""
    used = attention_mask.bool().any(0)  # (S + T,)
    start = int(used[:prompt_length].int().argmax())
    tail = used[prompt_length:].nonzero()  # (used response columns, 1)
    return start, int(tail[-1]) + 1 if tail.numel() else 1


def part_cost(prompt: Tensor, response: Tensor, packed: bool) -> int:
    """The tokens one forward holds for the sequences of lengths ``prompt`` and ``response``
    (n,): their sum packed, else n times the longest prompt plus the longest response."""
    if packed:
        return int((prompt + response).sum())
    return int(prompt.numel() * (prompt.max() + response.max())) if prompt.numel() else 0


class _Filling:
    """The part being filled: its sequences and what it costs (:func:`part_cost`)."""

    def __init__(self, packed: bool) -> None:
        self.packed, self.members = packed, []
        self.prompt = self.response = self.used = 0  # longest prompt, longest response, tokens

    def cost_with(self, prompt: int, response: int) -> int:
        if self.packed:
            return self.used + prompt + response
        widest = max(self.prompt, prompt) + max(self.response, response)
        return (len(self.members) + 1) * widest

    def add(self, i: int, prompt: int, response: int) -> None:
        self.members.append(i)
        self.prompt, self.response = max(self.prompt, prompt), max(self.response, response)
        self.used += prompt + response


def _fill(
    order: list[int], prompt: list[int], response: list[int], max_tokens: int, limit: int,
    packed: bool,
) -> list[list[int]]:  # fmt: skip
    """The sequences of ``order``, in turn, in parts of at most ``max_tokens`` and ``limit``
    sequences (a sequence over the budget alone)."""
    parts = [_Filling(packed)]
    for i in order:
        part = parts[-1]
        full = len(part.members) >= limit or part.cost_with(prompt[i], response[i]) > max_tokens
        if part.members and full:
            parts.append(part := _Filling(packed))
        part.add(i, prompt[i], response[i])
    return [part.members for part in parts]


def token_parts(
    attention_mask: Tensor,
    prompt_length: int,
    max_tokens: int | None,
    max_sequences: int | None = None,
    packed: bool = False,
) -> list[Tensor]:
    """The sequences of each micro-batch, as (n,) index tensors into B (ascending).

    With ``max_tokens`` None, consecutive parts of ``max_sequences`` sequences (one part when
    that is None too). Otherwise the sequences, longest first, fill a part while its cost
    (:func:`part_cost`) stays within ``max_tokens`` and it holds at most ``max_sequences``.
    """
    total = attention_mask.shape[0]
    device = attention_mask.device
    limit = total if max_sequences is None else max_sequences
    if max_tokens is None:
        return [
            torch.arange(i, min(i + limit, total), device=device) for i in range(0, total, limit)
        ]
    prompt, response = (t.tolist() for t in lengths_of(attention_mask, prompt_length))
    order = sorted(range(total), key=lambda i: -(prompt[i] + response[i]))  # stable
    parts = _fill(order, prompt, response, max_tokens, limit, packed)
    return [torch.tensor(sorted(part), dtype=torch.long, device=device) for part in parts]


def consecutive_parts(
    attention_mask: Tensor, prompt_length: int, max_tokens: int | None, packed: bool = False
) -> list[slice]:
    """Consecutive ranges of sequences, each costing at most ``max_tokens`` (:func:`part_cost`;
    a longer sequence alone), for passes whose outputs must keep the rollout's order (the
    teacher-forced passes without gradient). One range of all of them with ``max_tokens`` None."""
    total = attention_mask.shape[0]
    if max_tokens is None:
        return [slice(0, total)]
    prompt, response = (t.tolist() for t in lengths_of(attention_mask, prompt_length))
    parts = _fill(list(range(total)), prompt, response, max_tokens, total, packed)
    return [slice(part[0], part[-1] + 1) for part in parts]


def split_to(parts: list[Tensor], count: int, costs: list[int]) -> list[Tensor]:
    """``parts`` split until there are ``count`` of them: the costliest part of several
    sequences is halved each time (``costs`` are the parts' costs, halved with them). Raises
    ``ValueError`` when there are fewer sequences than ``count``."""
    parts, costs = list(parts), list(costs)
    if sum(len(p) for p in parts) < count:
        raise ValueError(f"cannot make {count} micro-batches of {sum(map(len, parts))} sequences")
    while len(parts) < count:
        i = max((j for j in range(len(parts)) if len(parts[j]) > 1), key=costs.__getitem__)
        half = len(parts[i]) // 2
        parts[i : i + 1] = [parts[i][:half], parts[i][half:]]
        costs[i : i + 1] = [costs[i] // 2, costs[i] - costs[i] // 2]
    return parts


def as_many_as_every_process(ranges: list[slice], model: nn.Module) -> list[slice]:
    """``ranges`` split until every process has as many as the one with most, where ``model`` is
    sharded with FSDP2 over several processes (each forward gathers its weights with every other
    process, so all must run as many); the longest range is halved each time. Unchanged
    otherwise."""
    if not (is_sharded(model) and dist.is_initialized() and dist.get_world_size() > 1):
        return ranges
    count = torch.tensor([len(ranges)], device=next(model.parameters()).device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    ranges = list(ranges)
    while len(ranges) < int(count):
        i = max(range(len(ranges)), key=lambda j: ranges[j].stop - ranges[j].start)
        part = ranges[i]
        if part.stop - part.start < 2:
            raise ValueError(f"cannot make {int(count)} passes of {ranges[-1].stop} sequences")
        middle = (part.start + part.stop) // 2
        ranges[i : i + 1] = [slice(part.start, middle), slice(middle, part.stop)]
    return ranges


def pass_ranges(
    attention_mask: Tensor, prompt_length: int, max_tokens: int | str | None, packed: bool,
    model: nn.Module,
) -> list[slice]:  # fmt: skip
    """The consecutive ranges a teacher-forced pass of ``model`` runs in: ``max_tokens``
    resolved for the model (:func:`resolve_tokens`), :func:`consecutive_parts`, as many on every
    process as a sharded model needs (:func:`as_many_as_every_process`)."""
    tokens = resolve_tokens(max_tokens, model)
    ranges = consecutive_parts(attention_mask, prompt_length, tokens, packed)
    return as_many_as_every_process(ranges, model)
