"""How far the policy has moved from the behaviour policy that sampled a rollout.

After a rollout's optimiser steps, the policy's distributions at the rollout's response tokens
are compared with the behaviour policy's cached sparse rows: the KL between the lumped sparse
distributions (what TROLL's projection bounds) and a sampled estimate over the whole
vocabulary. Clipping runs measure it too when they cache the sparse rows. Nothing here imports
Lightning.

Notation: N response tokens, V vocabulary, H hidden size, n rows of one chunk.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor, nn

from lightning_troll.models.snapshots import evaluating
from lightning_troll.objectives.chunking import head_logits, map_row_chunks
from lightning_troll.rollouts.forward import linear_head, response_hidden, response_logits
from lightning_troll.rollouts.micro_batches import pass_ranges
from lightning_troll.rollouts.rollout import Rollout
from lightning_troll.trust_region.projection import SparseDistribution, TrustRegionProjection

__all__ = ["drift_from_behaviour", "kl_to_behaviour", "sampled_kl", "support_rule"]


def support_rule(objective: nn.Module, trust_region) -> TrustRegionProjection:
    """The rule that chooses the sparse rows, ``model.trust_region``'s: TROLL's own projection,
    or for clipping one built from the same settings (clipping runs cache and measure the rows
    with it once a reader asks: ``TrollModule.keep_old_distributions``)."""
    projection = getattr(objective, "projection", None)
    if projection is not None:
        return projection
    try:
        return TrustRegionProjection.from_config(trust_region)
    except ValueError as error:
        raise ValueError(f"model.trust_region: {error}") from None


@torch.no_grad()
def kl_to_behaviour(
    policy: nn.Module,
    rollout: Rollout,
    rule: TrustRegionProjection,
    chunk_size: int | None,
    share_prompts: bool = False,
    max_tokens: int | None = None,
    packed: bool = False,
) -> tuple[Tensor, Tensor]:
    """Per response token of ``rollout``, how far ``policy`` is from the behaviour policy that
    sampled it: two ``(N,)`` tensors.

    The first is KL(pi || pi_old) between the lumped sparse distributions (support U plus the
    rest bucket, ``rule``'s supports: what TROLL's ``kl_before`` measures); the second the
    sampled estimate ``r log r - r + 1`` with ``r = pi(o_t) / pi_old(o_t)``, whose mean is an
    unbiased estimate of the mean KL(pi || pi_old) over the whole vocabulary (the tokens come
    from pi_old; with ``sampling.top_p`` or ``top_k`` truncating it, from a truncation of it
    instead). Needs ``rollout.old``. ``chunk_size`` and ``share_prompts`` are the module's
    ``logits_chunk_size`` and ``share_prompts``; ``max_tokens`` and ``packed`` its
    ``optimization.micro_batch_tokens`` and ``pack_sequences`` (consecutive parts of at most that
    many tokens, padded or packed). The policy runs in eval mode and outside any
    autocast, as the behaviour pass runs, so that on-policy data gives 0 whatever its dropout or
    the training precision (its mode comes back after).
    """
    device = next(policy.parameters()).device.type
    mask, prompt_length = rollout.attention_mask, rollout.prompt_length
    parts = []
    with evaluating(policy), torch.autocast(device, enabled=False):
        for part in pass_ranges(mask, prompt_length, max_tokens, packed, policy):
            rows = torch.arange(part.start, part.stop, device=mask.device)
            piece = rollout if part.stop - part.start == len(mask) else rollout.select(rows)
            parts.append(drift_from_behaviour(policy, piece.trimmed(), rule, chunk_size,
                                              share_prompts, packed))  # fmt: skip
    lumped, log_ratio = (torch.cat(values) for values in zip(*parts, strict=True))
    return lumped, sampled_kl(log_ratio)


def sampled_kl(log_ratio: Tensor) -> Tensor:
    """Per token, ``r log r - r + 1`` with ``r = exp(log_ratio)``: >= 0, and its mean over tokens
    sampled from pi_old estimates the mean KL(pi || pi_old) without bias."""
    ratio = log_ratio.exp()
    return ratio * log_ratio - ratio + 1


@torch.no_grad()
def drift_from_behaviour(
    policy: nn.Module,
    rollout: Rollout,
    rule: TrustRegionProjection,
    chunk_size: int | None,
    share_prompts: bool = False,
    packed: bool = False,
) -> tuple[Tensor, Tensor]:
    """Per response token: the lumped sparse KL(pi || pi_old) of :func:`kl_to_behaviour`, and
    the log-ratio ``log pi(o_t) - log pi_old(o_t)`` of the sampled token; ``(N,)`` each."""
    if rollout.old is None:
        raise ValueError(
            "kl_to_behaviour needs the rollout's sparse old distributions, which a clipping "
            "run caches once asked: call TrollModule.keep_old_distributions() before the "
            "rollout (trust_region_monitor.kl_end and kl_start ask for them)"
        )
    mask = rollout.response_mask
    tokens = rollout.tokens[mask]  # (N,)
    inputs = (policy, rollout.input_ids, rollout.attention_mask, mask.shape[1])
    head = None if chunk_size is None and not packed else linear_head(policy)
    if head is None:
        rows = response_logits(*inputs, rollout.temperature)[mask]  # (N, V)
        fn = partial(_kl_rows, rule=rule)
    else:
        rows = response_hidden(*inputs, share_prompts, packed)[mask]  # (N, H)
        fn = partial(_kl_hidden, rule=rule, head=head, temperature=rollout.temperature)
    parts = map_row_chunks(fn, rows, chunk_size, tokens, rollout.old)
    lumped, new_logp = (torch.cat(values) for values in zip(*parts, strict=True))
    return lumped, new_logp - rollout.old_logprobs[mask].to(new_logp.dtype)


def _kl_rows(rows: Tensor, tokens: Tensor, old: SparseDistribution, *, rule):
    """(n, V) logit rows -> lumped KL to the old rows (n,) and the tokens' log-probs (n,)."""
    logp = rows.float().log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return rule.kl_to_old(rows, old, tokens), logp


def _kl_hidden(hidden: Tensor, tokens: Tensor, old: SparseDistribution, *, rule, head, temperature):
    return _kl_rows(head_logits(head, hidden, temperature), tokens, old, rule=rule)
