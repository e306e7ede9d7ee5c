"""TrollModule: the LightningModule that holds the policy, its frozen snapshot and the objective.

The module wires; it does not compute: the loss comes from :mod:`lightning_troll.objectives`,
rollouts from the :class:`~lightning_troll.callbacks.RolloutGeneration` callback, which puts a
:class:`~lightning_troll.rollout.Rollout` on ``module.rollout`` before every training step.
Optimisation is manual: per rollout, ``epochs_per_rollout`` passes over shuffled minibatches,
each minibatch one optimiser step, accumulated over micro-batches.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor

from lightning_troll.advantages import compute_advantages, get_advantage_estimator
from lightning_troll.lora import LoraConfig, adapters_disabled, apply_lora
from lightning_troll.models import load_policy, load_tokenizer
from lightning_troll.objectives import (
    AGGREGATION_SIZES,
    ObjectiveStats,
    PolicyObjective,
    build_objective,
)
from lightning_troll.projection import SparseDistribution, sparsify
from lightning_troll.rewards import RewardScorer
from lightning_troll.rollout import Rollout, SamplingConfig, response_logits, sample
from lightning_troll.snapshots import Snapshot, SnapshotConfig, build_snapshot

__all__ = ["ClipConfig", "LossConfig", "OptimizationConfig", "TrollModule", "TrustRegionConfig"]


@dataclass(frozen=True)
class TrustRegionConfig:
    """TROLL's projection (used when ``objective: troll``)."""

    eps: float = 0.05
    """KL bound per token, > 0."""
    alpha: float = 1.0
    """Weight of the regression KL(pi_new || sg(pi_proj)), >= 0."""
    max_tokens: int = 64
    """The most tokens kept per distribution, >= 1."""
    mass_delta: float = 1e-5
    """Keep tokens until their mass reaches 1 - mass_delta, in [0, 1)."""


@dataclass(frozen=True)
class ClipConfig:
    """PPO-style ratio clipping (used when ``objective: clip``)."""

    eps_low: float = 0.2
    """Lower clip range: the ratio is clipped at 1 - eps_low; in (0, 1)."""
    eps_high: float | None = None
    """Upper clip range: 1 + eps_high, > 0; null means eps_low (symmetric)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 for negative advantages; null switches it off."""


@dataclass(frozen=True)
class LossConfig:
    """What both objectives share."""

    importance: Literal["token", "sequence"] = "token"
    """Importance ratio per token, or per sequence (GSPO)."""
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = (
        "token_mean"
    )
    """How token losses become one number; seq_mean_token_sum_norm is Dr.GRPO's."""
    norm_length: int | None = None
    """Constant length for seq_mean_token_sum_norm; null uses sampling.max_new_tokens."""
    ref_kl_coef: float = 0.0
    """Weight of a KL penalty to the initial policy (k3 estimator); 0 switches it off."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus; 0 switches it off."""


