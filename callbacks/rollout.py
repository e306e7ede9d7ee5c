"""RolloutGeneration: samples, scores and caches a rollout before every training step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_troll.callbacks.figures import each_logger, write_table
from lightning_troll.callbacks.samples import RolloutReport, Samples, log_rollout, samples_table
from lightning_troll.data.prompts import PromptBatch, draw_prompts
from lightning_troll.models.sharding import gathered, is_sharded
from lightning_troll.rewards.calls import RewardError
from lightning_troll.rewards.registry import RewardOutput
from lightning_troll.rollouts.behaviour import BehaviourRecorder, records_while_sampling
from lightning_troll.rollouts.dynamic_sampling import choose_groups
from lightning_troll.rollouts.rollout import Rollout, behaviour_outputs
from lightning_troll.rollouts.timing import clock
from lightning_troll.training.faults import RewardFault

__all__ = ["RolloutGeneration", "RolloutReport", "Samples", "samples_table"]


class RolloutGeneration(Callback):
    """Turns each batch of prompts into a :class:`~lightning_troll.rollouts.rollout.Rollout`.

    Before every training step: the rollout engine (``model.rollout_engine``; by default the frozen
    snapshot itself, the behaviour policy) samples ``model.group_size`` completions per prompt
    with ``model.sampling`` (left padding, KV cache, stop at EOS); ``model.rewards`` score them; ``model.estimator`` turns rewards into advantages;
    the snapshot's token log-probs (and, for TROLL, its sparse distributions) are computed at the
    sampling temperature and cached. The result goes on ``model.rollout``. With
    ``model.dynamic_sampling`` groups without reward spread leave the rollout and more prompts,
    drawn from the training prompts, are sampled (at most ``model.dynamic_sampling_max_rounds``
    extra rounds); with ``model.loss.mask_truncated`` truncated completions leave the loss.

    Logs, over every completion sampled: ``reward/{mean,std}``, ``reward/frac_zero_std``,
    ``reward/<name>/mean`` per reward function when there are several,
    ``completion/{mean,max}_length`` and ``completion/truncated_frac``; with dynamic sampling
    ``dynamic_sampling/prompts_sampled``, ``dynamic_sampling/rounds`` (extra rounds) and
    ``dynamic_sampling/frac_dropped`` (sampled groups left out); failed reward calls
    ``rewards/timeouts`` and ``rewards/errors`` (and per function, when there are several); and a
    few completions as a table in every logger (prompt, completion, rewards, advantage).
    Where the rollout's time goes, in seconds: ``time/generation`` (sampling, every round, in the
    progress bar), ``time/forward_passes`` (teacher-forced passes after sampling: the behaviour
    policy's when ``model.behaviour_logprobs`` recomputes it, the reference policy's with
    ``model.loss.ref_kl_coef`` > 0), ``time/rollout`` (all of it, rewards included), and
    ``throughput/generated_tokens_per_s`` (response tokens up to EOS per second of generation).
    An engine other than ``hf`` adds its own figures (``engine/startup_s``,
    ``engine/weight_push_s``) and ``rollout/engine_logprob_diff``, the mean absolute difference
    between its log-probs of the sampled tokens and the snapshot's; with
    ``model.loss.engine_is_cap`` each token's advantage is weighted by the truncated ratio of the
    two (``rollout/engine_is_weight_mean``, ``rollout/engine_is_capped_frac``).
    The optimiser steps' time is the module's ``time/training``; ``time/iteration`` is the whole
    of it, rollout and optimiser steps, until this callback's ``on_train_batch_end`` (validation
    is not counted).

    Args:
        log_samples: completions shown per rollout in the samples table (every logger); 0
            switches it off.
        log_samples_every_n_rollouts: how often the samples table is written.
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
        self._warned_cap = False
        self._started: float | None = None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        engine = getattr(pl_module, "engine", None)
        if stage == "fit" and trainer.world_size > 1 and engine and not engine.several_processes:
            raise ValueError(
                f"model.rollout_engine={engine.name!r} runs in a single process; this run has "
                f"{trainer.world_size} (trainer.devices x trainer.num_nodes): use rollout_engine "
                "'hf' for DDP and FSDP2, or one device"
            )
        if stage != "fit" or not getattr(pl_module, "dynamic_sampling", False):
            return
        data = trainer.datamodule
        if not (hasattr(data, "train_items") and hasattr(data, "seed")):
            raise ValueError(
                "model.dynamic_sampling=true draws its extra prompts from the training prompts "
                "of a lightning_troll.data.datamodule.PromptDataModule; fit with one (the lightning-troll "
                f"command does), not {type(data).__name__}"
            )

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._started = clock(pl_module.device)
        more = self._extra_prompts(trainer, len(batch)) if pl_module.dynamic_sampling else None
        try:
            rollout, report = self.collect(pl_module, batch, more)
        except RewardError as error:  # before any step of this rollout: the run's state is whole
            raise RewardFault(str(error)) from error
        pl_module.rollout = rollout
        self.rollouts += 1
        self.mean_rewards.append(float(report.rewards.mean()))
        log_rollout(pl_module, report)
        if report.capped and not self._warned_cap:
            self._warned_cap = True
            rank_zero_warn(
                f"dynamic sampling: after model.dynamic_sampling_max_rounds="
                f"{pl_module.dynamic_sampling_max_rounds} extra rounds rollout {self.rollouts} "
                "had fewer informative prompt groups than data.batch_size; it trains on them "
                "and groups without reward spread (zero advantage). Raise the cap or "
                "model.group_size to sample more (warned once)"
            )
        if self.log_samples and (self.rollouts - 1) % self.log_samples_every_n_rollouts == 0:
            self._log_text(trainer, report.kept, report.advantages)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        engine = getattr(pl_module, "engine", None)
        if engine is not None:  # the snapshot may hold other weights now (a resumed run)
            engine.stale = True

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Stops the reward worker processes and the rollout engine (a later fit starts them
        again)."""
        if stage != "fit":
            return
        for part in (getattr(pl_module, "scorer", None), getattr(pl_module, "engine", None)):
            if hasattr(part, "close"):
                part.close()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._started is not None:
            pl_module.log("time/iteration", clock(pl_module.device) - self._started)
            self._started = None

    def _extra_prompts(self, trainer: Trainer, count: int) -> Callable[[int], PromptBatch]:
        """Extra round r of this rollout: ``count`` training prompts drawn by a generator seeded
        with (data.seed, rank, rollout, r), so a resumed run draws what the first one drew."""
        data, rank, rollout = trainer.datamodule, trainer.global_rank, self.rollouts
        if data.train_items is None:
            data.setup("fit")
        return lambda r: draw_prompts(
            data.train_items, count, data.seed, f"dynamic-{rank}-{rollout}-{r}"
        )

    @staticmethod
    @torch.no_grad()
    def collect(
        module: LightningModule,
        batch: Any,
        more_prompts: Callable[[int], PromptBatch] | None = None,
    ) -> tuple[Rollout, RolloutReport]:
        """Samples, scores and caches one rollout from a batch of prompts.

        With ``more_prompts`` (dynamic sampling) extra rounds ``more_prompts(1)``, ... are
        sampled while some process has fewer informative groups than ``len(batch)``, at most
        ``module.dynamic_sampling_max_rounds`` of them; the rollout keeps ``len(batch)`` groups.
        """
        start = clock(module.device)
        rounds = [_sample(module, batch)]
        kept, capped = rounds[0], False
        if more_prompts is not None:
            target = len(batch)
            for r in range(1, module.dynamic_sampling_max_rounds + 1):
                have = sum(int(s.informative.sum()) for s in rounds)
                if not _on_any_process(module, have < target):
                    break
                rounds.append(_sample(module, more_prompts(r)))
            groups, informative = choose_groups([s.informative for s in rounds], target)
            capped = _on_any_process(module, informative < target)
            parts = [s.select(g) for s, g in zip(rounds, groups, strict=True) if g.numel()]
            kept = Samples.cat(parts, module.pad_id)
        response_mask = kept.response_mask & kept.scored.valid.unsqueeze(-1)  # dropped rewards
        if module.loss_config.mask_truncated:
            response_mask = response_mask & ~kept.truncated.unsqueeze(-1)
        advantages = module.compute_advantages(kept.rewards)
        temperature = module.sampling.temperature
        inputs = (kept.input_ids, kept.attention_mask, response_mask, temperature)
        chunks = module.logits_chunk_size
        passes = clock(module.device)
        if kept.behaviour is not None:  # recorded while sampling: no second pass
            old_logprobs, old = kept.behaviour.outputs(response_mask)
        else:
            with module.behaviour_policy() as snapshot:
                share = module.share_prompts and not is_sharded(snapshot)
                old_logprobs, old = behaviour_outputs(
                    snapshot, *inputs, module.sparsify_old, chunks, share
                )
        ref_logprobs = None
        with module.reference_policy() as reference:
            if reference is not None:
                share = module.share_prompts and not is_sharded(reference)
                ref_logprobs = behaviour_outputs(reference, *inputs, None, chunks, share)[0]
        end = clock(module.device)
        engine = dict(module.engine.figures())
        token_advantages = advantages
        if kept.engine_logprobs is not None:  # the sampler's log-probs against the trainer's
            tokens = response_mask.sum().clamp_min(1)
            gap = (kept.engine_logprobs - old_logprobs).abs() * response_mask
            engine["rollout/engine_logprob_diff"] = float(gap.sum() / tokens)
            cap = module.loss_config.engine_is_cap
            if cap is not None:  # truncated importance weights, per token: (B, T)
                weights = (old_logprobs - kept.engine_logprobs).exp().clamp(max=cap)
                weights = weights * response_mask
                token_advantages = advantages.unsqueeze(-1) * weights
                engine["rollout/engine_is_weight_mean"] = float(weights.sum() / tokens)
                at_cap = ((weights >= cap) & response_mask).sum() / tokens
                engine["rollout/engine_is_capped_frac"] = float(at_cap)
        rollout = Rollout(
            input_ids=kept.input_ids,
            attention_mask=kept.attention_mask,
            response_mask=response_mask,
            old_logprobs=old_logprobs,
            old=old,
            rewards=kept.rewards,
            advantages=token_advantages,
            truncated=kept.truncated,
            temperature=temperature,
            group_size=module.group_size,
            ref_logprobs=ref_logprobs,
        )
        seconds = {
            "generation": sum(s.seconds for s in rounds),
            "forward_passes": end - passes,
            "rollout": end - start,
        }
        report = RolloutReport(rounds, kept, capped, advantages, engine, seconds)
        return rollout, report

    @rank_zero_only
    def _log_text(self, trainer: Trainer, samples: Samples, advantages: Tensor) -> None:
        """The first ``log_samples`` completions as a table in every logger: prompt, completion,
        reward, each function's reward when there are several, advantage."""
        shown = min(self.log_samples, len(samples.completions))
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
        each_logger(trainer, write_table, "samples", columns, list(values), trainer.global_step)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"rollouts": self.rollouts, "mean_rewards": list(self.mean_rewards)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rollouts = state_dict["rollouts"]
        self.mean_rewards = list(state_dict.get("mean_rewards", []))


