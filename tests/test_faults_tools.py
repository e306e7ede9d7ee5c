"""Broken tools fail loudly: a rollout whose tools fail at ``model.episodes.tool_failure_limit``
stops the run as a failing environment does (an ``EnvironmentFailure``, which the rollout callback
turns into a saved checkpoint, two lines and exit status 3: ``tests/test_faults_environment.py``),
or warns once a rollout under ``tool_failures: warn``; a long reply is cut and counted; a hanging
tool without workers times out; a tool whose schema cannot be called as written, or an
environment without its methods, is refused before the model loads."""

from __future__ import annotations

import time
import warnings

import pytest

from lightning_troll.rollouts.multiturn import EpisodeSampler, episode_figures
from lightning_troll.tasks.environments import ToolCall, ToolRunner
from lightning_troll.tasks.environments.options import EpisodesConfig
from lightning_troll.tasks.environments.protocol import EnvironmentFailure, load_environment
from lightning_troll.tasks.environments.tool_workers import ToolResult, tool_failure_problem
from lightning_troll.tasks.environments.tools import load_tool
from tests.chat_helpers import CHATML_TOOLS, chat_tokenizer
from tests.conftest import refused_here
from tests.test_episodes import Scripted
from tests.test_faults_reward import command

H = "tests.tool_helpers:"
ZERO = '<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call>'
GOOD = '<tool_call>{"name": "divide", "arguments": {"a": 6, "b": 3}}</tool_call>'
BAD = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'


def test_the_share_of_failed_calls_counts_the_tools_faults_among_the_calls_that_ran():
    """10 calls, 4 the model's own errors (malformed, unknown, bad arguments): 6 ran. 6 of 6
    failed by the tool's fault reaches 1.0; of 12 calls (8 ran), 4 failed reach 0.5 but not 0.6;
    none ran, none; 3 of 3 failed: fewer than TOOL_FAILURE_MIN (4), none."""
    mixed = {"malformed": 2, "unknown": 1, "bad_arguments": 1}
    problem = tool_failure_problem(10, {**mixed, "raised": 4, "timeout": 2}, 1.0)
    assert problem == (
        "6 of the 6 tool calls that ran in this rollout failed (raised 4, timeout 2), at or above "
        "model.episodes.tool_failure_limit=1"
    )
    assert tool_failure_problem(10, {**mixed, "raised": 5}, 1.0) is None
    assert tool_failure_problem(12, {**mixed, "crashed": 4}, 0.5) is not None
    assert tool_failure_problem(12, {**mixed, "crashed": 4}, 0.6) is None
    assert tool_failure_problem(4, mixed, 0.1) is None
    assert tool_failure_problem(3, {"raised": 3}, 1.0) is None
    assert tool_failure_problem(4, {"raised": 4}, 1.0) is not None


def sampler(**options) -> tuple[EpisodeSampler, object]:
    tokenizer = chat_tokenizer(CHATML_TOOLS)
    config = EpisodesConfig(tools=[H + "divide"], max_turns=2, **options)
    return EpisodeSampler(config, tokenizer, [tokenizer.eos_token_id], 600), tokenizer


def play(turns: list[str], **options):
    made, tokenizer = sampler(**options)
    rows = [{"prompt": f"question {k}"} for k in range(len(turns))]
    generate = Scripted(
        tokenizer, {r["prompt"]: [t, "done"] for r, t in zip(rows, turns, strict=True)}
    )
    try:
        return made.sample(generate, rows, tokenizer.eos_token_id, "cpu")
    finally:
        made.close()


def test_a_rollout_whose_every_tool_call_raises_stops_the_run_naming_the_first_error():
    with pytest.raises(EnvironmentFailure) as stopped:
        play([ZERO, ZERO, ZERO, ZERO, BAD])
    assert str(stopped.value) == (
        "4 of the 4 tool calls that ran in this rollout failed (raised 4), at or above "
        "model.episodes.tool_failure_limit=1; the first: tool 'divide' raised ZeroDivisionError: "
        "division by zero; fix the tool, or set model.episodes.tool_failures warn to "
        "train on"
    )
    play([ZERO, GOOD])  # one call of two failed: below the default limit, the rollout trains
    play([ZERO, ZERO, ZERO])  # every call failed, but fewer than TOOL_FAILURE_MIN: it trains


