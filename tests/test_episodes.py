"""The episode loop at token level: model tokens with mask 1 and their log-probs, environment
tokens with mask 0 as the template renders them, and the three ways an episode ends."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_troll.rollouts.episodes import (
    EpisodeLimits,
    GeneratedTurn,
    Stops,
    cut_at_stop,
    pad_episodes,
    run_episodes,
)
from lightning_troll.rollouts.multiturn import last_turn, sampled_turns
from lightning_troll.tasks.environments import (
    Environment,
    EnvironmentFactory,
    Step,
    ToolCall,
    ToolEnvironment,
    ToolRunner,
    parse_tool_calls,
)
from lightning_troll.tasks.environments.protocol import EnvironmentFailure
from lightning_troll.tasks.environments.tools import tool_schema
from tests import tool_helpers
from tests.chat_helpers import chat_tokenizer, encode

CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>'
FIRST = "Let me see.\n" + CALL
"""The first turn: it ends at the end of the tool call (what follows it is cut)."""
REPLY = (
    "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)
"""What the template writes after the first turn: the close of the model's turn (the model
stopped at the stop string, not at <|im_end|>), the result as a user turn (the template has no
tool role), and the next generation prompt."""
SECOND = "It is 42.<|im_end|>"


def logprobs_of(n: int) -> list[float]:
    return [-(k + 1) / 100 for k in range(n)]


class Scripted:
    """A ``generate_turn`` that plays each episode's scripted turns, found by a text its prompt
    holds, each followed by text that a stop should cut; it records what it was asked."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]]) -> None:
        self.tokenizer = tokenizer
        self.scripts = {key: list(turns) for key, turns in scripts.items()}
        self.asked: list[tuple[list[list[int]], list[int]]] = []

    def __call__(self, prompts, max_new_tokens, stops):
        self.asked.append((prompts, max_new_tokens))
        turns = []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt)
            key = next(k for k in self.scripts if k in text)
            ids = encode(self.tokenizer, self.scripts[key].pop(0) + "\nAND MORE")
            turns.append(GeneratedTurn(ids, logprobs_of(len(ids))))
        return turns


def tool_episode(budget: int = 400, max_turns: int = 4, rows=({"prompt": "6*7?"},)):
    tokenizer = chat_tokenizer()
    runner = ToolRunner(["tests.tool_helpers:multiply"])
    generate = Scripted(tokenizer, {row["prompt"]: [FIRST, SECOND] for row in rows})
    envs = [ToolEnvironment(runner) for _ in rows]
    stops = Stops((tokenizer.eos_token_id,))
    episodes = run_episodes(
        generate, tokenizer, envs, list(rows), EpisodeLimits(max_turns, budget), stops
    )
    return tokenizer, generate, episodes


def test_a_tool_episode_masks_the_environments_tokens_as_the_template_renders_them():
    tokenizer, generate, (episode,) = tool_episode()
    first, reply, second = (
        encode(tokenizer, FIRST),
        encode(tokenizer, REPLY),
        encode(tokenizer, SECOND),
    )
    assert episode.token_ids == first + reply + second
    assert episode.mask == [1] * len(first) + [0] * len(reply) + [1] * len(second)
    assert episode.logprobs == logprobs_of(len(first)) + [0.0] * len(reply) + logprobs_of(
        len(second)
    )
    assert (episode.end, episode.truncated, episode.turns) == ("done", False, 2)
    assert episode.turn_texts == [FIRST, "It is 42."]
    assert episode.turn_rewards == [None, None]
    assert (episode.tool_calls, episode.tool_errors) == (1, {})
    # the prompt and the response are the whole conversation as the template renders it
    rendered = tokenizer.apply_chat_template(episode.messages, tokenize=False)
    whole = tokenizer.decode(episode.prompt_ids + episode.token_ids, skip_special_tokens=False)
    assert "<bos>" + rendered == whole + "\n"  # the template's final close: <|im_end|>\n
    # the second turn continued the whole context, with what was left of the budget
    (_, _), (prompts, room) = generate.asked
    assert prompts == [episode.prompt_ids + first + reply] and room == [400 - len(first + reply)]


