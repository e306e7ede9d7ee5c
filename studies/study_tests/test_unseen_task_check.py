"""studies/unseen_task_check.py: the task it writes, its refusals, and both objectives trained
on that task from its own folder, recorded in the paper-regime study's format."""

from __future__ import annotations

import json
import os
import random
import re

import pytest

from .helpers import load

check = load("unseen_task_check")


def test_the_task_asks_for_the_largest_or_smallest_and_answers_it():
    rng = random.Random(3)
    rows = [check.extreme_of_three(rng) for _ in range(200)]
    words = set()
    for row in rows:
        word, *numbers = re.fullmatch(
            r"Which is the (largest|smallest) of (\d\d), (\d\d) and (\d\d)\?", row["question"]
        ).groups()
        values = [int(n) for n in numbers]
        assert len(set(values)) == 3
        assert int(row["answer"]) == (max if word == "largest" else min)(values)
        words.add(word)
    assert words == {"largest", "smallest"}


def test_make_task_writes_data_reward_and_config_and_refuses_a_full_folder(tmp_path):
    folder = check.make_task(tmp_path / "t", train=30, val=6)
    train = (folder / "data" / "train.jsonl").read_text().splitlines()
    val = (folder / "data" / "val.jsonl").read_text().splitlines()
    assert len(train) == 30 and len(val) == 6 and not set(train) & set(val)
    namespace: dict = {}
    exec((folder / "reward.py").read_text(), namespace)
    reward = namespace["answer_is_last_number"]
    row = json.loads(val[0])
    assert reward("", f"It is 12, no: {row['answer']}", row) == 1.0
    assert reward("", f"{row['answer']} or 1000", row) == 0.0
    assert reward("", "none", row) == 0.0
    assert "reward:answer_is_last_number" in (folder / "task.yaml").read_text()
    with pytest.raises(SystemExit, match="exists and is not empty"):
        check.make_task(folder)


def test_bad_arguments_are_refused_before_work(tmp_path, capsys):
    with pytest.raises(SystemExit):
        check.parse_args([])
    assert "--task FOLDER" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        check.parse_args(["--task", str(tmp_path)])
    assert "no task.yaml there" in capsys.readouterr().err
    (tmp_path / "task.yaml").write_text("{}\n")
    with pytest.raises(SystemExit):
        check.parse_args(["--task", str(tmp_path), "--rollouts", "0"])
    assert "--rollouts must be at least 1; got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_both_objectives_train_the_task_from_its_folder(tmp_path, tiny_chat_model_dir, capsys):
    """One rollout of 1 prompt x 8 completions each, validated on 4 rows: the runs start in the
    task's folder (its reward module is found there), TROLL runs at the library's projection
    defaults, and the table is the study's."""
    folder = check.make_task(tmp_path / "task", train=40, val=4)
    here = os.getcwd()
    args = ["--task", str(folder), "--model", str(tiny_chat_model_dir), "--prompts", "1",
            "--rollouts", "1", "--", "--model.sampling.max_new_tokens", "8",
            "--trainer.val_check_interval", "1"]  # fmt: skip
    check.main(args)
    assert os.getcwd() == here  # the runs start in the task's folder; the caller's is back
    out = folder / "check"
    records = {r["name"]: r for r in json.loads((out / "results.json").read_text())}
    assert set(records) == {"clip-s0", "troll-s0"}
    assert records["troll-s0"]["fields"] == {"objective": "troll", "lr": 3e-6, "seed": 0}
    config = (out / "runs" / "troll-s0" / "logs" / "version_0" / "config.yaml").read_text()
    assert re.search(r"support: official\n", config) and re.search(r"max_tokens: 256\n", config)
    assert re.search(r"temperature: 1\.0\n", config) and "aggregation: token_mean" in config
    table = (out / "table.md").read_text()
    assert (
        table.startswith("| arm | seeds | accuracy, rollouts 1-1")
        and "| troll lr 3e-06 | 1 |" in table
    )
    rows = (out / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("name,") and len(rows) == 1 + 2 * 2  # the start and one rollout each
    capsys.readouterr()
    check.main(args)  # again: both runs are done, nothing trains
    assert capsys.readouterr().out.count("done before, skipped") == 2
    with pytest.raises(ValueError, match="holds runs made with"):  # other settings: refused
        check.main([*args[:-2]])
    assert os.getcwd() == here  # refused, it left the caller's folder as it was