def test_under_warn_each_such_rollout_warns_once_and_trains_on():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        for _ in range(2):  # the same text twice: both rollouts warn
            sampled = play([ZERO] * 4, tool_failures="warn")
    told = [str(w.message) for w in seen if "tool calls that ran" in str(w.message)]
    assert len(told) == 2 and told[0].endswith("(model.episodes.tool_failures='warn': training on)")
    assert episode_figures(sampled.episodes)["episodes/tool_errors_raised"] == 1.0


@pytest.mark.parametrize("workers", [0, 1])
def test_a_long_reply_is_cut_and_counted(workers):
    runner = ToolRunner([H + "echo"], workers=workers, reply_chars=100)
    try:
        short, long = runner.run(
            [ToolCall("echo", {"text": "x" * 100}), ToolCall("echo", {"text": "y" * 5_000_000})]
        )
    finally:
        runner.close()
    assert short == ToolResult("echo", "x" * 100)
    assert long.cut and long.error is None
    assert (
        long.text == "y" * 100 + "\n[cut: the reply was 5,000,000 characters; the first 100 shown]"
    )


def test_cut_replies_are_a_figure_of_the_rollout():
    long = '<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 3}}</tool_call>'
    sampled = play([long, GOOD], tool_reply_chars=5)  # 0.3333333333333333 is cut, 2.0 is not
    assert episode_figures(sampled.episodes)["episodes/tool_replies_cut"] == 0.5


def test_a_hanging_tool_without_workers_times_out_in_the_trainers_process():
    runner = ToolRunner([H + "sleep", H + "multiply"], workers=0, timeout=0.5)
    start = time.monotonic()
    late, fine = runner.run(
        [ToolCall("sleep", {"seconds": 30}), ToolCall("multiply", {"a": 2, "b": 3})]
    )
    assert time.monotonic() - start < 5
    assert late == ToolResult("sleep", "Error: tool 'sleep' timed out after 0.5 s", "timeout")
    assert fine == ToolResult("multiply", "6")
    assert EpisodesConfig(tools=[H + "multiply"]).tool_timeout == 60.0  # bounded by default


def star(*nums: int) -> int:
    """Add numbers.

    Args:
        nums: The numbers.
    """
    return sum(nums)


def keywords(a: int, **more: int) -> int:
    """Add numbers.

    Args:
        a: A number.
        more: More numbers.
    """
    return a


def positional(a: int, /) -> int:
    """A number.

    Args:
        a: A number.
    """
    return a


@pytest.mark.parametrize(
    ("function", "told"),
    [(star, "*nums, which takes positional arguments"), (keywords, "**more, which takes any keyword"),
     (positional, "a positional-only (before a /)")],
)  # fmt: skip
def test_a_tool_that_a_call_by_name_cannot_reach_is_refused(function, told):
    with pytest.raises(ValueError) as refused:
        load_tool(function, f"t:{function.__name__}")
    assert str(refused.value).startswith(
        f"model.episodes.tools: 't:{function.__name__}' cannot be a tool: its parameter is {told}; "
        "a tool call gives its arguments by name"
    )


def test_an_environment_without_its_step_is_refused_when_named():
    with pytest.raises(ValueError, match=r"'tests.tool_helpers:NoStep' has no step method"):
        load_environment(H + "NoStep")


def test_a_tool_that_cannot_be_called_as_written_is_refused_before_the_model_loads(
    tmp_path, monkeypatch, capsys
):
    """Through the command: at most 3 lines, no traceback, exit status 2, no run folder and the
    model never loaded (its folder is empty)."""
    (tmp_path / "my_reward.py").write_text("def reward(prompt, completion, row):\n    return 1.0\n")
    (tmp_path / "my_tools.py").write_text(
        'def add(*nums: int) -> int:\n    """Add.\n\n    Args:\n        nums: Numbers.\n    """\n'
        "    return sum(nums)\n"
    )
    empty = tmp_path / "no_model_here"
    empty.mkdir()
    episodes = ["--model.episodes", '{"tools": ["my_tools:add"]}']
    stderr = refused_here(command(tmp_path, empty, 2, *episodes)[1:], tmp_path, monkeypatch, capsys)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) <= 3 and "Traceback" not in stderr, lines
    assert any("model.episodes.tools: 'my_tools:add' cannot be a tool: its parameter is *nums"
               in line for line in lines), lines  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "my_reward.py", "my_tools.py", "no_model_here", "run.yaml"
    ]  # fmt: skip
