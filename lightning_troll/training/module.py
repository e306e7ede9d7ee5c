"""TrollModule: the LightningModule that holds the policy, its frozen snapshot and the objective.

The module wires; it does not compute: the loss comes from :mod:`lightning_troll.objectives`,
rollouts from the :class:`~lightning_troll.callbacks.RolloutGeneration` callback, which puts a
:class:`~lightning_troll.rollouts.rollout.Rollout` on ``module.rollout`` before every training step.
Optimisation is manual: per rollout, ``epochs_per_rollout`` passes over shuffled minibatches,
each minibatch one optimiser step, accumulated over micro-batches; the loop that does this is
:class:`~lightning_troll.training.optimization.MinibatchLoop`. The module owns its parts and calls them
from Lightning's hooks: the policies (:class:`~lightning_troll.training.policies.Policies`), the rollout
pipeline over them (``collector``), the old policy's sparse rows and the global batch
(:mod:`~lightning_troll.training.rollout_parts`), and what a checkpoint keeps beyond the weights
(:class:`~lightning_troll.training.resume.ResumeState`). The option records
live beside the code they configure (``TrustRegionConfig``, ``ClipConfig``, ``LossConfig``,
``CorrectionsConfig`` and ``AdvantageConfig`` in :mod:`~lightning_troll.objectives`,
``OptimizationConfig`` in :mod:`~lightning_troll.training.optimization`, ``DynamicSamplingConfig`` in
:mod:`~lightning_troll.rollouts.dynamic_sampling`, ``EngineConfig`` in
:mod:`~lightning_troll.engines.base`) and are importable from here too; every one travels whole to
its user.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from lightning_troll.engines.base import EngineConfig, EngineContext
from lightning_troll.engines.sampling import SamplingConfig
from lightning_troll.models.lora import LoraConfig
from lightning_troll.models.sharding import (  # the two checks: importable from here too
    check_shardable,  # noqa: F401
    check_strategy,
    data_parallel_mesh,
)
from lightning_troll.models.snapshots import SnapshotConfig
from lightning_troll.models.weights import ties_an_adapted_embedding as tied_adapter
from lightning_troll.objectives import (
    ClipConfig,
    CorrectionsConfig,
    LossConfig,
    ObjectiveStats,
    PolicyObjective,
    TrustRegionConfig,
    objective_from_records,
)
from lightning_troll.objectives.options import AdvantageConfig
from lightning_troll.rollouts.collector import RolloutCollector
from lightning_troll.rollouts.drift import kl_to_behaviour
from lightning_troll.rollouts.dynamic_sampling import DynamicSamplingConfig, check_dynamic_sampling
from lightning_troll.rollouts.multiturn import (
    EpisodeSampler,
    environment_factory,
    episode_tokenizer_check,
)
from lightning_troll.rollouts.rollout import Rollout
from lightning_troll.rollouts.timing import clock
from lightning_troll.tasks.environments.options import EpisodesConfig
from lightning_troll.tasks.rewards.options import (  # RewardErrorPolicy: importable from here too
    RewardErrorPolicy,
    RewardOptions,
)
from lightning_troll.tasks.rewards.registry import RewardScorer
from lightning_troll.training.optimization import (
    MinibatchLoop,
    OptimizationConfig,
    StepParts,
    optimizers,
)
from lightning_troll.training.policies import Policies, policy_loss
from lightning_troll.training.preflight import check_fit_data, check_module_options
from lightning_troll.training.resume import ResumeState
from lightning_troll.training.rollout_parts import (
    GlobalBatch,
    OldRows,
    build_rollout_engine,
    check_engine,
    check_engine_processes,
    world_size,
)
from lightning_troll.training.staleness import StalenessSchedule
from lightning_troll.training.validation import (
    ValidationFigures,
    stopping_between_validations,
    validation_metrics,
)

__all__ = [
    "AdvantageConfig",
    "ClipConfig",
    "CorrectionsConfig",
    "DynamicSamplingConfig",
    "EngineConfig",
    "LossConfig",
    "OptimizationConfig",
    "RewardErrorPolicy",
    "RewardOptions",
    "TrollModule",
    "TrustRegionConfig",
]


DEFAULT_OPTIMIZER = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-6}}
"""``model.optimizer`` when none is given: AdamW at 1e-6 (the command line's default too, so that
``--model.optimizer.init_args.lr`` and ``--model.optimizer.lr`` work without naming a class)."""


def _default_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, **DEFAULT_OPTIMIZER["init_args"])


def _reward_scorer(rewards, options: RewardOptions, episodes) -> RewardScorer:
    """The scorer of ``model.rewards`` (None: TinyMath's, see ``setup``; empty: none, with
    episodes only) called as ``model.reward_options`` says; an error names the option
    (``model.reward_options.kwargs``)."""
    rewards = {"tinymath": 1.0} if rewards is None else rewards
    try:
        return RewardScorer.from_options(rewards, options, none_ok=episodes is not None)
    except ValueError as error:
        prefix = "model." if str(error).startswith(("reward_options.", "rewards ")) else ""
        raise ValueError(f"{prefix}{error}") from None


class TrollModule(LightningModule):
    """RL fine-tuning of a causal LM with TROLL (or clipping) from one switch.

    Args:
        model: a causal LM: hub name, local directory, or ``tinymath`` (the shipped demo).
        dtype: weight dtype of the policy: float32, bfloat16, float16 or auto.
        objective: ``troll`` (trust-region projection) or ``clip`` (PPO-style clipping).
        trust_region: TROLL's settings.
        clip: clipping's settings.
        loss: settings both objectives share.
        corrections: what the rollout corrects before either objective sees it: truncated
            completions masked, weights for an engine that samples apart from the trainer, the
            policy the update is drawn around when the sampler is stale.
        advantages: the advantage estimator and the reward scale.
        group_size: completions per prompt (G).
        sampling: how the snapshot samples (temperature, top_p, top_k, max_new_tokens).
        rewards: reward functions and weights: built-in names (tinymath, gsm8k, boxed,
            last_number, math_verify, overlong), ``reward_model:<model>`` or ``module:function``
            (``module.py`` in the working directory or beside the config); null only on TinyMath's
            data (its reward); ``{}`` only with ``episodes`` (the environment scores alone).
        reward_options: how the rewards are called: keyword arguments, failed calls, workers.
        dynamic_sampling: DAPO's: groups without reward spread leave the rollout, and more
            prompts are sampled until it holds ``data.batch_size`` informative groups.
        optimization: epochs per rollout, minibatches, micro-batches, clipping, the shuffle's
            seed, and what the forward passes hold at once (chunks, shared prompts, gradient
            checkpointing).
        optimizer: any torch or bitsandbytes optimiser (``class_path`` + ``init_args``).
        lr_scheduler: an optional LR scheduler, stepped after every optimiser step.
        snapshot: how the behaviour-policy snapshot is held: a copy (in the policy's dtype,
            bfloat16 or int8) or the policy itself (``shared``).
        lora: low-rank adapters (peft) instead of full fine-tuning; null trains every weight.
            The snapshot is then a second adapter and the reference policy the base model.
        engine: what samples the rollouts (``hf``, ``vllm`` or a ``RolloutEngine`` subclass),
            its options, and where the behaviour log-probs come from.
        episodes: multi-turn episodes with tools or an environment (docs/own-task.md); null:
            one completion per sample.
    """

    def __init__(
        self,
        model: str = "tinymath",
        dtype: str = "float32",
        objective: Literal["troll", "clip"] = "troll",
        trust_region: TrustRegionConfig = TrustRegionConfig(),
        clip: ClipConfig = ClipConfig(),
        loss: LossConfig = LossConfig(),
        corrections: CorrectionsConfig = CorrectionsConfig(),
        advantages: AdvantageConfig = AdvantageConfig(),
        group_size: int = 8,
        sampling: SamplingConfig = SamplingConfig(),
        rewards: dict[str, float] | None = None,
        reward_options: RewardOptions = RewardOptions(),
        dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig(),
        optimization: OptimizationConfig = OptimizationConfig(),
        optimizer: OptimizerCallable = _default_optimizer,
        lr_scheduler: LRSchedulerCallable | None = None,
        snapshot: SnapshotConfig = SnapshotConfig(),
        lora: LoraConfig | None = None,
        engine: EngineConfig = EngineConfig(),
        episodes: EpisodesConfig | None = None,
    ) -> None:
        super().__init__()
        if isinstance(dynamic_sampling, bool):  # 0.1's switch, as load_from_checkpoint reads it
            dynamic_sampling = DynamicSamplingConfig(enabled=dynamic_sampling)
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])
        check_module_options(objective, advantages, group_size, engine)
        check_dynamic_sampling(dynamic_sampling, group_size)
        check_engine(engine.name, engine.options, lora, corrections)
        self.objective_name, self.group_size, self.sampling = objective, group_size, sampling
        self.corrections, self.engine_config = corrections, engine
        self.optimization = optimization  # the minibatch loop's; callbacks read it too
        self.dynamic_sampling = dynamic_sampling
        self.scorer = _reward_scorer(rewards, reward_options, episodes)
        make = environment_factory(episodes) if episodes else None  # refused before the model
        self.objective: PolicyObjective = objective_from_records(
            objective, trust_region, clip, loss, corrections, sampling.max_new_tokens
        )
        self.old_rows = OldRows(self.objective, trust_region)
        self.cache_old_distributions = objective == "troll"  # clipping: keep_old_distributions
        self._optimizer_factory, self._scheduler_factory = optimizer, lr_scheduler

        self.policies = Policies(
            model, dtype, lora, snapshot, self.objective.needs_old_logits,
            loss.ref_kl_coef > 0, optimization.gradient_checkpointing,
            check_tokenizer=episode_tokenizer_check(make),
        )  # fmt: skip
        self.policy, self.ref_policy = self.policies.policy, self.policies.ref_policy
        if not self.policies.snapshot.shares_policy:  # a child module: saved, moved, sharded
            self.old_policy = self.policies.old_policy  # nn.Module registers it
        self.tokenizer = self.policies.tokenizer  # the policy's (its stop ids: policies)
        self.snapshot = self.policies.snapshot
        self.automatic_optimization = False
        context = EngineContext(model, dtype, self.tokenizer, lora, tied_adapter(self.policy))
        self.engine = build_rollout_engine(engine.name, engine.options, context)
        self.global_batch = GlobalBatch(
            advantages.estimator, group_size, advantages.scale_rewards
        )  # fmt: skip
        self.episodes = None if episodes is None else EpisodeSampler(
            episodes, self.tokenizer, self.policies.stop_ids, sampling.max_new_tokens, make
        )  # fmt: skip

        self.rollout: Rollout | None = None  # the next training step's, from the callback
        self.staleness = StalenessSchedule()  # OldPolicyRefresh's, once it is set up
        self.minibatch_loop = MinibatchLoop(optimization)  # seed None: the run's
        self.resume = ResumeState(self.minibatch_loop)
        self.val_figures = ValidationFigures()

    @property
    def old_policy(self) -> torch.nn.Module:
        """The snapshot's module: a frozen copy, or the policy itself (``shared``, LoRA)."""
        return self.policies.old_policy

    # -- set-up and parts --------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        """Before fitting, the checks the command makes before the model loads, for a module and
        a DataModule built apart in Python (see ``check_fit_data``)."""
        if stage == "fit" and self._trainer is not None and self.trainer.datamodule is not None:
            options = self.hparams.get("rewards"), self.optimization.minibatch_size, self.group_size
            check_fit_data(*options, self.trainer.datamodule, self.hparams.get("episodes"))
        self.global_batch.strategy = self.trainer.strategy if self._trainer is not None else None
        if stage == "fit":
            check_engine_processes(self.engine, world_size(self))

    def configure_model(self) -> None:
        """Shards the policies with FSDP2 under ``ModelParallelStrategy`` (others wrap them)."""
        if self._trainer is not None:  # load_from_checkpoint calls this without a trainer
            check_strategy(self.trainer.strategy)
        if self._device_mesh is not None:
            self.policies.shard(data_parallel_mesh(self._device_mesh))

    def train(self, mode: bool = True):
        super().train(mode)
        self.policies.keep_frozen_in_eval()
        return self

    def keep_old_distributions(self) -> None:
        """Caches the behaviour policy's sparse distributions in every rollout, with clipping too
        (TROLL always does): what a reader of them asks for before the first rollout (the
        trust-region monitor's ``kl_end`` and ``kl_start``)."""
        if not self.cache_old_distributions:
            self.cache_old_distributions = True
            self.__dict__.pop("collector", None)  # built again, caching them

    @cached_property
    def collector(self) -> RolloutCollector:
        """The rollout pipeline over this module's parts (built once, on first use)."""
        policies, cached, passes = self.policies, self.cache_old_distributions, self.optimization
        return RolloutCollector(
            policy=self.policy, behaviour=policies.behaviour, engine=self.engine,
            scorer=self.scorer, decode=policies.decode, advantages=self.global_batch.advantages,
            sampling=self.sampling, group_size=self.group_size, pad_id=policies.pad_id,
            stop_ids=policies.stop_ids, reference=policies.reference, corrections=self.corrections,
            sparsify_old=self.old_rows.sparsify if cached else RolloutCollector.sparsify_old,
            behaviour_logprobs=self.engine_config.behaviour_logprobs,
            share_prompts=passes.share_prompts, logits_chunk_size=passes.logits_chunk_size,
            packed=passes.pack_sequences, max_tokens=passes.micro_batch_tokens,
            max_rounds=self.dynamic_sampling.max_rounds, any_process=self.global_batch.any_process,
            episodes=self.episodes,
        )  # fmt: skip

    def on_fit_start(self) -> None:
        self.engine.stale = True  # the snapshot may hold other weights now (a resumed run)
        self.policies.expect_frozen_in_eval(self)

    def teardown(self, stage: str) -> None:
        """Stops the reward workers and the rollout engine (a later fit starts them again)."""
        for part in (self.scorer, self.engine, self.episodes) if stage == "fit" else ():
            if part is not None:
                part.close()

    def configure_optimizers(self):
        return optimizers(self.policy, self._optimizer_factory, self._scheduler_factory)

    # -- training --------------------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> None:
        """The optimiser steps of one rollout (see :mod:`lightning_troll.training.optimization`)."""
        if self.rollout is None:
            raise RuntimeError(
                "TrollModule found no rollout: add lightning_troll.callbacks.RolloutGeneration "
                "to the trainer's callbacks (the lightning-troll command adds it)"
            )
        rollout, self.rollout = self.rollout, None
        start = clock(self.device)  # every optimiser step of the rollout, from policy_loss
        self.minibatch_loop.run(self.step_parts(), rollout)
        seconds = clock(self.device) - start
        self.log("time/training", seconds, prog_bar=True, sync_dist=True, batch_size=1)

    def step_parts(self) -> StepParts:
        """What the minibatch loop takes for a rollout's steps."""
        return StepParts(
            self.trainer, self.policy, self.objective.aggregation, self.optimizers(),
            self.lr_schedulers(), self.loss_of, self.manual_backward, self.log_dict,
        )  # fmt: skip

    def loss_of(self, rollout: Rollout) -> tuple[torch.Tensor, ObjectiveStats]:
        """The objective on a (part of a) rollout, with the policy's current weights."""
        o = self.optimization
        passes = o.logits_chunk_size, o.share_prompts, o.pack_sequences
        return policy_loss(self.policies, self.objective, rollout, *passes)

    @property
    def last_stats(self) -> list[ObjectiveStats]:
        """The detached statistics of every optimiser step of the last rollout (for monitors)."""
        return self.minibatch_loop.last_stats

    def kl_to_behaviour(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """Per response token, how far the policy's current weights are from the behaviour
        policy that sampled ``rollout`` (:func:`~lightning_troll.rollouts.drift.kl_to_behaviour`)."""
        o = self.optimization
        options = o.logits_chunk_size, o.share_prompts, *o.parts
        return kl_to_behaviour(self.policy, rollout, self.old_rows.rule, *options)

    # -- checkpoints -----------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.resume.save(checkpoint, self.global_rank, world_size(self))

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        rank, size = self.global_rank, world_size(self)
        self.resume.load(checkpoint, self.state_dict, self.hparams, rank, size)

    def on_train_start(self) -> None:
        self.resume.start(self.global_rank, world_size(self))

    # -- validation ------------------------------------------------------------------------------
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """Greedy answers to held-out prompts (and ``data.val_samples: k`` sampled ones), scored;
        none on the way out of a fit stopped between two scheduled validations (both in
        :mod:`lightning_troll.training.validation`)."""
        if not stopping_between_validations(self.trainer):
            self.val_figures.add(validation_metrics(self, batch, batch_idx))

    def on_validation_epoch_end(self) -> None:
        for name, value in self.val_figures.means(self.trainer.strategy, self.device).items():
            self.log(name, value, sync_dist=True)  # exact means over processes, the same on each
