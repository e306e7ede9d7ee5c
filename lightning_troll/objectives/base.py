"""PolicyObjective: the machinery TROLL and clipping share (see :mod:`lightning_troll.objectives`).

Both objectives share the importance level (``token``, or ``sequence`` as in GSPO), the
aggregation over tokens and sequences (both from :mod:`lightning_troll.objectives.aggregation`), an
optional reference-KL penalty and an entropy bonus; each returns ``(loss, stats)`` with
``loss = -J`` (+ penalties) and a detached statistics record
(:mod:`lightning_troll.objectives.stats`).

Notation (shape comments below use these letters):

    B   sequences in the (mini)batch        T   response positions, padded
    V   vocabulary                          N   response tokens, ``mask.sum()``
    H   hidden size of the policy           n   rows of one chunk

Every objective runs in two stages: a row stage turns each response token's logit row into a
few numbers (:class:`TokenTerms`: log-probs, entropy, regression term, projection record), and
an aggregation stage turns those ``(N,)`` terms into the loss. ``forward`` takes ``(B, T, V)``
logits; ``forward_hidden`` takes ``(B, T, H)`` hidden states and the output layer and runs the
row stage on chunks of rows under activation checkpointing, so ``(N, V)`` logits never exist.
A subclass defines the row stage's ``_token_terms`` and the surrogate ``_surrogate``.

The per-token inputs travel by name in one :class:`LossInputs` record: padded ``(B, T)`` tensors
with a boolean ``mask`` of response tokens, and the old policy's sparse distributions, one row per
response token in the row-major order of ``mask`` (the order of ``logits[mask]``). Nothing here
imports Lightning or transformers.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from functools import partial, wraps
from typing import Any

import torch
from torch import Tensor, nn

from lightning_troll.objectives.aggregation import (
    AGGREGATIONS,
    IMPORTANCE_LEVELS,
    REF_KL_ESTIMATORS,
    ResponseTokens,
)
from lightning_troll.objectives.chunking import (
    DEFAULT_CHUNK_SIZE,
    HiddenRows,
    check_chunk_size,
    head_logits,
    map_row_chunks,
)
from lightning_troll.objectives.options import LossConfig
from lightning_troll.objectives.stats import ObjectiveStats
from lightning_troll.trust_region.projection import ProjectionResult, SparseDistribution
from lightning_troll.trust_region.sparse import compute_dtype

__all__ = ["LossInputs", "PolicyObjective", "TokenTerms", "check_choice", "token_entropy"]


def check_choice(option: str, value: str, allowed: dict) -> str:
    """``value`` if it is a key of ``allowed``, else a ``ValueError`` naming ``option``."""
    if value not in allowed:
        raise ValueError(f"{option} must be one of {sorted(allowed)}; got {value!r}")
    return value


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` per row, (..., V) -> (...), in float32 or wider.

    Logits of ``-inf`` (a masked vocabulary) have no mass and add nothing, nor NaN gradients.
    """
    x = logits.to(compute_dtype(logits))
    logz = torch.logsumexp(x, dim=-1, keepdim=True)
    finite_x = x.masked_fill(x.isneginf(), 0.0)  # p = 0 there: p * x counts as 0
    return (logz - (torch.softmax(x, dim=-1) * finite_x).sum(-1, keepdim=True)).squeeze(-1)