def test_tool_errors_are_counted_by_kind_over_the_episode():
    tokenizer = chat_tokenizer()
    bad = '<tool_call>{"name": "divide", "arguments": {}}</tool_call>'
    generate = Scripted(tokenizer, {"6*7?": [bad, "<tool_call>{</tool_call>" + bad, SECOND]})
    (episode,) = run_episodes(
        generate, tokenizer, [ToolEnvironment(ToolRunner([tool_helpers.multiply]))],
        [{"prompt": "6*7?"}], EpisodeLimits(4, 800), Stops((tokenizer.eos_token_id,)),
    )  # fmt: skip
    assert episode.end == "done" and episode.turns == 3
    assert episode.tool_calls == 2  # a turn ends at its first </tool_call>
    assert episode.tool_errors == {"unknown": 1, "malformed": 1}
    assert "Error: unknown tool 'divide'; the tools are multiply" in episode.messages[-4]["content"]
    assert "Error: the tool call is malformed: it is not JSON" in episode.messages[-2]["content"]


def test_a_call_escaping_half_a_surrogate_pair_is_an_error_the_model_reads():
    """All ASCII, as a model writes it, but its JSON decodes to text no tokenizer can read: a
    tool that echoed it would make a reply that cannot be tokenized. The call is malformed, the
    episode goes on."""
    tokenizer = chat_tokenizer()
    half = '<tool_call>{"name": "echo", "arguments": {"text": "Paris \\ud83d"}}</tool_call>'
    generate = Scripted(tokenizer, {"Echo": [half, SECOND]})
    (episode,) = run_episodes(
        generate, tokenizer, [ToolEnvironment(ToolRunner([tool_helpers.echo]))],
        [{"prompt": "Echo"}], EpisodeLimits(4, 800), Stops((tokenizer.eos_token_id,)),
    )  # fmt: skip
    assert (episode.end, episode.turns, episode.tool_errors) == ("done", 2, {"malformed": 1})
    assert "it escapes text that holds half a surrogate pair" in episode.messages[-2]["content"]


class TakesTheAnswer(Environment):
    """Takes the answer out of its row, and adds a hint to the row's own messages."""

    def reset(self, row):
        self.answer = row.pop("answer")
        row["prompt"].append({"role": "user", "content": "Hint: it is even."})
        return row["prompt"]

    def step(self, turn):
        return Step(reward=float(turn.strip() == self.answer), done=True)


def test_each_episode_of_a_group_gets_its_own_copy_of_the_row():
    """The episodes of a group share one row, which the rewards read after them: what one
    environment does to its row reaches neither its siblings nor the row."""
    tokenizer = chat_tokenizer()
    row = {"prompt": [{"role": "user", "content": "Guess"}], "answer": "4"}
    generate = Scripted(tokenizer, {"Guess": ["4<|im_end|>"] * 3})
    episodes = run_episodes(
        generate, tokenizer, [TakesTheAnswer() for _ in range(3)], [row] * 3,
        EpisodeLimits(2, 400), Stops((tokenizer.eos_token_id,)),
    )  # fmt: skip
    assert [e.turn_rewards for e in episodes] == [[1.0]] * 3
    assert [len(e.messages) for e in episodes] == [3] * 3  # user, hint, the model's answer
    assert row == {"prompt": [{"role": "user", "content": "Guess"}], "answer": "4"}


def test_the_turn_limit_ends_an_episode_after_the_models_turn():
    tokenizer = chat_tokenizer()
    generate = Scripted(tokenizer, {"go": ["a<|im_end|>", "b<|im_end|>", "c<|im_end|>"]})
    rows = [{"prompt": "go", "turns": 5}]
    envs = [tool_helpers.Countdown()]
    (episode,) = run_episodes(
        generate, tokenizer, envs, rows, EpisodeLimits(2, 400), Stops((tokenizer.eos_token_id,))
    )
    assert (episode.end, episode.turns, episode.turn_rewards) == ("max_turns", 2, [0.0, 0.0])
    reply = encode(tokenizer, "\n<|im_start|>user\n4 left<|im_end|>\n<|im_start|>assistant\n")
    model = encode(tokenizer, "a<|im_end|>")
    assert episode.token_ids == model + reply + encode(tokenizer, "b<|im_end|>")
    assert episode.mask == [1] * len(model) + [0] * len(reply) + [1] * len(model)


def test_the_environment_ends_an_episode_with_its_reward():
    tokenizer = chat_tokenizer()
    generate = Scripted(tokenizer, {"go": ["a<|im_end|>", "b<|im_end|>"]})
    (episode,) = run_episodes(
        generate, tokenizer, [tool_helpers.Countdown()], [{"prompt": "go", "turns": 2}],
        EpisodeLimits(3, 400), Stops((tokenizer.eos_token_id,)),
    )  # fmt: skip
    assert (episode.end, episode.turns, episode.turn_rewards) == ("done", 2, [0.0, 1.0])


