"""An option given before a ``--config`` file that sets it too is overridden by the file: the
command warns, naming the option, the file and what the file sets."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lightning_troll.cli import run
from lightning_troll.cli.order import overridden_options

ROOT = Path(__file__).resolve().parents[1]
TINYMATH = str(ROOT / "configs" / "tinymath.yaml")


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "trainer:\n  accelerator: cpu\n  max_steps: 4\n"
        "model:\n  episodes: null\n  optimizer:\n    class_path: torch.optim.AdamW\n"
        "    init_args: {lr: 1.0e-4}\n"
    )
    return str(path)


def test_an_option_before_a_config_that_sets_it_is_named_with_what_the_config_sets(config):
    for args in (
        ["fit", "--trainer.accelerator", "gpu", "--config", config],
        ["fit", "--trainer.accelerator=gpu", f"--config={config}"],
        ["fit", "--trainer.accelerator", "gpu", "-c", config],
    ):
        assert overridden_options(args) == [
            f"--trainer.accelerator gpu comes before --config {config}, which sets "
            "trainer.accelerator: cpu; options apply in the order given, so the config's value "
            "is used. Give --config first, then the options that override it."
        ]


def test_keys_under_or_above_a_config_setting_count_and_others_do_not(config):
    args = ["fit", "--model.episodes.environment", "env:Game", "--seed_everything", "3",
            "--model.optimizer.init_args.lr", "0.1", "--trainer.devices", "2",
            "--model.optimizer", "torch.optim.SGD", "--config", config]  # fmt: skip
    messages = overridden_options(args)
    assert [m.split(" comes before")[0] for m in messages] == [
        "--model.episodes.environment env:Game",
        "--model.optimizer.init_args.lr 0.1",
        "--model.optimizer torch.optim.SGD",
    ]
    assert "which sets model.episodes: None;" in messages[0]
    assert "which sets model.optimizer.init_args.lr: 0.0001;" in messages[1]
    assert "which sets model.optimizer.class_path: torch.optim.AdamW;" in messages[2]


def test_no_warning_when_the_config_comes_first_or_the_option_is_given_again(config):
    assert overridden_options(["fit", "--config", config, "--trainer.accelerator", "gpu"]) == []
    again = ["fit", "--trainer.accelerator", "gpu", "--config", config, "--trainer.accelerator=gpu"]
    assert overridden_options(again) == []
    assert overridden_options(["fit", "--trainer.max_steps", "9", "--config", TINYMATH]) == [
        f"--trainer.max_steps 9 comes before --config {TINYMATH}, which sets trainer.max_steps: "
        "400; options apply in the order given, so the config's value is used. Give --config "
        "first, then the options that override it."
    ]


def test_paths_among_the_arguments_are_read_as_text(config):
    args = ["fit", "--trainer.default_root_dir", Path("runs"), "--config", Path(config)]
    assert overridden_options(args) == []


def test_each_config_file_overrides_only_what_came_before_it(config, tmp_path):
    other = tmp_path / "other.yaml"
    other.write_text("trainer:\n  devices: 1\n")
    args = ["fit", "--config", str(other), "--trainer.devices", "2", "--trainer.accelerator",
            "gpu", "--config", config]  # fmt: skip
    (message,) = overridden_options(args)
    assert message.startswith(f"--trainer.accelerator gpu comes before --config {config}")


@pytest.mark.parametrize(
    "text", [None, "trainer: [unclosed\n", "- a list\n", "just text\n"], ids=str
)
def test_a_config_that_cannot_be_read_as_a_mapping_is_left_to_the_parser(tmp_path, text):
    path = tmp_path / "bad.yaml"
    if text is not None:
        path.write_text(text)
    assert overridden_options(["fit", "--trainer.accelerator", "gpu", "--config", str(path)]) == []


def test_the_command_warns_before_it_parses(monkeypatch, capsys):
    """``--print_config`` parses the whole command line and stops: the warning came before."""
    monkeypatch.setattr(sys, "argv", ["lightning-troll"])
    args = ["fit", "--trainer.accelerator", "gpu", "--config", TINYMATH, "--print_config"]
    warned = r"--trainer.accelerator gpu comes before --config .*tinymath.yaml, which sets trainer"
    with pytest.warns(UserWarning, match=warned), pytest.raises(SystemExit):
        run(args)
    assert "accelerator: cpu" in capsys.readouterr().out  # the config's value is the one used
