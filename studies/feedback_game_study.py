"""The multi-turn worked example: SmolLM2-135M-Instruct learns a word-problem game with feedback.

    python studies/feedback_game_study.py --estimate                      # hours, then stop
    nohup python studies/feedback_game_study.py --seeds 0 > g0.log 2>&1 &     # a share
    python studies/feedback_game_study.py --report                         # tables so far
    python studies/feedback_game_study.py --report --figure docs/images/feedback-game.png
    python studies/feedback_game_study.py --dry-run --out /tmp/dry         # the machinery

Every run is the game of ``--game`` (:data:`GAMES`; the environment ``retry.py`` beside its YAML: a
wrong answer is told so and tried again, up to 3 turns), both objectives at the task's lr on
``--seeds``, validated every :data:`VAL_EVERY` rollouts on the game's 64 validation problems
(greedy episodes). ``scored``, the default, is ``examples/feedback_game/task.yaml``, where the
environment scores and running out the token budget costs; ``first`` is the first version
(``first_game.yaml``), whose runs found that running out the budget cost nothing. The plan, its
endpoints and windows are in studies/feedback-game-plan.md, fixed before each game's first run.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "examples"))  # the task generators
import paper_regime_study as paper  # noqa: E402
import study_kit  # noqa: E402
import word_problems  # noqa: E402
from paper_regime_tables import ACCURACY  # noqa: E402
from study_figures import Line, Panel, plot_panels, window_mean  # noqa: E402
from study_kit import Grid, Run  # noqa: E402
from study_stats import paired, sign_test  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GAME = ROOT / "examples" / "feedback_game"
VAL_EVERY = 10
STEPS = 8
"""Optimiser steps per rollout (task.yaml: 8 prompts x 8 episodes, minibatches of 8)."""
VAL_REWARD, VAL_EPISODES = "val/reward", "val/episodes/"
"""Descriptive, kept beside the endpoints' figures: the greedy episodes' mean total, and their
turns and endings (``val/episodes/turns_mean``, ...)."""
METRICS = (*paper.METRICS, VAL_REWARD, "episodes/", VAL_EPISODES)
GAMES = {
    "scored": ("task.yaml", "feedback_game_scored"),
    "first": ("first_game.yaml", "feedback_game"),
}
"""--game -> (its YAML in examples/feedback_game/, its results' folder in studies/results/smollm2/)."""
WINDOWS = {"early": (1, 10), "late": (21, 30)}
"""Rollout windows of the plan's reward endpoint (inclusive)."""
BUDGET_ENDS, BUDGET_LIMIT = "episodes/frac_end_max_tokens", 0.5
"""The scored game's fifth endpoint: the late share of episodes that ran out of the budget, below
the limit in every run (the first game's clipping run: 0.997)."""
NO_ROOM = "episodes/frac_end_no_room"
"""Judged answers whose feedback found no room in the budget: reported beside ``BUDGET_ENDS``
(the first game's runs logged them inside it)."""


def run(args, objective: str, seed: int) -> Run:
    extra: tuple[str, ...] = ()
    if args.dry_run:  # TinyMath: no chat template, so the game's conversations cannot be written
        extra = ("--config", str(ROOT / "configs" / "tinymath.yaml"),
                 "--model.episodes.environment", "tests.tool_helpers:ThreePlainTurns",
                 "--data.source", "tinymath", "--data.val_file", "null", "--data.num_val", "8",
                 "--data.prompt_field", "prompt", "--model.rewards", json.dumps({"tinymath": 1.0}),
                 "--data.batch_size", "2", "--model.group_size", "4",
                 "--model.optimization.minibatch_size", "4", "--data.val_batch_size", "8",
                 "--model.sampling.max_new_tokens", "12")  # fmt: skip
    run_args = (
        "--config", str(GAME / GAMES[args.game][0]),
        "--model.model", str(args.model),
        "--data.source", str(GAME / "data" / "train.jsonl"),
        "--data.val_file", str(GAME / "data" / "val.jsonl"),
        "--seed_everything", str(seed),
        "--model.objective", objective,
        "--trainer.val_check_interval", str(VAL_EVERY),
        *extra,
    )  # fmt: skip
    steps = 2 if args.dry_run else STEPS
    fields = {"objective": objective, "seed": seed}
    return Run(f"{objective}-s{seed}", run_args, args.rollouts * steps, args.rollouts, fields)


def runs(args) -> list[Run]:
    return [run(args, o, s) for s in args.seeds for o in paper.OBJECTIVES]


def grid(args) -> Grid:
    def start() -> dict:
        return study_kit.validate(runs(args)[0], ACCURACY, VAL_REWARD, VAL_EPISODES)

    settings = {"rollouts": args.rollouts, "dry_run": args.dry_run}
    return Grid(args.out, settings, METRICS, start, args.prior_seconds)


def table(records: Sequence[dict]) -> str:
    """Per run: the reward and the turns per episode in the early and late windows, and the
    validation accuracy at each validation point."""
    lines = ["| run | reward early | reward late | turns early | turns late | val/accuracy |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in records:
        figures = [window_mean(r, m, WINDOWS[w]) for m in ("reward/mean", "episodes/turns_mean")
                   for w in ("early", "late")]  # fmt: skip
        shown = " | ".join("-" if f is None else f"{f:.3f}" for f in figures)
        accuracy = ", ".join(f"{row['rollout']}: {row[ACCURACY]:.3f}" for row in r["history"]
                             if row.get(ACCURACY) is not None)  # fmt: skip
        lines.append(f"| {r['name']} | {shown} | {accuracy} |")
    return "\n".join(lines)


def at_rollout(record: dict, metric: str, rollout: int) -> float | None:
    """``metric`` as logged at ``rollout``, or None."""
    found = [row[metric] for row in record["history"]
             if row["rollout"] == rollout and row.get(metric) is not None]  # fmt: skip
    return found[-1] if found else None


def endpoints(records: Sequence[dict], rollouts: int) -> str:
    """The plan's endpoints (studies/feedback-game-plan.md) over the finished runs: per run, the
    late window minus the early one of the reward and of the turns, and the held-out accuracy
    at the last validation minus at the start, each with its exact sign test; the late share of
    episodes that ran out of the budget; then TROLL minus clipping per seed (the seeds both
    finished), with the paired t-test."""
    lines = []
    changes = {
        "reward/mean, late - early (learns: > 0)": lambda r: _late_minus_early(r, "reward/mean"),
        "episodes/turns_mean, late - early (fewer retries: < 0)": lambda r: _late_minus_early(
            r, "episodes/turns_mean"
        ),
        f"{ACCURACY}, rollout {rollouts} - rollout 0": lambda r: _difference(
            at_rollout(r, ACCURACY, rollouts), at_rollout(r, ACCURACY, 0)
        ),
    }
    for title, change in changes.items():
        diffs = {r["name"]: change(r) for r in records}
        known = [d for d in diffs.values() if d is not None]
        if not known:
            continue
        each = ", ".join(f"{name} {d:+.3f}" for name, d in diffs.items() if d is not None)
        lines.append(f"- {title}: mean {sum(known) / len(known):+.3f} over {len(known)} runs "
                     f"({each}); sign test p {sign_test(known):.3f}")  # fmt: skip
    budget = {r["name"]: window_mean(r, BUDGET_ENDS, WINDOWS["late"]) for r in records}
    known = {name: share for name, share in budget.items() if share is not None}
    if known:
        each = ", ".join(f"{name} {share:.3f}" for name, share in known.items())
        held = all(share < BUDGET_LIMIT for share in known.values())
        lines.append(f"- {BUDGET_ENDS}, late window (the budget is not the way out: < "
                     f"{BUDGET_LIMIT} in every run): {each}; "
                     f"{'holds' if held else 'fails'} over {len(known)} runs")  # fmt: skip
    no_room = {r["name"]: window_mean(r, NO_ROOM, WINDOWS["late"]) for r in records}
    if any(share is not None for share in no_room.values()):
        each = ", ".join(f"{name} {s:.3f}" for name, s in no_room.items() if s is not None)
        lines.append(f"- {NO_ROOM}, late window (answered, no room for the feedback): {each}")
    by_name = {r["name"]: r for r in records}
    seeds = sorted({r["fields"]["seed"] for r in records})
    pairs = [(by_name.get(f"troll-s{s}"), by_name.get(f"clip-s{s}")) for s in seeds]
    pairs = [(t, c) for t, c in pairs if t is not None and c is not None]
    for title, value in (
        ("reward/mean, late window", lambda r: window_mean(r, "reward/mean", WINDOWS["late"])),
        (f"{ACCURACY} at rollout {rollouts}", lambda r: at_rollout(r, ACCURACY, rollouts)),
    ):
        both = [(value(t), value(c)) for t, c in pairs]
        both = [(a, b) for a, b in both if a is not None and b is not None]
        if both:
            comparison = paired([a for a, _ in both], [b for _, b in both])
            lines.append(f"- TROLL - clipping, {title}: {comparison.text()}")
    return "\n".join(lines)


def _late_minus_early(record: dict, metric: str) -> float | None:
    late, early = (window_mean(record, metric, WINDOWS[w]) for w in ("late", "early"))
    return _difference(late, early)


def _difference(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def figure(records: Sequence[dict], path: Path) -> Path:
    """Reward, turns per episode and held-out accuracy against the rollout for every run (the
    plan's plots): colour by objective, line style by seed."""
    colours = {"troll": "tab:blue", "clip": "tab:orange"}
    styles = ("-", "--", ":", "-.")

    def lines(metric: str) -> list[Line]:
        return [Line([r], metric, r["name"], colours[r["fields"]["objective"]],
                     styles[r["fields"]["seed"] % len(styles)], band=False)
                for r in records]  # fmt: skip

    panels = [
        Panel("reward per episode", "reward/mean", lines("reward/mean")),
        Panel("turns per episode", "episodes/turns_mean", lines("episodes/turns_mean")),
        Panel("held-out accuracy (greedy)", ACCURACY, lines(ACCURACY), top=1.0),
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    return plot_panels(panels, path)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--game", choices=sorted(GAMES), default="scored",
                   help="scored (task.yaml, the default) or first (first_game.yaml, as first run)")  # fmt: skip
    p.add_argument("--out", type=Path, default=None,
                   help="the results' folder (default: studies/results/smollm2/ and the game's)")  # fmt: skip
    p.add_argument("--model", type=Path, default=word_problems.SMOLLM2)
    p.add_argument("--rollouts", type=int, default=30)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--prior-seconds", type=float, default=211.0,
                   help="s / rollout before a run is done (the first game's clipping run: 211)")  # fmt: skip
    p.add_argument("--estimate", action="store_true", help="print the hours and stop")
    p.add_argument(
        "--report",
        action="store_true",
        help="the table and the plan's endpoints of the finished runs",
    )
    p.add_argument("--figure", type=Path, default=None,
                   help="with --report: the curves of the finished runs, as a PNG")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="TinyMath, tiny budgets: seconds")
    args = p.parse_args(argv)
    if args.figure is not None and not args.report:
        p.error(f"--figure {args.figure} draws the report's runs: it needs --report")
    study_kit.check_dry_run_out(p, args)
    if args.out is None:
        args.out = ROOT / "studies" / "results" / "smollm2" / GAMES[args.game][1]
    if args.dry_run:
        args.model, args.rollouts = "tinymath", 2
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    study = grid(args)
    if args.report:
        records = study.finished(runs(args))
        print(table(records))
        print(endpoints(records, args.rollouts))
        if args.figure is not None:
            print(f"figure: {figure(records, args.figure)}")
        return
    if args.estimate:
        total, left = study.estimate(runs(args))
        print(f"{total:.1f} h in all, {left:.1f} h left")
        return
    with study_kit.resumable():
        study.run_all(runs(args))
    print(table(study.finished(runs(args))))


if __name__ == "__main__":
    main()
