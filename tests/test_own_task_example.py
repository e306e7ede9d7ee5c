"""docs/own-task.md as a newcomer follows it: examples/own_task/ copied to a folder of its own and
run from there with the console script, no PYTHONPATH; the same task without its reward refused in
one line (by the command's main, in this process); the page's tool trained from a folder of its
own; and the first screen of `make demo` free of library notices."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import refused_here

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "own_task"
SCRIPT = Path(sys.executable).parent / "lightning-troll"


def own_folder(tmp_path: Path) -> Path:
    """``cp -r examples/own_task ~/my_task``: the example in a folder outside the repository."""
    folder = tmp_path / "my_task"
    shutil.copytree(EXAMPLE, folder)
    return folder


def command(line: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """A ``lightning-troll ...`` line of the page, run in ``cwd`` as a user would: the console
    script, no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    args = [str(SCRIPT), *line.split()[1:]]
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def page_commands() -> list[str]:
    """The ``lightning-troll`` lines of the page's bash blocks (continuations joined)."""
    text = (ROOT / "docs" / "own-task.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    lines = [" ".join(line.split()) for b in blocks for line in b.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line.startswith("lightning-troll ")]


# a budget of one rollout of 2 prompts x 2 completions (two optimiser steps), 2 held-out rows
TINY = (
    " --trainer.max_steps 2 --trainer.val_check_interval 1 --data.batch_size 2"
    " --model.group_size 2 --model.optimization.minibatch_size 2 --model.sampling.max_new_tokens 8"
    " --data.num_val 2 --data.val_batch_size 2"
)


def fit_in_own_folder(folder: Path, module: str, model_dir: Path, monkeypatch) -> Any:
    """``lightning-troll fit --config task.yaml`` for one rollout (:data:`TINY`) in this process,
    from ``folder``, with no PYTHONPATH: ``module`` (beside task.yaml) is found there and
    forgotten afterwards. Returns the command's LightningCLI."""
    from lightning_troll.cli.command import run as cli_run

    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.delitem(sys.modules, module, raising=False)
    try:
        return cli_run(
            ["fit", "--config", "task.yaml", *TINY.split(), "--model.model", str(model_dir)]
        )
    finally:
        sys.modules.pop(module, None)


def test_the_page_runs_the_example_as_it_is(tmp_path):
    """The commands the test runs are the page's, word for word (the budget and model added)."""
    assert page_commands() == [
        "lightning-troll fit --config task.yaml",
        "lightning-troll fit --config task.yaml --config chat.yaml",
        "lightning-troll export --ckpt_path runs/lightning_logs/version_0/checkpoints/last.ckpt "
        "--output_dir my-model",
    ]


@pytest.mark.slow
def test_the_example_trains_and_exports_from_its_own_folder(tmp_path, tiny_chat_model_dir):
    """The conversational form (both YAMLs, so both forms' settings) for one rollout on a tiny
    model with SmolLM2-135M-Instruct's tokenizer and chat template; my_reward.py is found in the working directory; the logs hold
    TensorBoard events; the export writes a model folder."""
    folder = own_folder(tmp_path)
    fit, conversational, export = page_commands()
    done = command(f"{conversational}{TINY} --model.model {tiny_chat_model_dir}", folder)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lightning-troll: training finished" in done.stdout
    assert "reward/mean" in done.stdout
    logs = folder / "runs" / "lightning_logs" / "version_0"
    assert list(logs.glob("events.out.tfevents.*"))  # tensorboard --logdir runs
    done = command(export, folder)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (folder / "my-model" / "config.json").is_file()
    assert (folder / "my-model" / "tokenizer_config.json").is_file()


def refused_in(folder: Path, monkeypatch, capsys) -> list[str]:
    """``lightning-troll fit --config task.yaml`` in ``folder``, by the command's ``main`` in this
    process (the console script's own lines: tests/test_parse_errors.py): exit status 2, and the
    lines it wrote to stderr. A ``my_reward`` another test imported in this process is set
    aside for the call, as a fresh process would not have it."""
    monkeypatch.delitem(sys.modules, "my_reward", raising=False)
    stderr = refused_here(["fit", "--config", "task.yaml"], folder, monkeypatch, capsys)
    return stderr.strip().splitlines()


def test_the_example_without_its_reward_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    folder = own_folder(tmp_path)
    task = folder / "task.yaml"
    lines = task.read_text().splitlines()
    task.write_text("\n".join(line for line in lines if "rewards:" not in line) + "\n")
    assert refused_in(folder, monkeypatch, capsys) == [
        "lightning-troll: error: model.rewards is not set, and only the built-in TinyMath data "
        "has a reward of its own (data.source='data/plain.jsonl'); name one in the config, e.g. "
        "model.rewards: {my_reward:score: 1.0} for score(prompt, completion, row) -> float in "
        "my_reward.py beside it, or a built-in: {last_number: 1.0}, {gsm8k: 1.0}, {boxed: 1.0}"
    ]
    assert not (folder / "runs").exists()


def test_a_reward_module_found_nowhere_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    folder = own_folder(tmp_path)
    (folder / "my_reward.py").unlink()
    (line,) = refused_in(folder, monkeypatch, capsys)
    assert line == (
        "lightning-troll: error: model.rewards: 'my_reward:number_reward': no module 'my_reward' "
        f"in the working directory {folder} (and not importable); put my_reward.py with the "
        "function in one of these folders, or name a built-in reward"
    )


NOTICES = ("warning", "deprecat", "tip:", "flops", "litlogger")


@pytest.mark.slow
def test_the_first_screen_of_the_demo_carries_no_library_notice(tmp_path, tiny_model_dir):
    """`make demo`'s command with a small budget: its first 60 lines (stdout and stderr as a
    terminal shows them) hold no warning, deprecation, tip or FLOPs count."""
    configs = f"--config {ROOT / 'configs/tinymath.yaml'} --config {ROOT / 'configs/demo.yaml'}"
    budget = (
        f" --model.model {tiny_model_dir} --trainer.max_steps 2 --data.batch_size 8"
        " --model.optimization.minibatch_size 32 --model.lr_scheduler.init_args.total_steps 2"
        " --trainer.val_check_interval 1 --data.num_val 8 --data.val_batch_size 8"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    args = [str(SCRIPT), "fit", *configs.split(), *budget.split()]
    done = subprocess.run(
        args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    first = done.stdout.splitlines()[:60]
    noisy = [line for line in first if any(word in line.lower() for word in NOTICES)]
    assert noisy == []
    assert any("Trainable params" in line for line in first)  # the summary is still there


@pytest.mark.slow
def test_the_plain_form_trains_from_its_own_folder(tmp_path, tiny_chat_model_dir):
    """The page's plain command (task.yaml alone: plain rows, my_reward.py beside it) for one
    rollout on a tiny model with SmolLM2-135M-Instruct's tokenizer, from a folder outside the repository, no PYTHONPATH."""
    folder = own_folder(tmp_path)
    fit, _, _ = page_commands()
    done = command(f"{fit}{TINY} --model.model {tiny_chat_model_dir}", folder)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lightning-troll: training finished" in done.stdout
    assert "reward/mean" in done.stdout
    assert list((folder / "runs" / "lightning_logs" / "version_0").glob("events.out.tfevents.*"))


def test_the_pages_tool_trains_from_a_folder_of_its_own(tmp_path, tiny_chat_model_dir, monkeypatch):
    """The page's ``my_tools.py``, word for word, beside a task.yaml that lists it, in a folder
    outside the repository: one rollout of tool episodes on a model with SmolLM2's tokenizer and
    chat template (no tool section: the tools go into a system message), its tool in a worker
    process with a timeout, no PYTHONPATH. Whether a model calls it is the episodes' tests'
    business (tests/test_episodes.py scripts the calls)."""
    from lightning_troll.tasks.data.prompts import write_jsonl

    text = (ROOT / "docs" / "own-task.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S)
                if b.startswith("# my_tools.py, beside task.yaml")]  # fmt: skip
    folder = tmp_path / "my_tool_task"
    folder.mkdir()
    (folder / "my_tools.py").write_text(block)
    rows = [  # the prompt in a column of its own name: the episodes start from it all the same
        {"question": f"What is {a} times 7? Use the tools.", "answer": str(7 * a)} for a in range(8)
    ]
    write_jsonl(folder / "rows.jsonl", rows)
    (folder / "task.yaml").write_text(
        "model:\n  rewards: {last_number: 1.0}\n"
        "  episodes: {tools: [my_tools:multiply], max_turns: 2, tool_workers: 1, tool_timeout: 5}\n"
        "data: {source: rows.jsonl, prompt_field: question, answer_field: answer}\n"
    )
    cli = fit_in_own_folder(folder, "my_tools", tiny_chat_model_dir, monkeypatch)
    logged = cli.trainer.logged_metrics
    assert cli.trainer.global_step == 2
    assert cli.model.episodes.config.tools == ["my_tools:multiply"]
    assert 1 <= float(logged["episodes/turns_mean"]) <= 2
    errors = {k: float(v) for k, v in logged.items() if k.startswith("episodes/tool_errors_")}
    assert errors and set(errors.values()) == {0.0}, errors
    assert "val/accuracy" in logged
