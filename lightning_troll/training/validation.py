"""Validation on held-out prompts: greedy answers, and k sampled answers per prompt (pass@k).

:func:`validation_metrics` is what ``TrollModule.validation_step`` scores, and
:class:`ValidationFigures` gives its mean over batches and processes, which is logged;
:func:`pass_at_k` is the arithmetic. Sampling draws from a forked random state seeded by the batch
and the process, so a validation neither moves the training run's random streams (a resumed run,
which skips the validation its checkpoint preceded, samples what the uninterrupted run samples)
nor differs from one validation to the next by chance alone.

Notation: P prompts of a validation batch, k samples per prompt.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_troll.engines.sampling import sample
from lightning_troll.models.sharding import gathered
from lightning_troll.rollouts.episodes import Episode
from lightning_troll.rollouts.multiturn import episode_figures, sampled_turns
from lightning_troll.tasks.data.prompts import seeded_generator
from lightning_troll.tasks.environments.protocol import EnvironmentFailure
from lightning_troll.tasks.rewards.calls import RewardError
from lightning_troll.tasks.rewards.registry import RewardOutput, reward_tag
from lightning_troll.training.faults import EpisodeFault, RewardFault

__all__ = [
    "ValidationFigures",
    "pass_at_k",
    "stopping_between_validations",
    "validation_metrics",
]


def stopping_between_validations(trainer: Any) -> bool:
    """Whether this validation runs only because the fit is stopping between two scheduled ones.

    Lightning validates on the way out of a fit whose ``should_stop`` is set (Ctrl-C or SIGTERM
    through :class:`~lightning_troll.callbacks.RolloutCheckpoint`, or another callback's stop),
    whatever ``trainer.val_check_interval`` says. Such a validation is skipped, so that a run
    stopped and resumed validates at the points an uninterrupted run does, and runs compare on
    the same points. A validation at a scheduled rollout, a time-based schedule and validations
    outside a fit are kept.
    """
    if trainer.sanity_checking or trainer.state.fn != "fit" or not trainer.should_stop:
        return False
    if getattr(trainer, "_val_check_time_interval", None) is not None:
        return False
    loop = trainer.fit_loop.epoch_loop
    every = trainer.val_check_batch
    if every is None or every == float("inf"):  # once per epoch, at its end
        return not loop.batch_progress.is_last_batch
    index = loop.total_batch_idx if trainer.check_val_every_n_epoch is None else loop.batch_idx
    return (index + 1) % every != 0


def pass_at_k(correct: Tensor) -> tuple[Tensor, Tensor]:
    """(P, k) bool -> pass@k, the share of prompts with at least one correct sample, and mean@k,
    the share of correct samples (the expected accuracy of one sample)."""
    correct = correct.float()
    return correct.amax(-1).mean(), correct.mean()


def validation_metrics(module: Any, batch: Any, batch_idx: int) -> dict[str, tuple[Tensor, int]]:
    """``val/accuracy`` and ``val/reward`` of greedy answers, ``val/reward/<name>/mean`` per reward
    function when there are several, with ``model.episodes`` what the greedy episodes did
    (``val/episodes/...``: turns, tool calls, endings, as :func:`episode_figures` reports a
    rollout's), and with ``batch.samples = k > 0`` also ``val/pass@k`` and ``val/mean@k`` of k
    answers sampled at ``model.sampling``; each as (value, the number of prompts or answers it is
    the mean of), the weight it takes in the mean over batches and processes.

    A completion is correct when its total reward over the functions that have a best score
    reaches full marks (:attr:`~lightning_troll.tasks.rewards.registry.RewardScorer.full_marks`; a
    reward model's logit is left out). Where no function has one (a reward model alone, or
    episodes scored by their environment alone, ``model.rewards: {}``, whose reward is the sum of
    its turn rewards) a positive total is correct. Prompts that only pad a validation set
    shared out over processes (``batch.counted`` false) are answered but not counted.
    """
    counted = _counted(batch)
    greedy, episodes = _answers(module, batch, 1, do_sample=False)
    correct = _correct(module, greedy)
    values = {
        "val/accuracy": _mean(correct.float(), counted),
        "val/reward": _mean(greedy.total, counted),
    }
    if episodes is not None:
        played = [e for e, c in zip(episodes, counted.tolist(), strict=True) if c]
        size = len(played)
        for name, value in episode_figures(played).items():
            values[f"val/{name}"] = (torch.tensor(value), size)
    if len(greedy.per_function) > 1:
        valid = greedy.valid & counted
        for name, column in greedy.per_function.items():
            values[f"val/reward/{reward_tag(name)}/mean"] = _mean(column, valid)
    k = int(getattr(batch, "samples", 0))
    if k > 0:
        device = next(module.policy.parameters()).device
        devices = [device] if device.type == "cuda" else []
        seed = int(seeded_generator(batch_idx, f"validation-{module.global_rank}").initial_seed())
        with torch.random.fork_rng(devices=devices, device_type=device.type):
            torch.manual_seed(seed)
            sampled, _ = _answers(module, batch, k, do_sample=True)
        hits = _correct(module, sampled).view(-1, k)[counted]  # (counted P, k)
        size = len(hits)
        passed, mean = pass_at_k(hits) if size else (torch.tensor(0.0), torch.tensor(0.0))
        values[f"val/pass@{k}"], values[f"val/mean@{k}"] = (passed, size), (mean, size)
    return values


class ValidationFigures:
    """Each validation figure's sum of value x count and its count over a validation's batches.

    :meth:`means` adds them up over processes and divides: the mean over every prompt or answer
    counted, exact whatever share of them each batch and each process holds. (Lightning's own
    weighted mean under ``sync_dist`` averages the counts as integers, which floors them where
    processes count different numbers, as they do when copies pad a validation set.)
    """

    def __init__(self) -> None:
        self.totals: dict[str, tuple[float, int]] = {}

    def add(self, figures: dict[str, tuple[Tensor, int]]) -> None:
        for name, (value, count) in figures.items():
            total, counted = self.totals.get(name, (0.0, 0))
            self.totals[name] = (total + float(value) * count, counted + count)

    def means(self, strategy: Any, device: torch.device) -> dict[str, Tensor]:
        """Every figure's mean over all processes (0 where none counted anything), on
        ``device``; the totals start again. Every process calls it with the same figures."""
        names = sorted(self.totals)
        if not names:
            return {}
        local = torch.tensor([self.totals[name] for name in names], dtype=torch.float64)
        summed = strategy.reduce(local.to(device), reduce_op="sum")
        self.totals = {}
        return {n: (summed[i, 0] / summed[i, 1].clamp_min(1)).float() for i, n in enumerate(names)}


def _counted(batch: Any) -> Tensor:
    """(P,) bool: the prompts that count in the figures."""
    flags = getattr(batch, "counted", None)
    return (
        torch.ones(len(batch.prompts), dtype=torch.bool) if flags is None else torch.tensor(flags)
    )


def _mean(values: Tensor, mask: Tensor) -> tuple[Tensor, int]:
    """The mean of ``values`` where ``mask`` holds (0 where it holds nowhere), and its count."""
    count = int(mask.sum())
    return torch.where(mask, values.float(), 0.0).sum() / max(count, 1), count


def _answers(
    module: Any, batch: Any, group: int, do_sample: bool
) -> tuple[RewardOutput, list[Episode] | None]:
    """``group`` answers per prompt from the policy, scored: (P * group,) tensors, and with
    ``model.episodes`` their episodes (None without), where an answer is an episode's last turn,
    the policy taking every turn."""
    if module.episodes is not None:
        return _episode_answers(module, batch, group, do_sample)
    with gathered(module.policy):
        ids, _, response_mask, _ = sample(
            module.policy,
            batch.prompt_ids,
            group,
            module.sampling,
            module.policies.pad_id,
            module.policies.stop_ids,
            do_sample=do_sample,
        )
    completions = module.policies.decode(ids[:, -response_mask.shape[1] :], response_mask)
    prompts = [p for p in batch.prompts for _ in range(group)]
    rows = [r for r in batch.rows for _ in range(group)]
    tokens = response_mask.sum(-1).tolist()  # generated tokens, EOS included
    return _scored(module, prompts, completions, rows, tokens), None


def _episode_answers(
    module: Any, batch: Any, group: int, do_sample: bool
) -> tuple[RewardOutput, list[Episode]]:
    rows = [r for r in batch.rows for _ in range(group)]
    pad_id, episodes = module.policies.pad_id, module.episodes
    with gathered(module.policy):
        generate = sampled_turns(module.policy, module.sampling, pad_id, do_sample=do_sample)
        try:
            sampled = episodes.sample(generate, rows, pad_id, module.device)
        except EnvironmentFailure as error:  # the last checkpoint stays as it was
            raise EpisodeFault(str(error), resumable=False) from error
    if not module.scorer.functions:  # the environment's rewards alone (model.rewards: {})
        rewards = sampled.env_rewards.cpu()
        valid = torch.ones_like(rewards, dtype=torch.bool)
        return RewardOutput(rewards, {}, valid), sampled.episodes
    answers = episodes.answers(sampled, module.policies.decode)
    tokens = sampled.budget_mask.sum(-1).tolist()  # the model's and the environment's tokens
    return _scored(module, sampled.prompts, answers, rows, tokens), sampled.episodes


def _scored(module: Any, prompts: list, completions: list, rows: list, tokens: list) -> Any:
    """The validation's rewards; a reward that fails stops the run in one line, the last
    checkpoint as it was (:class:`RewardFault`, not resumable)."""
    try:
        return module.scorer(
            prompts, completions, rows, tokens, module.sampling.max_new_tokens, device=module.device
        )
    except RewardError as error:
        raise RewardFault(f"in validation: {error}", resumable=False) from error


def _correct(module: Any, scored: RewardOutput) -> Tensor:
    scorer = module.scorer
    counted = [name for name, best in scorer.best.items() if best is not None]
    if not counted:  # the environment's rewards or a reward model alone
        return (scored.total > 0) & scored.valid
    marks = sum(scorer.weights[name] * scored.per_function[name] for name in counted)
    return (marks >= scorer.full_marks - 1e-6) & scored.valid
