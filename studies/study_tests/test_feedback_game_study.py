"""The multi-turn worked example (examples/feedback_game/ and studies/feedback_game_study.py):
the game's environment, its problems, and the study's machinery on TinyMath."""

from __future__ import annotations

import json
import sys

import pytest

from .helpers import EXAMPLES, STUDIES, load

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


def test_the_scored_game_prices_running_out_the_budget_below_every_answer():
    """The game (``Scored``): a right answer ends the episode with 1.0, a wrong one -0.25 and
    feedback; the turn limit adds nothing, and neither does a judged answer whose feedback finds
    no room in the budget (``"no_room"``); a turn cut off by the budget costs -1.0. Every
    episode's total by how it ends: answered within 3 turns 1.0, 0.75, 0.5, or -0.75 never
    solved; answered wrongly once or twice with no room left for another try -0.25, -0.5; cut
    off inside a turn after 0, 1 or 2 wrong answers -1.0, -1.25, -1.5: below every answered one."""
    retry = retry_module()
    game = retry.Scored()
    game.reset({"question": "How many?", "answer": "12"})
    wrong, right = game.step("It is 7."), game.step("She has 12")
    assert (wrong.observation, wrong.reward, wrong.done) == (retry.FEEDBACK, -0.25, False)
    assert (right.observation, right.reward, right.done) == (None, 1.0, True)
    ends = ("max_turns", "max_tokens", "no_room")
    assert [game.on_end(end) for end in ends] == [None, -1.0, None]
    answered = [1.0 - 0.25 * k for k in range(3)] + [-0.75, -0.25, -0.5]
    cut = [-0.25 * k + game.on_end("max_tokens") for k in range(3)]
    assert answered == [1.0, 0.75, 0.5, -0.75, -0.25, -0.5] and cut == [-1.0, -1.25, -1.5]
    assert max(cut) < min(answered)
    assert retry.Retry().on_end("max_tokens") is None  # the first game: the budget paid nothing


@pytest.mark.parametrize(
    ("budget_after_answer", "end", "total"),
    # the tests' chat tokenizer writes a character a token: the feedback's reply takes about 100
    [(0, "no_room", -0.25), (20, "no_room", -0.25), (200, "max_tokens", -1.25)],
)
def test_the_episode_loop_scores_the_scored_game_at_the_budgets_edge(
    budget_after_answer, end, total
):
    """Played by the episode loop: a wrong first answer, then a second turn that rambles. With
    no room for the feedback (the budget ends at the answer, or the feedback would fill it) the
    episode ends at ``"no_room"`` and keeps the wrong answer's -0.25; with room, the rambling
    turn is cut off inside, ``"max_tokens"``, and costs the budget's 1.0 more."""
    from lightning_troll.rollouts.episodes import EpisodeLimits, Stops, run_episodes
    from tests.chat_helpers import chat_tokenizer
    from tests.test_episodes import Scripted

    retry = retry_module()
    tokenizer = chat_tokenizer()
    answer = "It is 7.<|im_end|>"
    generate = Scripted(tokenizer, {"How many": [answer, "so" * 400]})
    budget = len(tokenizer(answer, add_special_tokens=False)["input_ids"]) + budget_after_answer
    (episode,) = run_episodes(
        generate, tokenizer, [retry.Scored()], [{"question": "How many?", "answer": "12"}],
        EpisodeLimits(3, budget), Stops((tokenizer.eos_token_id,)),
    )  # fmt: skip
    assert (episode.end, sum(r for r in episode.turn_rewards if r is not None)) == (end, total)
    assert episode.truncated


def test_each_game_has_its_yaml_and_its_own_results(capsys):
    """--game scored (the default) runs task.yaml into feedback_game_scored/, --game first runs
    first_game.yaml into feedback_game/, where the first game's records are; a dry run still
    needs its own --out."""
    scored, first = study.parse_args([]), study.parse_args(["--game", "first"])
    assert (scored.out.name, first.out.name) == ("feedback_game_scored", "feedback_game")
    for args, yaml in ((scored, "task.yaml"), (first, "first_game.yaml")):
        config = study.run(args, "troll", 0).args[1]
        assert config.endswith(f"feedback_game/{yaml}"), config
    task = (EXAMPLES / "feedback_game" / "task.yaml").read_text()
    assert "environment: retry:Scored" in task and "rewards: {}" in task
    assert (
        "environment: retry:Retry" in (EXAMPLES / "feedback_game" / "first_game.yaml").read_text()
    )
    with pytest.raises(SystemExit):
        study.parse_args(["--dry-run"])
    assert "--dry-run needs its own --out" in capsys.readouterr().err


