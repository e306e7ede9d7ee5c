"""Sparse token distributions: the few tokens that carry almost all of a row's probability.

Notation: N rows, V vocabulary, k tokens kept by probability (<= max_tokens), K columns kept
per row (the k plus an optional always-kept token, padded with index -1 / log-prob -inf).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["SparseDistribution", "softmax_and_logz", "sparsify", "top_tokens"]

_NEG_INF = float("-inf")
# Block size of the two-level top-k search (see top_tokens).
_BLOCK = 128
# Below this mass, linear sums lose precision to underflow: sum in log space instead.
LINEAR_MASS_MIN = 1e-30


@dataclass(frozen=True)
class SparseDistribution:
    """A distribution over a vocabulary, sparsified per row.

    Padding entries have index ``-1`` and log-probability ``-inf``. Everything not kept is
    summarised by ``tail_logmass`` (the log of the probability mass of the tokens not kept), which
    the projection spreads uniformly over those ``vocab_size - size`` tokens.
    """

    indices: Tensor
    """(N, K) int64 token ids, ``-1`` marks padding."""
    logprobs: Tensor
    """(N, K) log-probabilities of the kept tokens, ``-inf`` at padding."""
    tail_logmass: Tensor
    """(N,) log of the probability mass of every token not kept (``-inf`` when none is left)."""
    vocab_size: int
    """Size V of the vocabulary the indices point into."""

    def __post_init__(self) -> None:
        if self.indices.dim() != 2 or self.indices.shape != self.logprobs.shape:
            raise ValueError(
                "SparseDistribution: indices and logprobs must both be (N, K); got "
                f"{tuple(self.indices.shape)} and {tuple(self.logprobs.shape)}"
            )
        if self.tail_logmass.shape != self.indices.shape[:1]:
            raise ValueError(
                f"SparseDistribution: tail_logmass must be (N,) = ({self.indices.shape[0]},); "
                f"got {tuple(self.tail_logmass.shape)}"
            )
        if self.indices.dtype != torch.long:
            raise ValueError(
                f"SparseDistribution: indices must be int64 (torch.long); got {self.indices.dtype}"
            )
        if self.vocab_size < 1:
            raise ValueError(f"SparseDistribution: vocab_size must be >= 1; got {self.vocab_size}")

    @property
    def num_rows(self) -> int:
        return self.indices.shape[0]

    @property
    def mask(self) -> Tensor:
        """(N, K) True where an entry is a kept token, False at padding."""
        return self.indices >= 0

    @property
    def sizes(self) -> Tensor:
        """(N,) number of kept tokens per row."""
        return self.mask.sum(-1)

    @property
    def coverage(self) -> Tensor:
        """(N,) probability mass covered by the kept tokens (summed directly, not 1 - tail)."""
        return torch.logsumexp(self.logprobs, dim=-1).exp()

    def to(self, *args, **kwargs) -> SparseDistribution:
        """Moves the tensors (``Tensor.to`` arguments); indices stay int64."""
        logprobs = self.logprobs.to(*args, **kwargs)
        return SparseDistribution(
            indices=self.indices.to(device=logprobs.device),
            logprobs=logprobs,
            tail_logmass=self.tail_logmass.to(*args, **kwargs),
            vocab_size=self.vocab_size,
        )

    def select(self, rows: Tensor) -> SparseDistribution:
        """The distributions of ``rows`` (an index or boolean mask over N)."""
        return SparseDistribution(
            self.indices[rows], self.logprobs[rows], self.tail_logmass[rows], self.vocab_size
        )

    @staticmethod
    def cat(parts: list[SparseDistribution]) -> SparseDistribution:
        """Concatenates rows, padding each part to the widest K."""
        if not parts:
            raise ValueError("SparseDistribution.cat: needs at least one part")
        vocab = {p.vocab_size for p in parts}
        if len(vocab) != 1:
            raise ValueError(f"SparseDistribution.cat: parts have different vocab sizes {vocab}")
        width = max(p.indices.shape[1] for p in parts)

        def pad(t: Tensor, value: float) -> Tensor:
            return nn.functional.pad(t, (0, width - t.shape[1]), value=value)

        return SparseDistribution(
            indices=torch.cat([pad(p.indices, -1) for p in parts]),
            logprobs=torch.cat([pad(p.logprobs, _NEG_INF) for p in parts]),
            tail_logmass=torch.cat([p.tail_logmass for p in parts]),
            vocab_size=vocab.pop(),
        )


def check_sparsity(max_tokens: int, mass_delta: float) -> None:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1; got {max_tokens!r}")
    if not (isinstance(mass_delta, (int, float)) and 0 <= mass_delta < 1):
        raise ValueError(
            f"mass_delta must be a number with 0 <= mass_delta < 1; got {mass_delta!r}"
        )


def compute_dtype(t: Tensor) -> torch.dtype:
    """float32, or the input dtype if it is a wider float (float64 stays float64)."""
    if not t.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor; got dtype {t.dtype}")
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def check_tokens(
    tokens: Tensor, n: int, vocab: int, device: torch.device, name: str, values: bool = True
) -> None:
    """Refuses ``tokens`` unless they are ``(n,)`` int64 ids on ``device``, in ``[0, vocab)``.

    The range is the one check that reads the tokens' values, a wait on the device;
    ``values=False`` leaves it to the caller (:func:`tokens_out_of_range`, :func:`token_range_error`).
    """
    if tokens.shape != (n,):
        raise ValueError(f"{name} must be ({n},), one token id per row; got {tuple(tokens.shape)}")
    if tokens.dtype != torch.long:
        raise ValueError(f"{name} must hold int64 token ids; got dtype {tokens.dtype}")
    if tokens.device != device:
        raise ValueError(f"{name} is on {tokens.device} but the logits are on {device}")
    if values and n and bool(tokens_out_of_range(tokens, vocab)):
        raise token_range_error(tokens, vocab, name)


def tokens_out_of_range(tokens: Tensor, vocab: int) -> Tensor:
    """() bool on the tokens' device: whether any id lies outside ``[0, vocab)``; one reduction,
    so reading it is one wait on the device, not two."""
    return ((tokens < 0) | (tokens >= vocab)).any()


def token_range_error(tokens: Tensor, vocab: int, name: str) -> ValueError:
    """The error for ``tokens`` (named ``name``) holding ids outside ``[0, vocab)``."""
    return ValueError(
        f"{name} must hold token ids in [0, {vocab}); got values in "
        f"[{int(tokens.min())}, {int(tokens.max())}]"
    )


def top_tokens(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest logits of each row, descending: values (N, k) and token ids (N, k).

    A top-k over a whole 150k-token row is slow on CPUs. The k largest entries lie in the k
    blocks of ``_BLOCK`` tokens with the largest maxima (a block that holds one of them has a
    maximum at least as large as the k-th value, and at most k blocks do), so one pass of block
    maxima narrows the search to ``k * _BLOCK`` candidates.
    """
    n, vocab = logits.shape
    blocks = vocab // _BLOCK
    if blocks <= 4 * k:
        return logits.topk(k, dim=-1)
    main = blocks * _BLOCK
    block_max = logits[:, :main].reshape(n, blocks, _BLOCK).amax(-1)  # (N, blocks)
    chosen = block_max.topk(k, dim=-1).indices  # (N, k)
    offsets = torch.arange(_BLOCK, device=logits.device)
    candidates = (chosen.unsqueeze(-1) * _BLOCK + offsets).flatten(1)  # (N, k * _BLOCK)
    if main < vocab:  # the last, partial block is always searched
        rest = torch.arange(main, vocab, device=logits.device).expand(n, -1)
        candidates = torch.cat([candidates, rest], dim=-1)
    values, position = logits.gather(-1, candidates).topk(k, dim=-1)  # (N, k)
    return values, candidates.gather(-1, position)


