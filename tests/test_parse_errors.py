"""Parse errors of ``lightning-troll``: at most 3 lines on stderr, exit status 2, before any work,
with the closest valid name, the file and line, or the allowed values."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_troll.cli.command import main as cli_main
from lightning_troll.cli.parse_errors import config_paths, describe, suggest

ROOT = Path(__file__).resolve().parents[1]
TINYMATH = str(ROOT / "configs" / "tinymath.yaml")


def refused(args: list[str], tmp_path: Path, monkeypatch, capsys) -> str:
    """Runs ``lightning-troll <args>`` in ``tmp_path``; asserts exit status 2, at most 3 lines on
    stderr and nothing written; returns the first line of stderr."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-troll"])  # as the console script runs
    with pytest.raises(SystemExit) as exited:
        cli_main(args)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert exited.value.code == 2, err
    assert 1 <= len(lines) <= 3, err
    assert "usage:" not in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # refused before any work
    assert lines[0].startswith("lightning-troll: error: ")
    return lines[0].removeprefix("lightning-troll: error: ")


def write(tmp_path: Path, name: str, text: str) -> str:
    (tmp_path / name).write_text(text)
    return name


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        ("--data.batchsize", "no option --data.batchsize; did you mean --data.batch_size?"),
        ("--model.group_sise", "no option --model.group_sise; did you mean --model.group_size?"),
        (
            "--model.trust_region.epss",
            "no option --model.trust_region.epss; did you mean --model.trust_region.eps?",
        ),
        ("--modle.group_size", "did you mean --model.group_size?"),
    ],
)
def test_a_misspelt_option_on_the_command_line_gets_did_you_mean(
    flag, expected, tmp_path, monkeypatch, capsys
):
    line = refused(["fit", "--config", TINYMATH, flag, "2"], tmp_path, monkeypatch, capsys)
    assert expected in line


def test_a_misspelt_yaml_key_names_its_file_and_the_closest_key(tmp_path, monkeypatch, capsys):
    name = write(tmp_path, "task.yaml", "model:\n  group_size: 4\n  objectiv: troll\n")
    line = refused(["fit", "--config", name], tmp_path, monkeypatch, capsys)
    assert line == "task.yaml: no option model.objectiv; did you mean model.objective?"


def test_a_yaml_syntax_error_names_its_file_and_line(tmp_path, monkeypatch, capsys):
    name = write(tmp_path, "broken.yaml", "model:\n  group_size: 4\n  rewards: {a: 1\n")
    line = refused(["fit", "--config", TINYMATH, "--config", name], tmp_path, monkeypatch, capsys)
    assert line.startswith("broken.yaml, line 4, column 1: ")
    assert "at line 3, column 12" in line  # where the unclosed mapping opened


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model.objective", "kl"], "model.objective: 'kl' is not allowed; choose one of troll, clip"),
        (
            ["--model.advantages.scale_rewards", "std"],
            "model.advantages.scale_rewards: 'std' is not allowed; choose one of group, batch, none or null",
        ),
        (["--model.group_size", "two"], "model.group_size: expected an integer; got 'two'"),
        (["--model.sampling.temperature", "hot"], "expected a number; got 'hot'"),
        (
            ["--model.optimizer.init_args.lrr", "1"],
            "model.optimizer: torch.optim.AdamW takes no argument 'lrr'; did you mean 'lr'?",
        ),
        # the fields of an optional record, which jsonargparse reports against the whole record
        (["--model.episodes.max_turns", "1.5"],
         "model.episodes.max_turns: expected an integer; got '1.5'"),
        (["--model.episodes.tool_workers", "two"],
         "model.episodes.tool_workers: expected an integer; got 'two'"),
        (["--model.episodes.tools", "my_tools:multiply"],
         "model.episodes.tools: expected a list or null; got 'my_tools:multiply'"),
        (["--model.episodes.max_turnz", "3"],
         "no option model.episodes.max_turnz; did you mean model.episodes.max_turns?"),
    ],
)  # fmt: skip
def test_a_bad_value_says_what_is_allowed(args, expected, tmp_path, monkeypatch, capsys):
    line = refused(["fit", "--config", TINYMATH, *args], tmp_path, monkeypatch, capsys)
    assert line == expected or expected in line


def test_a_misspelt_field_of_an_optional_record_in_a_file_names_the_file(
    tmp_path, monkeypatch, capsys
):
    name = write(tmp_path, "task.yaml", "model:\n  episodes:\n    max_turn: 3\n")
    line = refused(["fit", "--config", TINYMATH, "--config", name], tmp_path, monkeypatch, capsys)
    assert line == (
        "task.yaml: no option model.episodes.max_turn; did you mean model.episodes.max_turns?"
    )


def test_a_bad_value_in_a_file_names_the_file(tmp_path, monkeypatch, capsys):
    name = write(tmp_path, "task.yaml", "model:\n  objective: kl\n")
    line = refused(["fit", "--config", name], tmp_path, monkeypatch, capsys)
    assert line == "model.objective: 'kl' is not allowed (in task.yaml); choose one of troll, clip"


def test_a_missing_config_file_says_where_it_was_looked_for(tmp_path, monkeypatch, capsys):
    line = refused(["fit", "--config", "nowhere.yaml"], tmp_path, monkeypatch, capsys)
    assert line == f"--config nowhere.yaml: no such file: {tmp_path / 'nowhere.yaml'}"


def test_a_misspelt_command_gets_did_you_mean(tmp_path, monkeypatch, capsys):
    line = refused(["fitt", "--config", TINYMATH], tmp_path, monkeypatch, capsys)
    assert line.startswith("no command 'fitt'; did you mean fit?")


def test_debug_keeps_jsonargparses_own_report(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        cli_main(["--debug", "fit", "--config", TINYMATH, "--data.batchsize", "2"])
    assert exited.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_help_and_print_config_are_unchanged(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        cli_main(["fit", "--config", TINYMATH, "--print_config"])
    assert exited.value.code == 0
    assert yaml.safe_load(capsys.readouterr().out)["model"]["group_size"] == 8


def test_the_console_script_prints_at_most_three_lines(tmp_path):
    """As a user sees it: a separate process, nothing but the error on stderr, status 2."""
    (tmp_path / "task.yaml").write_text("data:\n  batchsise: 4\n")
    script = Path(sys.executable).parent / "lightning-troll"
    done = subprocess.run(
        [str(script), "fit", "--config", "task.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) <= 3, done.stderr
    assert lines[0] == (
        "lightning-troll: error: task.yaml: no option data.batchsise; did you mean data.batch_size?"
    )


# -- the pieces ----------------------------------------------------------------------------------


def test_suggest_corrects_one_dotted_part_at_a_time():
    names = {"model.group_size", "model.trust_region.eps", "data.batch_size", "data.seed"}
    assert suggest("modle.group_size", names) == "model.group_size"
    assert suggest("model.trust_regoin.epss", names) == "model.trust_region.eps"
    assert suggest("data.batch_size", names) is None  # already valid: nothing to suggest
    assert suggest("model.zzz", names) is None  # nothing close


def test_describe_and_config_paths():
    from typing import Literal

    assert describe(int) == "an integer"
    assert describe(float | None) == "a number or null"
    assert describe(Literal["a", "b"]) == "one of a, b"
    args = ["fit", "--config", "a.yaml", "-c", "b.yaml", "--config=c.yaml", "--x", "1"]
    assert config_paths(args) == ["a.yaml", "b.yaml", "c.yaml"]