def test_the_games_problems_are_apart_from_the_headroom_studys_held_out_and_pilot_sets():
    """640 training and 64 validation problems, distinct, none in both, none among the headroom
    study's held-out or pilot problems, every answer a whole number."""
    data = EXAMPLES / "feedback_game" / "data"
    train = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    val = [json.loads(line) for line in (data / "val.jsonl").read_text().splitlines()]
    assert (len(train), len(val)) == (640, 64)
    questions = [r["question"] for r in train + val]
    assert len(set(questions)) == len(questions)
    headroom = STUDIES / "results" / "smollm2" / "headroom"
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


def game_record(objective, seed, reward, turns, accuracy, budget=(0.1, 0.2)):
    """A run's record: ``reward``, ``turns`` and the share of ``budget`` ends (early, late)
    logged at rollouts 5 and 25, and the held-out ``accuracy`` (start, end) at rollouts 0 and
    30."""
    ends = "episodes/frac_end_max_tokens"
    history = [
        {"rollout": 0, "val/accuracy": accuracy[0]},
        {"rollout": 5, "reward/mean": reward[0], "episodes/turns_mean": turns[0], ends: budget[0]},
        {"rollout": 25, "reward/mean": reward[1], "episodes/turns_mean": turns[1], ends: budget[1]},
        {"rollout": 30, "val/accuracy": accuracy[1]},
    ]
    fields = {"objective": objective, "seed": seed}
    return {"name": f"{objective}-s{seed}", "fields": fields, "history": history}


def test_the_plans_endpoints_by_hand():
    """Four runs. Reward, late - early: +0.4, +0.2, +0.2, +0.3, mean +0.275, 4 of 4 above 0, so a
    sign test p of 2/16. TROLL - clipping at the end: late reward +0.2 and -0.1, mean +0.05, sd
    0.212, t = 0.05 / (0.212 / sqrt 2) = 0.33, p = 1 - 2 atan(1/3) / pi = 0.80; accuracy +0.10 and +0.04: mean +0.07, sd 0.0424, t = 0.07 / (0.0424 / sqrt 2) = 2.33
    on 1 degree of freedom, p = 1 - 2 atan(2.33) / pi = 0.26."""
    records = [
        game_record("troll", 0, (0.2, 0.6), (2.5, 2.0), (0.1, 0.4)),
        game_record("clip", 0, (0.2, 0.4), (2.5, 2.2), (0.1, 0.3)),
        game_record("troll", 1, (0.1, 0.3), (2.6, 2.4), (0.2, 0.3)),
        game_record("clip", 1, (0.1, 0.4), (2.6, 2.1), (0.2, 0.26), budget=(0.3, 0.6)),
    ]
    text = study.endpoints(records, 30)
    assert (
        "- episodes/frac_end_max_tokens, late window (the budget is not the way out: < 0.5 in "
        "every run): troll-s0 0.200, clip-s0 0.200, troll-s1 0.200, clip-s1 0.600; fails over "
        "4 runs" in text
    )
    assert "; holds over 3 runs" in study.endpoints(records[:3], 30)
    assert "frac_end_no_room" not in text  # none of these runs logged it
    records[0]["history"][2]["episodes/frac_end_no_room"] = 0.125
    assert (
        "- episodes/frac_end_no_room, late window (answered, no room for the feedback): "
        "troll-s0 0.125\n" in study.endpoints(records, 30) + "\n"
    )
    assert "reward/mean, late - early (learns: > 0): mean +0.275 over 4 runs" in text
    assert (
        "troll-s0 +0.400, clip-s0 +0.200, troll-s1 +0.200, clip-s1 +0.300); sign test p 0.125"
        in text
    )
    assert "turns_mean, late - early (fewer retries: < 0): mean -0.375 over 4 runs" in text
    assert "val/accuracy, rollout 30 - rollout 0: mean +0.165 over 4 runs" in text
    assert (
        "TROLL - clipping, reward/mean, late window: +0.050 (+0.200, -0.100); t-test p 0.80" in text
    )
    assert (
        "TROLL - clipping, val/accuracy at rollout 30: +0.070 (+0.100, +0.040); t-test p 0.26, sign test p 0.50"
        in text
    )


def test_a_figure_needs_the_report(capsys):
    with pytest.raises(SystemExit):
        study.parse_args(["--figure", "x.png"])
    assert "--figure x.png draws the report's runs: it needs --report" in capsys.readouterr().err


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
        start = record["history"][0]
        assert start["rollout"] == 0 and {"val/accuracy", "val/reward"} <= set(start)
        assert 1 <= start["val/episodes/turns_mean"] <= 3
    assert "| troll-s0 |" in study.table(records)
    image = tmp_path / "game.png"
    study.main(["--dry-run", "--out", str(out), "--seeds", "0", "--report", "--figure", str(image)])
    assert image.read_bytes().startswith(b"\x89PNG")
