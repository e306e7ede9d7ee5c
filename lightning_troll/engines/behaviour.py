"""The behaviour policy's view of a rollout, recorded while it samples.

The loss needs, per response token, the log-prob under the policy that sampled it and (for
TROLL) that policy's sparse distribution. Generation computes exactly those logits, one step at
a time, to draw each token: :class:`BehaviourRecorder` keeps what the loss needs from them as
they pass (the sampled token's log-prob and the sparse rows), so no second forward pass over the
rollout is needed and no ``(B, T, V)`` tensor of logits is ever held. The alternative, a
teacher-forced forward pass of the snapshot after sampling, is
:func:`lightning_troll.rollouts.rollout.behaviour_outputs`; both agree up to float rounding (the KV-cached
and the whole-sequence attention sum in different orders).

Notation: B sequences, T response positions (right padded), V vocabulary, K sparse columns per
row, N response tokens (``response_mask.sum()``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import LogitsProcessor

from lightning_troll.engines.choice import Check
from lightning_troll.engines.records import SlotRecord, Store, not_finite
from lightning_troll.trust_region.sparse import SparseDistribution

__all__ = ["BehaviourRecord", "BehaviourRecorder", "behaviour_rows", "records_while_sampling"]

BEHAVIOUR_LOGPROBS = ("auto", "forward", "sampling")
"""Values of ``model.engine.behaviour_logprobs``."""

_NEG_INF = float("-inf")

SparsifyFn = Callable[..., "SparseDistribution | None"]
"""``(logits (n, V), tokens (n,), reads=True) -> SparseDistribution | None``; ``reads`` as
:func:`~lightning_troll.trust_region.sparse.sparsify`'s, passed only where it is False."""


def records_while_sampling(option: str, policy: nn.Module) -> bool:
    """Whether ``model.engine.behaviour_logprobs: option`` records the behaviour log-probs while sampling
    (else a teacher-forced pass recomputes them after it).

    ``auto`` records them when ``policy`` computes in float32 or float64 (its first floating-point
    parameter's dtype). In bfloat16 or float16 the KV-cached steps of generation and the
    teacher-forced training pass round differently enough to make the first minibatch visibly
    off-policy (on SmolLM2-135M-Instruct in bfloat16 the sampled tokens' log-probs differ by 0.05
    on average and up to 0.6; in float32 by at most 6e-5), so the behaviour policy is recomputed
    with the same kind of pass the loss uses.
    """
    if option != "auto":
        return option == "sampling"
    dtype = next((p.dtype for p in policy.parameters() if p.is_floating_point()), torch.float32)
    return dtype in (torch.float32, torch.float64)


