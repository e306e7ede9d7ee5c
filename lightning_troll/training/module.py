"""TrollModule: the LightningModule that holds the policy, its frozen snapshot and the objective.

The module wires; it does not compute: the loss comes from :mod:`lightning_troll.objectives`,
rollouts from the :class:`~lightning_troll.callbacks.RolloutGeneration` callback, which puts a
:class:`~lightning_troll.rollouts.rollout.Rollout` on ``module.rollout`` before every training step.
Optimisation is manual: per rollout, ``epochs_per_rollout`` passes over shuffled minibatches,
each minibatch one optimiser step, accumulated over micro-batches; the loop that does this is
:class:`~lightning_troll.training.optimization.MinibatchLoop`. The checkpoint hooks (what a resumed run
needs beyond the weights) are :class:`~lightning_troll.training.resume.ResumeHooks`. The option records
live beside the code they configure (``TrustRegionConfig``, ``ClipConfig`` and ``LossConfig`` in
:mod:`~lightning_troll.objectives`, ``OptimizationConfig`` in
:mod:`~lightning_troll.training.optimization`) and are importable from here too.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from lightning_troll.models.loading import load_policy, load_tokenizer, stop_token_ids
from lightning_troll.models.lora import LoraConfig, apply_lora
from lightning_troll.models.sharding import (  # the two checks: importable from here too
    check_shardable,  # noqa: F401
    check_strategy,  # noqa: F401
)
from lightning_troll.models.snapshots import Snapshot, SnapshotConfig, build_snapshot, frozen_copy
from lightning_troll.objectives import (
    ClipConfig,
    LossConfig,
    ObjectiveStats,
    PolicyObjective,
    TrustRegionConfig,
    build_objective,
)
from lightning_troll.objectives.chunking import DEFAULT_CHUNK_SIZE, check_chunk_size
from lightning_troll.rewards.registry import RewardScorer
from lightning_troll.rollouts.dynamic_sampling import check_dynamic_sampling
from lightning_troll.rollouts.rollout import (
    Rollout,
    SamplingConfig,
)
from lightning_troll.rollouts.timing import clock
from lightning_troll.training.optimization import MinibatchLoop, OptimizationConfig
from lightning_troll.training.policies import PolicyHooks
from lightning_troll.training.preflight import (
    check_fit_data,
    check_module_options,
)
from lightning_troll.training.resume import ResumeHooks
from lightning_troll.training.rollout_hooks import RolloutHooks
from lightning_troll.training.validation import stopping_between_validations, validation_metrics

__all__ = ["ClipConfig", "LossConfig", "OptimizationConfig", "TrollModule", "TrustRegionConfig"]


DEFAULT_OPTIMIZER = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-6}}
"""``model.optimizer`` when none is given: AdamW at 1e-6 (the command line's default too, so that
``--model.optimizer.init_args.lr`` and ``--model.optimizer.lr`` work without naming a class)."""


def _default_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, **DEFAULT_OPTIMIZER["init_args"])


RewardErrorPolicy = Literal["raise", "drop"] | float | dict[str, Literal["raise", "drop"] | float]
"""``model.on_reward_error``: one policy, or reward names to policies."""


def _reward_scorer(rewards, on_error, kwargs, workers, timeout) -> RewardScorer:
    """The scorer of ``model.rewards``; an error names the option (``model.reward_kwargs``)."""
    try:
        return RewardScorer(rewards, on_error, kwargs, workers=workers, timeout=timeout)
    except ValueError as error:
        options = ("reward_kwargs", "on_reward_error", "reward_timeout", "reward_workers")
        prefix = "model." if str(error).startswith(options) else ""
        raise ValueError(f"{prefix}{error}") from None


class TrollModule(ResumeHooks, RolloutHooks, PolicyHooks, LightningModule):
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
            last_number, math_verify, overlong), ``reward_model:<model>``, or import paths
            ``module:function`` (``module.py`` in the working directory or beside the config);
            null only for the built-in TinyMath data, whose reward it is (other data is refused).
        reward_kwargs: keyword arguments bound to reward functions by name, e.g.
            ``{overlong: {buffer: 256}}`` (the last 256 tokens of the budget carry the penalty).
        on_reward_error: a failed reward call (raised, timed out, NaN, None, ...): ``raise``
            stops; ``drop`` leaves the completion out of the loss; a number is its score. One
            policy, or reward names to policies (the rest raise).
        reward_workers: processes scoring a rollout's rewards in parallel; 0: in-process.
        reward_timeout: seconds per reward call in a worker, then abandoned; null: no limit.
        dynamic_sampling: DAPO's dynamic sampling: prompt groups whose rewards have no spread
            (no gradient under group-relative advantages) leave the rollout, and more prompts
            (drawn from the training prompts) are sampled until it holds ``data.batch_size``
            informative groups.
        dynamic_sampling_max_rounds: the most extra rounds of sampling per rollout, >= 1; after
            them the rollout is filled up with groups without spread (warned once).
        optimization: epochs per rollout, minibatches, accumulation, clipping.
        optimizer: any torch or bitsandbytes optimiser (``class_path`` + ``init_args``).
        lr_scheduler: an optional LR scheduler, stepped after every optimiser step.
        seed: seed of the minibatch shuffling; null follows the run's seed (seed_everything).
        gradient_checkpointing: recompute the policy's activations in the backward pass instead
            of storing them (less memory, about a third more compute); the snapshots, which
            never run a backward pass, are unaffected.
        logits_chunk_size: response tokens whose logits exist at once: the loss and the cached
            old distributions are computed from the hidden states this many tokens at a time
            (the loss's chunks recomputed in the backward pass), so no (tokens x vocabulary)
            float32 logits are held; null computes all logits at once. Models with soft-capped
            or scaled logits always use full logits.
        behaviour_logprobs: where the behaviour policy's token log-probs (and TROLL's sparse old
            distributions) come from: ``sampling`` keeps them from the logits generation computes
            anyway, one step at a time (no second pass over the rollout); ``forward`` recomputes
            them with a teacher-forced pass of the snapshot after sampling; ``auto`` (default):
            ``sampling`` when the policy's weights are float32 (the two agree to 6e-5 there),
            ``forward`` in bfloat16/float16 (they differ by up to 0.6 in log-prob there; see the
            benchmarks page, docs/benchmarks.md).
        share_prompts: run each distinct prompt of a micro-batch through the model once (a
            group's completions share theirs) and its completions against its cached keys and
            values, in the training passes and the passes after sampling; the same results up to
            float rounding, with less compute and activation memory the longer prompts are
            against completions. Off (or with gradient checkpointing, or under FSDP2 sharding)
            every sequence runs whole.
        snapshot: how the behaviour-policy snapshot is held: a copy (in the policy's dtype,
            bfloat16 or int8) or the policy itself (``shared``).
        lora: low-rank adapters (peft) instead of full fine-tuning; null trains every weight.
            The snapshot is then a second adapter and the reference policy the base model.
        rollout_engine: what samples the rollouts: ``hf`` (the snapshot, in this process),
            ``vllm`` (after ``make setup-vllm``), or a ``RolloutEngine`` subclass's import path.
        rollout_engine_options: the engine's own options (docs/engines.md).
        cache_old_distributions: cache the behaviour policy's sparse distributions in every
            rollout with clipping too (TROLL always does), for what reads them (the trust-region
            monitor's ``kl_end``); the command line sets it from ``trust_region_monitor.kl_end``.
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
        on_reward_error: RewardErrorPolicy = "raise",
        reward_workers: int = 0,
        reward_timeout: float | None = None,
        dynamic_sampling: bool = False,
        dynamic_sampling_max_rounds: int = 3,
        optimization: OptimizationConfig = OptimizationConfig(),
        optimizer: OptimizerCallable = _default_optimizer,
        lr_scheduler: LRSchedulerCallable | None = None,
        seed: int | None = None,
        gradient_checkpointing: bool = False,
        logits_chunk_size: int | None = DEFAULT_CHUNK_SIZE,
        behaviour_logprobs: Literal["auto", "sampling", "forward"] = "auto",
        share_prompts: bool = True,
        snapshot: SnapshotConfig = SnapshotConfig(),
        lora: LoraConfig | None = None,
        rollout_engine: str = "hf",
        rollout_engine_options: dict[str, Any] | None = None,
        cache_old_distributions: bool = False,
    ) -> None:
        super().__init__()
        # not seed: loggers refuse model.seed and data.seed as one key with two values; the
        # shuffle generator's state is in checkpoints (MinibatchLoop)
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler", "seed"])
        check_chunk_size(logits_chunk_size, "model.logits_chunk_size")
        self.logits_chunk_size = logits_chunk_size
        check_module_options(
            objective, estimator, scale_rewards, group_size, behaviour_logprobs, rollout_engine
        )
        self.behaviour_logprobs = behaviour_logprobs
        self.share_prompts = share_prompts
        self.objective_name = objective
        self.estimator = estimator
        self.scale_rewards = scale_rewards
        self.group_size = group_size
        self.sampling = sampling
        self.optimization = optimization
        self.loss_config = loss
        self.scorer = _reward_scorer(
            {"tinymath": 1.0} if rewards is None else rewards,  # TinyMath's: see setup
            on_reward_error, reward_kwargs, reward_workers, reward_timeout
        )  # fmt: skip
        check_dynamic_sampling(dynamic_sampling, dynamic_sampling_max_rounds, group_size)
        self.dynamic_sampling = dynamic_sampling
        self.dynamic_sampling_max_rounds = dynamic_sampling_max_rounds
        self.objective: PolicyObjective = self._build_objective(objective, trust_region, clip, loss)
        self._trust_region = trust_region
        self.cache_old_distributions = objective == "troll" or bool(cache_old_distributions)
        """Cache the behaviour policy's sparse distributions in every rollout: always for TROLL;
        for clipping when asked to (``cache_old_distributions``)."""
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
        self.snapshot: Snapshot = build_snapshot(
            self.policy, snapshot, lora is not None, self.objective.needs_old_logits
        )
        if not self.snapshot.shares_policy:
            self.old_policy = self.snapshot.model  # a child module: saved, moved, sharded
        with_ref = loss.ref_kl_coef > 0 and lora is None
        self.ref_policy = frozen_copy(self.policy) if with_ref else None
        if gradient_checkpointing:
            self.policy.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self.automatic_optimization = False
        self.engine = self._build_engine(rollout_engine, rollout_engine_options, model, dtype)

        self.rollout: Rollout | None = None
        if seed is None:  # the run's seed, as Lightning's seed_everything recorded it
            seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        self.minibatch_loop = MinibatchLoop(optimization, seed)
        """Turns each rollout into optimiser steps; holds the shuffle generator and bad steps."""
        self._rng_to_restore: dict[str, Any] | None = None

    # -- construction ----------------------------------------------------------------------------
    def _build_objective(self, name, trust_region, clip, loss) -> PolicyObjective:
        shared = asdict(loss)
        rollout_options = ("mask_truncated", "engine_is_cap", "engine_is_level", "engine_is_mode",
                           "engine_is_floor", "anchor", "anchor_is_cap")  # fmt: skip
        for option in rollout_options:  # the rollout applies them
            shared.pop(option)
        shared["norm_length"] = loss.norm_length or self.sampling.max_new_tokens
        specific = asdict({"troll": trust_region, "clip": clip}[name])
        try:
            return build_objective(name, **specific, **shared)
        except ValueError as error:
            raise ValueError(f"model: {error}") from None

    def setup(self, stage: str) -> None:
        """Before fitting, the checks the command makes before the model loads, for a module and
        a DataModule built apart in Python (see ``check_fit_data``)."""
        if stage == "fit" and self._trainer is not None and self.trainer.datamodule is not None:
            minibatch = self.optimization.minibatch_size
            rewards = self.hparams.get("rewards")
            check_fit_data(rewards, minibatch, self.group_size, self.trainer.datamodule)
        if stage == "fit":
            self.check_engine_processes()

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
        """The optimiser steps of one rollout (see :mod:`lightning_troll.training.optimization`)."""
        if self.rollout is None:
            raise RuntimeError(
                "TrollModule found no rollout: add lightning_troll.callbacks.RolloutGeneration "
                "to the trainer's callbacks (the lightning-troll command adds it)"
            )
        rollout, self.rollout = self.rollout, None
        start = clock(self.device)
        self.minibatch_loop.run(self, rollout)
        seconds = clock(self.device) - start  # every optimiser step of the rollout
        self.log("time/training", seconds, prog_bar=True, sync_dist=True, batch_size=1)

    @property
    def last_stats(self) -> list[ObjectiveStats]:
        """The detached statistics of every optimiser step of the last rollout (for monitors)."""
        return self.minibatch_loop.last_stats

    # -- validation ------------------------------------------------------------------------------
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """Greedy answers to held-out prompts, scored by the reward functions, and with
        ``data.val_samples: k`` k sampled ones (see :mod:`lightning_troll.training.validation`).
        Nothing is validated on the way out of a fit stopped between two scheduled validations
        (:func:`~lightning_troll.training.validation.stopping_between_validations`)."""
        if stopping_between_validations(self.trainer):
            return
        size = len(batch.prompts)
        for name, value in validation_metrics(self, batch, batch_idx).items():
            self.log(name, value, batch_size=size, sync_dist=True)
