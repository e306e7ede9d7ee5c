"""Choosing each decoding step's tokens, and the checks a step reads in one wait on the device.

Both decoding loops (:mod:`~lightning_troll.engines.decode`, :mod:`~lightning_troll.engines.
graph_decode`) sample from the distribution ``generate`` samples from with the same options: the
float32 logits divided by the temperature, then top-k (0: off) and top-p (1: off) as
transformers' ``TopKLogitsWarper`` and ``TopPLogitsWarper`` apply them, then the softmax;
``do_sample=False`` takes the argmax of the raw logits. The model's own ``generation_config``
plays no part. A token is drawn by :func:`draw` (the inverse of the cumulative distribution at
one uniform number per sequence from torch's global generator, so seeded runs repeat) where
``generate`` calls ``torch.multinomial`` (one exponential number per sequence and vocabulary
entry, a sixth of a rollout's time on SmolLM2 on a CPU). A seed therefore gives other
completions than ``generate`` would, from the same distribution; greedy decoding gives the same
tokens.

Notation: n sequences still running, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

__all__ = ["Check", "Sampling", "choose_tokens", "draw", "raise_failed", "top_k_mask", "top_p_mask"]

_NEG_INF = float("-inf")


class Sampling(Protocol):
    """What decoding reads of :class:`~lightning_troll.engines.sampling.SamplingConfig`."""

    temperature: float
    top_k: int
    top_p: float
    max_new_tokens: int


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
    cost on a CPU grows with the vocabulary and runs on one thread). The inversion is a search
    in two levels: the vocabulary is cut into blocks of about sqrt(V) tokens (:func:`_block`),
    the uniform number finds its block in the cumulative sums of the blocks' masses, then its
    token in the cumulative sums within that block; every sum is float64, so a token's share of
    the unit interval is its probability to ~1e-16 however small. One scan over all V tokens
    (what this did before) cost 280 us of a 7 ms decoding step at Qwen3's vocabulary on an H200
    (the eighth GPU report's profile); on a CPU, for 64 rows, this draw takes x0.57 of its time
    at SmolLM2's vocabulary and x0.54 at Qwen3's (``examples/benchmark_draw.py``). Tokens at -inf are never drawn (each search is held to
    the last block, and the last token within it, of positive weight, and starts at the first).
    A row holding NaN or +inf, or -inf throughout, raises ``RuntimeError`` (as
    ``torch.multinomial`` does). With ``defer``, a list, that check is appended to it as a
    :class:`Check` instead, for a caller that reads several values in one wait on the device
    (:func:`raise_failed`).
    """
    n, vocab = scores.shape
    size = _block(vocab)
    blocks = -(-vocab // size)
    padded = scores.new_zeros(n, blocks * size)  # (n, blocks * size): weight 0 past V
    weights = padded[:, :vocab]
    torch.sub(scores, scores.amax(dim=-1, keepdim=True), out=weights).exp_()  # at most 1
    grid = padded.view(n, blocks, size)
    cdf = grid.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)  # (n, blocks), nondecreasing
    total = cdf[:, -1:]  # (n, 1)
    drawable = (total.isfinite() & (total > 0)).all()  # ()
    if defer is None:
        if not bool(drawable):
            raise _not_drawable()
    else:
        defer.append(Check(drawable, _not_drawable))
    uniform = torch.rand(total.shape, dtype=torch.float64, device=scores.device)  # (n, 1)
    target = uniform * total  # (n, 1)
    block = torch.searchsorted(cdf, target, right=True)  # (n, 1) the first block past it
    block = torch.minimum(block, cdf.argmax(dim=-1, keepdim=True))  # the last of positive mass
    before = torch.where(block > 0, cdf.gather(-1, (block - 1).clamp_min(0)), 0.0)  # (n, 1)
    inside = grid.gather(1, block.unsqueeze(-1).expand(n, 1, size)).squeeze(1)  # (n, size)
    inside = inside.double().cumsum(dim=-1)  # (n, size)
    rest = (target - before).clamp_min(0.0)  # (n, 1): summed in another order, held in range
    offset = torch.searchsorted(inside, rest, right=True)  # (n, 1) first cumulative > rest
    offset = torch.minimum(offset, inside.argmax(dim=-1, keepdim=True))  # last positive token
    return (block * size + offset).squeeze(-1)  # (n,)


def _block(vocab: int) -> int:
    """The block size of :func:`draw`'s search: the power of two at or above sqrt(``vocab``)."""
    return 1 << max(0, math.ceil(math.log2(max(vocab, 1)) / 2))


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
