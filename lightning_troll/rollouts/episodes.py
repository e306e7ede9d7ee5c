"""Multi-turn episodes at token level: the model's turns generated, the environment asked, its
reply tokenized as the chat template renders it, until the episode ends.

:func:`run_episodes` runs the episodes of a batch with any engine: it takes a ``generate_turn``
callable (:class:`GenerateTurn`) that continues token sequences, one environment per episode
(:mod:`lightning_troll.tasks.environments`) and their data rows. Each round, every running episode's
context (prompt and response so far) is continued until a stop: an end-of-turn or end-of-text
token (``<|im_end|>``, eos; kept), or the end of a stop string, ``</tool_call>`` for every
environment (kept: a turn makes one tool call); tokens after the stop are dropped, so an engine
that cannot stop at strings may run on.
The environment answers the turn's text (:func:`~lightning_troll.tasks.environments.step_all`); its
reply becomes the tokens the template writes between this turn and the next one's generation
prompt (:class:`~lightning_troll.tasks.environments.Conversation`), with mask 0 and log-prob 0. An
episode ends:

- ``"done"``: the environment said so (a :class:`ToolEnvironment` turn without a tool call);
- ``"max_turns"``: the model took ``model.episodes.max_turns`` turns;
- ``"max_tokens"``: the token budget (model and environment tokens after the prompt) ran out
  inside a model turn;
- ``"no_room"``: the environment answered the model's turn, but its reply could not be added
  whole with room for one more token (the model never reads it). Both budget ends leave the
  episode ``truncated``; at ``"no_room"`` the last turn was judged, at ``"max_tokens"`` never.

At the last three, the environment's ``on_end(end)`` (where it defines one) may add a reward to
the last turn's; then its ``close()`` runs. An episode of one turn is exactly a plain completion:
the same tokens, all with mask 1.

Notation: B episodes, T_i episode i's response (model and environment tokens), T = max_i T_i.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_troll.tasks.environments import TOOL_CALL_CLOSE, Conversation, step_all
from lightning_troll.tasks.environments.protocol import (
    EnvironmentFailure,
    Step,
    call_environment,
    closed_on_failure,
    is_finite_reward,
    tool_schemas_of,
)
from lightning_troll.tasks.environments.rendering import unrendered

__all__ = [
    "ENDINGS",
    "Episode",
    "EpisodeLimits",
    "GenerateTurn",
    "GeneratedTurn",
    "PaddedEpisodes",
    "Stops",
    "cut_at_stop",
    "pad_episodes",
    "run_episodes",
]

ENDINGS = ("done", "max_turns", "max_tokens", "no_room")
"""Why an episode ended: the environment's word, the turn limit, the token budget."""


@dataclass(frozen=True)
class Stops:
    """What ends a model turn (kept as its last tokens)."""

    token_ids: tuple[int, ...]
    """End-of-turn and end-of-text tokens (``<|im_end|>``, eos)."""
    strings: tuple[str, ...] = (TOOL_CALL_CLOSE,)
    """Texts that end a turn once written: the end of a tool call, whatever the environment (one
    call a turn)."""


@dataclass(frozen=True)
class GeneratedTurn:
    """What an engine generated for one sequence."""

    token_ids: Sequence[int]
    """The new tokens; a stop and anything after it may be included."""
    logprobs: Sequence[float] | None = None
    """The behaviour policy's log-prob of each new token; None gives 0 (computed later)."""


class GenerateTurn(Protocol):
    """Continues each of ``prompts`` (token ids) by at most ``max_new_tokens[i]`` tokens, ideally
    stopping at ``stops``; returns one :class:`GeneratedTurn` (or a list of token ids) each."""

    def __call__(
        self, prompts: list[list[int]], max_new_tokens: list[int], stops: Stops
    ) -> Sequence[GeneratedTurn | Sequence[int]]: ...


