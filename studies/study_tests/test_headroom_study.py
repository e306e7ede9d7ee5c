"""The task with headroom (examples/word_problems.py) and its study (studies/headroom_study.py):
fresh prompts, a held-out set apart from them, exact answers, the lr rule, and the machinery on
TinyMath."""

from __future__ import annotations

import json
import re

import pytest

from .helpers import load

words = load("word_problems")
study = load("headroom_study")


def template_of(question: str) -> tuple[str, tuple[int, int, int]]:
    """The arithmetic of the template ``question`` was written from, and its numbers a, b, c
    (c = 0 where the template has none)."""
    for template, arithmetic in words.TEMPLATES:
        pattern = re.escape(template).replace(r"\{n\}", r"\w+")
        for name in "abc":
            pattern = pattern.replace(re.escape("{" + name + "}"), rf"(?P<{name}>\d+)")
        match = re.fullmatch(pattern, question)
        if match:
            values = match.groupdict()
            return arithmetic, (int(values["a"]), int(values["b"]), int(values.get("c") or 0))
    raise AssertionError(f"no template writes {question!r}")


def test_problems_are_distinct_exact_and_their_splits_apart():
    """1,200 training and 512 held-out problems at the task's level: no question twice, none in
    both splits, operands from 2 to the level, and every answer the template's arithmetic of the
    question's own numbers, a whole number above 0."""
    train = words.problems(words.TRAIN_ROWS, "train")
    held = words.problems(words.VAL_ROWS, "validation")
    questions = [r["question"] for r in train]
    assert len(set(questions)) == len(train) == 1200
    assert len(held) >= 500 and not set(questions) & {r["question"] for r in held}
    formulas = {"a*b-c": lambda a, b, c: a * b - c, "a*b+c": lambda a, b, c: a * b + c,
                "(a+b)/c": lambda a, b, c: (a + b) / c, "a+b": lambda a, b, c: a + b,
                "a-b": lambda a, b, c: a - b, "a*b": lambda a, b, c: a * b}  # fmt: skip
    for row in train + held:
        arithmetic, (a, b, c) = template_of(row["question"])
        assert 2 <= a <= words.LEVEL and 2 <= b <= words.LEVEL, row
        value = formulas[arithmetic](a, b, c)
        assert value == int(row["answer"]) and value > 0, row
    assert words.problems(5, "train") == train[:5]  # the same rows on every call
    assert words.problems(5, "train", seed=1) != train[:5]


def test_a_run_never_repeats_a_prompt_and_the_mix_is_the_same_in_both_splits():
    """A study's run draws 80 rollouts x 8 prompts from the training rows without repeats; the
    share of one-step problems is about the same in the training and held-out rows."""
    assert words.TRAIN_ROWS >= 80 * 8

    def one_step(rows: list[dict]) -> float:
        simple = ("a+b", "a-b", "a*b")
        return sum(template_of(r["question"])[0] in simple for r in rows) / len(rows)

    train = one_step(words.problems(words.TRAIN_ROWS, "train"))
    held = one_step(words.problems(words.VAL_ROWS, "validation"))
    assert 0.3 < train < 0.6 and abs(train - held) < 0.05


def test_problems_refuse_a_bad_split_and_a_level_too_small_for_the_count():
    with pytest.raises(ValueError, match="split must be 'train' or 'validation'"):
        words.problems(3, "test")
    with pytest.raises(ValueError, match="fewer than 50000 distinct"):
        words.problems(50_000, "train", level=3)


def test_make_task_writes_the_folder_and_refuses_a_full_one(tmp_path):
    folder = words.make_task(tmp_path / "task", train=20, val=8)
    lines = (folder / "data" / "train.jsonl").read_text().splitlines()
    assert len(lines) == 20 and set(json.loads(lines[0])) == {"question", "answer"}
    config = (folder / "task.yaml").read_text()
    assert "last_number: 1.0" in config and words.INSTRUCTION in config
    with pytest.raises(SystemExit, match="exists and is not empty"):
        words.make_task(folder)


