"""Environments written for TRL's ``environment_factory`` used as they are: ``reset(**row)``, the
public methods as tools bound to each episode's instance, ``get_reward`` as the environment's
reward however the episode ends; refused at the door where they cannot work."""

from __future__ import annotations

import inspect
import json
import sys

import pytest

from lightning_troll.rollouts.episodes import EpisodeLimits, Stops, run_episodes
from lightning_troll.tasks.environments import (
    EnvironmentFactory,
    Step,
    TrlEnvironment,
    is_trl_environment,
)
from lightning_troll.tasks.environments.protocol import EnvironmentFailure
from tests import tool_helpers
from tests.chat_helpers import chat_tokenizer
from tests.test_episodes import Scripted
from tests.test_own_task_example import fit_in_own_folder

C = "tests.tool_helpers:"


def call(name: str, **arguments) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(arguments)}}}</tool_call>'


def test_which_classes_are_in_trls_form():
    assert is_trl_environment(tool_helpers.Counter)
    assert is_trl_environment(tool_helpers.Counter())
    assert not is_trl_environment(tool_helpers.Countdown)  # the library's own protocol
    assert not is_trl_environment(object)


def test_an_episode_keeps_its_state_in_its_own_instance():
    """Two episodes, two instances: 'add 4' then 'double' gives 4 then 8 in the first, while the
    second, started at 3, gives 3 + 4 = 7. The methods are the tools, the private one not."""
    first, second = TrlEnvironment(tool_helpers.Counter()), TrlEnvironment(tool_helpers.Counter())
    assert sorted(s["function"]["name"] for s in first.tool_schemas) == ["add", "double"]
    assert first.reset({"prompt": "Count."}) == [{"role": "user", "content": "Count."}]
    talk = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count"}]
    assert second.reset({"prompt": talk, "start": 3}) == [
        talk[0], {"role": "user", "content": "Count (start at 3)"}  # appended, as TRL does
    ]  # fmt: skip
    assert second.instance.row == {"prompt": talk, "start": 3}  # reset(**row)
    steps = [
        first.step(call("add", n=4)),
        first.step(call("double")),
        second.step(call("add", n=4)),
    ]
    assert [s.observation[0]["content"] for s in steps] == ["4", "8", "7"]
    assert [s.tool_calls for s in steps] == [1, 1, 1]
    assert first.step("It is 8.") == Step(reward=0.0, done=True)  # get_reward: 8 != 10
    assert second.on_end("max_turns") == 0.0
    first.instance.count = 10
    assert first.step("Ten.") == Step(reward=1.0, done=True)


def test_an_episode_reads_each_methods_schema_once(monkeypatch):
    """The schemas come from the docstrings and type hints once per episode (two methods, two
    reads), not once to check them and again to load them."""
    from lightning_troll.tasks.environments import tools

    reads = []
    real = tools.tool_schema
    monkeypatch.setattr(tools, "tool_schema", lambda *a: reads.append(a[1]) or real(*a))
    TrlEnvironment(tool_helpers.Counter())
    assert sorted(reads) == ["Counter.add", "Counter.double"]


def test_async_reset_tools_and_reward_are_awaited():
    env = TrlEnvironment(tool_helpers.AsyncCounter())
    assert env.reset({"prompt": "Go", "start": 2})[-1]["content"] == "Go (start at 2)"
    assert env.step(call("double")).observation[0]["content"] == "4"
    assert env.step("Four.") == Step(reward=4.0, done=True)


def test_the_factory_pools_instances_made_once_and_reset_often():
    """As TRL does: the instance made to check the tools starts the pool; an episode takes an
    idle instance and a new one is made only when none is idle; an ended episode (closed, once)
    gives its instance back."""
    before = tool_helpers.Counter.made
    make = EnvironmentFactory(C + "Counter", tools=[C + "multiply"])
    assert tool_helpers.Counter.made == before + 1  # the one made to check the tools
    assert make.uses_tools and make.runner is not None and len(make.idle) == 1
    checked = make.idle[0]
    a, b = make(), make()
    assert isinstance(a, TrlEnvironment) and a.instance is checked  # taken from the pool
    assert b.instance is not checked and tool_helpers.Counter.made == before + 2  # none idle
    names = sorted(s["function"]["name"] for s in a.tool_schemas)
    assert names == ["add", "double", "multiply"]  # model.episodes.tools join the methods
    a.close()
    a.close()  # an episode gives its instance back once
    b.close()
    assert len(make.idle) == 2 and {id(i) for i in make.idle} == {id(checked), id(b.instance)}
    c = make()
    assert c.instance in (checked, b.instance) and tool_helpers.Counter.made == before + 2
    make.close()


