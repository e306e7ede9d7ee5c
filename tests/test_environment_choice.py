"""Several environments in one run (``model.episodes.environment`` as a mapping, TRL's
multi-environment form): each row chooses its own by its ``environment`` field, each episode is
offered its own environment's tools only, and a row that chooses none is refused before anything
trains, naming the file and the line."""

from __future__ import annotations

import json

import pytest

from lightning_troll.rollouts.episodes import EpisodeLimits, Stops, run_episodes
from lightning_troll.rollouts.multiturn import environment_factory
from lightning_troll.tasks.data.prompts import write_jsonl
from lightning_troll.tasks.environments import EnvironmentChoice, TrlEnvironment
from lightning_troll.tasks.environments.options import EpisodesConfig
from lightning_troll.training.preflight import check_fit_data
from tests import tool_helpers
from tests.chat_helpers import chat_tokenizer
from tests.conftest import refused_here
from tests.test_episodes import Scripted
from tests.test_own_task_example import fit_in_own_folder

C = "tests.tool_helpers:"
CHOICE = {"count": C + "Counter", "countdown": C + "Countdown"}


def call(name: str, **arguments) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(arguments)}}}</tool_call>'


def test_each_row_plays_the_environment_it_names():
    """A TRL-form counter (tools, get_reward) and the library's countdown (no tools) in one
    batch: the counter's episode calls its tool and is scored by get_reward (2 + 8 = 10: 1.0),
    its reset never given the choosing field; the countdown's plays its 2 turns (reward 1 at the
    last), its prompt showing no tools."""
    tokenizer = chat_tokenizer()
    make = EnvironmentChoice(CHOICE)
    rows = [
        {"prompt": "Count to ten.", "start": 2, "environment": "count"},
        {"prompt": "Go down.", "turns": 2, "environment": "countdown"},
    ]
    environments = [make(row) for row in rows]
    assert isinstance(environments[0], TrlEnvironment)
    assert isinstance(environments[1], tool_helpers.Countdown)
    generate = Scripted(
        tokenizer,
        {"Count": [call("add", n=8), "Ten.<|im_end|>"], "Go down": ["a<|im_end|>", "b<|im_end|>"]},
    )
    counted, countdown = run_episodes(
        generate, tokenizer, environments, rows, EpisodeLimits(4, 800),
        Stops((tokenizer.eos_token_id,)),
    )  # fmt: skip
    assert (counted.end, counted.tool_calls, counted.turn_rewards) == ("done", 1, [None, 1.0])
    assert environments[0].instance.row == {"prompt": "Count to ten.", "start": 2}
    assert (countdown.end, countdown.tool_calls, countdown.turn_rewards) == ("done", 0, [0.0, 1.0])
    prompts = [
        tokenizer.decode(e.prompt_ids, skip_special_tokens=False) for e in (counted, countdown)
    ]
    assert '"name": "add"' in prompts[0] and '"name": "add"' not in prompts[1]
    assert make.uses_tools
    make.close()


def test_a_row_that_names_no_environment_is_refused_by_name():
    make = EnvironmentChoice(CHOICE)
    with pytest.raises(ValueError, match=r"^model.episodes.environment: the row's 'environment' "
                       r"is 'counter', which model.episodes.environment does not name; it names "
                       r"count, countdown$"):  # fmt: skip
        make({"prompt": "x", "environment": "counter"})
    with pytest.raises(ValueError, match=r"the row has no field 'environment', which "
                       r"model.episodes.environment needs to choose its environment \(one of "
                       r"count, countdown\)"):  # fmt: skip
        make({"prompt": "x"})


@pytest.mark.parametrize(
    ("environment", "message"),
    [
        ({}, r"^model.episodes.environment is an empty mapping; name one environment"),
        ({"": C + "Counter"}, r"^model.episodes.environment: '' cannot name an environment"),
    ],
)
def test_a_mapping_without_names_is_refused(environment, message):
    with pytest.raises(ValueError, match=message):
        EpisodesConfig(environment=environment)


