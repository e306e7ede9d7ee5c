"""A rollout of multi-turn episodes (``model.episodes``): the collector's sampling round when the
model talks to tools or an environment instead of writing one completion.

:class:`EpisodeSampler` runs ``group_size`` episodes per prompt with the rollout engine
(:func:`engine_turns` continues every running episode by one turn through
``RolloutEngine.generate``), then lays them out as a round of
:class:`~lightning_troll.rollouts.samples.Samples`: the prompt (the environment's conversation,
left padded), then the model's turns and the environment's replies (right padded). Every token
is attended; the response mask, and with it the loss, the cached old distributions and every
trust-region statistic, holds the model's own tokens only. The behaviour log-probs come from the
teacher-forced pass after sampling, whatever ``model.engine.behaviour_logprobs`` says (``sampling``
warns: :func:`behaviour_logprobs_warning`); the engine's own, where it reports them, feed the
mismatch correction. The reward functions score each episode's final answer (its last turn), and the
environment's per-turn rewards add to it.

Notation: B = P x G episodes, S the longest prompt, T the longest response.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_troll.engines.base import RolloutEngine, SampleRequest
from lightning_troll.engines.behaviour import BehaviourRecorder
from lightning_troll.engines.sampling import SamplingConfig, left_pad, sample
from lightning_troll.models.sharding import gathered
from lightning_troll.rollouts.episodes import (
    ENDINGS,
    Episode,
    EpisodeLimits,
    GeneratedTurn,
    GenerateTurn,
    Stops,
    pad_episodes,
    run_episodes,
)
from lightning_troll.rollouts.samples import Samples, filled_rewards
from lightning_troll.rollouts.timing import clock
from lightning_troll.tasks.environments import EnvironmentChoice, EnvironmentFactory
from lightning_troll.tasks.environments.calls import TOOL_ERROR_KINDS
from lightning_troll.tasks.environments.options import EpisodesConfig
from lightning_troll.tasks.environments.protocol import EnvironmentFailure, closed_on_failure
from lightning_troll.tasks.environments.rendering import check_chat_template
from lightning_troll.tasks.environments.tool_workers import tool_failure_problem

if TYPE_CHECKING:
    from lightning_troll.tasks.data.prompts import PromptBatch

__all__ = [
    "EngineTurns",
    "EpisodeSampler",
    "SampledEpisodes",
    "behaviour_logprobs_warning",
    "check_tool_failures",
    "environment_factory",
    "episode_figures",
    "episode_tokenizer_check",
    "last_turn",
    "sampled_turns",
]


class EngineTurns:
    """A ``generate_turn`` (:class:`~lightning_troll.rollouts.episodes.GenerateTurn`) over
    ``engine.generate``: one continuation per context, each up to the room its episode has left
    (the request's ``budgets``), stopping at the stop tokens. An engine that ignores the budgets
    samples every context up to the largest room (the request's ``max_new_tokens``), and each
    episode is cut to its own."""

    def __init__(
        self, engine: RolloutEngine, snapshot: nn.Module, sampling: SamplingConfig, pad_id: int
    ) -> None:
        self.engine, self.snapshot, self.sampling, self.pad_id = engine, snapshot, sampling, pad_id
        self.reported = False
        """Whether the engine gave its own log-probs of the sampled tokens."""

    def __call__(
        self, prompts: list[list[int]], max_new_tokens: list[int], stops: Stops
    ) -> list[GeneratedTurn]:
        turn = replace(self.sampling, max_new_tokens=max(max_new_tokens))
        request = SampleRequest(prompts, 1, turn, self.pad_id, stops.token_ids, max_new_tokens)
        out = self.engine.generate(self.snapshot, request)
        self.reported = out.logprobs is not None
        length = out.response_mask.shape[1]
        responses = out.input_ids[:, -length:]  # (B, T)
        return [
            GeneratedTurn(
                responses[i][kept].tolist(),
                None if out.logprobs is None else out.logprobs[i][kept].tolist(),
            )
            for i, kept in enumerate(out.response_mask)
        ]


def sampled_turns(
    model: nn.Module, sampling: SamplingConfig, pad_id: int, do_sample: bool = True
) -> GenerateTurn:
    """A ``generate_turn`` over :func:`~lightning_troll.engines.sampling.sample` (the HF
    engine's KV-cached loop) that records the behaviour log-probs while it samples, each context
    up to the room its episode has left. It stops at the stop tokens only; :func:`run_episodes`
    cuts a turn at a stop string."""

    def generate(prompts: list[list[int]], max_new_tokens: list[int], stops: Stops):
        turn = replace(sampling, max_new_tokens=max(max_new_tokens))
        recorder = BehaviourRecorder(sampling.temperature)
        input_ids, _, response_mask, _ = sample(
            model, prompts, 1, turn, pad_id, list(stops.token_ids), do_sample, recorder,
            budgets=max_new_tokens,
        )  # (B, S + T), (B, T)  # fmt: skip
        length = response_mask.shape[1]
        record = recorder.finish(input_ids[:, -length:])  # logprobs (B, T)
        return [
            GeneratedTurn(ids[kept].tolist(), logprobs[kept].tolist())
            for ids, logprobs, kept in zip(
                input_ids[:, -length:], record.logprobs, response_mask, strict=True
            )
        ]

    return generate


def last_turn(response_mask: Tensor, episodes: Sequence[Episode]) -> Tensor:
    """(B, T) bool: each episode's last model turn, the tokens of ``response_mask`` (B, T) from
    its :attr:`~lightning_troll.rollouts.episodes.Episode.last_turn_start` on."""
    starts = torch.tensor([e.last_turn_start for e in episodes], device=response_mask.device)
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)  # (T,)
    return response_mask & (positions >= starts.unsqueeze(-1))


def episode_figures(episodes: Sequence[Episode]) -> dict[str, float]:
    """What the episodes of a rollout did: turns, tool calls and their errors per episode, the
    share that called a tool, and the share of each ending (``episodes/...``). Every ending and
    every kind of tool error (:data:`~lightning_troll.tasks.environments.calls.TOOL_ERROR_KINDS`) has
    its figure, 0 where none occurred, so that every process logs the same names (figures are
    reduced over the processes name by name)."""
    n = max(len(episodes), 1)
    errors: Counter[str] = Counter()
    for episode in episodes:
        errors.update(episode.tool_errors)
    figures = {
        "episodes/turns_mean": sum(e.turns for e in episodes) / n,
        "episodes/tool_calls_mean": sum(e.tool_calls for e in episodes) / n,
        "episodes/frac_tool_use": sum(e.tool_calls > 0 for e in episodes) / n,
        "episodes/env_tokens_mean": sum(len(e.mask) - sum(e.mask) for e in episodes) / n,
        "episodes/tool_replies_cut": sum(e.tool_replies_cut for e in episodes) / n,
    }
    figures.update({f"episodes/frac_end_{end}": sum(e.end == end for e in episodes) / n
                    for end in ENDINGS})  # fmt: skip
    figures.update({f"episodes/tool_errors_{kind}": errors[kind] / n for kind in TOOL_ERROR_KINDS})
    return figures


@dataclass(frozen=True)
class SampledEpisodes:
    """One round of episodes laid out as a rollout holds sequences."""

    input_ids: Tensor
    """(B, S + T) the prompt (left padded), then model turns and replies (right padded)."""
    attention_mask: Tensor
    """(B, S + T) 1 at every prompt and response token, the environment's included."""
    response_mask: Tensor
    """(B, T) bool, True at the model's own tokens."""
    truncated: Tensor
    """(B,) bool, True where the token budget cut the episode off (inside a turn, or before a
    reply that did not fit)."""
    engine_logprobs: Tensor | None
    """(B, T) the engine's log-probs of the model's tokens (0 elsewhere), where it reports them."""
    prompts: list[str]
    """Each episode's prompt text (the environment's conversation, rendered)."""
    env_rewards: Tensor
    """(B,) float32 the environment's rewards summed over the episode's turns."""
    episodes: list[Episode]

    @property
    def budget_mask(self) -> Tensor:
        """(B, T) 1 at every response token, the model's and the environment's: what the token
        budget counts, and what ``completion_tokens`` (the ``overlong`` penalty) counts."""
        return self.attention_mask[:, -self.response_mask.shape[1] :]


def check_tool_failures(episodes: Sequence[Episode], config: EpisodesConfig) -> None:
    """Stops the run (an :class:`EnvironmentFailure`, which saves and names the checkpoint) or
    warns once, by ``model.episodes.tool_failures``, where the tools failed in this round of
    episodes at ``model.episodes.tool_failure_limit`` or more (:func:`tool_failure_problem`);
    the message quotes the first failure the model read."""
    errors: Counter[str] = Counter()
    for episode in episodes:
        errors.update(episode.tool_errors)
    problem = tool_failure_problem(
        sum(e.tool_calls for e in episodes), errors, config.tool_failure_limit
    )
    if problem is None:
        return
    first = next(
        (str(m["content"]) for e in episodes for m in e.messages
         if m.get("role") == "tool" and _is_fault(str(m.get("content", "")))),
        None,
    )  # fmt: skip
    if first is not None:
        problem += f"; the first: {first[len('Error: ') :][:200]}"
    if config.tool_failures == "raise":
        raise EnvironmentFailure(
            f"{problem}; fix the tool, or set model.episodes.tool_failures warn to train on"
        )
    # a registry of its own: shown at every such rollout, not once per text as warn() would
    warnings.warn_explicit(
        f"{problem} (model.episodes.tool_failures='warn': training on)", UserWarning,
        __file__, 0, module=__name__, registry={},
    )  # fmt: skip


def _is_fault(text: str) -> bool:
    """Whether a tool message is an error of
    :data:`~lightning_troll.tasks.environments.tool_workers.TOOL_FAULTS` (a tool's own failure): the
    model's errors are a malformed call, an unknown tool or bad arguments."""
    return text.startswith("Error: tool ") and " got bad arguments: " not in text.split("\n")[0]


def behaviour_logprobs_warning(behaviour_logprobs: str) -> str | None:
    """The warning for ``model.engine.behaviour_logprobs: sampling`` with ``model.episodes``, else None.
    An episode's behaviour log-probs always come from one teacher-forced pass over the whole
    episode once it is played (the environment's tokens lie between the model's turns), as with
    ``forward``: recording them while sampling does not apply."""
    if behaviour_logprobs != "sampling":
        return None
    return (
        "model.engine.behaviour_logprobs='sampling' does not apply to model.episodes: an episode's "
        "behaviour log-probs come from one teacher-forced pass of the snapshot over the whole "
        "episode once it is played, as with 'forward'; set model.engine.behaviour_logprobs to 'forward' "
        "or 'auto'"
    )


def episode_tokenizer_check(
    make: EnvironmentFactory | EnvironmentChoice | None,
) -> Callable[[Any], None] | None:
    """What episodes need of the tokenizer, to check before the model's weights load: a chat
    template where they have tools (:func:`check_chat_template`, as :class:`EpisodeSampler`
    checks it); None without episodes or without tools."""
    if make is None or not make.uses_tools:
        return None
    return partial(check_chat_template, tools=True)


def environment_factory(config: EpisodesConfig) -> EnvironmentFactory | EnvironmentChoice:
    """The environment per episode of ``model.episodes``: its tools loaded and checked and
    its environment class found (refused in one line naming the option); an
    :class:`EnvironmentChoice` where it names several."""
    options = config.tools or (), config.tool_workers, config.tool_timeout, config.tool_reply_chars
    if isinstance(config.environment, Mapping):
        return EnvironmentChoice(config.environment, *options)
    return EnvironmentFactory(config.environment, *options)


class EpisodeSampler:
    """Runs the episodes of ``model.episodes`` for the rollout collector.

    Args:
        config: the episodes' options.
        tokenizer: the policy's tokenizer (its chat template renders the conversations).
        stop_ids: the tokens that end a model turn (end of turn, end of text).
        max_tokens: the token budget of an episode's response (model and environment tokens).
        make: the environments' factory, made from ``config`` by :func:`environment_factory`
            where not given (a module makes it before its model loads, so that a tool or an
            environment named wrong is refused first).
    """

    def __init__(
        self,
        config: EpisodesConfig,
        tokenizer: Any,
        stop_ids: Sequence[int],
        max_tokens: int,
        make: EnvironmentFactory | EnvironmentChoice | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.make = environment_factory(config) if make is None else make
        if self.make.uses_tools:  # episodes with tools are messages: refused now, not at a turn
            check_chat_template(tokenizer, tools=True)
        self.limits = EpisodeLimits(config.max_turns, max_tokens)
        self.stops = Stops(tuple(stop_ids))

    def sample(
        self, generate: GenerateTurn, rows: list[dict[str, Any]], pad_id: int, device
    ) -> SampledEpisodes:
        """One episode per row of ``rows`` (each with an environment of its own), continued turn by
        turn by ``generate``, laid out on ``device``. The prompts the data wrote are not used:
        the environment writes the conversation from the row."""
        environments: list[Any] = []
        with closed_on_failure(lambda: environments):  # one that cannot be made
            environments.extend(self.make(row) for row in rows)
        episodes = run_episodes(
            generate, self.tokenizer, environments, rows, self.limits, self.stops
        )
        check_tool_failures(episodes, self.config)
        prompt_ids, prompt_mask = left_pad([e.prompt_ids for e in episodes], pad_id, device)
        padded = pad_episodes(episodes, pad_id)
        response = padded.tokens.to(device)  # (B, T)
        reported = getattr(generate, "reported", False)
        rewards = [sum(r for r in e.turn_rewards if r is not None) for e in episodes]
        return SampledEpisodes(
            input_ids=torch.cat([prompt_ids, response], dim=1),
            attention_mask=torch.cat([prompt_mask, padded.attention_mask.to(device).long()], 1),
            response_mask=padded.mask.to(device),
            truncated=torch.tensor([e.truncated for e in episodes], device=device),
            engine_logprobs=padded.logprobs.to(device) if reported else None,
            prompts=[self.tokenizer.decode(e.prompt_ids) for e in episodes],
            env_rewards=torch.tensor(rewards, dtype=torch.float32, device=device),
            episodes=episodes,
        )

    def answers(
        self, sampled: SampledEpisodes, decode: Callable[[Tensor, Tensor], list[str]]
    ) -> list[str]:
        """Each episode's final answer (its last turn), decoded as a completion is."""
        mask = sampled.response_mask
        return decode(sampled.input_ids[:, -mask.shape[1] :], last_turn(mask, sampled.episodes))

    def round(self, collector: Any, batch: PromptBatch) -> Samples:
        """A :class:`~lightning_troll.rollouts.collector.RolloutCollector`'s sampling round as
        episodes: ``collector.group_size`` per row of
        ``batch`` from its engine and behaviour policy, each scored on its final answer by the
        reward functions (``collector.score``) plus the environment's rewards over its turns. An
        episode whose reward was dropped (``model.reward_options.on_error: drop``) takes the mean
        of its group's other episodes' whole rewards (:func:`filled_rewards`)."""
        group, engine = collector.group_size, collector.engine
        start = clock(collector.device)
        rows = [r for r in batch.rows for _ in range(group)]
        with collector.behaviour() as snapshot, gathered(snapshot):
            if engine.stale:
                engine.load_weights(snapshot)
            generate = EngineTurns(engine, snapshot, collector.sampling, collector.pad_id)
            sampled = self.sample(generate, rows, collector.pad_id, collector.device)
        seconds = clock(collector.device) - start
        mask, device = sampled.response_mask, sampled.input_ids.device
        answers = self.answers(sampled, collector.decode)
        scored = collector.score(sampled.prompts, answers, rows, sampled.budget_mask, device)
        return Samples(
            input_ids=sampled.input_ids,
            attention_mask=sampled.attention_mask,
            response_mask=mask,
            truncated=sampled.truncated,
            rewards=filled_rewards(scored, group, sampled.env_rewards),
            scored=scored,
            completions=answers,
            prompts=sampled.prompts,
            rows=rows,
            group_size=group,
            seconds=seconds,
            engine_logprobs=sampled.engine_logprobs,
            episodes=sampled.episodes,
        )

    def close(self) -> None:
        """Stops the tool workers."""
        self.make.close()
