"""The multi-turn worked example (examples/feedback_game/ and examples/feedback_game_study.py):
the game's environment, its problems, and the study's machinery on TinyMath."""

from __future__ import annotations

import json
import sys

import pytest

from .helpers import EXAMPLES, load

study = load("feedback_game_study")


def retry_module():
    sys.path.insert(0, str(EXAMPLES / "feedback_game"))
    try:
        import retry
    finally:
        sys.path.remove(str(EXAMPLES / "feedback_game"))
    return retry


def test_a_right_answer_ends_the_game_and_a_wrong_one_is_sent_back():
    """The first turn's answer is wrong: feedback and -0.25; the second is right: the episode
    ends, scored by the reward functions alone (no reward of the environment's)."""
    retry = retry_module()
    game = retry.Retry()
    start = game.reset({"question": "Mia has 3 bags with 4 marbles in each bag. How many?",
                        "answer": "12"})  # fmt: skip
    assert start == [{"role": "user", "content": "Mia has 3 bags with 4 marbles in each bag. "
                      "How many? " + retry.INSTRUCTION}]  # fmt: skip
    wrong = game.step("Mia has 3 + 4 = 7 marbles, so 7.")
    assert (wrong.observation, wrong.reward, wrong.done) == (retry.FEEDBACK, -0.25, False)
    right = game.step("3 bags of 4 marbles make 1,2 ... she has 12")
    assert (right.observation, right.reward, right.done) == (None, None, True)
    assert retry.last_number("It costs 1,250 dollars.") == "1250"
    assert retry.last_number("no number") is None


def test_the_games_problems_are_apart_from_the_headroom_studys_held_out_and_pilot_sets():
    """640 training and 64 validation problems, distinct, none in both, none among the headroom
    study's held-out or pilot problems, every answer a whole number."""
    data = EXAMPLES / "feedback_game" / "data"
    train = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    val = [json.loads(line) for line in (data / "val.jsonl").read_text().splitlines()]
    assert (len(train), len(val)) == (640, 64)
    questions = [r["question"] for r in train + val]
    assert len(set(questions)) == len(questions)
    headroom = EXAMPLES / "results" / "smollm2" / "headroom"
    held_out = {json.loads(x)["question"] for x in
                (headroom / "task" / "data" / "val.jsonl").read_text().splitlines()}  # fmt: skip
    pilot = {json.loads(x)["question"] for x in
             (headroom / "pilot" / "holdout.jsonl").read_text().splitlines()}  # fmt: skip
    assert not set(questions) & (held_out | pilot)
    assert all(r["answer"].isdigit() for r in train + val)


def test_window_means_read_the_rollouts_of_a_window():
    record = {
        "history": [
            {"rollout": 0, "val/accuracy": 0.2},
            {"rollout": 1, "reward/mean": 0.5},
            {"rollout": 10, "reward/mean": 1.5},
            {"rollout": 11, "reward/mean": 9.0},
        ]
    }
    assert study.window_mean(record, "reward/mean", (1, 10)) == 1.0
    assert study.window_mean(record, "reward/mean", (21, 30)) is None


@pytest.mark.slow
def test_the_study_runs_both_objectives_on_tinymath_episodes(tmp_path):
    """Two runs of three-turn plain-text episodes on TinyMath: records with the episodes'
    figures per rollout, the start's validation, and the table."""
    out = tmp_path / "game"
    study.main(["--dry-run", "--out", str(out), "--seeds", "0"])
    args = study.parse_args(["--dry-run", "--out", str(out), "--seeds", "0"])
    records = study.grid(args).finished(study.runs(args))
    assert sorted(r["name"] for r in records) == ["clip-s0", "troll-s0"]
    for record in records:
        rows = [row for row in record["history"] if "episodes/turns_mean" in row]
        assert [row["rollout"] for row in rows] == [1, 2]
        assert all(1 <= row["episodes/turns_mean"] <= 3 for row in rows)
        assert record["history"][0]["rollout"] == 0 and "val/accuracy" in record["history"][0]
    assert "| troll-s0 |" in study.table(records)