@dataclass(frozen=True)
class BehaviourRecord:
    """Per sequence and response position: what the behaviour policy gave the sampled tokens.

    Values at positions that are not response tokens (after EOS, padding) are meaningless; the
    response mask selects the real ones in :meth:`outputs`.
    """

    logprobs: Tensor
    """(B, T) float32 log-prob of the token at each response position, at the temperature."""
    indices: Tensor | None
    """(B, T, K) int64 sparse support per position (-1 pads); None without sparse rows (clip)."""
    sparse_logprobs: Tensor | None
    """(B, T, K) log-probs of the support (-inf pads)."""
    tail_logmass: Tensor | None
    """(B, T) log of the mass outside the support."""
    vocab_size: int

    def select(self, rows: Tensor) -> BehaviourRecord:
        """The records of sequences ``rows`` (indices into B)."""

        def pick(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[rows]

        return BehaviourRecord(
            self.logprobs[rows],
            pick(self.indices),
            pick(self.sparse_logprobs),
            pick(self.tail_logmass),
            self.vocab_size,
        )

    @staticmethod
    def cat(parts: list[BehaviourRecord]) -> BehaviourRecord:
        """Concatenates sequences, right padding every part to the longest T and widest K."""
        if len(parts) == 1:
            return parts[0]
        length = max(p.logprobs.shape[1] for p in parts)  # T
        sparse = parts[0].indices is not None
        width = max(p.indices.shape[2] for p in parts) if sparse else 0  # K

        def pad(t: Tensor, value: float, k: int | None = None) -> Tensor:
            # (B, T) -> (B, length); (B, T, K) -> (B, length, k)
            grow = (
                (0, length - t.shape[1])
                if k is None
                else (0, k - t.shape[2], 0, length - t.shape[1])
            )
            return nn.functional.pad(t, grow, value=value)

        return BehaviourRecord(
            logprobs=torch.cat([pad(p.logprobs, 0.0) for p in parts]),
            indices=torch.cat([pad(p.indices, -1, width) for p in parts]) if sparse else None,
            sparse_logprobs=(
                torch.cat([pad(p.sparse_logprobs, _NEG_INF, width) for p in parts])
                if sparse
                else None
            ),
            tail_logmass=(
                torch.cat([pad(p.tail_logmass, _NEG_INF) for p in parts]) if sparse else None
            ),
            vocab_size=parts[0].vocab_size,
        )

    def outputs(self, response_mask: Tensor) -> tuple[Tensor, SparseDistribution | None]:
        """The rollout's ``old_logprobs`` (B, T), 0 outside ``response_mask``, and its sparse
        rows, one per response token in row-major order (as
        :func:`~lightning_troll.rollouts.rollout.behaviour_outputs` returns them)."""
        if response_mask.shape != self.logprobs.shape:
            raise ValueError(
                f"BehaviourRecord.outputs: response_mask is {tuple(response_mask.shape)} but the "
                f"record covers {tuple(self.logprobs.shape)} (sequences, positions)"
            )
        old_logprobs = self.logprobs.masked_fill(~response_mask, 0.0)
        if self.indices is None:
            return old_logprobs, None
        indices = self.indices[response_mask]  # (N, K)
        width = max(int((indices >= 0).sum(-1).max()), 1) if indices.shape[0] else 1
        old = SparseDistribution(
            indices=indices[:, :width],
            logprobs=self.sparse_logprobs[response_mask][:, :width],
            tail_logmass=self.tail_logmass[response_mask],
            vocab_size=self.vocab_size,
        )
        return old_logprobs, old


class BehaviourRecorder(LogitsProcessor):
    """A logits processor that records the behaviour policy's view of each sampled token.

    ``generate`` hands it the raw next-token logits (float32, before temperature and top-k/top-p,
    which ``generate`` applies after the processors it is given) at every step and then samples.
    The recorder divides them by ``temperature`` and keeps the logits of one step until the next
    call shows which token was sampled from them; :meth:`finish` handles the last step. Per step
    and sequence it keeps the sampled token's log-prob and, with ``sparsify_fn``, its sparse
    distribution. It returns the logits unchanged.

    :func:`~lightning_troll.engines.decode.decode`, which drops finished sequences from its
    batch, calls :meth:`record_rows` instead, with the running sequences' logits, tokens and row
    numbers; :meth:`finish` then leaves the positions after a sequence's end padded. There a
    step reads nothing from the device for the recorder where ``read_free``: its check of the
    logits joins the loop's one wait on the device, and the sparse rows are cut without reads
    (every row keeps ``max_tokens`` (+1) columns until :meth:`BehaviourRecord.outputs` cuts
    them to the widest). The CUDA-graph path, where it captures whole steps, calls
    :meth:`record_slots`, which writes every step in place.

    Args:
        temperature: the sampling temperature (the loss uses it too).
        sparsify_fn: a :data:`SparsifyFn`, as the module's ``sparsify_old``; None records
            log-probs only.
        read_free: whether a decoding loop's steps record without reading from the device;
            None: where the logits are not on a CPU (on a CPU a read waits for nothing, and
            the reading path skips a pass over the vocabulary).
    """

    def __init__(
        self,
        temperature: float,
        sparsify_fn: SparsifyFn | None = None,
        read_free: bool | None = None,
    ) -> None:
        self.temperature = temperature
        self.sparsify_fn = sparsify_fn
        self.read_free = read_free
        self._pending: Tensor | None = None  # (B, V) logits of the step whose token is unknown
        # per step: token log-probs (n,), sparse rows (n of them) or None, and the rows (n,)
        # of B they belong to (None: all B rows)
        self._steps: list[tuple[Tensor, SparseDistribution | None, Tensor | None]] = []
        self._store = Store()
        self._slots: SlotRecord | None = None  # record_slots' record, written in place

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self._pending is not None:
            self._record(self._pending, input_ids[:, -1], None, None)
        self._pending = scores.float() / self.temperature  # (B, V), a copy
        return scores

    def record_rows(
        self, scores: Tensor, tokens: Tensor, rows: Tensor, checks: list[Check] | None = None
    ) -> None:
        """One decoding step of the sequences still running, for a sampler that drops finished
        ones (:func:`~lightning_troll.engines.decode.decode`): their raw logits ``scores``
        (n, V), the tokens drawn from them (n,) and their indices into B (n,). With ``checks``,
        the step's list of :class:`~lightning_troll.engines.choice.Check`, the check of the
        logits goes first in it (its error names the step and the sequences) instead of being
        read here; the loop reads it before it ends the step."""
        self._record(scores.float() / self.temperature, tokens, rows, checks)

    def record_slots(
        self,
        scores: Tensor,
        tokens: Tensor,
        rows: Tensor,
        step: Tensor,
        shape: tuple[int, int],
        checks: list[Check],
    ) -> None:
        """One decoding step of a loop whose b slots keep fixed places (the CUDA-graph path
        capturing its whole step, :func:`~lightning_troll.engines.graph_decode.static_decode`):
        the slots' raw logits ``scores`` (b, V), the tokens drawn from them (b,), each slot's
        row of B (b,; B itself for a slot that holds no sequence), the response position
        ``step`` (a () tensor on the device) and the rollout's ``shape`` (B, T). Reads nothing
        from the device and allocates nothing after its first call, so a CUDA graph can hold
        it: each step writes in place, at (row, step), into tensors of (B + 1, T) allocated at
        the first call; its check of the logits goes first in ``checks``, and its error names
        the first step and the sequences whose logits were bad, from what all steps wrote."""
        logits = scores.float() / self.temperature
        logp, sparse, bad = behaviour_rows(
            logits, tokens, sparsify_fn=self.sparsify_fn, reads=False
        )
        if self._slots is None:
            self._slots = SlotRecord(shape, logp, sparse)
        self._slots.write(rows, step, logp, sparse, bad)
        checks.insert(0, Check(~bad.any(), self._slots.not_finite))

    def _record(
        self, logits: Tensor, tokens: Tensor, rows: Tensor | None, checks: list[Check] | None
    ) -> None:
        self._pending = None
        free = logits.device.type != "cpu" if self.read_free is None else self.read_free
        reads = checks is None or not free
        logp, sparse, bad = behaviour_rows(
            logits, tokens, sparsify_fn=self.sparsify_fn, reads=reads
        )
        step = len(self._steps)
        if checks is not None:
            checks.insert(0, Check(~bad.any(), lambda: not_finite(bad, rows, step)))
        elif bool(bad.any()):
            raise not_finite(bad, rows, step)
        keep = self._store.keep
        if sparse is not None:
            sparse = SparseDistribution(
                keep(sparse.indices),
                keep(sparse.logprobs),
                keep(sparse.tail_logmass),
                sparse.vocab_size,
            )
        self._steps.append((keep(logp), sparse, None if rows is None else keep(rows)))

    def finish(self, responses: Tensor) -> BehaviourRecord:
        """The record of a finished generation whose new tokens are ``responses`` (B, T)."""
        if self._slots is not None:
            slots, self._slots = self._slots, None
            return BehaviourRecord(*slots.fields(responses))
        if self._pending is not None:
            self._record(self._pending, responses[:, -1], None, None)
        steps, self._steps, self._store = self._steps, [], Store()
        if len(steps) != responses.shape[1]:
            raise RuntimeError(
                f"BehaviourRecorder saw {len(steps)} generation steps for {responses.shape[1]} "
                "generated tokens: this model's generate does not call logits processors once per "
                "token; set model.engine.behaviour_logprobs: forward"
            )
        # Each step's values go to the rows that ran in it, all steps in one write; the rest
        # (sequences that had ended) keep the values BehaviourRecord.cat pads with.
        device = responses.device
        every = torch.arange(responses.shape[0], device=device)  # (B,)
        rows = torch.cat([every if r is None else r for _, _, r in steps])  # (M,) all steps
        counts = torch.tensor([len(logp) for logp, _, _ in steps], device=device)  # (T,)
        at = (rows, torch.arange(len(steps), device=device).repeat_interleave(counts))
        logprobs = responses.new_zeros(responses.shape, dtype=torch.float32)  # (B, T)
        logprobs[at] = torch.cat([logp for logp, _, _ in steps])
        sparse = [s for _, s, _ in steps]
        if sparse[0] is None:
            return BehaviourRecord(logprobs, None, None, None, 0)
        width = max(s.indices.shape[1] for s in sparse)  # K

        def written(name: str, value: float, shape: tuple[int, ...]) -> Tensor:
            """The steps' field ``name`` at their (row, step) places, ``value`` elsewhere."""
            parts = [getattr(s, name) for s in sparse]  # (n, k) or (n,) each
            if len(shape) == 3:
                parts = [nn.functional.pad(p, (0, width - p.shape[1]), value=value) for p in parts]
            out = torch.full(shape, value, dtype=parts[0].dtype, device=device)
            out[at] = torch.cat(parts)
            return out

        shape = (*responses.shape, width)
        return BehaviourRecord(
            logprobs=logprobs,
            indices=written("indices", -1, shape),  # (B, T, K)
            sparse_logprobs=written("logprobs", _NEG_INF, shape),  # (B, T, K)
            tail_logmass=written("tail_logmass", _NEG_INF, responses.shape),  # (B, T)
            vocab_size=sparse[0].vocab_size,
        )


def behaviour_rows(
    rows: Tensor, tokens: Tensor, *, sparsify_fn, reads: bool = True
) -> tuple[Tensor, SparseDistribution | None, Tensor]:
    """(n, V) logit rows -> token log-probs (n,), sparse rows (or None), bad-row flags (n,).

    A row is bad if it holds NaN or +inf, or -inf at the sampled token; other -inf entries are a
    masked vocabulary and stay. Where a row is bad the outputs are zeros and no sparse rows;
    with ``reads=False`` nothing is read from the device, so they are computed from the rows
    as they are (the caller reads the flags before it uses them), and ``sparsify_fn`` is asked
    for read-free rows."""
    at_token = rows.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # (n,)
    bad = (rows.isnan() | rows.isposinf()).any(-1) | at_token.isneginf()  # (n,)
    if reads and bool(bad.any()):  # nothing below is computed from garbage
        return rows.new_zeros(bad.shape, dtype=torch.float32), None, bad
    logp = rows.float().log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # (n,)
    if sparsify_fn is None:
        return logp, None, bad
    return logp, sparsify_fn(rows, tokens) if reads else sparsify_fn(rows, tokens, reads=False), bad
