"""A task of one's own: reward modules found in the working directory, then beside the config;
no silent default reward; configurations that cannot train refused before the model loads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lightning_troll.cli.command import main as cli_main
from lightning_troll.tasks.rewards.lookup import config_folders
from lightning_troll.tasks.rewards.registry import resolve_reward
from lightning_troll.training.preflight import check_rollout_split, task_rewards

ROOT = Path(__file__).resolve().parents[1]
TINYMATH = str(ROOT / "configs" / "tinymath.yaml")


def reward_module(folder: Path, value: float, name: str = "my_reward") -> Path:
    """``folder/<name>.py`` whose ``score`` returns ``value``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(f"def score(prompt, completion, row):\n    return {value}\n")
    return path


def task_folders(tmp_path: Path) -> tuple[Path, Path]:
    """(working directory, the config's folder), each with its own my_reward.py."""
    cwd, configs = tmp_path / "work", tmp_path / "configs"
    reward_module(cwd, 1.0)
    reward_module(configs, 2.0)
    (configs / "task.yaml").write_text("model:\n  rewards: {my_reward:score: 1.0}\n")
    return cwd, configs


# -- where a reward module is found --------------------------------------------------------------


def test_the_working_directory_comes_before_the_configs_folder(tmp_path, monkeypatch):
    """Two modules named my_reward: the working directory's (score 1.0) wins; without it the
    config's folder's (score 2.0) is found; without the config's folder neither is."""
    cwd, configs = task_folders(tmp_path)
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the folders found join sys.path
    with config_folders([configs / "task.yaml"]):
        assert resolve_reward("my_reward:score")("", "", {}) == 1.0
        (cwd / "my_reward.py").unlink()
        assert resolve_reward("my_reward:score")("", "", {}) == 2.0
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as error:
        resolve_reward("my_reward:score")
    assert str(error.value) == (
        f"model.rewards: 'my_reward:score': no module 'my_reward' in the working directory "
        f"{tmp_path} (and not importable); put my_reward.py with the function in one of these "
        "folders, or name a built-in reward"
    )


def test_a_missing_module_names_every_folder_looked_in(tmp_path, monkeypatch):
    cwd, configs = tmp_path / "work", tmp_path / "configs"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    with config_folders([configs / "task.yaml"]), pytest.raises(ValueError) as error:
        resolve_reward("rewardz:score")
    assert (
        f"no module 'rewardz' in the working directory {cwd} or beside the config "
        f"{configs / 'task.yaml'} (and not importable)"
    ) in str(error.value)


def test_a_missing_function_gets_did_you_mean(tmp_path, monkeypatch):
    path = reward_module(tmp_path, 1.0, name="exact_reward")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(ValueError) as error:
        resolve_reward("exact_reward:scor")
    assert str(error.value) == (
        f"model.rewards: 'exact_reward:scor': {path} has no function 'scor'; did you mean "
        "'score'? (it defines score)"
    )


def test_a_reward_module_that_fails_to_import_says_where(tmp_path, monkeypatch):
    (tmp_path / "broken_reward.py").write_text("def score(:\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(
        ValueError, match=r"importing .*broken_reward.py failed: SyntaxError.*line 1"
    ):
        resolve_reward("broken_reward:score")


def cli_refusal(args: list[str], cwd: Path, monkeypatch, capsys) -> str:
    """``lightning-troll fit <args>`` run in ``cwd``: exit status 2, nothing trained; the error."""
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["lightning-troll"])
    with pytest.raises(SystemExit) as exited:
        cli_main(["fit", *args])
    assert exited.value.code == 2
    assert not (cwd / "runs").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("lightning-troll: error: ")
    return err[-1].removeprefix("lightning-troll: error: ")