def test_a_reused_instance_plays_each_episode_from_its_reset():
    """Two batches of three episodes through one factory: the second batch reuses the first's
    three instances (no new one made) and, each reset from its row, plays exactly as the first:
    start at 2, add 6 (8), add 2 (10), answer: get_reward 1.0."""
    tokenizer = chat_tokenizer()
    make = EnvironmentFactory(C + "Counter")
    made = tool_helpers.Counter.made

    def batch():
        turns = [call("add", n=6)] * 3 + [call("add", n=2)] * 3 + ["Ten.<|im_end|>"] * 3
        episodes = run_episodes(
            Scripted(tokenizer, {"Count": turns}), tokenizer, [make() for _ in range(3)],
            [{"prompt": "Count to ten.", "start": 2}] * 3, EpisodeLimits(4, 800),
            Stops((tokenizer.eos_token_id,)),
        )  # fmt: skip
        return [(e.end, e.turn_rewards, e.token_ids) for e in episodes]

    first = batch()
    assert tool_helpers.Counter.made == made + 2  # the checked instance, and two more
    assert first[0][:2] == ("done", [None, None, 1.0])
    assert batch() == first and tool_helpers.Counter.made == made + 2 and len(make.idle) == 3


def test_environments_in_trls_form_are_refused_where_they_cannot_work():
    with pytest.raises(
        ValueError, match=r"tool_workers=1 with .*Counter'.* TRL's form: its methods"
    ):
        EnvironmentFactory(C + "Counter", tools=[C + "multiply"], tool_workers=1)
    message = r"^model.episodes.environment: 'Undocumented.poke' cannot be a tool: .* no docstring"
    with pytest.raises(ValueError, match=message):
        EnvironmentFactory(C + "Undocumented")
    env = TrlEnvironment(tool_helpers.Counter())
    env.instance.reset = lambda **row: 3
    with pytest.raises(EnvironmentFailure, match=r"Counter.reset returned a int; .* None or a str"):
        env.reset({"prompt": "Go"})
    env.instance.get_reward = lambda: float("nan")
    with pytest.raises(EnvironmentFailure, match=r"Counter.get_reward returned nan"):
        env.step("Done.")
    env.instance.get_reward = lambda: 1 / 0
    message = r"^the environment Counter.get_reward raised ZeroDivisionError: division by zero"
    with pytest.raises(EnvironmentFailure, match=message):
        env.on_end("max_turns")


def test_a_trl_environment_plays_token_level_episodes_with_its_reward():
    """The episode loop over a TRL-form environment: a tool call, its result as a message the
    model did not write (mask 0), then the final answer scored by get_reward (count 10: 1.0)."""
    tokenizer = chat_tokenizer()
    turns = [call("add", n=6), call("add", n=4), "Ten.<|im_end|>"]
    generate = Scripted(tokenizer, {"Count": turns})
    make = EnvironmentFactory(C + "Counter")
    (episode,) = run_episodes(
        generate, tokenizer, [make()], [{"prompt": "Count to ten."}], EpisodeLimits(4, 800),
        Stops((tokenizer.eos_token_id,)),
    )  # fmt: skip
    assert (episode.end, episode.turns, episode.tool_calls) == ("done", 3, 2)
    assert episode.turn_rewards == [None, None, 1.0]
    assert 0 in episode.mask and episode.mask[0] == 1
    replies = [m["content"] for m in episode.messages if m["content"].startswith("<tool_response>")]
    assert replies == [
        "<tool_response>\n6\n</tool_response>",
        "<tool_response>\n10\n</tool_response>",
    ]


def test_a_trl_environment_trains_from_a_folder_of_its_own(
    tmp_path, tiny_chat_model_dir, monkeypatch
):
    """An environment class in TRL's form beside task.yaml, its reward from get_reward alone
    (model.rewards empty): every episode scores 0.5 however it ends, so reward/mean is 0.5."""
    from lightning_troll.tasks.data.prompts import write_jsonl

    folder = tmp_path / "my_task"
    folder.mkdir()
    code = inspect.getsource(tool_helpers.HalfScored)
    (folder / "notes_env.py").write_text("from typing import Any\n\n\n" + code)
    write_jsonl(
        folder / "rows.jsonl", [{"prompt": f"Note {a}.", "answer": str(a)} for a in range(8)]
    )
    (folder / "task.yaml").write_text(
        "model:\n  rewards: {}\n  episodes: {environment: notes_env:HalfScored, max_turns: 2}\n"
        "data: {source: rows.jsonl, prompt_field: prompt, answer_field: answer}\n"
    )
    cli = fit_in_own_folder(folder, "notes_env", tiny_chat_model_dir, monkeypatch)
    logged = cli.trainer.logged_metrics
    assert cli.trainer.global_step == 2
    assert float(logged["reward/mean"]) == pytest.approx(0.5, abs=1e-7)
    assert float(logged["val/reward"]) == pytest.approx(0.5, abs=1e-7)


def test_the_pages_environment_works_as_written(tmp_path, monkeypatch):
    """docs/own-task.md's ``counter_env.py``, word for word, named by import path from its own
    folder: adding 10 is rewarded 1, adding 3 is not."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "own-task.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S)
                if b.startswith("# counter_env.py, beside task.yaml")]  # fmt: skip
    (tmp_path / "counter_env.py").write_text(block)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "counter_env", raising=False)
    try:
        make = EnvironmentFactory("counter_env:Counter")
        rewards = []
        for n in (10, 3):
            env = make()
            env.reset({"prompt": "Count to ten."})
            assert env.step(call("add", n=n)).observation[0]["content"] == str(n)
            rewards.append(env.step("Done.").reward)
        assert rewards == [1.0, 0.0]
    finally:
        sys.modules.pop("counter_env", None)