def test_the_token_budget_cuts_a_turn_and_the_environment_is_not_asked():
    tokenizer = chat_tokenizer()
    budget = len(encode(tokenizer, FIRST)) - 3
    _, _, (episode,) = tool_episode(budget)
    assert (episode.end, episode.truncated, episode.turns) == ("max_tokens", True, 1)
    assert episode.token_ids == encode(tokenizer, FIRST)[:budget] and episode.mask == [1] * budget
    assert episode.turn_rewards == [None] and episode.tool_calls == 0


def test_the_token_budget_ends_an_episode_before_a_reply_without_room_after_it():
    """The reply would fill the budget exactly, leaving the next turn no token: the episode ends
    after the model's turn, which the environment answered, at ``"no_room"``; cut off by the
    budget, so truncated (neither the environment nor a final answer ended it). One token more,
    and the next turn gets that one token, and is cut off inside it, at ``"max_tokens"``."""
    tokenizer = chat_tokenizer()
    first, reply = encode(tokenizer, FIRST), encode(tokenizer, REPLY)
    _, _, (episode,) = tool_episode(len(first) + len(reply))
    assert (episode.end, episode.truncated, episode.token_ids) == ("no_room", True, first)
    assert episode.tool_calls == 1  # the environment was asked
    _, generate, (episode,) = tool_episode(len(first) + len(reply) + 1)
    assert (episode.end, episode.truncated) == ("max_tokens", True)
    assert episode.token_ids == first + reply + encode(tokenizer, "I")
    assert generate.asked[1][1] == [1]


