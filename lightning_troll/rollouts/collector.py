"""The rollout pipeline: from a batch of prompts to a :class:`~lightning_troll.rollouts.rollout.Rollout`.

:meth:`RolloutCollector.collect` runs, in order:

1. **sample** ``group_size`` completions per prompt through the rollout engine, from the
   behaviour policy's weights (recording its log-probs and sparse rows while sampling where it
   can), decode them and **score** them with the reward functions; a completion whose reward was
   dropped takes its group's mean over the others; with ``episodes``, multi-turn episodes
   instead, the environment's tokens outside the response mask
   (:mod:`lightning_troll.rollouts.multiturn`);
2. **dynamic sampling** (when extra prompts are given): more rounds while any process has fewer
   informative groups than prompts, then the groups kept;
3. the **loss mask**: dropped rewards and, with ``corrections.mask_truncated``, truncated completions
   leave it;
4. the **advantages** of the rewards (over the global batch, through ``advantages``);
5. the **behaviour policy's** log-probs (and sparse rows) unless recorded while sampling, and the
   **reference policy's** log-probs when there is one;
6. the **mismatch correction**: where the engine reports its own log-probs, their difference
   from the trainer's, and with ``corrections.engine_is_cap`` importance weights on the advantages
   (truncated or masked, per token or per sequence: :mod:`lightning_troll.objectives.mismatch`);
   masked tokens leave the loss mask;
7. with ``corrections.anchor: proximal`` (a stale sampler), the **proximal policy**: the current
   weights' log-probs and sparse rows replace the sampler's as the old policy, and the
   advantages take the truncated proximal-over-behaviour weight.

Nothing here imports Lightning: :class:`~lightning_troll.training.module.TrollModule` builds its
collector from its parts (``TrollModule.collector``), and a script in plain PyTorch builds one
from a model, an engine and a scorer (docs/api.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_troll.engines.base import RolloutEngine, SampleRequest
from lightning_troll.engines.behaviour import BehaviourRecorder, records_while_sampling
from lightning_troll.engines.sampling import SamplingConfig
from lightning_troll.models.sharding import gathered, is_sharded
from lightning_troll.models.snapshots import evaluating
from lightning_troll.objectives.advantages import overflow_problem
from lightning_troll.objectives.mismatch import mismatch_weights
from lightning_troll.objectives.options import CorrectionsConfig
from lightning_troll.rollouts.dynamic_sampling import choose_groups
from lightning_troll.rollouts.multiturn import EpisodeSampler, episode_figures
from lightning_troll.rollouts.rollout import Rollout, behaviour_outputs
from lightning_troll.rollouts.samples import RolloutReport, Samples, filled_rewards
from lightning_troll.rollouts.timing import clock
from lightning_troll.tasks.rewards.calls import RewardError
from lightning_troll.tasks.rewards.registry import RewardOutput
from lightning_troll.trust_region.sparse import SparseDistribution

if TYPE_CHECKING:  # the data layer's package imports Lightning (its DataModule)
    from lightning_troll.tasks.data.prompts import PromptBatch

__all__ = ["RolloutCollector"]


def _no_reference() -> AbstractContextManager[nn.Module | None]:
    return nullcontext(None)


def _this_process(flag: bool) -> bool:
    return flag


def engine_mismatch(
    engine: dict[str, float],
    corrections: CorrectionsConfig,
    kept: Samples,
    response_mask: Tensor,
    advantages: Tensor,
    old_logprobs: Tensor,
) -> tuple[Tensor, dict[str, float], Tensor | None]:
    """The ``engine``'s figures with ``rollout/engine_logprob_diff`` added where it reports its
    own log-probs, the advantages weighted per token (``(B, T)``) by the importance weights of
    ``corrections.engine_is_*`` (:func:`mismatch_weights`; ``advantages`` as they are otherwise), and
    with ``engine_is_mode: mask`` the response tokens that stay in the loss (None otherwise)."""
    if kept.engine_logprobs is None:
        return advantages, engine, None
    tokens = response_mask.sum().clamp_min(1)
    gap = (kept.engine_logprobs - old_logprobs).abs() * response_mask
    engine["rollout/engine_logprob_diff"] = float(gap.sum() / tokens)
    if corrections.engine_is_cap is None:
        return advantages, engine, None
    weights, stay, figures = mismatch_weights(
        old_logprobs - kept.engine_logprobs,
        response_mask,
        corrections.engine_is_cap,
        corrections.engine_is_level,
        corrections.engine_is_mode,
        corrections.engine_is_floor,
    )
    masked = stay if corrections.engine_is_mode == "mask" else None
    return advantages.unsqueeze(-1) * weights, {**engine, **figures}, masked


@dataclass
class RolloutCollector:
    """Collects rollouts from batches of prompts (see the module's docstring for the order)."""

    policy: nn.Module
    """The policy being trained (its device is the rollout's)."""
    behaviour: Callable[[], AbstractContextManager[nn.Module]]
    """Context manager giving the behaviour policy, ready to sample (the frozen snapshot)."""
    engine: RolloutEngine
    """What samples (``hf``: the behaviour policy itself, in this process)."""
    scorer: Callable[..., RewardOutput]
    """The reward functions: ``scorer(prompts, completions, rows, tokens, max_new_tokens,
    device=...)`` (a :class:`~lightning_troll.tasks.rewards.registry.RewardScorer`)."""
    decode: Callable[[Tensor, Tensor], list[str]]
    """Response tokens and their mask -> text, without EOS and padding."""
    advantages: Callable[[Tensor], Tensor]
    """Rewards (B,) -> advantages (B,) (over the global batch under several processes)."""
    sampling: SamplingConfig
    group_size: int
    pad_id: int
    stop_ids: Sequence[int]
    reference: Callable[[], AbstractContextManager[nn.Module | None]] = _no_reference
    """Context manager giving the reference policy, or None when there is none."""
    sparsify_old: Callable[..., SparseDistribution | None] = lambda logits, ids, reads=True: None
    """The behaviour policy's sparse rows from its logits and the sampled tokens (TROLL), or
    None when nothing reads them; ``reads=False`` as :func:`~lightning_troll.trust_region.
    sparse.sparsify`'s (:class:`~lightning_troll.engines.behaviour.BehaviourRecorder` asks it
    so while a GPU decodes)."""
    corrections: CorrectionsConfig = CorrectionsConfig()
    """``model.corrections``: every one applies here."""
    behaviour_logprobs: str = "auto"
    """``model.engine.behaviour_logprobs``: record while sampling (``sampling``), recompute
    (``forward``), or choose by the weights' dtype (``auto``)."""
    logits_chunk_size: int | None = None
    share_prompts: bool = False
    max_tokens: int | None = None
    """The most tokens per teacher-forced pass (``model.optimization.micro_batch_tokens``)."""
    packed: bool = False
    """Teacher-forced passes without padding (``model.optimization.pack_sequences``)."""
    max_rounds: int = 3
    """The most extra rounds of dynamic sampling."""
    any_process: Callable[[bool], bool] = _this_process
    """Whether a flag holds on any process (every process calls it alike)."""
    episodes: EpisodeSampler | None = None
    """Multi-turn episodes (``model.episodes``) instead of single completions: the response
    holds the model's turns and the environment's replies, the response mask the model's tokens
    only (:mod:`lightning_troll.rollouts.multiturn`)."""

    @property
    def device(self) -> torch.device:
        return next(self.policy.parameters()).device

    @torch.no_grad()
    def collect(
        self, batch: PromptBatch, more_prompts: Callable[[int], PromptBatch] | None = None
    ) -> tuple[Rollout, RolloutReport]:
        """Samples, scores and caches one rollout from a batch of prompts.

        With ``more_prompts`` (dynamic sampling) extra rounds ``more_prompts(1)``, ... are
        sampled while some process has fewer informative groups than ``len(batch)``, at most
        :attr:`max_rounds` of them; the rollout keeps ``len(batch)`` groups.
        """
        start = clock(self.device)
        rounds = [self.sample(batch)]
        kept, capped = rounds[0], False
        if more_prompts is not None:
            target = len(batch)
            for r in range(1, self.max_rounds + 1):
                have = sum(int(s.informative.sum()) for s in rounds)
                if not self.any_process(have < target):
                    break
                rounds.append(self.sample(more_prompts(r)))
            groups, informative = choose_groups([s.informative for s in rounds], target)
            capped = self.any_process(informative < target)
            parts = [s.select(g) for s, g in zip(rounds, groups, strict=True) if g.numel()]
            kept = Samples.cat(parts, self.pad_id)
        response_mask = kept.response_mask & kept.scored.valid.unsqueeze(-1)  # dropped rewards
        if self.corrections.mask_truncated:
            response_mask = response_mask & ~kept.truncated.unsqueeze(-1)
        advantages = self.advantages(kept.rewards)
        problem = overflow_problem(kept.rewards, advantages)
        if problem is not None:  # before any step: stops as a failing reward does
            raise RewardError(problem)
        passes = clock(self.device)
        old_logprobs, old, ref_logprobs = self._teacher_forced(kept, response_mask)
        token_advantages, engine, masked = engine_mismatch(
            dict(self.engine.figures()),
            self.corrections,
            kept,
            response_mask,
            advantages,
            old_logprobs,
        )
        tokens = float(response_mask.sum())  # what the engine's rollout/ figures average over
        counts = dict.fromkeys([n for n in engine if n.startswith("rollout/")], tokens)
        if masked is not None:  # masked importance sampling: the masked tokens leave the loss
            old = None if old is None else old.select(masked[response_mask])
            response_mask = masked
            old_logprobs = old_logprobs * masked
            ref_logprobs = None if ref_logprobs is None else ref_logprobs * masked
        if self.corrections.anchor == "proximal":
            old_logprobs, old, token_advantages, figures = self._proximal(
                kept, response_mask, token_advantages, old_logprobs
            )
            engine.update(figures)
            counts.update(dict.fromkeys(figures, float(response_mask.sum())))
        if kept.episodes is not None:
            figures = episode_figures(kept.episodes)
            engine.update(figures)
            counts.update(dict.fromkeys(figures, float(len(kept.episodes))))
        end = clock(self.device)
        rollout = Rollout(
            input_ids=kept.input_ids,
            attention_mask=kept.attention_mask,
            response_mask=response_mask,
            old_logprobs=old_logprobs,
            old=old,
            rewards=kept.rewards,
            advantages=token_advantages,
            truncated=kept.truncated,
            temperature=self.sampling.temperature,
            group_size=self.group_size,
            ref_logprobs=ref_logprobs,
        )
        seconds = {
            "generation": sum(s.seconds for s in rounds),
            "forward_passes": end - passes,
            "rollout": end - start,
        }
        report = RolloutReport(rounds, kept, capped, advantages, engine, seconds, counts)
        return rollout, report

    def _teacher_forced(
        self, kept: Samples, response_mask: Tensor
    ) -> tuple[Tensor, SparseDistribution | None, Tensor | None]:
        """The behaviour policy's log-probs and sparse rows (recorded while sampling, or from a
        pass now) and the reference policy's log-probs (None without one)."""
        inputs = (kept.input_ids, kept.attention_mask, response_mask, self.sampling.temperature)
        chunks = self.logits_chunk_size
        if kept.behaviour is not None:  # recorded while sampling: no second pass
            old_logprobs, old = kept.behaviour.outputs(response_mask)
        else:
            with self.behaviour() as snapshot:
                share = self.share_prompts and not is_sharded(snapshot)
                old_logprobs, old = behaviour_outputs(
                    snapshot, *inputs, self.sparsify_old, chunks, share, *self._parts
                )
        ref_logprobs = None
        with self.reference() as reference:
            if reference is not None:
                share = self.share_prompts and not is_sharded(reference)
                ref_logprobs = behaviour_outputs(
                    reference, *inputs, None, chunks, share, *self._parts
                )[0]
        return old_logprobs, old, ref_logprobs

    @property
    def _parts(self) -> tuple[int | None, bool]:
        """How a teacher-forced pass splits and packs the rollout: ``max_tokens``, ``packed``."""
        return self.max_tokens, self.packed

    def _proximal(
        self, kept: Samples, response_mask: Tensor, advantages: Tensor, behaviour: Tensor
    ) -> tuple[Tensor, SparseDistribution | None, Tensor, dict[str, float]]:
        """``corrections.anchor: proximal``: the current weights' log-probs and sparse rows (a
        teacher-forced pass of the policy, before this rollout's update) become the old policy
        the objective bounds, and each token's advantage is weighted by
        ``min(p_proximal / p_behaviour, corrections.anchor_is_cap)``."""
        inputs = (kept.input_ids, kept.attention_mask, response_mask, self.sampling.temperature)
        share = self.share_prompts and not is_sharded(self.policy)
        with evaluating(self.policy) as policy:  # no dropout: the policy as the snapshot samples
            proximal, rows = behaviour_outputs(
                policy, *inputs, self.sparsify_old, self.logits_chunk_size, share, *self._parts
            )
        # the same truncated weight as the engine's token-level correction, under its own names
        weights, _, engine_figures = mismatch_weights(
            proximal - behaviour, response_mask, self.corrections.anchor_is_cap
        )
        figures = {k.replace("engine_is", "proximal_is"): v for k, v in engine_figures.items()}
        per_token = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1)
        return proximal, rows, per_token * weights, figures

    def sample(self, batch: PromptBatch) -> Samples:
        """One round: G completions (or episodes) per prompt of ``batch`` from the rollout engine
        (the behaviour policy's weights), decoded and scored."""
        if self.episodes is not None:
            return self.episodes.round(self, batch)
        group, engine = self.group_size, self.engine
        recorder = None
        if engine.records_behaviour and records_while_sampling(
            self.behaviour_logprobs, self.policy
        ):
            recorder = BehaviourRecorder(self.sampling.temperature, self.sparsify_old)
        start = clock(self.device)
        with self.behaviour() as snapshot, gathered(snapshot):
            # sharded weights are gathered once for the whole generation, not once per token
            if engine.stale:  # the first rollout, or the snapshot was refreshed since the last
                engine.load_weights(snapshot)
            request = SampleRequest(
                batch.prompt_ids, group, self.sampling, self.pad_id, self.stop_ids
            )
            generation = engine.generate(snapshot, request, recorder=recorder)
        input_ids, attention_mask = generation.input_ids, generation.attention_mask
        response_mask, truncated = generation.response_mask, generation.truncated
        length = response_mask.shape[1]
        behaviour = None if recorder is None else recorder.finish(input_ids[:, -length:])
        seconds = clock(self.device) - start
        completions = self.decode(input_ids[:, -length:], response_mask)
        prompts = [p for p in batch.prompts for _ in range(group)]
        rows = [r for r in batch.rows for _ in range(group)]
        scored = self.score(prompts, completions, rows, response_mask, input_ids.device)
        return Samples(
            input_ids=input_ids,
            attention_mask=attention_mask,
            response_mask=response_mask,
            truncated=truncated,
            rewards=filled_rewards(scored, group),
            scored=scored,
            completions=completions,
            prompts=prompts,
            rows=rows,
            group_size=group,
            behaviour=behaviour,
            seconds=seconds,
            engine_logprobs=generation.logprobs,
        )

    def score(
        self,
        prompts: list[str],
        completions: list[str],
        rows: list[dict[str, Any]],
        response_mask: Tensor,
        device: torch.device,
    ) -> RewardOutput:
        tokens = response_mask.sum(-1).tolist()  # (B,) generated tokens, EOS included
        scored = self.scorer(
            prompts, completions, rows, tokens, self.sampling.max_new_tokens, device=device
        )
        return RewardOutput(
            total=scored.total.to(device),
            per_function={k: v.to(device) for k, v in scored.per_function.items()},
            valid=scored.valid.to(device),
            timeouts=scored.timeouts,
            errors=scored.errors,
        )