@dataclass(frozen=True)
class EpisodeLimits:
    """Where an episode ends at the latest."""

    max_turns: int
    """Model turns per episode (``model.episodes.max_turns``), >= 1."""
    max_tokens: int
    """Response tokens per episode, model and environment tokens together (the rollout's response
    length, ``model.sampling.max_new_tokens``), >= 1."""

    def __post_init__(self) -> None:
        for option, value in (("model.episodes.max_turns", self.max_turns),
                              ("model.sampling.max_new_tokens", self.max_tokens)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{option} must be an integer >= 1; got {value!r}")


@dataclass(frozen=True)
class Episode:
    """One finished episode; the lists over its response are all T_i long."""

    prompt_ids: list[int]
    """The prompt's tokens."""
    token_ids: list[int]
    """(T_i,) the response after the prompt: model turns and environment replies."""
    mask: list[int]
    """(T_i,) 1 on the model's own tokens, 0 on the environment's."""
    logprobs: list[float]
    """(T_i,) the behaviour policy's log-prob of each model token; 0.0 on environment tokens."""
    turn_texts: list[str]
    """Each model turn's text, its final stop token left out (the last is the final answer)."""
    turn_rewards: list[float | None]
    """The environment's reward for each model turn (None where it gave none)."""
    end: str
    """Why it ended: one of :data:`ENDINGS`."""
    tool_calls: int = 0
    """Tool calls made over the episode."""
    tool_errors: dict[str, int] = field(default_factory=dict)
    """kind -> tool calls that failed that way over the episode."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The conversation: the prompt's messages, every model turn (its text) and every reply the
    model read, each once (a reply that did not fit the budget is left out; empty for a
    plain-text episode)."""
    last_turn_start: int = 0
    """Where the last model turn (the final answer) starts in ``token_ids``: known from the turns
    themselves, not from the environment's tokens, which an empty reply leaves out."""
    tool_replies_cut: int = 0
    """Tool replies cut at ``model.episodes.tool_reply_chars`` over the episode."""

    @property
    def turns(self) -> int:
        return len(self.turn_texts)

    @property
    def truncated(self) -> bool:
        """The token budget cut the episode off (``"max_tokens"`` or ``"no_room"``);
        ``model.corrections.mask_truncated`` leaves it out."""
        return self.end in ("max_tokens", "no_room")


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(
        list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
    )


def cut_at_stop(
    token_ids: Sequence[int], tokenizer: Any, stops: Stops, limit: int
) -> tuple[int, bool]:
    """How many of ``token_ids`` (at most ``limit``) a turn keeps, and whether a stop ended it:
    up to the first stop token, or to the first token whose text completes a stop string."""
    ids = list(token_ids[:limit])
    end = next((k + 1 for k, t in enumerate(ids) if t in stops.token_ids), None)
    upto = len(ids) if end is None else end

    def written(k: int) -> bool:
        text = _decode(tokenizer, ids[:k])
        return any(s in text for s in stops.strings)

    if stops.strings and upto and written(upto):
        low, high = 1, upto  # the first k whose text holds a stop string
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if written(middle) else (middle + 1, high)
        return low, True
    return upto, end is not None


def _turn_of(output: GeneratedTurn | Sequence[int]) -> tuple[list[int], list[float]]:
    if not isinstance(output, GeneratedTurn):
        output = GeneratedTurn(output)
    ids = [int(t) for t in output.token_ids]
    if output.logprobs is None:
        return ids, [0.0] * len(ids)
    logprobs = [float(x) for x in output.logprobs]
    if len(logprobs) != len(ids):
        raise ValueError(
            f"generate_turn gave {len(ids)} tokens but {len(logprobs)} log-probs for one sequence"
        )
    return ids, logprobs


class _Running:
    """One episode on its way: its environment, conversation and response so far."""

    def __init__(self, tokenizer: Any, environment: Any, row: Mapping[str, Any]) -> None:
        self.tokenizer = tokenizer
        self.environment = environment
        self.name = type(environment).__name__
        # its own copy: the episodes of a group share one row, which the rewards read after
        start = call_environment(environment, "reset", copy.deepcopy(row))
        schemas = tool_schemas_of(environment)
        try:
            self.conversation = Conversation(tokenizer, start, schemas)
            self.prompt_ids = self.conversation.prompt_ids
        except Exception as error:  # a start the protocol refuses, or the template raised
            raise unrendered(f"the episode {self.name}.reset started", error) from error
        self.last_turn_start = 0
        """Where the latest model turn starts in :attr:`tokens`."""
        self.tokens: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.texts: list[str] = []
        self.rewards: list[float | None] = []
        self.closing = ""
        self.end: str | None = None
        self.tool_calls = 0
        self.tool_errors: Counter[str] = Counter()
        self.tool_replies_cut = 0

    def room(self, limits: EpisodeLimits) -> int:
        return limits.max_tokens - len(self.tokens)

    def add_turn(self, output: Any, stops: Stops, limits: EpisodeLimits) -> bool:
        """Adds the model's turn (cut at its stop); False when it ran out of tokens first."""
        ids, logprobs = _turn_of(output)
        keep, stopped = cut_at_stop(ids, self.tokenizer, stops, self.room(limits))
        ids, logprobs = ids[:keep], logprobs[:keep]
        self.last_turn_start = len(self.tokens)
        self.tokens += ids
        self.mask += [1] * keep
        self.logprobs += logprobs
        closed = stopped and ids[-1] in stops.token_ids
        self.texts.append(_decode(self.tokenizer, ids[:-1] if closed else ids))
        self.closing = _decode(self.tokenizer, ids[-1:]) if closed else ""
        if not stopped:
            self.rewards.append(None)
            self.end = "max_tokens"
        return stopped

    def answer(self, step: Step, limits: EpisodeLimits) -> None:
        """Takes the environment's step: ends the episode, or adds its reply."""
        if not isinstance(step, Step):
            raise EnvironmentFailure(
                f"the environment {self.name}.step returned a {type(step).__name__}; an "
                "environment's step returns a lightning_troll.tasks.environments.Step"
            )
        self.rewards.append(None if step.reward is None else float(step.reward))
        self.tool_calls += step.tool_calls
        self.tool_errors.update(step.tool_errors)
        self.tool_replies_cut += step.tool_replies_cut
        if step.done:
            self.end = "done"
            return
        if len(self.texts) >= limits.max_turns:
            self.end = "max_turns"
            return
        try:
            reply = self.conversation.reply(
                self.texts[-1], self.closing, step.observation, step.role
            )
        except Exception as error:  # a reply the protocol refuses, or the template raised
            raise unrendered(f"the reply of {self.name}.step", error) from error
        if len(reply.ids) >= self.room(limits):  # the reply, and one token of the next turn
            self.end = "no_room"  # cut off after a judged turn: truncated, as inside a turn
            return  # the model never read the reply: the conversation ends at its turn
        self.conversation.add(reply)
        self.tokens += reply.ids
        self.mask += [0] * len(reply.ids)
        self.logprobs += [0.0] * len(reply.ids)

    def finish(self) -> None:
        """Ends the episode with its environment: ``on_end(end)``, where it has one, hears an end
        that the loop decided (the turn limit or the token budget) and may add a reward to the
        last turn's. The loop then closes the environment (:meth:`close`)."""
        environment = self.environment
        if self.end != "done" and callable(getattr(environment, "on_end", None)):
            reward = call_environment(environment, "on_end", self.end)
            if reward is not None:
                if not is_finite_reward(reward):
                    raise EnvironmentFailure(
                        f"the environment {self.name}.on_end({self.end!r}) returned {reward!r}; "
                        "it returns a number finite in float32 (a reward for the episode's end) "
                        "or None"
                    )
                last = self.rewards[-1]
                self.rewards[-1] = float(reward) + (0.0 if last is None else last)

    def close(self) -> None:
        """``close()``, where the environment has one: frees what it holds."""
        if callable(getattr(self.environment, "close", None)):
            call_environment(self.environment, "close")

    def episode(self) -> Episode:
        messages = [dict(m) for m in self.conversation.messages]
        if not self.conversation.plain:  # the last turn, which no reply followed
            messages.append({"role": "assistant", "content": self.texts[-1]})
        return Episode(
            self.prompt_ids, self.tokens, self.mask, self.logprobs, self.texts, self.rewards,
            str(self.end), self.tool_calls, dict(self.tool_errors), messages,
            self.last_turn_start, self.tool_replies_cut,
        )  # fmt: skip


def run_episodes(
    generate_turn: GenerateTurn,
    tokenizer: Any,
    environments: Sequence[Any],
    rows: Sequence[Mapping[str, Any]],
    limits: EpisodeLimits,
    stops: Stops,
) -> list[Episode]:
    """Runs one episode per (environment, row) pair to its end; all of a batch's running episodes
    generate each turn together. Each environment is closed when its episode ends, or when the
    batch fails."""
    if len(environments) != len(rows):
        raise ValueError(
            f"run_episodes needs one environment per row; got {len(environments)} environments "
            f"for {len(rows)} rows"
        )
    closed: list[Any] = []  # a failure closes the others (closed_on_failure)
    with closed_on_failure(lambda: [e for e in environments if all(e is not c for c in closed)]):
        running = [_Running(tokenizer, e, row) for e, row in zip(environments, rows, strict=True)]
        active = list(running)
        while active:
            outputs = generate_turn(
                [r.prompt_ids + r.tokens for r in active], [r.room(limits) for r in active], stops
            )
            if len(outputs) != len(active):
                raise ValueError(
                    f"generate_turn returned {len(outputs)} turns for {len(active)} sequences"
                )
            asking = [
                r for r, out in zip(active, outputs, strict=True) if r.add_turn(out, stops, limits)
            ]
            steps = step_all([r.environment for r in asking], [r.texts[-1] for r in asking])
            for episode, step in zip(asking, steps, strict=True):
                episode.answer(step, limits)
            for episode in (r for r in active if r.end is not None):
                closed.append(episode.environment)  # closed here once, whatever is raised
                with closed_on_failure(lambda e=episode: [e.environment]):
                    episode.finish()
                episode.close()
            active = [r for r in active if r.end is None]
    return [r.episode() for r in running]


@dataclass(frozen=True)
class PaddedEpisodes:
    """A batch of episodes' responses as right-padded tensors, as a rollout holds them."""

    tokens: Tensor
    """(B, T) int64 response tokens, ``pad_id`` after each episode's end."""
    attention_mask: Tensor
    """(B, T) bool, True on every response token (the model's and the environment's)."""
    mask: Tensor
    """(B, T) bool, True on the model's own tokens: the loss's response mask."""
    logprobs: Tensor
    """(B, T) float32 behaviour log-probs, 0 where ``mask`` is False."""


def pad_episodes(episodes: Sequence[Episode], pad_id: int) -> PaddedEpisodes:
    """The episodes' responses as (B, T) tensors, right padded with ``pad_id``."""
    width = max([len(e.token_ids) for e in episodes] + [1])  # T
    tokens = torch.full((len(episodes), width), pad_id, dtype=torch.long)  # (B, T)
    attention = torch.zeros((len(episodes), width), dtype=torch.bool)  # (B, T)
    mask = torch.zeros((len(episodes), width), dtype=torch.bool)  # (B, T)
    logprobs = torch.zeros((len(episodes), width), dtype=torch.float32)  # (B, T)
    for i, episode in enumerate(episodes):
        n = len(episode.token_ids)
        tokens[i, :n] = torch.tensor(episode.token_ids, dtype=torch.long)
        attention[i, :n] = True
        mask[i, :n] = torch.tensor(episode.mask, dtype=torch.bool)
        logprobs[i, :n] = torch.tensor(episode.logprobs, dtype=torch.float32)
    return PaddedEpisodes(tokens, attention, mask, logprobs.masked_fill(~mask, 0.0))