def _masked_stats(values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """mean, min, max of a 1-D tensor; zeros when it is empty."""
    if values.numel() == 0:
        zero = values.new_zeros(())
        return zero, zero, zero
    return values.mean(), values.min(), values.max()


@dataclass(frozen=True)
class LossInputs:
    """What an objective takes of a rollout besides the policy's logits (or hidden states).

    Build one by name, or from a rollout with
    :meth:`~lightning_troll.rollouts.rollout.Rollout.loss_inputs`; ``dataclasses.replace`` gives
    a copy with one field changed (the dense support's ``old``, say).
    """

    tokens: Tensor
    """(B, T) sampled response tokens."""
    mask: Tensor
    """(B, T) bool, True at response tokens."""
    advantages: Tensor
    """(B,) per sequence or (B, T) per token."""
    old_logprobs: Tensor
    """(B, T) log-probs of ``tokens`` under the behaviour policy."""
    old: SparseDistribution | Tensor | HiddenRows | None
    """The behaviour policy's sparse distributions, one row per response token (TROLL needs
    them; clipping ignores them); with ``support: dense`` the snapshot's logit rows instead, an
    (N, V) tensor or :class:`~lightning_troll.objectives.chunking.HiddenRows`; or None."""
    ref_logprobs: Tensor | None = None
    """(B, T) reference-policy log-probs of ``tokens``, needed when ``ref_kl_coef > 0``."""


def _takes_loss_inputs(method: Callable) -> Callable:
    """``method`` refusing, with a ``TypeError`` that says how to build one, any ``inputs`` but a
    :class:`LossInputs` (such as the tensors once passed one by one, by position)."""
    signature = inspect.signature(method)

    @wraps(method)
    def checked(self, *args, **kwargs):
        try:
            inputs = signature.bind(self, *args, **kwargs).arguments.get("inputs")
            got = f"got inputs of type {type(inputs).__name__}"
        except TypeError as error:
            inputs, got = None, str(error)
        if not isinstance(inputs, LossInputs):
            raise TypeError(
                f"{type(self).__name__}.{method.__name__} takes its per-token tensors as one "
                f"LossInputs ({got}): pass LossInputs(tokens=..., mask=..., advantages=..., "
                "old_logprobs=..., old=..., ref_logprobs=...) from lightning_troll.objectives, or "
                "rollout.loss_inputs()"
            )
        return method(self, *args, **kwargs)

    return checked


@dataclass(frozen=True)
class TokenTerms:
    """What the row stage computes per response token; the aggregation stage takes it from there."""

    logprob: Tensor  # (N,) log-prob entering the importance ratio
    new_logprob: Tensor  # (N,) log-prob of the current (unprojected) policy
    regression: Tensor | None  # (N,) per-token regression loss, or None
    entropy: Tensor | None = None  # (N,) entropy of the current policy
    projection: ProjectionResult | None = None  # per-token projection record, detached

    @staticmethod
    def cat(parts: list[TokenTerms]) -> TokenTerms:
        """The terms of consecutive chunks of rows, concatenated into one record."""
        if len(parts) == 1:
            return parts[0]

        def cat(values: list) -> object:
            if values[0] is None:
                return None
            if isinstance(values[0], ProjectionResult):
                names = (f.name for f in fields(ProjectionResult))
                return ProjectionResult(**{n: cat([getattr(v, n) for v in values]) for n in names})
            return torch.cat(values)

        return TokenTerms(
            **{f.name: cat([getattr(p, f.name) for p in parts]) for f in fields(TokenTerms)}
        )


class PolicyObjective(nn.Module):
    """Shared machinery of the policy objectives.

    Args:
        importance: ``token`` (PPO/GRPO) or ``sequence`` (GSPO).
        aggregation: ``token_mean``, ``seq_mean_token_mean`` (GRPO) or
            ``seq_mean_token_sum_norm`` (Dr.GRPO).
        norm_length: the constant length of ``seq_mean_token_sum_norm`` (the generation budget);
            ``None`` uses the padded length T of each batch.
        ref_kl_coef: weight beta of the reference-KL penalty, >= 0 (0 switches it off).
        ref_kl_estimator: ``k1`` or ``k3``.
        entropy_coef: weight of the entropy bonus, >= 0 (0 switches it off).
    """

    def __init__(
        self,
        importance: str = LossConfig.importance,
        aggregation: str = LossConfig.aggregation,
        norm_length: int | None = LossConfig.norm_length,
        ref_kl_coef: float = LossConfig.ref_kl_coef,
        ref_kl_estimator: str = "k3",
        entropy_coef: float = LossConfig.entropy_coef,
    ) -> None:
        super().__init__()
        self.importance = check_choice("importance", importance, IMPORTANCE_LEVELS)
        self.aggregation = check_choice("aggregation", aggregation, AGGREGATIONS)
        self.ref_kl_estimator = check_choice(
            "ref_kl_estimator", ref_kl_estimator, REF_KL_ESTIMATORS
        )
        if norm_length is not None and (isinstance(norm_length, bool) or norm_length < 1):
            raise ValueError(f"norm_length must be None or an integer >= 1; got {norm_length!r}")
        for name, value in (("ref_kl_coef", ref_kl_coef), ("entropy_coef", entropy_coef)):
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0; got {value!r}")
        self.norm_length = norm_length
        self.ref_kl_coef = float(ref_kl_coef)
        self.entropy_coef = float(entropy_coef)

    @classmethod
    def from_records(cls, own: Any, loss: LossConfig, max_new_tokens: int) -> PolicyObjective:
        """The objective from its own record (``model.trust_region`` for TROLL, ``model.clip``
        for clipping) and ``model.loss``, each taken whole: every field is the keyword of the
        same name. ``loss.norm_length`` null divides a sequence-sum aggregation by
        ``max_new_tokens``."""
        shared = {**asdict(loss), "norm_length": loss.norm_length or max_new_tokens}
        return cls(**asdict(own), **shared)

    @_takes_loss_inputs
    def forward(self, logits: Tensor, inputs: LossInputs) -> tuple[Tensor, ObjectiveStats]:
        """Loss ``-J`` (+ penalties) and its statistics.

        Args:
            logits: ``(B, T, V)`` policy logits at the positions that predict ``inputs.tokens``.
            inputs: the response tokens, their mask and advantages, and the behaviour (and
                reference) policy's view of them: :class:`LossInputs`.
        """
        self._check_inputs("logits", logits, inputs)
        response = ResponseTokens.of(inputs.mask)
        tokens = response.take(inputs.tokens)  # (N,)
        self._check_rows(tokens, inputs.old, logits.shape[-1])
        terms = self._row_terms(response.take(logits), tokens, inputs.old)  # rows (N, V)
        return self._aggregate(terms, inputs, response)

    @_takes_loss_inputs
    def forward_hidden(
        self,
        hidden: Tensor,
        head: Callable[[Tensor], Tensor],
        temperature: float,
        inputs: LossInputs,
        chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    ) -> tuple[Tensor, ObjectiveStats]:
        """:meth:`forward` with the logits ``head(hidden) / temperature`` made chunk by chunk.

        The row stage runs on ``chunk_size`` response tokens at a time; with more than one chunk
        each runs under activation checkpointing (its logits are recomputed in the backward
        pass), so the forward never holds ``(N, V)`` logits. Loss, gradients and statistics
        equal those of :meth:`forward` on the full logits, up to float rounding.

        Args:
            hidden: ``(B, T, H)`` the policy's last hidden states at the positions that predict
                ``inputs.tokens`` (after the final norm: the output layer's input).
            head: the output layer, ``(n, H) -> (n, V)`` logits (``get_output_embeddings()``).
            temperature: the sampling temperature, > 0; the logits are divided by it.
            inputs: as in :meth:`forward`.
            chunk_size: response tokens per chunk, >= 1; None makes one chunk of all of them.
        """
        self._check_inputs("hidden", hidden, inputs)
        check_chunk_size(chunk_size, "chunk_size")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0; got {temperature!r}")
        response, old = ResponseTokens.of(inputs.mask), inputs.old
        n = response.count
        rows = old.shape[0] if isinstance(old, Tensor) else getattr(old, "num_rows", n)
        if rows != n:
            raise ValueError(f"old must have one row per response token, N = {n}; got {rows} rows")
        tokens = response.take(inputs.tokens)  # (N,)
        self._check_rows(tokens, old, None)
        row_terms = partial(self._hidden_terms, head=head, temperature=temperature)
        parts = map_row_chunks(row_terms, response.take(hidden), chunk_size, tokens, old)
        return self._aggregate(TokenTerms.cat(parts), inputs, response)

    # The row stage: (n, V) logit rows -> per-token terms ------------------------------------------
    def _hidden_terms(self, hidden, tokens, old, *, head, temperature) -> TokenTerms:
        return self._row_terms(head_logits(head, hidden, temperature), tokens, old)  # (n, V)

    def _row_terms(
        self, rows: Tensor, tokens: Tensor, old: SparseDistribution | None
    ) -> TokenTerms:
        terms = self._token_terms(rows, tokens, old)
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.entropy_coef > 0):
            entropy = token_entropy(rows)  # (n,)
        return replace(terms, entropy=entropy)

    # The aggregation stage: (N,) terms -> loss and statistics -----------------------------------
    def _aggregate(
        self, terms: TokenTerms, inputs: LossInputs, response: ResponseTokens
    ) -> tuple[Tensor, ObjectiveStats]:
        mask, ref_logprobs = inputs.mask, inputs.ref_logprobs
        scatter = response.scatter  # (N,) -> (B, T), zeros at padding

        logp = scatter(terms.logprob)  # (B, T)
        old_logp = inputs.old_logprobs.to(logp.dtype)
        ratio = IMPORTANCE_LEVELS[self.importance](logp, old_logp, mask)  # (B, T)
        adv = inputs.advantages.to(logp.dtype)
        adv = adv.unsqueeze(-1).expand_as(ratio) if adv.dim() == 1 else adv  # (B, T)
        objective, extra = self._surrogate(ratio, adv, response)  # (B, T)

        norm = self.norm_length or mask.shape[-1]

        def aggregate(values: Tensor) -> Tensor:
            return AGGREGATIONS[self.aggregation](values, mask, norm)

        policy_loss = -aggregate(objective)
        loss = policy_loss
        zero = policy_loss.new_zeros(())
        regression_loss = (
            aggregate(scatter(terms.regression)) if terms.regression is not None else zero
        )
        loss = loss + self._regression_weight * regression_loss

        ref_kl = zero
        if self.ref_kl_coef > 0:
            per_token = REF_KL_ESTIMATORS[self.ref_kl_estimator](
                scatter(terms.new_logprob), ref_logprobs.to(logp.dtype)
            )
            ref_kl = aggregate(per_token)
            loss = loss + self.ref_kl_coef * ref_kl

        entropy = aggregate(scatter(terms.entropy))
        if self.entropy_coef > 0:
            loss = loss - self.entropy_coef * entropy

        token_ratios = response.take(ratio.detach())  # (N,)
        r_mean, r_min, r_max = _masked_stats(token_ratios)
        stats = self._stats_type(
            loss=loss.detach(),
            policy_loss=policy_loss.detach(),
            regression_loss=regression_loss.detach(),
            ref_kl=ref_kl.detach(),
            entropy=entropy.detach(),
            ratio_mean=r_mean,
            ratio_min=r_min,
            ratio_max=r_max,
            num_tokens=mask.sum(),
            token_ratio=token_ratios,
            token_old_prob=response.take(old_logp.detach()).exp(),  # (N,)
            token_advantage=response.take(adv.detach()),  # (N,)
            **self._token_stats(terms),
            **extra,
        )
        return loss, stats

    # Subclasses define these -----------------------------------------------------------------
    _stats_type: type[ObjectiveStats] = ObjectiveStats
    _regression_weight: float = 0.0
    needs_old_logits: bool = False
    """True where ``old`` must be the old policy's logit rows, not its sparse rows."""

    def _token_terms(
        self, rows: Tensor, tokens: Tensor, old: SparseDistribution | None
    ) -> TokenTerms:
        raise NotImplementedError

    def _surrogate(
        self, ratio: Tensor, adv: Tensor, response: ResponseTokens
    ) -> tuple[Tensor, dict]:
        """The per-token objective (B, T) from the ratios and advantages (B, T), and statistics;
        ``response`` holds the mask and takes (N,) values out of (B, T) ones."""
        raise NotImplementedError

    def _token_stats(self, terms: TokenTerms) -> dict:
        """Objective-specific statistics from the concatenated per-token terms."""
        return {}

    def _check_rows(self, tokens: Tensor, old: object, vocab: int | None) -> None:
        """Checks the response tokens (N,) and ``old`` once per call, before the row stage
        splits them into chunks (``vocab``: V, None where only ``old`` knows it)."""

    # -----------------------------------------------------------------------------------------
    def _check_inputs(self, what: str, values: Tensor, inputs: LossInputs) -> None:
        tokens, mask, advantages = inputs.tokens, inputs.mask, inputs.advantages
        old_logprobs, ref_logprobs = inputs.old_logprobs, inputs.ref_logprobs
        if values.dim() != 3:
            last = "V" if what == "logits" else "H"
            raise ValueError(f"{what} must be (B, T, {last}); got shape {tuple(values.shape)}")
        bt = values.shape[:2]
        for name, t in (("tokens", tokens), ("mask", mask), ("old_logprobs", old_logprobs)):
            if t.shape != bt:
                raise ValueError(f"{name} must be (B, T) = {tuple(bt)}; got {tuple(t.shape)}")
        if mask.dtype != torch.bool:
            raise ValueError(f"mask must be a bool tensor; got {mask.dtype}")
        if advantages.shape not in (bt[:1], bt):
            raise ValueError(
                f"advantages must be (B,) = ({bt[0]},) or (B, T) = {tuple(bt)}; "
                f"got {tuple(advantages.shape)}"
            )
        if self.ref_kl_coef > 0 and (ref_logprobs is None or ref_logprobs.shape != bt):
            got = None if ref_logprobs is None else tuple(ref_logprobs.shape)
            raise ValueError(
                f"ref_kl_coef={self.ref_kl_coef} needs ref_logprobs of shape (B, T) = "
                f"{tuple(bt)}; got {got}"
            )