def test_an_episode_ended_before_a_reply_holds_no_message_the_model_did_not_read():
    """The budget has no room for the tool's result after the first turn: the conversation ends
    at that turn (system, user, the assistant's call), with neither the result the model never
    read nor the turn twice. With room, the result and the second turn follow."""
    tokenizer = chat_tokenizer()
    first, reply = encode(tokenizer, FIRST), encode(tokenizer, REPLY)
    _, _, (cut,) = tool_episode(len(first) + len(reply))
    _, _, (whole,) = tool_episode()
    assert [m["role"] for m in whole.messages] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert whole.messages[3]["content"] == "<tool_response>\n42\n</tool_response>"
    assert whole.messages[2:5:2] == [
        {"role": "assistant", "content": FIRST},
        {"role": "assistant", "content": "It is 42."},
    ]
    assert cut.messages == whole.messages[:3]
    rendered = tokenizer.apply_chat_template(cut.messages, tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\n" + FIRST + "<|im_end|>\n")


class Judged(tool_helpers.Countdown):
    """A countdown that hears how the loop ended its episode and prices it, and records the
    order of the calls it gets at the end."""

    prices = {"max_turns": -0.5, "max_tokens": -2.0, "no_room": -4.0}

    def reset(self, row):
        self.heard: list[str] = []
        return super().reset(row)

    def on_end(self, end):
        self.heard.append(f"on_end {end}")
        return self.prices[end]

    def close(self):
        self.heard.append("close")


def test_on_end_hears_the_turn_limit_and_the_budget_and_prices_the_last_turn():
    """The loop's ends reach ``on_end`` once, before ``close``; its reward adds to the last
    turn's (None counting as 0); an end the environment decided does not call it."""
    tokenizer = chat_tokenizer()
    stops = Stops((tokenizer.eos_token_id,))
    turn = len(encode(tokenizer, "aaaa<|im_end|>"))
    cases = [  # limits, the turns' rewards, what the environment heard
        (EpisodeLimits(2, 400), "max_turns", [0.0, -0.5], ["on_end max_turns", "close"]),
        (EpisodeLimits(3, 2), "max_tokens", [-2.0], ["on_end max_tokens", "close"]),
        # the turn fits with one token to spare, and the reply "2 left" does not: step judged it
        (EpisodeLimits(3, turn + 1), "no_room", [-4.0], ["on_end no_room", "close"]),
        (EpisodeLimits(3, 400), "done", [0.0, 0.0, 1.0], ["close"]),
    ]
    for limits, end, rewards, heard in cases:
        generate = Scripted(tokenizer, {"go": ["aaaa<|im_end|>"] * 3})
        env = Judged()
        (episode,) = run_episodes(
            generate, tokenizer, [env], [{"prompt": "go", "turns": 3}], limits, stops
        )
        assert (episode.end, episode.turn_rewards, env.heard) == (end, rewards, heard)


def test_on_end_must_return_a_finite_number_or_none():
    tokenizer = chat_tokenizer()
    for bad in (float("nan"), "1", True, 1e39):

        class Bad(tool_helpers.Countdown):
            def on_end(self, end, bad=bad):
                return bad

        generate = Scripted(tokenizer, {"go": ["a<|im_end|>"] * 2})
        with pytest.raises(
            EnvironmentFailure,
            match=r"the environment Bad.on_end\('max_turns'\) returned .*; it returns a number "
            r"finite in float32 \(a reward for the episode's end\) or None",
        ):
            run_episodes(generate, tokenizer, [Bad()], [{"prompt": "go", "turns": 5}],
                         EpisodeLimits(1, 400), Stops((tokenizer.eos_token_id,)))  # fmt: skip


class Closing(tool_helpers.Countdown):
    """A countdown that counts its closes, and raises in ``step`` at a turn given by its row
    (or in ``reset`` for ``fail_at`` 0), and in ``close`` when asked."""

    def __init__(self, close_raises: bool = False) -> None:
        self.closes, self.close_raises = 0, close_raises

    def reset(self, row):
        self.fail_at, self.turn = row.get("fail_at"), 0
        if self.fail_at == 0:
            raise KeyError("answer")
        return super().reset(row)

    def step(self, turn):
        self.turn += 1
        if self.turn == self.fail_at:
            raise KeyError("answer")
        return super().step(turn)

    def close(self):
        self.closes += 1
        if self.close_raises:
            raise OSError("already gone")


@pytest.mark.parametrize("fail_at", [0, 2])
def test_a_failing_batch_closes_every_environment_once_and_keeps_its_error(fail_at):
    """One episode's environment raises (in reset, or in step at its second turn) while the
    others run: each environment is closed exactly once, the one that ended before the failure
    by its own end, the others by the clean-up, whose own error (a close that raises) does not
    hide the failure."""
    tokenizer = chat_tokenizer()
    rows = [{"prompt": "go", "turns": 1}, {"prompt": "run", "turns": 3, "fail_at": fail_at},
            {"prompt": "walk", "turns": 3}]  # fmt: skip
    envs = [Closing(), Closing(), Closing(close_raises=True)]
    generate = Scripted(tokenizer, {k: ["a<|im_end|>"] * 3 for k in ("go", "run", "walk")})
    with pytest.raises(
        EnvironmentFailure, match=r"the environment Closing\.(reset|step) raised KeyError"
    ):
        run_episodes(generate, tokenizer, envs, rows, EpisodeLimits(3, 400),
                     Stops((tokenizer.eos_token_id,)))  # fmt: skip
    assert [env.closes for env in envs] == [1, 1, 1]


class EndRaises(Closing):
    """A closing countdown whose ``on_end`` raises."""

    def on_end(self, end):
        raise ValueError(f"no score for {end}")


@pytest.mark.parametrize(
    ("first", "limits", "error"),
    [
        (Closing(close_raises=True), EpisodeLimits(3, 400), r"Closing\.close raised OSError"),
        (EndRaises(), EpisodeLimits(1, 400), r"EndRaises\.on_end raised ValueError"),
    ],
    ids=["close", "on_end"],
)
def test_an_environment_that_raises_at_its_own_end_is_closed_once(first, limits, error):
    """An episode that ends normally and whose environment then raises, in ``close`` or in
    ``on_end``, is closed exactly once (not again by the batch's clean-up), the other
    environments once each, and the error names the method."""
    tokenizer = chat_tokenizer()
    rows = [{"prompt": "go", "turns": 1 if limits.max_turns > 1 else 3},
            {"prompt": "walk", "turns": 3}]  # fmt: skip
    first.closes = 0
    envs = [first, Closing()]
    generate = Scripted(tokenizer, {k: ["a<|im_end|>"] * 3 for k in ("go", "walk")})
    with pytest.raises(EnvironmentFailure, match=error):
        run_episodes(generate, tokenizer, envs, rows, limits,
                     Stops((tokenizer.eos_token_id,)))  # fmt: skip
    assert [env.closes for env in envs] == [1, 1]


def test_a_batch_runs_each_episode_to_its_own_end_and_pads():
    tokenizer = chat_tokenizer()
    rows = [{"prompt": "go", "turns": 1}, {"prompt": "run", "turns": 2}]
    generate = Scripted(tokenizer, {"go": ["a<|im_end|>"], "run": ["bb<|im_end|>", "c<|im_end|>"]})
    episodes = run_episodes(
        generate, tokenizer, [tool_helpers.Countdown(), tool_helpers.Countdown()], rows,
        EpisodeLimits(4, 400), Stops((tokenizer.eos_token_id,)),
    )  # fmt: skip
    assert [len(prompts) for prompts, _ in generate.asked] == [2, 1]  # the first ended at once
    padded = pad_episodes(episodes, pad_id=tokenizer.pad_token_id)
    width = len(episodes[1].token_ids)
    assert padded.tokens.shape == padded.mask.shape == padded.logprobs.shape == (2, width)
    assert padded.tokens[0].tolist() == encode(tokenizer, "a<|im_end|>") + [0] * (width - 2)
    assert padded.attention_mask.sum(-1).tolist() == [2, width]
    assert padded.mask[1].tolist() == [bool(m) for m in episodes[1].mask]
    assert padded.mask.sum().item() == 2 + 3 + 2  # model tokens: "a<im_end>", "bb<im_end>", ...
    assert bool((padded.logprobs[~padded.mask] == 0).all())
    assert padded.logprobs[1, :3].tolist() == pytest.approx(logprobs_of(3))


def test_a_turn_is_cut_at_the_first_stop():
    tokenizer = chat_tokenizer()
    stops = Stops((tokenizer.eos_token_id,))
    ids = encode(tokenizer, "ab<|im_end|>cd")
    assert cut_at_stop(ids, tokenizer, stops, 10) == (3, True)
    assert cut_at_stop(ids, tokenizer, stops, 2) == (2, False)
    ids = encode(tokenizer, "x</tool_call>y<|im_end|>")
    assert cut_at_stop(ids, tokenizer, stops, 100) == (len("x</tool_call>"), True)
    assert cut_at_stop(ids, tokenizer, Stops((), ()), 100) == (len(ids), False)


def test_a_turn_makes_one_tool_call_whatever_the_environment():
    """A turn that writes two tool calls ends at the end of the first: an environment of our
    own, no ToolEnvironment, reads that one call, and the second is no part of the episode."""

    class Reads(Environment):
        def reset(self, row):
            self.turns = []
            return [{"role": "user", "content": row["prompt"]}]

        def step(self, turn):
            self.turns.append(turn)
            return Step(done=True)

    tokenizer = chat_tokenizer()
    environment = Reads()
    (episode,) = run_episodes(
        Scripted(tokenizer, {"go": [CALL + "\n" + CALL]}), tokenizer, [environment],
        [{"prompt": "go"}], EpisodeLimits(2, 400), Stops((tokenizer.eos_token_id,)),
    )  # fmt: skip
    assert environment.turns == [CALL] == episode.turn_texts
    assert episode.token_ids == encode(tokenizer, CALL) and episode.end == "done"
    assert parse_tool_calls(environment.turns[0]) == [ToolCall("multiply", {"a": 6, "b": 7})]


def test_generate_turn_must_answer_every_sequence_with_matching_log_probs():
    tokenizer = chat_tokenizer()
    args = ([tool_helpers.Countdown()], [{"prompt": "go", "turns": 1}], EpisodeLimits(1, 9),
            Stops((tokenizer.eos_token_id,)))  # fmt: skip
    with pytest.raises(ValueError, match="generate_turn returned 0 turns for 1 sequences"):
        run_episodes(lambda p, n, s: [], tokenizer, *args)
    with pytest.raises(ValueError, match="generate_turn gave 2 tokens but 1 log-probs"):
        run_episodes(lambda p, n, s: [GeneratedTurn([5, 6], [0.0])], tokenizer, *args)
    (episode,) = run_episodes(lambda p, n, s: [[5, tokenizer.eos_token_id]], tokenizer, *args)
    assert episode.logprobs == [0.0, 0.0] and episode.end == "done"
    with pytest.raises(ValueError, match="model.episodes.max_turns must be an integer >= 1; got 0"):
        EpisodeLimits(0, 9)
    with pytest.raises(ValueError, match="model.sampling.max_new_tokens must be an integer >= 1"):
        EpisodeLimits(1, 0)


# -- real sampling from TinyMath -------------------------------------------------------------------


class OneTurn(Environment):
    """A plain-text prompt, and the first turn ends the episode."""

    def reset(self, row):
        return row["prompt"]

    def step(self, turn):
        return Step(done=True)


class MoreToAdd(Environment):
    """A plain-text prompt; each turn is answered with ``+1=`` until ``turns`` turns."""

    def __init__(self, turns: int) -> None:
        self.turns = turns

    def reset(self, row):
        return row["prompt"]

    def step(self, turn):
        self.turns -= 1
        return Step(done=True) if self.turns == 0 else Step("+1=")


@pytest.fixture(scope="module")
def tinymath():
    from lightning_troll.models.loading import load_policy, load_tokenizer, stop_token_ids
    from lightning_troll.models.tinymath import generate_problems

    model, tokenizer = load_policy("tinymath"), load_tokenizer("tinymath")
    return model, tokenizer, stop_token_ids(tokenizer, model), generate_problems(6, seed=3)


@pytest.mark.parametrize("do_sample", [False, True])
def test_an_episode_of_one_turn_is_a_plain_completion(tinymath, do_sample):
    """The same tokens, the same mask and the same behaviour log-probs as sampling the prompts
    once, greedily or (from the same seed) at random."""
    from lightning_troll.engines.behaviour import BehaviourRecorder
    from lightning_troll.engines.sampling import SamplingConfig, sample

    model, tokenizer, stop_ids, rows = tinymath
    sampling = SamplingConfig(max_new_tokens=6)
    pad = tokenizer.pad_token_id
    prompts = [tokenizer(row["prompt"])["input_ids"] for row in rows]
    recorder = BehaviourRecorder(sampling.temperature)
    torch.manual_seed(0)
    ids, _, response_mask, _ = sample(
        model, prompts, 1, sampling, pad, list(stop_ids), do_sample, recorder
    )  # (B, S + T), (B, T)
    width = response_mask.shape[1]
    logprobs = recorder.finish(ids[:, -width:]).logprobs.masked_fill(~response_mask, 0.0)
    torch.manual_seed(0)
    episodes = run_episodes(
        sampled_turns(model, sampling, pad, do_sample), tokenizer, [OneTurn() for _ in rows],
        rows, EpisodeLimits(1, sampling.max_new_tokens), Stops(stop_ids),
    )  # fmt: skip
    padded = pad_episodes(episodes, pad)
    assert torch.equal(padded.tokens, ids[:, -width:])
    assert torch.equal(padded.mask, response_mask)
    assert torch.equal(padded.attention_mask, response_mask)
    assert torch.allclose(padded.logprobs, logprobs, atol=1e-6)
    assert all(e.prompt_ids == p for e, p in zip(episodes, prompts, strict=True))


def test_sampled_episodes_continue_after_the_environments_tokens(tinymath):
    model, tokenizer, stop_ids, rows = tinymath
    from lightning_troll.engines.sampling import SamplingConfig

    torch.manual_seed(1)
    episodes = run_episodes(
        sampled_turns(model, SamplingConfig(max_new_tokens=40), tokenizer.pad_token_id),
        tokenizer, [MoreToAdd(3) for _ in rows], rows, EpisodeLimits(3, 40), Stops(stop_ids),
    )  # fmt: skip
    reply = tokenizer("+1=", add_special_tokens=False)["input_ids"]
    for episode in episodes:
        assert episode.end in ("done", "max_turns", "max_tokens", "no_room")
        environment = [t for t, m in zip(episode.token_ids, episode.mask, strict=True) if m == 0]
        assert environment == reply * (episode.turns - 1)
        # every model turn but a truncated last ends with the eos token
        ends = [k for k, m in enumerate(episode.mask) if m and (k + 1 == len(episode.mask)
                or episode.mask[k + 1] == 0)]  # fmt: skip
        assert len(ends) == episode.turns
        assert all(episode.token_ids[k] in stop_ids for k in ends[: len(ends) - episode.truncated])
        assert all(lp < 0 for lp, m in zip(episode.logprobs, episode.mask, strict=True) if m)
    assert any(episode.turns == 3 for episode in episodes)


@pytest.mark.parametrize("budget", [16, 40])
def test_a_turn_sampled_up_to_its_own_room_is_the_turn_cut_there(tinymath, budget):
    """Greedy episodes of three turns whose turns are each sampled up to the room their episode
    has left are those sampled up to the batch's largest room and then cut: the same tokens,
    mask, ends and log-probs. The rooms differ from the second turn on, and no turn runs past
    its own; with 16 tokens, three episodes' last turns end at a room smaller than another's
    (two cut there, one stopping there)."""
    from lightning_troll.engines.sampling import SamplingConfig

    model, tokenizer, stop_ids, rows = tinymath
    generate = sampled_turns(model, SamplingConfig(max_new_tokens=budget), 0, do_sample=False)
    turns = []

    def own(prompts, rooms, stops):
        out = generate(prompts, rooms, stops)
        turns.append((rooms, [len(t.token_ids) for t in out]))
        return out

    def largest(prompts, rooms, stops):
        return generate(prompts, [max(rooms)] * len(rooms), stops)

    def play(generate_turn):
        return run_episodes(
            generate_turn, tokenizer, [MoreToAdd(3) for _ in rows], rows,
            EpisodeLimits(3, budget), Stops(stop_ids),
        )  # fmt: skip

    ours, theirs = play(own), play(largest)
    for a, b in zip(ours, theirs, strict=True):
        assert (a.token_ids, a.mask, a.end) == (b.token_ids, b.mask, b.end)
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-6)
    assert any(len(set(rooms)) > 1 for rooms, _ in turns)
    assert all(n <= r for rooms, n_s in turns for r, n in zip(rooms, n_s, strict=True))
    cut = [n == r < max(rooms) for rooms, n_s in turns for r, n in zip(rooms, n_s, strict=True)]
    assert sum(cut) == (3 if budget == 16 else 0)


