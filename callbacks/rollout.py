"""RolloutGeneration: samples, scores and caches a rollout before every training step."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from lightning_troll.rollout import Rollout, behaviour_outputs, sample
from lightning_troll.sharding import gathered

__all__ = ["RolloutGeneration", "samples_table"]


def samples_table(prompts: list[str], completions: list[str], rewards: list[float]) -> str:
    """A Markdown table of prompts, completions and rewards, one row each.

    Chat-template prompts span several lines and may hold ``|``: both are escaped in every cell,
    so each sample stays one row of the table.
    """

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\r", "").replace("\n", "⏎")

    lines = ["| prompt | completion | reward |", "| --- | --- | --- |"]
    for prompt, completion, reward in zip(prompts, completions, rewards, strict=True):
        lines.append(f"| `{cell(prompt)}` | `{cell(completion)}` | {reward:.3g} |")
    return "\n".join(lines)


class RolloutGeneration(Callback):
    """Turns each batch of prompts into a :class:`~lightning_troll.rollout.Rollout`.

    Before every training step: the frozen snapshot (the behaviour policy) samples
    ``model.group_size`` completions per prompt with ``model.sampling`` (left padding, KV cache,
    stop at EOS); ``model.rewards`` score them; ``model.estimator`` turns rewards into advantages;
    the snapshot's token log-probs (and, for TROLL, its sparse distributions) are computed at the
    sampling temperature and cached. The result goes on ``model.rollout``.

    Logs ``reward/{mean,std}``, ``reward/frac_zero_std``, ``completion/{mean,max}_length`` and
    ``completion/truncated_frac``, and a few completions as text.

    Args:
        log_samples: completions shown as text in TensorBoard per rollout; 0 switches it off.
        log_samples_every_n_rollouts: how often the text samples are written.
    """

    def __init__(self, log_samples: int = 4, log_samples_every_n_rollouts: int = 10) -> None:
        if log_samples < 0 or log_samples_every_n_rollouts < 1:
            raise ValueError(
                "RolloutGeneration: log_samples must be >= 0 and log_samples_every_n_rollouts "
                f">= 1; got {log_samples} and {log_samples_every_n_rollouts}"
            )
        self.log_samples = log_samples
        self.log_samples_every_n_rollouts = log_samples_every_n_rollouts
        self.rollouts = 0
        self.mean_rewards: list[float] = []
        """Mean reward of every rollout so far (this process's completions)."""

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        rollout, completions = self.collect(pl_module, batch)
        pl_module.rollout = rollout
        self.rollouts += 1
        self.mean_rewards.append(float(rollout.rewards.mean()))
        self._log_metrics(pl_module, rollout)
        if self.log_samples and (self.rollouts - 1) % self.log_samples_every_n_rollouts == 0:
            self._log_text(trainer, batch, rollout, completions)

    @staticmethod
    @torch.no_grad()
    def collect(module: LightningModule, batch: Any) -> tuple[Rollout, list[str]]:
        """Samples, scores and caches one rollout from a batch of prompts."""
        group = module.group_size
        with module.behaviour_policy() as snapshot, gathered(snapshot):
            # sharded weights are gathered once for the whole generation, not once per token
            input_ids, attention_mask, response_mask, truncated = sample(
                snapshot, batch.prompt_ids, group, module.sampling, module.pad_id, module.stop_ids
            )
        length = response_mask.shape[1]
        completions = module.decode(input_ids[:, -length:], response_mask)
        prompts = [p for p in batch.prompts for _ in range(group)]
        rows = [r for r in batch.rows for _ in range(group)]
        scored = module.scorer(prompts, completions, rows)
        rewards = scored.total.to(input_ids.device, torch.float32)  # (B,)
        valid = scored.valid.to(input_ids.device)  # (B,)
        if not bool(valid.all()):
            # Dropped completions leave the loss; in their group they take the mean reward of
            # the others, so they shift no one's advantage.
            grouped, ok = rewards.view(-1, group), valid.view(-1, group)
            mean = (grouped * ok).sum(-1) / ok.sum(-1).clamp_min(1)  # (P,)
            rewards = torch.where(valid, rewards, mean.repeat_interleave(group))
            response_mask = response_mask & valid.unsqueeze(-1)
        advantages = module.compute_advantages(rewards)
        temperature = module.sampling.temperature
        inputs = (input_ids, attention_mask, response_mask, temperature)
        chunks = module.logits_chunk_size
        with module.behaviour_policy() as snapshot:
            old_logprobs, old = behaviour_outputs(snapshot, *inputs, module.sparsify_old, chunks)
        ref_logprobs = None
        with module.reference_policy() as reference:
            if reference is not None:
                ref_logprobs = behaviour_outputs(reference, *inputs, None, chunks)[0]
        rollout = Rollout(
            input_ids=input_ids,
            attention_mask=attention_mask,
            response_mask=response_mask,
            old_logprobs=old_logprobs,
            old=old,
            rewards=rewards,
            advantages=advantages,
            truncated=truncated,
            temperature=temperature,
            group_size=group,
            ref_logprobs=ref_logprobs,
        )
        return rollout, completions

    @staticmethod
    def _log_metrics(module: LightningModule, rollout: Rollout) -> None:
        grouped = rollout.rewards.view(-1, rollout.group_size)
        spread = grouped.amax(-1) - grouped.amin(-1)
        lengths = rollout.response_mask.sum(-1).float()
        values = {
            "reward/std": rollout.rewards.std()
            if rollout.num_sequences > 1
            else lengths.new_zeros(()),
            "reward/frac_zero_std": (spread == 0).float().mean(),
            "completion/mean_length": lengths.mean(),
            "completion/truncated_frac": rollout.truncated.float().mean(),
        }
        size = rollout.num_sequences
        module.log(
            "reward/mean", rollout.rewards.mean(), prog_bar=True, sync_dist=True, batch_size=size
        )
        module.log_dict(values, sync_dist=True, batch_size=size)
        module.log(
            "completion/max_length", lengths.max(), sync_dist=True, reduce_fx="max", batch_size=size
        )

    @rank_zero_only
    def _log_text(self, trainer: Trainer, batch: Any, rollout: Rollout, completions: list[str]):
        logger = trainer.logger
        if not isinstance(logger, TensorBoardLogger):
            return
        shown = min(self.log_samples, rollout.num_sequences)
        prompts = [batch.prompts[i // rollout.group_size] for i in range(shown)]
        table = samples_table(prompts, completions[:shown], rollout.rewards[:shown].tolist())
        logger.experiment.add_text("samples", table, trainer.global_step)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"rollouts": self.rollouts, "mean_rewards": list(self.mean_rewards)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rollouts = state_dict["rollouts"]
        self.mean_rewards = list(state_dict.get("mean_rewards", []))
