"""A start that cannot train is refused early and leaves nothing behind: prompts a run cannot use
(a conversation's role, a chat template that raises or is missing, a prompt too long) are named by
the file's line before the model loads, with the tokenizer alone; a refusal once the model has
loaded removes the run folder that start created.

Each refusal runs the ``lightning-troll`` command in this process (``refused_here``): exit status
2, at most 3 lines on stderr, no traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lightning_troll.training.module import TrollModule
from tests.conftest import refused_here
from tests.test_faults_reward import command

REWARD = "def reward(prompt, completion, row):\n    return 1.0\n"
RAISES = (
    "{% for m in messages %}{% if loop.first and m['role'] == 'assistant' %}"
    "{{ raise_exception('Conversations must start with a user turn') }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
)


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def tokenizer_only(model_dir: Path, folder: Path, chat_template: str | None = None) -> Path:
    """A folder with ``model_dir``'s tokenizer and no weights: a run that loaded the model from
    it would fail, so a refusal from it was made before the model loads."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    return folder


def refused(tmp_path, model: Path, rows: list, monkeypatch, capsys, *extra: str) -> list[str]:
    """The lines a refused start wrote on stderr, checked: at most 3, no traceback, and nothing
    written in ``tmp_path`` but what the test put there."""
    (tmp_path / "my_reward.py").write_text(REWARD)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = sorted(p.name for p in tmp_path.iterdir()) + ["run.yaml"]
    args = command(tmp_path, model, 2, "--data.source", "rows.jsonl", "--data.num_val", "0",
                   "--data.num_train", "null", *extra)[1:]  # fmt: skip
    stderr = refused_here(args, tmp_path, monkeypatch, capsys)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) <= 3 and "Traceback" not in stderr, lines
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(before))
    return lines


@pytest.mark.parametrize(
    ("bad", "told"),
    [({"prompt": [{"role": "robot", "content": "hi"}]},
      "data.prompt_field='prompt': line 3 of the train rows of 'rows.jsonl': message 0 has role "
      "'robot'; roles are system, user, assistant, tool"),
     ({"prompt": [{"role": "user", "content": 7}]},
      "data.prompt_field='prompt': line 3 of the train rows of 'rows.jsonl': message 0 needs a "
      "string 'content'"),
     ({"prompt": user("2+2?")},
      "train line 3 of 'rows.jsonl': the tokenizer has no chat template to write a "
      "conversational row")],
)  # fmt: skip
def test_a_conversation_the_run_cannot_write_is_refused_by_line_before_the_model_loads(
    bad, told, tmp_path, tiny_model_dir, monkeypatch, capsys
):
    model = tokenizer_only(tiny_model_dir, tmp_path / "tokenizer_only")
    rows = [{"prompt": f"{k}+1=", "answer": str(k + 1)} for k in range(4)]
    rows[2] = {**bad, "answer": "4"}
    lines = refused(tmp_path, model, rows, monkeypatch, capsys)
    assert any(line.startswith(f"lightning-troll: error: {told}") for line in lines), lines


def test_a_chat_template_that_raises_is_one_line_naming_the_row_and_its_error(
    tmp_path, tiny_model_dir, monkeypatch, capsys
):
    model = tokenizer_only(tiny_model_dir, tmp_path / "tokenizer_only", RAISES)
    rows = [{"prompt": user(f"{k}+1="), "answer": str(k + 1)} for k in range(4)]
    rows[3] = {"prompt": [{"role": "assistant", "content": "hi"}, *user("2+2?")], "answer": "4"}
    lines = refused(tmp_path, model, rows, monkeypatch, capsys)
    assert lines[0] == (
        "lightning-troll: error: train line 4 of 'rows.jsonl': the tokenizer's chat template "
        "cannot write it (TemplateError: Conversations must start with a user turn); fix the "
        "row, or give a tokenizer whose template takes it (model.model names the tokenizer)"
    )


def test_a_prompt_too_long_is_named_by_its_line_as_a_user_counts(
    tmp_path, tiny_model_dir, monkeypatch, capsys
):
    """Row 40 (0-based) of the file is its line 41."""
    model = tokenizer_only(tiny_model_dir, tmp_path / "tokenizer_only")
    rows = [{"prompt": f"{k % 9}+1=", "answer": "1"} for k in range(50)]
    rows[40] = {"prompt": "1" * 100_000, "answer": "1"}
    lines = refused(tmp_path, model, rows, monkeypatch, capsys)
    assert "the first is line 41 with 100001 tokens" in lines[0], lines


