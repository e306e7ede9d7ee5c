"""Rollouts: G sampled completions per prompt, their rewards and the behaviour policy's view.

A :class:`Rollout` holds everything the loss needs from the moment of sampling: the sequences,
which positions are response tokens, the behaviour policy's token log-probs and (for TROLL) its
sparse distributions, the rewards and the advantages. Sampling itself is
:mod:`lightning_troll.engines.sampling`. Nothing here imports Lightning.

Notation: P prompts, G samples per prompt, B = P * G sequences, S prompt length (left padded),
T response length (right padded), V vocabulary, N = response tokens (``response_mask.sum()``),
H hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from lightning_troll.objectives.base import LossInputs
from lightning_troll.rollouts.forward import (  # re-exported: the teacher-forced passes over rollouts
    behaviour_outputs,
    linear_head,
    position_ids,
    response_hidden,
    response_logits,
)
from lightning_troll.rollouts.micro_batches import used_columns
from lightning_troll.trust_region.projection import SparseDistribution

__all__ = [
    "Rollout",
    "behaviour_outputs",
    "position_ids",
    "linear_head",
    "response_hidden",
    "response_logits",
]


@dataclass(frozen=True)
class Rollout:
    """One batch of sampled completions, as the loss sees them."""

    input_ids: Tensor
    """(B, S + T) prompt (left padded) followed by the response (right padded)."""
    attention_mask: Tensor
    """(B, S + T) 1 at prompt and response tokens, 0 at padding."""
    response_mask: Tensor
    """(B, T) bool, True at response tokens up to and including the first EOS."""
    old_logprobs: Tensor
    """(B, T) log-probs of the response tokens under the behaviour policy (0 at padding)."""
    old: SparseDistribution | None
    """The behaviour policy's sparse distributions, one row per response token (TROLL only)."""
    rewards: Tensor
    """(B,) total reward of each completion."""
    advantages: Tensor
    """(B,) advantage of each completion."""
    truncated: Tensor
    """(B,) bool, True where the completion hit the token budget without an EOS."""
    temperature: float
    """The sampling temperature, applied to every logit the loss computes from this rollout."""
    group_size: int
    """G, completions per prompt (rows are prompt-major)."""
    ref_logprobs: Tensor | None = None
    """(B, T) log-probs of the response tokens under the reference policy, if one is used."""

    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]

    @property
    def prompt_length(self) -> int:
        return self.input_ids.shape[1] - self.response_mask.shape[1]

    @property
    def tokens(self) -> Tensor:
        """(B, T) the response tokens."""
        return self.input_ids[:, self.prompt_length :]

    def loss_inputs(self) -> LossInputs:
        """What the objective takes of this rollout besides the policy's logits: the response
        tokens, ``response_mask``, the advantages and the behaviour (and reference) policy's
        log-probs and sparse rows."""
        return LossInputs(
            tokens=self.tokens,
            mask=self.response_mask,
            advantages=self.advantages,
            old_logprobs=self.old_logprobs,
            old=self.old,
            ref_logprobs=self.ref_logprobs,
        )

    def select(self, sequences: Tensor) -> Rollout:
        """The rollout restricted to ``sequences`` (indices into B), in ascending order."""
        sequences = sequences.sort().values
        old = self.old
        if old is not None:
            owner = torch.repeat_interleave(
                torch.arange(self.num_sequences, device=self.response_mask.device),
                self.response_mask.sum(-1),
            )  # (N,) the sequence each sparse row belongs to
            old = old.select(torch.isin(owner, sequences.to(owner.device)))
        return replace(self, old=old, **self._map_tensors(lambda t: t[sequences]))

    def minibatches(self, size: int | None, generator: torch.Generator | None = None):
        """Shuffled minibatches of ``size`` sequences (all of them when ``size`` is None)."""
        if size is None or size >= self.num_sequences:
            return [self]
        order = torch.randperm(self.num_sequences, generator=generator)
        return self._split(order.to(self.input_ids.device), size)

    def chunks(self, size: int | None) -> list[Rollout]:
        """Consecutive parts of at most ``size`` sequences (one part when ``size`` is None)."""
        if size is None or size >= self.num_sequences:
            return [self]
        return self._split(torch.arange(self.num_sequences, device=self.input_ids.device), size)

    def trimmed(self) -> Rollout:
        """The rollout without the columns none of its sequences uses: prompt columns of left
        padding in every row, and response columns past every row's last token. Everything the
        loss computes from it is unchanged (up to float rounding); a part of short sequences
        then costs its own length, not the rollout's longest."""
        start, keep = used_columns(self.attention_mask, self.prompt_length)  # keep: T'
        length = self.response_mask.shape[1]
        if start == 0 and keep == length:
            return self
        fields_ = {"input_ids": self.input_ids, "attention_mask": self.attention_mask}
        cut = {name: t[:, start : self.prompt_length + keep] for name, t in fields_.items()}
        for name, value in self._map_tensors(lambda t: t).items():
            if name not in cut and value.dim() == 2 and value.shape[1] == length:
                cut[name] = value[:, :keep]  # (B, T'): response_mask, log-probs, advantages
        return replace(self, **cut)

    def to(self, device: torch.device | str) -> Rollout:
        old = None if self.old is None else self.old.to(device)
        return replace(self, old=old, **self._map_tensors(lambda t: t.to(device)))

    def _split(self, order: Tensor, size: int) -> list[Rollout]:
        """Parts of ``size`` sequences taken from ``order`` (a permutation of B), in turn."""
        return [self.select(order[i : i + size]) for i in range(0, len(order), size)]

    def _map_tensors(self, fn) -> dict[str, Tensor]:
        """``fn`` applied to every per-sequence tensor field (None fields are left out)."""
        return {
            f.name: fn(getattr(self, f.name))
            for f in fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