def test_a_step_that_is_not_a_step_is_refused():
    class Tuple(OneTurn):
        def step(self, turn):
            return ("Lower.", 0.0, False)

    tokenizer = chat_tokenizer()
    with pytest.raises(
        EnvironmentFailure, match=r"the environment Tuple.step returned a tuple; an environment's "
    ):
        run_episodes(
            lambda p, n, s: [[5, tokenizer.eos_token_id]], tokenizer, [Tuple()],
            [{"prompt": "go"}], EpisodeLimits(2, 9), Stops((tokenizer.eos_token_id,)),
        )  # fmt: skip


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no text")


def test_an_environment_that_raises_is_named_with_the_method_and_the_error():
    """reset, step and close raising (one with an exception whose own __str__ raises): each is
    an EnvironmentFailure that names the environment, the method and the error."""
    tokenizer = chat_tokenizer()

    def run(environment):
        generate = Scripted(tokenizer, {"go": ["a<|im_end|>"] * 3})
        run_episodes(generate, tokenizer, [environment], [{"prompt": "go", "turns": 2}],
                     EpisodeLimits(3, 400), Stops((tokenizer.eos_token_id,)))  # fmt: skip

    class BadReset(tool_helpers.Countdown):
        def reset(self, row):
            raise KeyError("answer")

    class BadStep(tool_helpers.Countdown):
        def step(self, turn):
            raise Unprintable()

    class BadClose(tool_helpers.Countdown):
        def close(self):
            raise OSError("the sandbox is gone")

    class BadStart(tool_helpers.Countdown):
        def reset(self, row):
            return [{"role": "user"}]

    class BadTools(tool_helpers.Countdown):
        @property
        def tool_schemas(self):
            raise AttributeError("no tools yet")

    expected = [
        (BadReset, "the environment BadReset.reset raised KeyError: 'answer'"),
        (BadStep, "the environment BadStep.step raised Unprintable: (its message could not be "),
        (BadClose, "the environment BadClose.close raised OSError: the sandbox is gone"),
        (BadStart, "the episode BadStart.reset started: reset(row) (a plain prompt string, or "
         "messages): message 0 needs a string 'content'"),
        (BadTools, "the environment BadTools.tool_schemas raised AttributeError: no tools yet"),
    ]  # fmt: skip
    for environment, message in expected:
        with pytest.raises(EnvironmentFailure, match=re.escape(message)):
            run(environment())