def softmax_and_logz(
    logits: Tensor, top_val: Tensor, top_idx: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``softmax(logits)`` in ``dtype`` (one fused kernel, one (N, V) buffer) and logZ (N,).

    logZ comes from the most probable token: logZ = x_top - log p_top, with p_top >= 1 / V.
    """
    p = torch.softmax(logits, dim=-1, dtype=dtype)  # (N, V)
    p_top = p.gather(-1, top_idx[:, :1]).squeeze(-1)  # (N,)
    return p, top_val[:, 0].to(dtype) - p_top.log()


def prefix_count(sorted_logp: Tensor, mass_delta: float) -> Tensor:
    """Per row, how many of the descending log-probs (N, k) to keep: tokens are added while the
    mass kept so far is below 1 - mass_delta (at least one); mass_delta = 0 keeps all k."""
    if mass_delta == 0:
        return torch.full(sorted_logp.shape[:1], sorted_logp.shape[1], device=sorted_logp.device)
    before = torch.logcumsumexp(sorted_logp, dim=-1)[:, :-1]  # (N, k-1) mass before token j+1
    return 1 + (before < math.log1p(-mass_delta)).sum(-1)  # (N,)


@torch.no_grad()
def sparsify(
    logits: Tensor,
    max_tokens: int = 64,
    mass_delta: float = 1e-5,
    keep: Tensor | None = None,
    *,
    reads: bool = True,
) -> SparseDistribution:
    """Keeps, per row, the most probable tokens of ``softmax(logits)``.

    Tokens are kept in order of probability until their mass reaches ``1 - mass_delta``, at most
    ``max_tokens`` of them, plus the token ``keep[i]`` of each row if given (so a row holds at most
    ``max_tokens + 1``). ``mass_delta = 0`` disables the mass criterion. The tail log-mass is summed
    from the tail itself, so it stays accurate however small it is.

    Args:
        logits: ``(N, V)`` logits (any float dtype; arithmetic in float32 or wider).
        max_tokens: the most tokens kept per row by probability, >= 1.
        mass_delta: stop once the kept mass reaches ``1 - mass_delta``; ``0 <= mass_delta < 1``.
        keep: optional ``(N,)`` token ids kept in every case (the sampled tokens).
        reads: False reads nothing from the device, for a caller that must not wait on it (a
            decoding step): ``keep``'s range is then the caller's to vouch for, every row keeps
            ``max_tokens`` (+1) columns, the unused ones padded (``-1``, ``-inf``), and the
            tail's log-space sum is computed for every row, not only where it is tiny.

    Returns:
        A :class:`SparseDistribution` (detached; the old policy is a constant).
    """
    check_sparsity(max_tokens, mass_delta)
    if logits.dim() != 2:
        raise ValueError(f"logits must be (N, V); got shape {tuple(logits.shape)}")
    dtype = compute_dtype(logits)
    n, vocab = logits.shape
    if keep is not None:
        check_tokens(keep, n, vocab, logits.device, "keep", values=reads)
    k = min(max_tokens, vocab)

    top_val, top_idx = top_tokens(logits, k)  # (N, k), descending
    p, logz = softmax_and_logz(logits, top_val, top_idx, dtype)  # (N, V), (N,)
    top_lp = top_val.to(dtype) - logz.unsqueeze(-1)  # (N, k)
    count = prefix_count(top_lp, mass_delta)  # (N,)
    in_prefix = torch.arange(k, device=logits.device) < count.unsqueeze(-1)  # (N, k)
    indices = torch.where(in_prefix, top_idx, -1)  # (N, k)
    logprobs = torch.where(in_prefix, top_lp, _NEG_INF)  # (N, k)
    if keep is not None:
        # The kept token goes right after the prefix unless the prefix already holds it.
        missing = ~(indices == keep.unsqueeze(-1)).any(-1)  # (N,)
        keep_lp = logits.gather(-1, keep.unsqueeze(-1)).squeeze(-1).to(dtype) - logz  # (N,)
        indices = torch.cat([indices, indices.new_full((n, 1), -1)], dim=-1)  # (N, k+1)
        logprobs = torch.cat([logprobs, logprobs.new_full((n, 1), _NEG_INF)], dim=-1)
        slot = count.unsqueeze(-1)  # (N, 1)
        indices = indices.scatter(-1, slot, torch.where(missing, keep, -1).unsqueeze(-1))
        logprobs = logprobs.scatter(-1, slot, torch.where(missing, keep_lp, _NEG_INF).unsqueeze(-1))
    if reads:  # the widest row's columns only
        width = max(int((indices >= 0).sum(-1).max()), 1) if n else 1
        indices, logprobs = indices[:, :width], logprobs[:, :width]  # (N, K)

    # Tail mass summed over the tokens not kept (never 1 - kept, which cancels) ...
    kept = torch.where(indices >= 0, indices, indices[:, :1])  # padding repeats a kept index
    tail = p.scatter_(-1, kept, 0.0).sum(-1)  # (N,)
    tail_logmass = tail.log()
    # ... and in log space where it is too small for linear sums (extreme logits).
    tiny = (tail < LINEAR_MASS_MIN) & ((indices >= 0).sum(-1) < vocab)  # (N,)
    if not reads:
        masked = logits.to(dtype).scatter(-1, kept, _NEG_INF)  # (N, V)
        logsum = torch.logsumexp(masked, dim=-1) - logz  # (N,)
        tail_logmass = torch.where(tiny, logsum, tail_logmass)
    elif bool(tiny.any()):
        rows = tiny.nonzero().squeeze(-1)
        masked = logits[rows].to(dtype).scatter(-1, kept[rows], _NEG_INF)
        tail_logmass[rows] = torch.logsumexp(masked, dim=-1) - logz[rows]
    return SparseDistribution(indices, logprobs, tail_logmass, vocab)
