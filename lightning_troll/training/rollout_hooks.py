"""What the rollout callback and the monitors ask of TrollModule: the rollout engine, the old
policy's sparse rows, advantages over the global batch, and how far the policy drifted from the
behaviour policy.

:class:`RolloutHooks` is a mixin of :class:`~lightning_troll.training.module.TrollModule`; the
attributes it reads (``objective``, ``_trust_region``, ``cache_old_distributions``, ``policy``,
``estimator``, ``group_size``, ``scale_rewards``, ``minibatch_loop``, ...) are set by the module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_troll.objectives.advantages import compute_advantages
from lightning_troll.rollouts.collector import RolloutCollector
from lightning_troll.rollouts.drift import kl_to_behaviour, support_rule
from lightning_troll.rollouts.engine import EngineContext, RolloutEngine, build_engine
from lightning_troll.rollouts.rollout import Rollout
from lightning_troll.trust_region.projection import (
    SparseDistribution,
    TrustRegionProjection,
    sparsify,
)

__all__ = ["RolloutHooks"]


class RolloutHooks:
    """The rollout-facing hooks of :class:`~lightning_troll.training.module.TrollModule`."""

    def _build_engine(
        self, name: str, options: dict[str, Any] | None, model: str, dtype: str
    ) -> RolloutEngine:
        """The engine of ``model.rollout_engine`` (it starts on its first rollout)."""
        lora = self.lora is not None
        if name != "hf" and lora and self.lora.load_in_4bit:
            raise ValueError(
                f"model.rollout_engine={name!r} takes the policy's weights with the adapters "
                "merged, which a 4-bit base rounds away; use rollout_engine 'hf' with "
                "lora.load_in_4bit, or a base in float32/bfloat16"
            )
        engine = build_engine(name, EngineContext(model, dtype, self.tokenizer, lora), options)
        if self.loss_config.engine_is_cap is not None and engine.records_behaviour:
            raise ValueError(
                f"model.loss.engine_is_cap={self.loss_config.engine_is_cap} corrects for an "
                f"engine that samples apart from the snapshot, but the {engine.name!r} engine "
                "samples with the snapshot itself; set it to null, or use rollout_engine 'vllm'"
            )
        return engine

    def check_engine_processes(self) -> None:
        """Refuses an engine that runs in one process for a run of several."""
        world = self.trainer.world_size if self._trainer is not None else 1
        if world > 1 and not self.engine.several_processes:
            raise ValueError(
                f"model.rollout_engine={self.engine.name!r} runs in a single process; this run "
                f"has {world} (trainer.devices x trainer.num_nodes): use rollout_engine 'hf' for "
                "DDP and FSDP2, or one device"
            )

    def on_fit_start(self) -> None:
        self.engine.stale = True  # the snapshot may hold other weights now (a resumed run)

    def teardown(self, stage: str) -> None:
        """Stops the reward worker processes and the rollout engine after a fit (a later fit
        starts them again)."""
        if stage == "fit":
            self.scorer.close()
            self.engine.close()

    @property
    def collector(self) -> RolloutCollector:
        """The rollout pipeline (:class:`~lightning_troll.rollouts.collector.RolloutCollector`)
        over this module's parts: its engine, scorer, policies and options."""
        return RolloutCollector(
            policy=self.policy,
            behaviour=self.behaviour_policy,
            engine=self.engine,
            scorer=self.scorer,
            decode=self.decode,
            advantages=self.compute_advantages,
            sampling=self.sampling,
            group_size=self.group_size,
            pad_id=self.pad_id,
            stop_ids=self.stop_ids,
            reference=self.reference_policy,
            sparsify_old=self.sparsify_old,
            loss=self.loss_config,
            behaviour_logprobs=self.behaviour_logprobs,
            logits_chunk_size=self.logits_chunk_size,
            share_prompts=self.share_prompts,
            max_rounds=self.dynamic_sampling_max_rounds,
            any_process=self.on_any_process,
        )

    def on_any_process(self, flag: bool) -> bool:
        """True if ``flag`` holds on any process (every process must call this alike)."""
        trainer = self._trainer
        if trainer is None or trainer.world_size == 1:
            return flag
        value = torch.tensor(float(flag), device=self.device)
        return bool(trainer.strategy.reduce(value, reduce_op="sum") > 0)

    @property
    def support_rule(self) -> TrustRegionProjection:
        """The sparse rows' rule (see :func:`lightning_troll.rollouts.drift.support_rule`)."""
        return support_rule(self.objective, self._trust_region)

    def sparsify_old(self, logits: Tensor, tokens: Tensor) -> SparseDistribution | None:
        """The behaviour policy's sparse distributions (``model.trust_region``'s rule) for TROLL,
        or when ``cache_old_distributions`` is on; None otherwise."""
        if not self.cache_old_distributions:
            return None
        rule = self.support_rule
        keep = tokens if rule.keep_token else None
        return sparsify(logits, rule.max_tokens, rule.mass_delta, keep=keep)

    def kl_to_behaviour(self, rollout: Rollout) -> tuple[Tensor, Tensor]:
        """Per response token of ``rollout``, how far the policy's current weights are from the
        behaviour policy that sampled it (see :func:`lightning_troll.rollouts.drift.kl_to_behaviour`)."""
        return kl_to_behaviour(
            self.policy, rollout, self.support_rule, self.logits_chunk_size, self.share_prompts
        )

    @property
    def last_minibatch(self) -> Rollout | None:
        """The minibatch of the last rollout's last optimiser step (None before one is taken)."""
        return self.minibatch_loop.last_minibatch

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