def test_an_environment_chooses_its_tools_in_reset():
    """``tool_schemas`` is read after ``reset``: an environment that picks an episode's tools
    from its row shows the model those tools, and only those."""
    tokenizer = chat_tokenizer()

    class PerRowTools(tool_helpers.Countdown):
        @property
        def tool_schemas(self):
            return self.tools  # set by reset: before it, reading raises AttributeError

        def reset(self, row):
            self.tools = [tool_schema(getattr(tool_helpers, row["tool"]), row["tool"])]
            return super().reset(row)

    generate = Scripted(tokenizer, {"go": ["a<|im_end|>"] * 2})
    rows = [
        {"prompt": "go", "turns": 1, "tool": "multiply"},
        {"prompt": "go", "turns": 1, "tool": "divide"},
    ]
    episodes = run_episodes(generate, tokenizer, [PerRowTools(), PerRowTools()], rows,
                            EpisodeLimits(3, 400), Stops((tokenizer.eos_token_id,)))  # fmt: skip
    prompts = [tokenizer.decode(e.prompt_ids, skip_special_tokens=False) for e in episodes]
    assert '"name": "multiply"' in prompts[0] and '"name": "divide"' not in prompts[0]
    assert '"name": "divide"' in prompts[1] and '"name": "multiply"' not in prompts[1]