def test_the_command_looks_beside_its_config(tmp_path, monkeypatch, capsys):
    """The CLI passes its config files' folders down: a module only beside the config is found
    (the run goes on to the next check, here a refused group size), one nowhere is refused."""
    _, configs = task_folders(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setattr(sys, "path", list(sys.path))
    config = ["--config", TINYMATH, "--config", str(configs / "task.yaml")]
    error = cli_refusal([*config, "--model.group_size", "1"], elsewhere, monkeypatch, capsys)
    assert error.startswith("model.group_size=1")  # the reward was found
    (configs / "my_reward.py").unlink()
    error = cli_refusal(config, elsewhere, monkeypatch, capsys)
    assert error.startswith("model.rewards: 'my_reward:score': no module 'my_reward' in the ")
    assert f"or beside the config {configs / 'task.yaml'}" in error


@pytest.mark.parametrize("option", ["source", "val_file"])
def test_a_data_file_beside_the_config_only_is_refused_with_its_path(
    tmp_path, monkeypatch, capsys, option
):
    """Data paths are read from the working directory; a missing one that lies beside the config
    is refused with the path that would work. One found nowhere gets no such advice."""
    _, configs = task_folders(tmp_path)
    rows = "".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(4))
    (configs / "rows.jsonl").write_text(rows)
    (tmp_path / "work" / "rows.jsonl").write_text(rows)
    other = "source" if option == "val_file" else "val_file"
    config = ["--config", TINYMATH, "--config", str(configs / "task.yaml")]
    config += [
        f"--data.{option}",
        "rows.jsonl",
        f"--data.{other}",
        str(tmp_path / "work/rows.jsonl"),
    ]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setattr(sys, "path", list(sys.path))
    error = cli_refusal(config, elsewhere, monkeypatch, capsys)
    assert error.startswith(f"data.{option}: file 'rows.jsonl' does not exist; give ")
    assert error.endswith(
        f"; paths are read from the working directory {elsewhere}, and 'rows.jsonl' lies beside "
        f"the config {configs / 'task.yaml'}: give data.{option}={str(configs / 'rows.jsonl')!r}"
    )
    (configs / "rows.jsonl").unlink()
    error = cli_refusal(config, elsewhere, monkeypatch, capsys)
    assert error.endswith("or a hub dataset name" if option == "source" else ".parquet file")


# -- no silent default reward --------------------------------------------------------------------


def test_tinymath_keeps_its_reward_and_other_data_must_name_one():
    assert task_rewards(None, "tinymath") == {"tinymath": 1.0}
    assert task_rewards({"gsm8k": 1.0}, "openai/gsm8k") == {"gsm8k": 1.0}
    with pytest.raises(ValueError, match=r"^model.rewards is not set.*data.source='x.jsonl'"):
        task_rewards(None, "x.jsonl")


def test_the_command_refuses_data_without_a_reward_in_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n' * 4)
    (tmp_path / "task.yaml").write_text(
        "data: {source: rows.jsonl, batch_size: 2, num_val: 1}\n"
        "model: {optimization: {minibatch_size: 16}}\n"
    )
    error = cli_refusal(["--config", "task.yaml"], tmp_path, monkeypatch, capsys)
    assert error.startswith("model.rewards is not set, and only the built-in TinyMath data")
    assert "model.rewards: {my_reward:score: 1.0}" in error


# -- configurations that cannot train ------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_group_size_one_is_refused_for_every_group_estimator(
    estimator, tmp_path, monkeypatch, capsys
):
    args = [
        "--config",
        TINYMATH,
        "--model.group_size",
        "1",
        "--model.advantages.estimator",
        estimator,
    ]
    error = cli_refusal(args, tmp_path, monkeypatch, capsys)
    assert error.startswith(f"model.group_size=1: the estimator {estimator!r} compares")


def test_a_minibatch_larger_than_the_rollout_is_refused(tmp_path, monkeypatch, capsys):
    args = ["--config", TINYMATH, "--data.batch_size", "4"]  # tinymath.yaml: minibatch 1024
    error = cli_refusal(args, tmp_path, monkeypatch, capsys)
    assert error == (
        "model.optimization.minibatch_size=1024 is larger than a rollout: data.batch_size=4 "
        "prompts x model.group_size=8 completions = 32 sequences; lower it to at most 32 (null: "
        "the whole rollout), or raise data.batch_size"
    )
    check_rollout_split(32, 4, 8)  # exactly the rollout: fine
    check_rollout_split(None, 1, 2)


