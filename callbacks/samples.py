"""What one rollout sampled, logged: its figures (:func:`log_rollout`) and a table of samples.

The records themselves, :class:`~lightning_troll.rollouts.samples.Samples` and
:class:`~lightning_troll.rollouts.samples.RolloutReport`, live with the collector that makes them
(:mod:`lightning_troll.rollouts.collector`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor

from lightning_troll.callbacks.figures import (
    each_logger,
    logged_step,
    markdown_table,
    write_table,
)
from lightning_troll.rollouts.samples import RolloutReport, Samples
from lightning_troll.tasks.rewards.registry import reward_tag

__all__ = ["RolloutReport", "Samples", "log_rollout", "log_samples", "samples_table"]


def samples_table(prompts: list[str], completions: list[str], rewards: list[float]) -> str:
    """A Markdown table of prompts, completions and rewards, one row each.

    Chat-template prompts span several lines and may hold ``|``: both are escaped in every cell,
    so each sample stays one row of the table.
    """
    rows = zip(prompts, completions, [float(r) for r in rewards], strict=True)
    return markdown_table(["prompt", "completion", "reward"], list(rows))


def log_rollout(module: Any, report: RolloutReport) -> None:
    """Logs what one rollout sampled, over every completion sampled: ``reward/{mean,std}``,
    ``reward/frac_zero_std``, ``reward/<name>/mean`` per reward function when there are several,
    ``completion/{mean,max}_length`` and ``completion/truncated_frac``; with dynamic sampling
    ``dynamic_sampling/prompts_sampled``, ``dynamic_sampling/rounds`` (extra rounds) and
    ``dynamic_sampling/frac_dropped`` (sampled groups left out); failed reward calls
    ``rewards/timeouts`` and ``rewards/errors`` (and per function, when there are several).
    Where the rollout's time goes, in seconds: ``time/generation`` (sampling, every round),
    ``time/forward_passes`` (teacher-forced passes after sampling: the behaviour policy's when
    ``model.engine.behaviour_logprobs`` recomputes it, the reference policy's with
    ``model.loss.ref_kl_coef`` > 0), ``time/rollout`` (all of it, rewards included), and
    ``throughput/generated_tokens_per_s`` (response tokens up to EOS per second of generation).
    An engine other than ``hf`` adds its own figures (``engine/startup_s``,
    ``engine/weight_push_s``) and ``rollout/engine_logprob_diff``, the mean absolute difference
    between its log-probs of the sampled tokens and the snapshot's; with
    ``model.corrections.engine_is_cap`` each token's advantage is weighted by the truncated (or masked)
    ratio of the two (``rollout/engine_is_weight_mean``, ``rollout/engine_is_capped_frac`` or
    ``rollout/engine_is_masked_frac``). With several processes ``reward/std`` and the figures
    that average over tokens or episodes are those of every process's samples together
    (:func:`_pooled`)."""

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
    if module.dynamic_sampling.enabled:
        groups, kept = (
            size // module.group_size,
            report.kept.rewards.numel() // module.group_size,
        )
        values["dynamic_sampling/prompts_sampled"] = torch.tensor(float(groups))
        values["dynamic_sampling/rounds"] = torch.tensor(float(len(report.rounds) - 1))
        values["dynamic_sampling/frac_dropped"] = torch.tensor(1.0 - kept / groups)
    values.update({name: torch.tensor(value) for name, value in report.engine.items()})
    values.update(_pooled(module, report, rewards))
    seconds = dict(report.seconds)
    for name in ("forward_passes", "rollout"):
        if name in seconds:
            values[f"time/{name}"] = torch.tensor(seconds[name])
    generation = seconds.get("generation", 0.0)
    if generation > 0:
        speed = float(lengths.sum()) / generation
        values["throughput/generated_tokens_per_s"] = torch.tensor(speed)

    def log(figures: dict[str, Tensor | float], **options: Any) -> None:
        # Rewards, lengths and timings are CPU tensors; with sync_dist NCCL reduces only
        # tensors on the module's device (it has no CPU backend), so each figure moves there.
        on_device = {name: torch.as_tensor(v).to(module.device) for name, v in figures.items()}
        module.log_dict(on_device, sync_dist=True, batch_size=size, **options)

    log({"reward/mean": rewards.mean()}, prog_bar=True)
    if "generation" in seconds:
        log({"time/generation": generation}, prog_bar=True)
    log(values)
    log(_failures(report), reduce_fx="sum")
    log({"completion/max_length": lengths.max()}, reduce_fx="max")


def _pooled(module: Any, report: RolloutReport, rewards: Tensor) -> dict[str, Tensor]:
    """With several processes, the figures that are means or spreads over every process's
    samples: ``reward/std`` of all the rewards, and each figure of ``report.engine`` that
    averages over tokens or episodes (``report.counts``) weighed by its count. Logged as they are,
    a process's own figures would be averaged with equal weights, and the mean of the processes'
    standard deviations leaves out the spread between them. One reduction of a few numbers;
    nothing with one process, whose figures are its own."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None or trainer.world_size == 1:
        return {}
    names = sorted(report.counts)  # the same names, in the same order, on every process
    r = rewards.double()
    parts = [[report.engine[n] * report.counts[n], report.counts[n]] for n in names]
    parts.append([float(r.numel()), float(r.sum()), float((r * r).sum())])
    flat = torch.tensor([x for part in parts for x in part], dtype=torch.float64)
    total = trainer.strategy.reduce(flat.to(module.device), reduce_op="sum").cpu()
    pooled = {name: total[2 * i] / total[2 * i + 1].clamp_min(1) for i, name in enumerate(names)}
    n, summed, squares = total[-3:]
    variance = (squares - summed * summed / n) / (n - 1) if n > 1 else summed.new_zeros(())
    pooled["reward/std"] = variance.clamp_min(0).sqrt()
    return {name: value.float() for name, value in pooled.items()}


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


@rank_zero_only
def log_samples(trainer: Any, report: RolloutReport, count: int) -> None:
    """The first ``count`` completions the rollout trains on as a table in every logger: prompt,
    completion, reward, each function's reward when there are several, advantage."""
    samples, advantages = report.kept, report.advantages
    shown = min(count, len(samples.completions))
    names = list(samples.scored.per_function) if len(samples.scored.per_function) > 1 else []
    columns = ["prompt", "completion", "reward", *[f"reward/{n}" for n in names], "advantage"]
    per_function = [samples.scored.per_function[n][:shown].tolist() for n in names]
    values = zip(
        samples.prompts[:shown],
        samples.completions[:shown],
        samples.rewards[:shown].tolist(),
        *per_function,
        advantages[:shown].tolist(),
        strict=True,
    )
    each_logger(trainer, write_table, "samples", columns, list(values), logged_step(trainer))
