"""The multi-turn worked example: SmolLM2-135M-Instruct learns a word-problem game with feedback.

    python examples/feedback_game_study.py --estimate                      # hours, then stop
    nohup python examples/feedback_game_study.py --seeds 0 > g0.log 2>&1 &     # a share
    python examples/feedback_game_study.py --report                         # tables so far
    python examples/feedback_game_study.py --dry-run --out /tmp/dry         # the machinery

Every run is ``examples/feedback_game/task.yaml`` (the environment ``retry.py`` beside it: a wrong
answer is told so and tried again, up to 3 turns; the final answer scores 1.0 when right, each
retry costs 0.25), both objectives at the task's lr on ``--seeds``, validated every
:data:`VAL_EVERY` rollouts on the game's 64 validation problems (greedy episodes). The plan, its
endpoints and windows are in docs/feedback-game-plan.md, fixed before the first run.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paper_regime_study as paper  # noqa: E402
import study_kit  # noqa: E402
import word_problems  # noqa: E402
from paper_regime_tables import ACCURACY  # noqa: E402
from study_kit import Grid, Interrupted, Run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GAME = ROOT / "examples" / "feedback_game"
VAL_EVERY = 10
STEPS = 8
"""Optimiser steps per rollout (task.yaml: 8 prompts x 8 episodes, minibatches of 8)."""
METRICS = (*paper.METRICS, "episodes/")
WINDOWS = {"early": (1, 10), "late": (21, 30)}
"""Rollout windows of the plan's reward endpoint (inclusive)."""


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
        "--config", str(GAME / "task.yaml"),
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
        return study_kit.validate(runs(args)[0], ACCURACY)

    settings = {"rollouts": args.rollouts, "dry_run": args.dry_run}
    return Grid(args.out, settings, METRICS, start, args.prior_seconds)


def window_mean(record: dict, metric: str, window: tuple[int, int]) -> float | None:
    """The mean of ``metric`` over the rollouts of ``window`` (inclusive), or None."""
    low, high = window
    values = [row[metric] for row in record["history"]
              if low <= row["rollout"] <= high and row.get(metric) is not None]  # fmt: skip
    return sum(values) / len(values) if values else None


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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "examples/results/smollm2/feedback_game")
    p.add_argument("--model", type=Path, default=word_problems.SMOLLM2)
    p.add_argument("--rollouts", type=int, default=30)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--prior-seconds", type=float, default=120.0, help="s / rollout, no run done")
    p.add_argument("--estimate", action="store_true", help="print the hours and stop")
    p.add_argument("--report", action="store_true", help="the table of finished runs")
    p.add_argument("--dry-run", action="store_true", help="TinyMath, tiny budgets: seconds")
    args = p.parse_args(argv)
    study_kit.check_dry_run_out(p, args)
    if args.dry_run:
        args.model, args.rollouts = "tinymath", 2
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    study = grid(args)
    if args.report:
        print(table(study.finished(runs(args))))
        return
    if args.estimate:
        total, left = study.estimate(runs(args))
        print(f"{total:.1f} h in all, {left:.1f} h left")
        return
    try:
        study.run_all(runs(args))
    except Interrupted as stopped:
        print(f"{stopped}; the same command resumes it", flush=True)
        sys.exit(stopped.exit_code)
    print(table(study.finished(runs(args))))


if __name__ == "__main__":
    main()