def test_a_minibatch_that_leaves_a_short_last_step_is_refused_in_one_short_line():
    """A rollout of 4,096 in minibatches of 3: the line counts the steps, it does not list them."""
    with pytest.raises(ValueError) as error:
        check_rollout_split(3, 512, 8)
    assert str(error.value) == (
        "model.optimization.minibatch_size=3 does not divide a rollout of 4096 sequences "
        "(data.batch_size=512 x model.group_size=8): 1365 steps of 3 sequences would leave a last "
        "one of 1; choose one of [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]"
    )


def test_the_python_api_refuses_the_same_at_setup(tiny_model_dir):
    """A module and a DataModule built apart: the checks run when the fit sets them up."""
    from lightning.pytorch import Trainer

    from lightning_troll.tasks.data.datamodule import PromptDataModule
    from lightning_troll.training.module import OptimizationConfig, TrollModule

    module = TrollModule(model=str(tiny_model_dir), group_size=2)
    rows = Path(tiny_model_dir) / "rows.jsonl"
    rows.write_text('{"prompt": "1+1=", "answer": "2"}\n' * 4)
    data = PromptDataModule(str(rows), tokenizer=str(tiny_model_dir), batch_size=2, num_val=1)
    trainer = Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match="^model.rewards is not set"):
        trainer.fit(module, datamodule=data)
    module = TrollModule(
        model=str(tiny_model_dir),
        group_size=2,
        rewards={"last_number": 1.0},
        optimization=OptimizationConfig(minibatch_size=8),
    )
    with pytest.raises(ValueError, match="minibatch_size=8 is larger than a rollout"):
        trainer.fit(module, datamodule=data)


def test_a_lookup_from_another_folder_keeps_what_was_importable_before(tmp_path, monkeypatch):
    """A module found in the working directory, then looked up from a folder that lacks it, is
    imported as before: the same object, and a sys.path entry the lookup did not add stays."""
    import sys
    from pathlib import Path

    from lightning_troll.tasks.rewards.registry import resolve_reward
    from tests.reward_helpers import length_reward

    root = str(Path(__file__).resolve().parents[1])
    monkeypatch.chdir(root)
    assert resolve_reward("tests.reward_helpers:length_reward") is length_reward
    monkeypatch.chdir(tmp_path)
    assert resolve_reward("tests.reward_helpers:length_reward") is length_reward
    assert root in sys.path


def test_a_reward_edited_between_two_lookups_in_one_process_is_imported_again(
    tmp_path, monkeypatch
):
    """A reward fixed between two runs in one Python process (a notebook's) trains with the fix:
    a lookup imports its module again when the source changed (the module's file, or any file of
    its package), and returns the very same function when it did not."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    names = ("my_reward", "my_pkg", "my_pkg.parts")
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        reward_module(tmp_path, 1.0)
        first = resolve_reward("my_reward:score")
        assert first("", "", {}) == 1.0 and resolve_reward("my_reward:score") is first
        reward_module(tmp_path, 0.25)  # another size too: Python's bytecode cache compares both
        assert resolve_reward("my_reward:score")("", "", {}) == 0.25
        package = tmp_path / "my_pkg"
        package.mkdir()
        (package / "__init__.py").write_text("from my_pkg.parts import score\n")
        reward_module(package, 3.0, name="parts")
        assert resolve_reward("my_pkg:score")("", "", {}) == 3.0
        reward_module(package, 0.125, name="parts")  # a file inside the package, resized
        assert resolve_reward("my_pkg:score")("", "", {}) == 0.125
    finally:
        for name in names:
            sys.modules.pop(name, None)
