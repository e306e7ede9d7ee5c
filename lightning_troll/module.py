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
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.strategies import FSDPStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_troll.advantages import (
    REWARD_SCALES,
    compute_advantages,
    get_advantage_estimator,
)
from lightning_troll.checkpoints import (
    changed_options,
    check_compatible,
    restore_rng_states,
    rng_states,
    seed_per_rank,
)
from lightning_troll.chunking import (
    DEFAULT_CHUNK_SIZE,
    check_chunk_size,
    head_logits,
    map_row_chunks,
)
from lightning_troll.dynamic_sampling import check_dynamic_sampling
from lightning_troll.lora import LoraConfig, adapters_disabled, apply_lora
from lightning_troll.models import load_policy, load_tokenizer, stop_token_ids
from lightning_troll.objectives import (
    AGGREGATION_SIZES,
    ObjectiveStats,
    PolicyObjective,
    build_objective,
)
from lightning_troll.projection import SparseDistribution, TrustRegionProjection, sparsify
from lightning_troll.rewards import RewardScorer
from lightning_troll.rollout import (
    Rollout,
    SamplingConfig,
    linear_head,
    response_hidden,
    response_logits,
)
from lightning_troll.sharding import is_sharded, shard_model
from lightning_troll.snapshots import Snapshot, SnapshotConfig, build_snapshot
from lightning_troll.validation import validation_metrics

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
    keep_sampled_token: bool = True
    """Always add the sampled token to the sparse supports (old and projected); false keeps only
    the most probable tokens, and a sampled token outside them shares the rest bucket's mass."""


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
    mask_truncated: bool = False
    """Leave completions that hit sampling.max_new_tokens without EOS out of the loss (TRL's
    mask_truncated_completions, DAPO's overlong filtering); their rewards still count in their
    group's baseline."""


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


# The configs are saved with the hyperparameters; checkpoints are loaded with weights_only=True,
# which accepts only allow-listed classes.
torch.serialization.add_safe_globals(
    [
        TrustRegionConfig,
        ClipConfig,
        LossConfig,
        OptimizationConfig,
        SamplingConfig,
        SnapshotConfig,
        LoraConfig,
    ]
)


def _default_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-6)


def check_strategy(strategy: Strategy) -> None:
    """Refuses Lightning's FSDPStrategy (FSDP1), whose root wrapper gathers the weights outside
    the decoder layers only inside the module's own forward: rollouts sample outside it."""
    if isinstance(strategy, FSDPStrategy):
        raise ValueError(
            "trainer.strategy: FSDPStrategy (FSDP1) is not supported; shard with FSDP2 instead: "
            "lightning.pytorch.strategies.ModelParallelStrategy with tensor_parallel_size: 1 and "
            "data_parallel_size: <processes> (see configs/fsdp2.yaml), or use ddp"
        )