def _sample(module: LightningModule, batch: Any) -> Samples:
    """One round: G completions per prompt of ``batch`` from the rollout engine (the snapshot's
    weights), decoded and scored."""
    group, engine = module.group_size, module.engine
    recorder = None
    if engine.records_behaviour and records_while_sampling(
        module.behaviour_logprobs, module.policy
    ):
        recorder = BehaviourRecorder(module.sampling.temperature, module.sparsify_old)
    start = clock(module.device)
    with module.behaviour_policy() as snapshot, gathered(snapshot):
        # sharded weights are gathered once for the whole generation, not once per token
        if engine.stale:  # the first rollout, or the snapshot was refreshed since the last one
            engine.load_weights(snapshot)
        generation = engine.generate(
            snapshot,
            batch.prompt_ids,
            group,
            module.sampling,
            module.pad_id,
            module.stop_ids,
            recorder=recorder,
        )
    input_ids, attention_mask = generation.input_ids, generation.attention_mask
    response_mask, truncated = generation.response_mask, generation.truncated
    length = response_mask.shape[1]
    behaviour = None if recorder is None else recorder.finish(input_ids[:, -length:])
    seconds = clock(module.device) - start
    device = input_ids.device
    completions = module.decode(input_ids[:, -length:], response_mask)
    prompts = [p for p in batch.prompts for _ in range(group)]
    rows = [r for r in batch.rows for _ in range(group)]
    tokens = response_mask.sum(-1).tolist()  # (B,) generated tokens, EOS included
    scored = module.scorer(
        prompts, completions, rows, tokens, module.sampling.max_new_tokens, device=device
    )
    scored = RewardOutput(
        total=scored.total.to(device),
        per_function={k: v.to(device) for k, v in scored.per_function.items()},
        valid=scored.valid.to(device),
        timeouts=scored.timeouts,
        errors=scored.errors,
    )
    rewards = scored.total.to(torch.float32)  # (B,)
    if not bool(scored.valid.all()):
        # Dropped completions leave the loss; in their group they take the mean reward of the
        # others, so they shift no one's advantage.
        grouped, ok = rewards.view(-1, group), scored.valid.view(-1, group)
        mean = (grouped * ok).sum(-1) / ok.sum(-1).clamp_min(1)  # (P,)
        rewards = torch.where(scored.valid, rewards, mean.repeat_interleave(group))
    return Samples(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        truncated=truncated,
        rewards=rewards,
        scored=scored,
        completions=completions,
        prompts=prompts,
        rows=rows,
        group_size=group,
        behaviour=behaviour,
        seconds=seconds,
        engine_logprobs=generation.logprobs,
    )


def _on_any_process(module: LightningModule, flag: bool) -> bool:
    """True if ``flag`` holds on any process (every process must call this alike)."""
    trainer = module._trainer
    if trainer is None or trainer.world_size == 1:
        return flag
    value = torch.tensor(float(flag), device=module.device)
    return bool(trainer.strategy.reduce(value, reduce_op="sum") > 0)
