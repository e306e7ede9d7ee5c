"""RolloutGeneration: samples, scores and caches a rollout before every training step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_troll.callbacks.samples import (
    RolloutReport,
    Samples,
    log_rollout,
    log_samples,
    samples_table,
)
from lightning_troll.engines.process import EngineDied
from lightning_troll.rollouts.multiturn import behaviour_logprobs_warning
from lightning_troll.rollouts.timing import clock
from lightning_troll.tasks.data.prompts import PromptBatch, draw_prompts
from lightning_troll.tasks.environments.protocol import EnvironmentFailure
from lightning_troll.tasks.rewards.calls import RewardError
from lightning_troll.training.faults import EngineFault, EpisodeFault, RewardFault
from lightning_troll.training.memory_check import check_fits
from lightning_troll.training.rollout_parts import engine_warnings

__all__ = ["RolloutGeneration", "RolloutReport", "Samples", "samples_table"]


class RolloutGeneration(Callback):
    """Collects a rollout before every training step and logs what it sampled.

    The module's collector (:class:`~lightning_troll.rollouts.collector.RolloutCollector`, the
    pipeline: sampling, rewards, dynamic sampling, advantages, behaviour and reference log-probs,
    the engine's mismatch correction) makes the rollout; this callback triggers it at the start of
    each training step, draws dynamic sampling's extra prompts from the training prompts, hands
    the rollout to the module (``model.rollout``), and logs the figures of
    :func:`~lightning_troll.callbacks.samples.log_rollout`, a table of samples and
    ``time/iteration`` (the rollout and its optimiser steps, validation not counted). At the
    start of a fit it warns once where ``model.engine.behaviour_logprobs: sampling`` cannot apply
    (``model.episodes``).

    Args:
        log_samples: completions shown per rollout in the samples table (every logger); 0
            switches it off.
        log_samples_every_n_rollouts: how often the samples table is written.
    """

    def __init__(self, log_samples: int = 4, log_samples_every_n_rollouts: int = 10) -> None:
        if log_samples < 0:
            raise ValueError(f"rollout.log_samples must be an integer >= 0; got {log_samples}")
        if log_samples_every_n_rollouts < 1:
            raise ValueError(
                "rollout.log_samples_every_n_rollouts must be an integer >= 1; got "
                f"{log_samples_every_n_rollouts}"
            )
        self.log_samples = log_samples
        self.log_samples_every_n_rollouts = log_samples_every_n_rollouts
        self.rollouts = 0
        self.mean_rewards: list[float] = []
        """Mean reward of every rollout so far (this process's completions)."""
        self._warned_cap = False
        self._started: float | None = None

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Before any sampling, a run whose memory cannot fit stops in one line, and one that
        may not is warned about (:mod:`~lightning_troll.training.memory_check`)."""
        data = trainer.datamodule
        if hasattr(pl_module, "sampling") and isinstance(getattr(data, "batch_size", None), int):
            check_fits(pl_module, data.batch_size, getattr(data, "max_prompt_tokens", 0) or 0)

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        engine = getattr(pl_module, "engine_config", None)
        behaviour = getattr(engine, "behaviour_logprobs", "auto")
        if getattr(pl_module, "episodes", None) is not None:
            message = behaviour_logprobs_warning(behaviour)
            if message is not None:
                rank_zero_warn(message)
        elif engine is not None:
            sampling = getattr(pl_module, "sampling", None)
            decode = getattr(sampling, "decode", "auto")
            every = getattr(sampling, "check_every", 1)
            compiled = getattr(sampling, "compile_step", False)
            for message in engine_warnings(
                engine.name, engine.options, decode, behaviour, every, compiled
            ):
                rank_zero_warn(message)
        if not getattr(getattr(pl_module, "dynamic_sampling", None), "enabled", False):
            return
        data = trainer.datamodule
        if not (hasattr(data, "train_items") and hasattr(data, "seed")):
            raise ValueError(
                "model.dynamic_sampling.enabled=true draws its extra prompts from the training prompts "
                "of a lightning_troll.tasks.data.datamodule.PromptDataModule; fit with one (the lightning-troll "
                f"command does), not {type(data).__name__}"
            )

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._started = clock(pl_module.device)
        dynamic = pl_module.dynamic_sampling.enabled
        more = self._extra_prompts(trainer, len(batch)) if dynamic else None
        try:
            rollout, report = pl_module.collector.collect(batch, more)
        except RewardError as error:  # before any step of this rollout: the run's state is whole
            raise RewardFault(str(error)) from error
        except EnvironmentFailure as error:  # as above: the episodes ran, nothing trained
            raise EpisodeFault(str(error)) from error
        except EngineDied as error:  # as above: sampling stopped, nothing trained
            raise EngineFault(str(error)) from error
        pl_module.rollout = rollout
        self._sample_ahead(trainer, pl_module)
        self.rollouts += 1
        self.mean_rewards.append(float(report.rewards.mean()))
        log_rollout(pl_module, report)
        if report.capped and not self._warned_cap:
            self._warned_cap = True
            rank_zero_warn(
                f"dynamic sampling: after model.dynamic_sampling.max_rounds="
                f"{pl_module.dynamic_sampling.max_rounds} extra rounds rollout {self.rollouts} "
                "had fewer informative prompt groups than data.batch_size; it trains on them "
                "and groups without reward spread (zero advantage). Raise the cap or "
                "model.group_size to sample more (warned once)"
            )
        if self.log_samples and (self.rollouts - 1) % self.log_samples_every_n_rollouts == 0:
            log_samples(trainer, report, self.log_samples)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._started is not None:
            pl_module.log("time/iteration", clock(pl_module.device) - self._started)
            self._started = None

    def _sample_ahead(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """With a stale sampler and an engine in its own process, asks for the next rollout now,
        while this one trains (``model.staleness``,
        :meth:`~lightning_troll.training.staleness.StalenessSchedule.sample_ahead`). Nothing is
        asked ahead of a rollout that dynamic sampling or episodes make; at an epoch's end the
        next rollout is the next epoch's first (:meth:`~lightning_troll.tasks.data.prompts.ResumableLoader.peek`)."""
        schedule, engine = getattr(pl_module, "staleness", None), pl_module.engine
        if schedule is None or not schedule.max_staleness or not hasattr(engine, "submit"):
            return
        schedule.ahead_seed = None
        loader = getattr(trainer.datamodule, "train_loader", None)
        upcoming = loader.peek() if loader is not None else None
        if upcoming is None or pl_module.dynamic_sampling.enabled or pl_module.episodes is not None:
            return
        try:
            schedule.sample_ahead(
                upcoming, pl_module.collector, pl_module.policy, pl_module.snapshot, engine
            )
        except EngineDied as error:  # as in sampling: this rollout has not trained
            raise EngineFault(str(error)) from error

    def _extra_prompts(self, trainer: Trainer, count: int) -> Callable[[int], PromptBatch]:
        """Extra round r of this rollout: ``count`` training prompts drawn by a generator seeded
        with (data.seed, rank, rollout, r), so a resumed run draws what the first one drew."""
        data, rank, rollout = trainer.datamodule, trainer.global_rank, self.rollouts
        if data.train_items is None:
            data.setup("fit")
        return lambda r: draw_prompts(
            data.train_items, count, data.seed, f"dynamic-{rank}-{rollout}-{r}"
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"rollouts": self.rollouts, "mean_rewards": list(self.mean_rewards)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rollouts = state_dict["rollouts"]
        self.mean_rewards = list(state_dict.get("mean_rewards", []))