def pilot(objective: str, lr: float, accuracy: float, active: float) -> dict:
    active_key = {"troll": "trust_region/active_frac", "clip": "clip/active_frac"}[objective]
    history = [{"rollout": r, "val/accuracy": accuracy, active_key: active} for r in (5, 10)]
    return {"name": f"{objective}-{lr}", "fields": {"objective": objective, "lr": lr},
            "history": history}  # fmt: skip


def test_the_lr_is_the_best_where_both_constraints_act():
    """At 1e-6 clipping acts on no token: left out though its pilots score best. Of 3e-6 (mean
    0.55) and 1e-5 (mean 0.5), 3e-6 is chosen."""
    pilots = [
        pilot("clip", 1e-6, 0.9, 0.0), pilot("troll", 1e-6, 0.9, 0.01),
        pilot("clip", 3e-6, 0.5, 0.01), pilot("troll", 3e-6, 0.6, 0.01),
        pilot("clip", 1e-5, 0.6, 0.05), pilot("troll", 1e-5, 0.4, 0.05),
    ]  # fmt: skip
    assert study.choose_lr(pilots) == 3e-6
    assert study.choose_lr(pilots[:2]) is None


@pytest.mark.slow
def test_the_study_runs_its_pilot_then_its_main_comparison_on_tinymath(tmp_path, monkeypatch):
    """Pilots at one lr and both objectives, validated on rows of the training generator that
    the task's training rows do not hold; then the main comparison on two seeds, its records
    keeping the monitors' figures, and the paired table."""
    out = tmp_path / "study"
    argv = ["--dry-run", "--out", str(out), "--pilot-rollouts", "1", "--pilot-lrs", "1e-3",
            "--rollouts", "2", "--seeds", "0", "1", "--prompts", "1"]  # fmt: skip
    study.main(argv)
    pilots = json.loads((out / "pilot" / "results.json").read_text())
    assert len(pilots) == 2
    held = (out / "pilot" / "holdout.jsonl").read_text().splitlines()
    train = (out / "task" / "train.jsonl").read_text().splitlines()
    assert held and not set(held) & set(train)
    monkeypatch.setattr(study, "choose_lr", lambda pilots: 1e-3)  # TinyMath's constraints idle
    study.main([*argv, "--phase", "main"])
    args = study.parse_args(argv)
    records = study.grid(args, "main").finished(study.main_runs(args, 1e-3))
    assert sorted(r["name"] for r in records) == [
        "clip-lr0.001-s0", "clip-lr0.001-s1", "troll-lr0.001-s0", "troll-lr0.001-s1",
    ]  # fmt: skip
    troll = next(r for r in records if r["name"] == "troll-lr0.001-s0")
    assert any(k.startswith("trust_region/by_advantage/") for k in troll["history"][-1])
    assert "| reward/mean | 1-2 |" in (out / "main" / "paired.md").read_text()


def test_objectives_choose_the_runs_a_process_trains_and_the_report_keeps_both(tmp_path):
    argv = ["--dry-run", "--out", str(tmp_path / "study"), "--seeds", "4", "1"]
    both = study.parse_args(argv)
    troll = study.parse_args([*argv, "--objectives", "troll"])
    assert [r.name for r in study.to_train(both, 1e-5)] == [
        "clip-lr1e-05-s4", "troll-lr1e-05-s4", "clip-lr1e-05-s1", "troll-lr1e-05-s1",
    ]  # fmt: skip
    assert [r.name for r in study.to_train(troll, 1e-5)] == ["troll-lr1e-05-s4", "troll-lr1e-05-s1"]
    assert study.main_runs(troll, 1e-5) == study.main_runs(both, 1e-5)
    with pytest.raises(SystemExit):
        study.parse_args([*argv, "--objectives", "ppo"])