def test_a_start_refused_after_the_model_loads_leaves_no_run_folder(
    tmp_path, tiny_model_dir, monkeypatch, capsys
):
    """The default logger creates runs/lightning_logs/version_0 (a config copy, an events file)
    as the fit starts; a refusal there (here in the module's on_fit_start) removes it, and the
    folders above it that the start created."""

    def refuses(self):
        raise ValueError("model.something=1 is refused here")

    monkeypatch.setattr(TrollModule, "on_fit_start", refuses)
    (tmp_path / "my_reward.py").write_text(REWARD)
    args = command(tmp_path, tiny_model_dir, 2, "--trainer.logger", "true")[1:]
    stderr = refused_here(args, tmp_path, monkeypatch, capsys)
    assert stderr.splitlines()[-1] == "lightning-troll: error: model.something=1 is refused here"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_reward.py", "run.yaml"]
    (tmp_path / "runs" / "lightning_logs" / "version_0").mkdir(parents=True)
    stderr = refused_here(args, tmp_path, monkeypatch, capsys)  # version_1: only it goes
    assert [p.name for p in (tmp_path / "runs" / "lightning_logs").iterdir()] == ["version_0"]
    shutil.rmtree(tmp_path / "runs")


def test_a_killed_saves_partial_file_goes_at_the_next_start_there_and_in_the_resumed_folder(
    tmp_path,
):
    """A kill during a save leaves ``.last.ckpt.partial``; the next run's start removes it from
    its checkpoint folder and from the folder of the checkpoint it resumes (the printed resume
    command writes into a new version folder), but not the file of a save in progress there, nor
    the previous checkpoint a sharded save set aside."""
    import fcntl
    from types import SimpleNamespace

    from lightning_troll.callbacks import RolloutCheckpoint

    old, new = tmp_path / "version_0" / "checkpoints", tmp_path / "version_1" / "checkpoints"
    old.mkdir(parents=True)
    (old / "last.ckpt").write_bytes(b"whole")
    (old / ".last.ckpt.partial").write_bytes(b"cut short")
    (old / ".last.ckpt.old").mkdir()
    new.mkdir(parents=True)
    (new / ".last.ckpt.partial").write_bytes(b"cut short")
    (new / ".last-v1.ckpt.partial").write_bytes(b"being written")
    with open(new / ".last-v1.ckpt.partial", "rb") as writing:
        fcntl.flock(writing.fileno(), fcntl.LOCK_EX)  # as a save in progress holds it
        trainer = SimpleNamespace(ckpt_path=str(old / "last.ckpt"), is_global_zero=True,
                                  strategy=SimpleNamespace(broadcast=lambda x: x))  # fmt: skip
        RolloutCheckpoint(dirpath=str(new))._claim(trainer)
    assert sorted(p.name for p in old.iterdir()) == [".last.ckpt.old", "last.ckpt"]
    assert sorted(p.name for p in new.iterdir()) == [".last-v1.ckpt.partial"]


TOOLS = 'def add(a: int, b: int) -> int:\n    """Add.\n\n    Args:\n        a: A number.\n        b: Another.\n    """\n    return a + b\n'


@pytest.mark.slow
def test_a_resumed_run_takes_the_tools_given_where_the_stored_module_was_renamed(
    tmp_path, tiny_model_dir, monkeypatch, recwarn
):
    """The checkpoint names ``my_tools:add``; renamed since to ``tl2:add``, the resumed run takes
    the given name, warns once naming both, and trains to its end."""
    from tests.chat_helpers import CHATML_TOOLS
    from tests.conftest import command_here

    model = tmp_path / "chat_model"
    shutil.copytree(tiny_model_dir, model)
    tokenizer_only(tiny_model_dir, model, CHATML_TOOLS)
    (tmp_path / "my_reward.py").write_text(REWARD)
    (tmp_path / "my_tools.py").write_text(TOOLS)
    episodes = ["--model.episodes", '{"tools": ["my_tools:add"], "max_turns": 2}']
    command_here(command(tmp_path, model, 2, *episodes)[1:], tmp_path, monkeypatch)
    (tmp_path / "my_tools.py").rename(tmp_path / "tl2.py")
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    renamed = ["--model.episodes", '{"tools": ["tl2:add"], "max_turns": 2}']
    args = command(tmp_path, model, 4, *renamed, "--ckpt_path", str(ckpt))[1:]
    recwarn.clear()
    command_here(args, tmp_path, monkeypatch)
    told = [str(w.message) for w in recwarn if "model.episodes" in str(w.message)]
    assert len(told) == 1 and "model.episodes.tools: ['my_tools:add'] -> ['tl2:add']" in told[0]
    import torch

    assert torch.load(ckpt, weights_only=True)["global_step"] == 4


@pytest.mark.parametrize(
    ("extra", "told"),
    [(["--model.rewards", "{tinymath: abc}"],
      "model.rewards: the weight of 'tinymath' is 'abc'; weights are numbers"),
     (["--model.model", "./nothere"], "model.model='./nothere': "),
     (["--model.optimizer.init_args.lr", "-1e-4"],
      "--model.optimizer.init_args.lr -1e-4: a value that starts with '-' is read as an option; "
      "write --model.optimizer.init_args.lr=-1e-4")],
)  # fmt: skip
def test_a_bad_value_is_named_by_its_option(extra, told, tmp_path, monkeypatch, capsys):
    from tests.test_faults_reward import ROOT

    args = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml"), *extra]
    stderr = refused_here(args, tmp_path, monkeypatch, capsys)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) <= 2 and "Traceback" not in stderr, lines
    assert lines[0].startswith(f"lightning-troll: error: {told}"), lines
    assert list(tmp_path.iterdir()) == []
