"""What one rollout sampled: the completions of every round, scored, and the report logged.

:class:`Samples` are one or more rounds of sampled completions with their rewards (and the
behaviour policy's view when it was recorded while sampling); :class:`RolloutReport` is what
:meth:`~lightning_troll.callbacks.RolloutGeneration.collect` hands to logging. Notation: P
prompts, G completions per prompt, B = P * G sequences (prompt-major), S prompt length, T
response length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_troll.callbacks.figures import markdown_table
from lightning_troll.objectives.advantages import flat_groups
from lightning_troll.rewards.registry import RewardOutput, reward_tag
from lightning_troll.rollouts.behaviour import BehaviourRecord
from lightning_troll.rollouts.dynamic_sampling import cat_sequences, group_rows

__all__ = ["RolloutReport", "Samples", "log_rollout", "samples_table"]


def samples_table(prompts: list[str], completions: list[str], rewards: list[float]) -> str:
    """A Markdown table of prompts, completions and rewards, one row each.

    Chat-template prompts span several lines and may hold ``|``: both are escaped in every cell,
    so each sample stays one row of the table.
    """
    rows = zip(prompts, completions, [float(r) for r in rewards], strict=True)
    return markdown_table(["prompt", "completion", "reward"], list(rows))


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
    """(B,) bool, True where the completion hit the token budget without an EOS."""
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
        )


@dataclass(frozen=True)
class RolloutReport:
    """What :meth:`RolloutGeneration.collect` sampled for one rollout, for logging."""

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

    @property
    def rewards(self) -> Tensor:
        """(all sampled,) total rewards of every completion sampled."""
        return torch.cat([s.rewards for s in self.rounds])


def log_rollout(module: Any, report: RolloutReport) -> None:
    """Logs what one rollout sampled: rewards, lengths, dynamic sampling, the engine's figures,
    times, and failed reward calls (see :class:`~lightning_troll.callbacks.RolloutGeneration`)."""

    def cat(values: Callable[[Samples], Tensor]) -> Tensor:  # over every round: (all,)
        return torch.cat([values(s) for s in report.rounds])

    rewards, valid = report.rewards, cat(lambda s: s.scored.valid)
    lengths = cat(lambda s: s.response_mask.sum(-1)).float()
    size = rewards.numel()
    values = {
        "reward/std": rewards.std() if size > 1 else lengths.new_zeros(()),
        "reward/frac_zero_std": cat(lambda s: ~s.informative).float().mean(),
        "completion/mean_length": lengths.mean(),
        "completion/truncated_frac": cat(lambda s: s.truncated).float().mean(),
    }
    names = list(report.kept.scored.per_function)
    if len(names) > 1:
        count = valid.sum().clamp_min(1)
        for name in names:
            column = cat(lambda s, name=name: s.scored.per_function[name])
            values[f"reward/{reward_tag(name)}/mean"] = (column * valid).sum() / count
    if module.dynamic_sampling:
        groups, kept = (
            size // module.group_size,
            report.kept.rewards.numel() // module.group_size,
        )
        values["dynamic_sampling/prompts_sampled"] = torch.tensor(float(groups))
        values["dynamic_sampling/rounds"] = torch.tensor(float(len(report.rounds) - 1))
        values["dynamic_sampling/frac_dropped"] = torch.tensor(1.0 - kept / groups)
    values.update({name: torch.tensor(value) for name, value in report.engine.items()})
    seconds = dict(report.seconds)
    for name in ("forward_passes", "rollout"):
        if name in seconds:
            values[f"time/{name}"] = torch.tensor(seconds[name])
    generation = seconds.get("generation", 0.0)
    if generation > 0:
        speed = float(lengths.sum()) / generation
        values["throughput/generated_tokens_per_s"] = torch.tensor(speed)
    module.log("reward/mean", rewards.mean(), prog_bar=True, sync_dist=True, batch_size=size)
    if "generation" in seconds:
        module.log("time/generation", generation, prog_bar=True, sync_dist=True, batch_size=size)
    module.log_dict(values, sync_dist=True, batch_size=size)
    module.log_dict(_failures(report), sync_dist=True, reduce_fx="sum", batch_size=size)
    module.log(
        "completion/max_length", lengths.max(), sync_dist=True, reduce_fx="max", batch_size=size
    )


def _failures(report: RolloutReport) -> dict[str, Tensor]:
    """Failed reward calls of the rollout (every round): ``rewards/timeouts``,
    ``rewards/errors`` and, with several functions, ``rewards/<name>/{timeouts,errors}``."""
    values: dict[str, Tensor] = {}
    names = list(report.kept.scored.per_function)
    for kind in ("timeouts", "errors"):
        counts = {n: sum(getattr(s.scored, kind).get(n, 0) for s in report.rounds) for n in names}
        values[f"rewards/{kind}"] = torch.tensor(float(sum(counts.values())))
        if len(names) > 1:
            for name, count in counts.items():
                values[f"rewards/{reward_tag(name)}/{kind}"] = torch.tensor(float(count))
    return values