def check_shardable(snapshot: SnapshotConfig, lora: LoraConfig | None) -> None:
    """Refuses the memory options that FSDP2 sharding does not support (yet)."""
    if lora is not None:
        raise ValueError(
            "model.lora is not supported with FSDP2 sharding (ModelParallelStrategy): adapters "
            "are small, so train them with the ddp strategy, or set model.lora: null"
        )
    if snapshot.dtype == "int8":
        raise ValueError(
            "model.snapshot.dtype='int8' is not supported with FSDP2 sharding "
            "(ModelParallelStrategy); use 'bfloat16' or 'same', or snapshot.mode: shared"
        )


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
        scale_rewards: what the estimator's baseline-subtracted rewards are divided by (TRL's
            names): ``group`` (the group's reward std + 1e-6), ``batch`` (the std of all rewards of
            the rollout + 1e-6) or ``none`` (Dr.GRPO's choice); null keeps the estimator's own
            (grpo: group, dr_grpo and rloo: none, reinforce_pp: its batch std).
        group_size: completions per prompt (G).
        sampling: how the snapshot samples (temperature, top_p, top_k, max_new_tokens).
        rewards: reward functions and their weights: built-in names (tinymath, gsm8k, boxed,
            overlong) or import paths ``package.module:function``.
        reward_kwargs: keyword arguments bound to reward functions by name, e.g.
            ``{overlong: {buffer: 256}}`` (the last 256 tokens of the budget carry the penalty).
        on_reward_error: ``raise`` stops on a reward function that fails or returns NaN/None;
            ``drop`` leaves that completion out of the loss (its group's other samples stay).
        dynamic_sampling: DAPO's dynamic sampling: prompt groups whose rewards have no spread
            (no gradient under group-relative advantages) leave the rollout, and more prompts
            (drawn from the training prompts) are sampled until it holds ``data.batch_size``
            informative groups.
        dynamic_sampling_max_rounds: the most extra rounds of sampling per rollout, >= 1; after
            them the rollout is filled up with groups without spread (warned once).
        optimization: epochs per rollout, minibatches, accumulation, clipping.
        optimizer: any torch or bitsandbytes optimiser (``class_path`` + ``init_args``).
        lr_scheduler: an optional LR scheduler, stepped after every optimiser step.
        seed: seed of the minibatch shuffling.
        gradient_checkpointing: recompute the policy's activations in the backward pass instead
            of storing them (less memory, about a third more compute); the snapshots, which
            never run a backward pass, are unaffected.
        logits_chunk_size: response tokens whose logits exist at once: the loss and the cached
            old distributions are computed from the hidden states this many tokens at a time
            (the loss's chunks recomputed in the backward pass), so no (tokens x vocabulary)
            float32 logits are held; null computes all logits at once. Models with soft-capped
            or scaled logits always use full logits.
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
        scale_rewards: Literal["group", "batch", "none"] | None = None,
        group_size: int = 8,
        sampling: SamplingConfig = SamplingConfig(),
        rewards: dict[str, float] | None = None,
        reward_kwargs: dict[str, dict[str, Any]] | None = None,
        on_reward_error: Literal["raise", "drop"] = "raise",
        dynamic_sampling: bool = False,
        dynamic_sampling_max_rounds: int = 3,
        optimization: OptimizationConfig = OptimizationConfig(),
        optimizer: OptimizerCallable = _default_optimizer,
        lr_scheduler: LRSchedulerCallable | None = None,
        seed: int = 0,
        gradient_checkpointing: bool = False,
        logits_chunk_size: int | None = DEFAULT_CHUNK_SIZE,
        snapshot: SnapshotConfig = SnapshotConfig(),
        lora: LoraConfig | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])
        check_chunk_size(logits_chunk_size, "model.logits_chunk_size")
        self.logits_chunk_size = logits_chunk_size
        get_advantage_estimator(estimator)
        if scale_rewards not in (None, *REWARD_SCALES):
            raise ValueError(
                f"model.scale_rewards must be one of {sorted(REWARD_SCALES)} or null; got "
                f"{scale_rewards!r}"
            )
        if isinstance(group_size, bool) or group_size < 1:
            raise ValueError(f"model.group_size must be an integer >= 1; got {group_size!r}")
        if objective not in ("troll", "clip"):
            raise ValueError(f"model.objective must be one of ['clip', 'troll']; got {objective!r}")
        self.objective_name = objective
        self.estimator = estimator
        self.scale_rewards = scale_rewards
        self.group_size = group_size
        self.sampling = sampling
        self.optimization = optimization
        self.loss_config = loss
        try:
            self.scorer = RewardScorer(
                rewards or {"tinymath": 1.0}, on_error=on_reward_error, kwargs=reward_kwargs
            )
        except ValueError as error:
            prefix = "model." if str(error).startswith("reward_kwargs") else ""
            raise ValueError(f"{prefix}{error}") from None
        check_dynamic_sampling(dynamic_sampling, dynamic_sampling_max_rounds, group_size)
        self.dynamic_sampling = dynamic_sampling
        self.dynamic_sampling_max_rounds = dynamic_sampling_max_rounds
        self.objective: PolicyObjective = self._build_objective(objective, trust_region, clip, loss)
        self._trust_region = trust_region
        self.cache_old_distributions = objective == "troll"
        """Cache the behaviour policy's sparse distributions in every rollout: always for TROLL;
        for clipping only when something needs them (the trust-region monitor's ``kl_end``)."""
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
        self.stop_ids = stop_token_ids(self.tokenizer, self.policy)
        """Token ids that end a completion (the tokenizer's eos first; see ``stop_token_ids``)."""
        if lora is not None:
            self.policy = apply_lora(self.policy, lora)
        self.policy.train()  # from_pretrained returns eval mode; snapshots stay in eval mode
        self.lora = lora
        self.snapshot_config = snapshot
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
        self.last_minibatch: Rollout | None = None
        """The minibatch of the last rollout's last optimiser step (None before one is taken)."""
        self._shuffle = torch.Generator().manual_seed(seed)
        self._bad_steps = 0
        self._rng_to_restore: dict[str, Any] | None = None

    # -- construction ----------------------------------------------------------------------------
    def _build_objective(self, name, trust_region, clip, loss) -> PolicyObjective:
        shared = asdict(loss)
        shared.pop("mask_truncated")  # the rollout applies it, not the objective
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

    @property
    def support_rule(self) -> TrustRegionProjection:
        """The sparse rows' rule, ``model.trust_region``'s: TROLL's projection, or for clipping
        one built from the same settings (it caches and measures the rows when
        ``cache_old_distributions`` is on)."""
        if self.objective_name == "troll":
            return self.objective.projection
        region = self._trust_region
        try:
            return TrustRegionProjection(
                region.eps, region.max_tokens, region.mass_delta, region.keep_sampled_token
            )
        except ValueError as error:
            raise ValueError(f"model.trust_region: {error}") from None

    def sparsify_old(self, logits: Tensor, tokens: Tensor) -> SparseDistribution | None:
        """The behaviour policy's sparse distributions (``model.trust_region``'s rule) for TROLL,
        or when ``cache_old_distributions`` is on; None otherwise."""
        if not self.cache_old_distributions:
            return None
        rule = self.support_rule
        keep = tokens if rule.keep_token else None
        return sparsify(logits, rule.max_tokens, rule.mass_delta, keep=keep)

    @torch.no_grad()
    def kl_to_behaviour(self, rollout: Rollout) -> tuple[Tensor, Tensor]:
        """Per response token of ``rollout``, how far the policy's current weights are from the
        behaviour policy that sampled it: two ``(N,)`` tensors.

        The first is KL(pi || pi_old) between the lumped sparse distributions (support U plus
        the rest bucket, ``model.trust_region``'s rule: what TROLL's ``kl_before`` measures);
        the second the sampled estimate ``r log r - r + 1`` with ``r = pi(o_t) / pi_old(o_t)``,
        whose mean is an unbiased estimate of the mean KL(pi || pi_old) over the whole
        vocabulary (the tokens come from pi_old; with ``sampling.top_p`` or ``top_k``
        truncating it, from a truncation of it instead). Needs ``rollout.old``.
        """
        if rollout.old is None:
            raise ValueError(
                "kl_to_behaviour needs the rollout's sparse old distributions: set "
                "cache_old_distributions (clipping runs do not cache them otherwise)"
            )
        mask = rollout.response_mask
        tokens = rollout.tokens[mask]  # (N,)
        inputs = (self.policy, rollout.input_ids, rollout.attention_mask, mask.shape[1])
        head = None if self.logits_chunk_size is None else linear_head(self.policy)
        rule = self.support_rule
        if head is None:
            rows = response_logits(*inputs, rollout.temperature)[mask]  # (N, V)
            fn = partial(_kl_rows, rule=rule)
        else:
            rows = response_hidden(*inputs)[mask]  # (N, H)
            fn = partial(_kl_hidden, rule=rule, head=head, temperature=rollout.temperature)
        parts = map_row_chunks(fn, rows, self.logits_chunk_size, tokens, rollout.old)
        lumped, new_logp = (torch.cat(values) for values in zip(*parts, strict=True))
        log_ratio = new_logp - rollout.old_logprobs[mask].to(new_logp.dtype)
        ratio = log_ratio.exp()
        return lumped, ratio * log_ratio - ratio + 1

    def compute_advantages(self, rewards: Tensor) -> Tensor:
        """Advantages of this process's rewards, computed over the global batch.

        With several processes the (few) rewards of all of them are gathered first, so an
        estimator that uses batch statistics (``reinforce_pp``'s std, ``scale_rewards: batch``,
        or a user's own) sees the same batch as a single-process run would; groups never
        straddle processes.
        """
        world = self.trainer.world_size if self._trainer is not None else 1
        if world == 1:
            return compute_advantages(self.estimator, rewards, self.group_size, self.scale_rewards)
        everyone = self.all_gather(rewards)  # (world, B)
        advantages = compute_advantages(
            self.estimator, everyone.flatten(), self.group_size, self.scale_rewards
        )
        return advantages.view_as(everyone)[self.global_rank]

    def train(self, mode: bool = True) -> TrollModule:
        """Frozen snapshots stay in eval mode whatever the trainer sets."""
        super().train(mode)
        if not self.snapshot.shares_policy:
            self.old_policy.eval()
        if self.ref_policy is not None:
            self.ref_policy.eval()
        return self

    def configure_model(self) -> None:
        """Shards the policy and its snapshots with FSDP2 under ``ModelParallelStrategy``.

        Each decoder layer, then the root, is sharded over the data-parallel mesh; the call is
        idempotent. Other strategies (single device, DDP, FSDPStrategy) wrap the module
        themselves and need nothing here.
        """
        if self._trainer is not None:  # load_from_checkpoint calls this without a trainer
            check_strategy(self.trainer.strategy)
        mesh = self._device_mesh
        if mesh is None:
            return
        names = mesh.mesh_dim_names or ()
        if "tensor_parallel" in names and mesh["tensor_parallel"].size() > 1:
            raise ValueError(
                "trainer.strategy: ModelParallelStrategy with tensor_parallel_size="
                f"{mesh['tensor_parallel'].size()} is not supported; lightning-troll shards with "
                "FSDP2 only: set tensor_parallel_size: 1 and data_parallel_size: <processes>"
            )
        check_shardable(self.snapshot_config, self.lora)
        data_parallel = mesh["data_parallel"] if "data_parallel" in names else mesh
        for model in (self.policy, self.old_policy, self.ref_policy):
            if model is not None:
                shard_model(model, data_parallel)

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
        self.last_minibatch = None
        opt = self.optimizers()
        for _ in range(self.optimization.epochs_per_rollout):
            for minibatch in rollout.minibatches(self.optimization.minibatch_size, self._shuffle):
                self._optimizer_step(minibatch, opt)

    def _optimizer_step(self, minibatch: Rollout, opt) -> None:
        size = AGGREGATION_SIZES[self.objective.aggregation]
        # Each process weighs its part by the global total, times the world size because
        # DDP and FSDP average gradients: the step equals a single-process step on the union.
        world = self.trainer.world_size
        total = self._sum_over_processes(size(minibatch.response_mask).float()).clamp_min(1)
        parts = minibatch.chunks(self.optimization.micro_batch_size)
        losses, step_stats = [], []
        for i, part in enumerate(parts):
            loss, stats = self.loss_of(part)
            weighted = loss * (size(part.response_mask) * world / total)
            with self._gradient_sync(i == len(parts) - 1):
                self.manual_backward(weighted)
            losses.append(weighted.detach())
            step_stats.append(stats)
        loss = torch.stack(losses).sum()
        grad_norm = self._grad_norm()
        # One decision for all processes: a step is skipped everywhere or nowhere.
        bad_loss = self._sum_over_processes((~torch.isfinite(loss)).float()) > 0
        if bad_loss or not torch.isfinite(grad_norm):
            self._skip_step(opt, "loss" if bad_loss else "gradient")
            return
        self._bad_steps = 0
        opt.step()
        opt.zero_grad(set_to_none=True)
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        self.last_stats.extend(step_stats)
        self.last_minibatch = minibatch
        self._log_step(loss, step_stats, grad_norm)

    def _sum_over_processes(self, value: Tensor) -> Tensor:
        if self.trainer.world_size == 1:
            return value
        return self.trainer.strategy.reduce(value.clone(), reduce_op="sum")

    @contextmanager
    def _gradient_sync(self, sync: bool) -> Iterator[None]:
        """Gradients are reduced across processes only at the last micro-batch of a step."""
        if sync or self.trainer.world_size == 1:
            yield
        elif is_sharded(self.policy):
            self.policy.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.policy.set_requires_gradient_sync(True)
        else:
            block = getattr(self.trainer.strategy, "block_backward_sync", nullcontext)
            with block():
                yield

    def loss_of(self, rollout: Rollout) -> tuple[Tensor, ObjectiveStats]:
        """The objective on a (part of a) rollout, with the policy's current weights."""
        inputs = (rollout.input_ids, rollout.attention_mask)
        length, temperature = rollout.response_mask.shape[1], rollout.temperature
        targets = (
            rollout.tokens,
            rollout.response_mask,
            rollout.advantages,
            rollout.old_logprobs,
            rollout.old,
            rollout.ref_logprobs,
        )
        head = None if self.logits_chunk_size is None else linear_head(self.policy)
        if head is None:
            logits = response_logits(self.policy, *inputs, length, temperature)  # (B, T, V)
            return self.objective(logits, *targets)
        hidden = response_hidden(self.policy, *inputs, length)  # (B, T, H)
        return self.objective.forward_hidden(
            hidden, head, temperature, *targets, chunk_size=self.logits_chunk_size
        )

    def _grad_norm(self) -> Tensor:
        params = [p for p in self.policy.parameters() if p.grad is not None]
        clip = self.optimization.gradient_clip_norm
        if not params:
            return torch.tensor(0.0)
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip is not None else math.inf)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

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
            sync_dist=True,  # the mean over processes of their weighted parts is the global loss
        )

    # -- validation ------------------------------------------------------------------------------
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """Greedy answers to held-out prompts, scored by the reward functions, and with
        ``data.val_samples: k`` k sampled ones (see :mod:`lightning_troll.validation`)."""
        size = len(batch.prompts)
        for name, value in validation_metrics(self, batch, batch_idx).items():
            self.log(name, value, batch_size=size, sync_dist=True)

    def decode(self, responses: Tensor, response_mask: Tensor) -> list[str]:
        """Response tokens -> text, without EOS and padding."""
        stops = torch.as_tensor(self.stop_ids, device=responses.device)
        keep = response_mask & ~torch.isin(responses, stops)
        return [
            self.tokenizer.decode(row[m].tolist(), skip_special_tokens=True)
            for row, m in zip(responses, keep, strict=True)
        ]

    # -- checkpoints -----------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Adds the shuffle generator, the bad-step count and every rank's global RNG states.

        Only one process writes the checkpoint (or its metadata, when sharded), so the states
        of all of them are gathered first; every process runs this hook.
        """
        states = rng_states()
        if self._trainer is not None and self.trainer.world_size > 1:
            everyone: list[Any] = [None] * self.trainer.world_size
            torch.distributed.all_gather_object(everyone, states)
            by_rank = dict(enumerate(everyone))
        else:
            by_rank = {self.global_rank: states}
        checkpoint["lightning_troll"] = {
            "shuffle_rng": self._shuffle.get_state(),
            "bad_steps": self._bad_steps,
            "rng": by_rank,
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Checks the checkpoint fits this model, then restores what ``on_save_checkpoint`` added.

        The global RNG states are set in ``on_train_start``, after Lightning has built the
        dataloaders, so a resumed run draws the numbers the interrupted one would have drawn.
        """
        if "state_dict" in checkpoint:  # sharded strategies load the weights elsewhere
            check_compatible(
                self.state_dict(), checkpoint["state_dict"], f"model {self.hparams.model!r}"
            )
        self._warn_changed_options(checkpoint.get("hyper_parameters", {}))
        state = checkpoint.get("lightning_troll", {})
        if "shuffle_rng" in state:
            self._shuffle.set_state(state["shuffle_rng"])
            self._bad_steps = state["bad_steps"]
        saved = state.get("rng", {})
        self._rng_to_restore = saved.get(self.global_rank)
        ranks = self.trainer.world_size if self._trainer is not None else 1
        missing = [rank for rank in range(ranks) if rank not in saved]
        if missing:
            rank_zero_warn(
                f"the checkpoint holds no random state for global ranks {missing} (it was written "
                "by fewer processes): they sample other completions than the interrupted run "
                "would have"
            )

    def on_train_start(self) -> None:
        """Restores the global RNG states of a checkpoint being resumed; in a new run of several
        processes, gives each its own random streams (:func:`seed_per_rank`)."""
        if self._rng_to_restore is not None:
            restore_rng_states(self._rng_to_restore)
            self._rng_to_restore = None
        elif self.trainer.world_size > 1:
            seed_per_rank(self.global_rank)

    def _warn_changed_options(self, saved: dict[str, Any]) -> None:
        changed = changed_options(self.hparams, saved)
        if changed:
            rank_zero_warn(
                "resuming with other options than the checkpoint was written with (weights, "
                "snapshot and optimiser carry over; the new options apply from here on): "
                + "; ".join(changed)
            )


def _kl_rows(rows: Tensor, tokens: Tensor, old: SparseDistribution, *, rule):
    """(n, V) logit rows -> lumped KL to the old rows (n,) and the tokens' log-probs (n,)."""
    logp = rows.float().log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return rule.kl_to_old(rows, old, tokens), logp


def _kl_hidden(hidden: Tensor, tokens: Tensor, old: SparseDistribution, *, rule, head, temperature):
    return _kl_rows(head_logits(head, hidden, temperature), tokens, old, rule=rule)
