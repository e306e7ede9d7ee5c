"""What one rollout sampled: the completions of every round, scored, and its report.

:class:`Samples` are one or more rounds of sampled completions with their rewards (and the
behaviour policy's view when it was recorded while sampling); :class:`RolloutReport` is what
:meth:`~lightning_troll.rollouts.collector.RolloutCollector.collect` hands to logging. Notation: P
prompts, G completions per prompt, B = P * G sequences (prompt-major), S prompt length, T
response length. No Lightning here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_troll.engines.behaviour import BehaviourRecord
from lightning_troll.objectives.advantages import flat_groups
from lightning_troll.rollouts.dynamic_sampling import cat_sequences, group_rows
from lightning_troll.tasks.rewards.registry import RewardOutput

__all__ = ["RolloutReport", "Samples", "filled_rewards"]


@dataclass(frozen=True)
class Samples:
    """One or more rounds of sampled, scored completions; per sequence, prompt-major (B = P * G)."""

    input_ids: Tensor
    """(B, S + T) prompt (left padded) followed by the response (right padded)."""
    attention_mask: Tensor
    """(B, S + T) 1 at prompt and response tokens."""
    response_mask: Tensor
    """(B, T) bool, response tokens up to and including the first EOS (nothing masked out yet)."""
    truncated: Tensor
    """(B,) bool, True where the completion hit the token budget without an EOS (an episode: where
    the budget cut it off)."""
    rewards: Tensor
    """(B,) float32 total reward; a dropped completion has its group's mean over the valid ones."""
    scored: RewardOutput
    """The reward functions' output (total, per function, valid), on the device of the ids."""
    completions: list[str]
    prompts: list[str]
    rows: list[dict[str, Any]]
    group_size: int
    behaviour: BehaviourRecord | None = None
    """The behaviour policy's log-probs (and sparse rows) recorded while sampling, if it was."""
    seconds: float = 0.0
    """Wall time of the generation that sampled this round (recording included)."""
    engine_logprobs: Tensor | None = None
    """(B, T) the rollout engine's own log-probs of the sampled tokens, where it reports them."""
    episodes: list[Any] | None = None
    """Multi-turn rollouts: each sequence's :class:`~lightning_troll.rollouts.episodes.Episode`
    (its completion is the final answer; the response holds every turn and reply)."""

    @property
    def informative(self) -> Tensor:
        """(P,) bool, True where the group's rewards have spread (a nonzero advantage)."""
        return ~flat_groups(self.rewards, self.group_size)

    def select(self, groups: Tensor) -> Samples:
        """The samples of ``groups`` (ascending group indices)."""
        rows = group_rows(groups.to(self.rewards.device), self.group_size)  # (g * G,)
        keep = rows.tolist()
        scored = RewardOutput(
            total=self.scored.total[rows],
            per_function={k: v[rows] for k, v in self.scored.per_function.items()},
            valid=self.scored.valid[rows],
        )
        tensors = ("input_ids", "attention_mask", "response_mask", "truncated", "rewards")
        return replace(
            self,
            **{name: getattr(self, name)[rows] for name in tensors},
            scored=scored,
            completions=[self.completions[i] for i in keep],
            prompts=[self.prompts[i] for i in keep],
            rows=[self.rows[i] for i in keep],
            behaviour=None if self.behaviour is None else self.behaviour.select(rows),
            engine_logprobs=None if self.engine_logprobs is None else self.engine_logprobs[rows],
            episodes=None if self.episodes is None else [self.episodes[i] for i in keep],
        )

    @staticmethod
    def cat(parts: list[Samples], pad_id: int) -> Samples:
        """Concatenates samples of several rounds (prompts and responses padded to the widest)."""
        if len(parts) == 1:
            return parts[0]
        ids, attention, response = cat_sequences(
            [(p.input_ids, p.attention_mask, p.response_mask) for p in parts], pad_id
        )
        engine_logprobs = None
        if parts[0].engine_logprobs is not None:  # right padded with 0 to the widest response
            width = response.shape[1]
            engine_logprobs = torch.cat(
                [F.pad(p.engine_logprobs, (0, width - p.engine_logprobs.shape[1])) for p in parts]
            )
        names = parts[0].scored.per_function
        scored = RewardOutput(
            total=torch.cat([p.scored.total for p in parts]),
            per_function={k: torch.cat([p.scored.per_function[k] for p in parts]) for k in names},
            valid=torch.cat([p.scored.valid for p in parts]),
        )
        return Samples(
            input_ids=ids,
            attention_mask=attention,
            response_mask=response,
            truncated=torch.cat([p.truncated for p in parts]),
            rewards=torch.cat([p.rewards for p in parts]),
            scored=scored,
            completions=[c for p in parts for c in p.completions],
            prompts=[x for p in parts for x in p.prompts],
            rows=[r for p in parts for r in p.rows],
            group_size=parts[0].group_size,
            behaviour=(
                None
                if parts[0].behaviour is None
                else BehaviourRecord.cat([p.behaviour for p in parts])
            ),
            engine_logprobs=engine_logprobs,
            episodes=None if parts[0].episodes is None else [e for p in parts for e in p.episodes],
        )


@dataclass(frozen=True)
class RolloutReport:
    """What :meth:`RolloutCollector.collect` sampled for one rollout, for logging."""

    rounds: list[Samples]
    """Every round sampled (one without dynamic sampling), before any group was left out."""
    kept: Samples
    """The samples the rollout trains on."""
    capped: bool
    """True when dynamic sampling ran out of rounds before it had enough informative groups (on
    any process)."""
    advantages: Tensor | None = None
    """(B,) the kept completions' advantages (before any per-token importance weight)."""
    engine: dict[str, float] = field(default_factory=dict)
    """The rollout engine's figures (``engine/...``) and, where it reports its own log-probs,
    ``rollout/engine_logprob_diff``: their mean absolute difference from the trainer's."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time of this process's ``generation`` (every round), ``forward_passes`` (the
    teacher-forced passes after sampling: the behaviour policy's unless it was recorded while
    sampling, the reference policy's) and the whole ``rollout``."""
    counts: dict[str, float] = field(default_factory=dict)
    """What each figure of :attr:`engine` that is a mean averages over on this process (its
    response tokens, its episodes), by name, so that several processes pool them."""

    @property
    def rewards(self) -> Tensor:
        """(all sampled,) total rewards of every completion sampled."""
        return torch.cat([s.rewards for s in self.rounds])


def filled_rewards(scored: RewardOutput, group: int, env_rewards: Tensor | None = None) -> Tensor:
    """(B,) float32 rewards: the reward functions' totals, plus ``env_rewards`` (B,) where given
    (an episode's environment rewards). A dropped completion leaves the loss and, in its group,
    takes the mean reward of the others (their whole rewards, the environment's included), so the
    group's mean, the baseline of the estimators that subtract it, does not move (a scaling by
    the group's standard deviation sees one more value at the mean, and grows the others'
    advantages a little; RLOO's leave-one-out baselines count one more reward at the mean, and
    shrink them a little)."""
    rewards = scored.total.to(torch.float32)
    if env_rewards is not None:
        rewards = rewards + env_rewards.to(rewards)
    if bool(scored.valid.all()):
        return rewards
    grouped, ok = rewards.view(-1, group), scored.valid.view(-1, group)
    mean = (grouped * ok).sum(-1) / ok.sum(-1).clamp_min(1)  # (P,)
    return torch.where(scored.valid, rewards, mean.repeat_interleave(group))