def test_the_config_makes_a_choice_and_each_entry_is_checked_as_one():
    """``model.episodes.environment`` as a mapping makes an :class:`EnvironmentChoice`; an entry
    that cannot be an environment is refused as it would be alone, naming it."""
    made = environment_factory(EpisodesConfig(environment=CHOICE))
    assert isinstance(made, EnvironmentChoice) and sorted(made.factories) == ["count", "countdown"]
    made.close()
    with pytest.raises(ValueError, match=r"model.episodes.environment: .*NotAnEnvironment"):
        environment_factory(EpisodesConfig(environment={"a": C + "NotAnEnvironment"}))


class Data:
    """What ``check_fit_data`` reads of a DataModule: its prepared rows."""

    def __init__(self, train, val=()):
        from lightning_troll.tasks.data.prompts import PromptItem

        self.train_items = [PromptItem("p", [1], row) for row in train]
        self.val_items = [PromptItem("p", [1], row) for row in val]


def test_a_module_built_in_python_refuses_a_row_without_a_choice_at_setup():
    episodes = EpisodesConfig(environment=CHOICE)
    good = {"prompt": "x", "environment": "count"}
    check_fit_data({}, None, 2, Data([good], [good]), episodes)
    with pytest.raises(ValueError, match=r"^data: val row 1: the row's 'environment' is 'nope'"):
        check_fit_data({}, None, 2, Data([good], [good, {**good, "environment": "nope"}]), episodes)


def test_the_command_refuses_a_row_without_a_choice_before_the_model_loads(
    tmp_path, tiny_chat_model_dir, monkeypatch, capsys
):
    """The data file's third line names no environment it knows: the command stops before the
    model loads, in one line that names the file, the line and the
    environments."""
    rows = [{"prompt": "Count.", "answer": "1", "environment": "count"}] * 2 + [
        {"prompt": "Count.", "answer": "1", "environment": "cnt"}
    ]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    (tmp_path / "task.yaml").write_text(
        "model:\n  rewards: {}\n  episodes:\n    environment: "
        f"{{count: '{C}Counter', countdown: '{C}Countdown'}}\n"
        "data: {source: rows.jsonl, prompt_field: prompt, answer_field: answer}\n"
    )
    args = ["fit", "--config", "task.yaml", "--model.model", str(tiny_chat_model_dir)]
    err = refused_here(args, tmp_path, monkeypatch, capsys)
    assert err.strip().splitlines() == [
        "lightning-troll: error: data.source='rows.jsonl', line 3: the row's 'environment' is "
        "'cnt', which model.episodes.environment does not name; it names count, countdown"
    ]


def test_a_run_mixes_two_environments_from_a_folder_of_its_own(
    tmp_path, tiny_chat_model_dir, monkeypatch
):
    """Two environments in TRL's form from a module beside task.yaml: the training rows all
    choose the one scoring 1.0, the two validation rows one each (0.5 and 1.0), so the training
    reward is 1.0 and the validation reward 0.75: each episode was scored by the environment
    its row named."""
    import inspect

    folder = tmp_path / "mixed"
    folder.mkdir()
    code = inspect.getsource(tool_helpers.HalfScored)
    whole = code.replace("HalfScored", "WholeScored").replace("return 0.5", "return 1.0")
    (folder / "notes_env.py").write_text("from typing import Any\n\n\n" + code + "\n\n" + whole)
    write_jsonl(
        folder / "rows.jsonl",
        [{"prompt": f"Note {a}.", "answer": str(a), "environment": "whole"} for a in range(8)],
    )
    write_jsonl(
        folder / "val.jsonl",
        [
            {"prompt": f"Check {a}.", "answer": "0", "environment": e}
            for a, e in enumerate(("half", "whole"))
        ],
    )
    (folder / "task.yaml").write_text(
        "model:\n  rewards: {}\n  episodes:\n    max_turns: 2\n"
        "    environment: {half: notes_env:HalfScored, whole: notes_env:WholeScored}\n"
        "data: {source: rows.jsonl, val_file: val.jsonl, prompt_field: prompt, answer_field: answer}\n"
    )
    cli = fit_in_own_folder(folder, "notes_env", tiny_chat_model_dir, monkeypatch)
    logged = cli.trainer.logged_metrics
    assert cli.trainer.global_step == 2
    assert float(logged["reward/mean"]) == pytest.approx(1.0, abs=1e-6)
    assert float(logged["val/reward"]) == pytest.approx(0.75, abs=1e-6)