STRICT = (
    "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if message.role == 'critic' %}"
    "{{ raise_exception('no critics here') }}{% endif %}<|im_start|>{{ message.role }}\n"
    "{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML whose template refuses a system message and a message of role ``critic``."""


def test_an_environment_that_cannot_be_made_or_rendered_is_named_with_the_error():
    """Making the environment (its class or its function) and rendering its episode through the
    chat template (whose raise_exception raises jinja2's TemplateError, not a ValueError) fail
    as its methods do: an EnvironmentFailure naming the environment, what failed and the error,
    which a run stops on (last.ckpt saved, exit status 3)."""

    class Unmade(tool_helpers.Countdown):
        def __init__(self):
            raise ConnectionError("the game server went away")

    def unmade_game():
        raise KeyError("seed")

    class SystemStart(tool_helpers.Countdown):
        def reset(self, row):
            return [{"role": "system", "content": "Count."}, *super().reset(row)]

    class Critic(tool_helpers.Countdown):
        def step(self, turn):
            return Step("Try again.", role="critic")

    for make, message in [
        (Unmade, "the environment Unmade could not be made: ConnectionError: the game server "
         "went away"),
        (unmade_game, "the environment unmade_game could not be made: KeyError: 'seed'"),
    ]:  # fmt: skip
        with pytest.raises(EnvironmentFailure) as error:
            EnvironmentFactory(make)()
        assert str(error.value) == message
    tokenizer = chat_tokenizer(STRICT)
    for environment, message in [
        (SystemStart(), "the episode SystemStart.reset started: the chat template raised "
         "TemplateError: System role not supported"),
        (Critic(), "the reply of Critic.step: the chat template raised TemplateError: no "
         "critics here"),
    ]:  # fmt: skip
        generate = Scripted(tokenizer, {"go": ["a<|im_end|>"] * 3})
        with pytest.raises(EnvironmentFailure) as error:
            run_episodes(generate, tokenizer, [environment], [{"prompt": "go", "turns": 2}],
                         EpisodeLimits(3, 400), Stops((tokenizer.eos_token_id,)))  # fmt: skip
        assert str(error.value) == message


class PlainEmptyReplies(Environment):
    """A plain-text episode of 3 turns whose replies are empty: no environment tokens part the
    turns."""

    def reset(self, row):
        self.turns = 0
        return str(row["prompt"])

    def step(self, turn):
        self.turns += 1
        return Step(done=True) if self.turns == 3 else Step("", reward=0.0)


def test_with_empty_replies_the_final_answer_is_the_last_turn_alone():
    """Turns '142', '19' and '7' with nothing between them: the answer a reward scores is '7',
    not the whole response '142197'."""
    tokenizer = chat_tokenizer()
    eos = tokenizer.eos_token
    generate = Scripted(tokenizer, {"Sum": [f"142{eos}", f"19{eos}", f"7{eos}"]})
    (episode,) = run_episodes(generate, tokenizer, [PlainEmptyReplies()], [{"prompt": "Sum:"}],
                              EpisodeLimits(3, 400), Stops((tokenizer.eos_token_id,)))  # fmt: skip
    assert episode.turn_texts == ["142", "19", "7"] and all(episode.mask)
    last = encode(tokenizer, f"7{eos}")
    assert episode.token_ids[episode.last_turn_start :] == last
    mask = torch.tensor([episode.mask], dtype=torch.bool)
    chosen = last_turn(mask, [episode])[0]
    kept = [t for t, keep in zip(episode.token_ids, chosen.tolist(), strict=True) if keep]
    assert kept == last