@dataclass(frozen=True)
class OptimizationConfig:
    """How each rollout becomes optimiser steps."""

    epochs_per_rollout: int = 1
    """Passes (mu) over each rollout."""
    minibatch_size: int | None = None
    """Sequences per optimiser step; null uses the whole rollout."""
    micro_batch_size: int | None = None
    """Sequences per forward pass (gradient accumulation); null uses the whole minibatch."""
    gradient_clip_norm: float | None = 1.0
    """Clip the gradient norm to this value; null switches clipping off."""
    max_bad_steps: int = 3
    """Stop the run after this many optimiser steps in a row with a non-finite loss or gradient."""

    def __post_init__(self) -> None:
        for name in ("epochs_per_rollout", "max_bad_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"optimization.{name} must be >= 1; got {getattr(self, name)!r}")
        for name in ("minibatch_size", "micro_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"optimization.{name} must be null or >= 1; got {value!r}")
        clip = self.gradient_clip_norm
        if clip is not None and not clip > 0:
            raise ValueError(f"optimization.gradient_clip_norm must be null or > 0; got {clip!r}")


def _default_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-6)


class TrollModule(LightningModule):
    """RL fine-tuning of a causal LM with TROLL (or clipping) from one switch.

    Args:
        model: a transformers causal LM: hub name, local directory, or ``tinymath`` (the shipped
            demo policy).
        dtype: weight dtype of the policy: float32, bfloat16, float16 or auto.
        objective: ``troll`` (trust-region projection) or ``clip`` (PPO-style clipping).
        trust_region: TROLL's settings.
        clip: clipping's settings.
        loss: settings both objectives share.
        estimator: advantage estimator: grpo, dr_grpo, rloo, reinforce_pp, or a registered name.
        group_size: completions per prompt (G).
        sampling: how the snapshot samples (temperature, top_p, top_k, max_new_tokens).
        rewards: reward functions and their weights: built-in names (tinymath, gsm8k, boxed) or
            import paths ``package.module:function``.
        on_reward_error: ``raise`` stops on a reward function that fails or returns NaN/None;
            ``drop`` leaves that completion out of the loss (its group's other samples stay).
        optimization: epochs per rollout, minibatches, accumulation, clipping.
        optimizer: any torch or bitsandbytes optimiser (``class_path`` + ``init_args``).
        lr_scheduler: an optional LR scheduler, stepped after every optimiser step.
        seed: seed of the minibatch shuffling.
        gradient_checkpointing: recompute the policy's activations in the backward pass instead
            of storing them (less memory, about a third more compute); the snapshots, which
            never run a backward pass, are unaffected.
        snapshot: how the behaviour-policy snapshot is held: a copy (in the policy's dtype,
            bfloat16 or int8) or the policy itself (``shared``).
        lora: low-rank adapters (peft) instead of full fine-tuning; null trains every weight.
            The snapshot is then a second adapter and the reference policy the base model.
    """

    def __init__(
        self,
        model: str = "tinymath",
        dtype: str = "float32",
        objective: Literal["troll", "clip"] = "troll",
        trust_region: TrustRegionConfig = TrustRegionConfig(),
        clip: ClipConfig = ClipConfig(),
        loss: LossConfig = LossConfig(),
        estimator: str = "grpo",
        group_size: int = 8,
        sampling: SamplingConfig = SamplingConfig(),
        rewards: dict[str, float] | None = None,
        on_reward_error: Literal["raise", "drop"] = "raise",
        optimization: OptimizationConfig = OptimizationConfig(),
        optimizer: OptimizerCallable = _default_optimizer,
        lr_scheduler: LRSchedulerCallable | None = None,
        seed: int = 0,
        gradient_checkpointing: bool = False,
        snapshot: SnapshotConfig = SnapshotConfig(),
        lora: LoraConfig | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])
        get_advantage_estimator(estimator)
        if isinstance(group_size, bool) or group_size < 1:
            raise ValueError(f"model.group_size must be an integer >= 1; got {group_size!r}")
        if objective not in ("troll", "clip"):
            raise ValueError(f"model.objective must be one of ['clip', 'troll']; got {objective!r}")
        self.objective_name = objective
        self.estimator = estimator
        self.group_size = group_size
        self.sampling = sampling
        self.optimization = optimization
        self.loss_config = loss
        self.scorer = RewardScorer(rewards or {"tinymath": 1.0}, on_error=on_reward_error)
        self.objective: PolicyObjective = self._build_objective(objective, trust_region, clip, loss)
        self._optimizer_factory = optimizer
        self._scheduler_factory = lr_scheduler

        self.tokenizer = load_tokenizer(model)
        self.policy = load_policy(model, dtype=dtype, load_in_4bit=bool(lora and lora.load_in_4bit))
        vocab = self.policy.get_output_embeddings().weight.shape[0]
        if vocab < len(self.tokenizer):
            raise ValueError(
                f"model: the policy {model!r} has {vocab} output tokens but its tokenizer has "
                f"{len(self.tokenizer)}; they must come from the same model (the policy may have "
                "more rows, never fewer)"
            )
        if lora is not None:
            self.policy = apply_lora(self.policy, lora)
        self.policy.train()  # from_pretrained returns eval mode; snapshots stay in eval mode
        self.lora = lora
        self.snapshot: Snapshot = build_snapshot(self.policy, snapshot, adapters=lora is not None)
        if not self.snapshot.shares_policy:
            self.old_policy = self.snapshot.model  # a child module: saved, moved, sharded
        with_ref = loss.ref_kl_coef > 0 and lora is None
        self.ref_policy = self._frozen_copy(self.policy) if with_ref else None
        if gradient_checkpointing:
            self.policy.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self.automatic_optimization = False

        self.rollout: Rollout | None = None
        self.last_stats: list[ObjectiveStats] = []
        self._shuffle = torch.Generator().manual_seed(seed)
        self._bad_steps = 0

    # -- construction ----------------------------------------------------------------------------
    def _build_objective(self, name, trust_region, clip, loss) -> PolicyObjective:
        shared = asdict(loss)
        shared["norm_length"] = loss.norm_length or self.sampling.max_new_tokens
        specific = asdict({"troll": trust_region, "clip": clip}[name])
        try:
            return build_objective(name, **specific, **shared)
        except ValueError as error:
            raise ValueError(f"model: {error}") from None

    @staticmethod
    def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
        snapshot = copy.deepcopy(model)
        snapshot.eval()
        snapshot.requires_grad_(False)
        return snapshot

    @property
    def old_policy(self) -> torch.nn.Module:
        """The snapshot's module: a separate frozen copy, or the policy itself when the snapshot
        shares it (``shared``, LoRA). Sample through :meth:`behaviour_policy`."""
        separate = self._modules.get("old_policy")
        return self.policy if separate is None else separate

    def behaviour_policy(self):
        """Context manager: the module that samples and caches old log-probs, ready for it."""
        return self.snapshot.behaviour()

    @contextmanager
    def reference_policy(self) -> Iterator[torch.nn.Module | None]:
        """Context manager: the reference policy for ref_kl_coef, or None when it is off."""
        if self.lora is not None and self.loss_config.ref_kl_coef > 0:
            with adapters_disabled(self.policy) as base:  # the base model is the initial policy
                yield base
        else:
            yield self.ref_policy

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    def sparsify_old(self, logits: Tensor, tokens: Tensor) -> SparseDistribution | None:
        """The behaviour policy's sparse distributions for TROLL; None for clipping."""
        if self.objective_name != "troll":
            return None
        projection = self.objective.projection
        return sparsify(logits, projection.max_tokens, projection.mass_delta, keep=tokens)

    def compute_advantages(self, rewards: Tensor) -> Tensor:
        return compute_advantages(self.estimator, rewards, self.group_size)

    def train(self, mode: bool = True) -> TrollModule:
        """Frozen snapshots stay in eval mode whatever the trainer sets."""
        super().train(mode)
        if not self.snapshot.shares_policy:
            self.old_policy.eval()
        if self.ref_policy is not None:
            self.ref_policy.eval()
        return self

    def configure_optimizers(self):
        optimizer = self._optimizer_factory(
            [p for p in self.policy.parameters() if p.requires_grad]
        )
        if self._scheduler_factory is None:
            return optimizer
        scheduler = self._scheduler_factory(optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    # -- training --------------------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> None:
        if self.rollout is None:
            raise RuntimeError(
                "TrollModule found no rollout: add lightning_troll.callbacks.RolloutGeneration "
                "to the trainer's callbacks (the lightning-troll command adds it)"
            )
        rollout, self.rollout = self.rollout, None
        self.last_stats = []
        opt = self.optimizers()
        for _ in range(self.optimization.epochs_per_rollout):
            for minibatch in rollout.minibatches(self.optimization.minibatch_size, self._shuffle):
                self._optimizer_step(minibatch, opt)

    def _optimizer_step(self, minibatch: Rollout, opt) -> None:
        size = AGGREGATION_SIZES[self.objective.aggregation]
        total = size(minibatch.response_mask).clamp_min(1)
        parts = minibatch.chunks(self.optimization.micro_batch_size)
        losses, step_stats = [], []
        for part in parts:
            loss, stats = self.loss_of(part)
            if not torch.isfinite(loss):
                self._skip_step(opt, "loss")
                return
            weighted = loss * (size(part.response_mask) / total)
            self.manual_backward(weighted)
            losses.append(weighted.detach())
            step_stats.append(stats)
        grad_norm = self._grad_norm()
        if not torch.isfinite(grad_norm):
            self._skip_step(opt, "gradient")
            return
        self._bad_steps = 0
        opt.step()
        opt.zero_grad(set_to_none=True)
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        self.last_stats.extend(step_stats)
        self._log_step(torch.stack(losses).sum(), step_stats, grad_norm)

    def loss_of(self, rollout: Rollout) -> tuple[Tensor, ObjectiveStats]:
        """The objective on a (part of a) rollout, with the policy's current weights."""
        logits = response_logits(
            self.policy,
            rollout.input_ids,
            rollout.attention_mask,
            rollout.response_mask.shape[1],
            rollout.temperature,
        )  # (B, T, V)
        return self.objective(
            logits,
            rollout.tokens,
            rollout.response_mask,
            rollout.advantages,
            rollout.old_logprobs,
            rollout.old,
            rollout.ref_logprobs,
        )

    def _grad_norm(self) -> Tensor:
        params = [p for p in self.policy.parameters() if p.grad is not None]
        clip = self.optimization.gradient_clip_norm
        if not params:
            return torch.tensor(0.0)
        return torch.nn.utils.clip_grad_norm_(params, clip if clip is not None else math.inf)

    def _skip_step(self, opt, what: str) -> None:
        opt.zero_grad(set_to_none=True)
        self._bad_steps += 1
        limit = self.optimization.max_bad_steps
        if self._bad_steps >= limit:
            raise RuntimeError(
                f"{self._bad_steps} optimiser steps in a row had a non-finite {what}; stopping "
                f"(optimization.max_bad_steps={limit}). The weights are those of the last good step."
            )
        warnings.warn(
            f"non-finite {what} at global step {self.global_step}: optimiser step skipped, "
            f"weights untouched ({self._bad_steps} of {limit} allowed in a row)",
            RuntimeWarning,
            stacklevel=2,
        )

    def _log_step(self, loss: Tensor, stats: list[ObjectiveStats], grad_norm: Tensor) -> None:
        def mean(name: str) -> Tensor:
            return torch.stack([getattr(s, name) for s in stats]).mean()

        self.log_dict(
            {
                "loss/total": loss,
                "loss/policy": mean("policy_loss"),
                "loss/regression": mean("regression_loss"),
                "entropy": mean("entropy"),
                "grad_norm": grad_norm,
            },
            on_step=True,
            on_epoch=False,
        )

    # -- validation ------------------------------------------------------------------------------
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """Greedy answers to held-out prompts, scored by the reward functions."""
        ids, _, response_mask, _ = sample(
            self.policy,
            batch.prompt_ids,
            1,
            self.sampling,
            self.pad_id,
            self.eos_id,
            do_sample=False,
        )
        completions = self.decode(ids[:, -response_mask.shape[1] :], response_mask)
        scored = self.scorer(batch.prompts, completions, batch.rows)
        full_marks = sum(w for w in self.scorer.weights.values() if w > 0)
        correct = (scored.total >= full_marks - 1e-6) & scored.valid
        size = len(batch.prompts)
        self.log("val/accuracy", correct.float().mean(), batch_size=size, sync_dist=True)
        self.log("val/reward", scored.total.mean(), batch_size=size, sync_dist=True)

    def decode(self, responses: Tensor, response_mask: Tensor) -> list[str]:
        """Response tokens -> text, without EOS and padding."""
        keep = response_mask & (responses != self.eos_id)
        return [
            self.tokenizer.decode(row[m].tolist(), skip_special_tokens=True)
            for row, m in zip(responses, keep, strict=True)
        ]

    # -- checkpoints -----------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["lightning_troll"] = {
            "shuffle_rng": self._shuffle.get_state(),
            "bad_steps": self._bad_steps,
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("lightning_troll")
        if state is not None:
            self._shuffle.set_state(state["shuffle_rng"])
            self._bad_steps = state["bad_steps"]
