"""TROLL against clipping on a task with headroom: SmolLM2-135M-Instruct on two-step word problems.

    python studies/headroom_study.py --estimate                     # hours, then stop
    nohup python studies/headroom_study.py --phase pilot > p.log 2>&1 &
    nohup python studies/headroom_study.py --phase main --seeds 0 1 > a.log 2>&1 &   # a share
    nohup python studies/headroom_study.py --phase main --seeds 4 --objectives troll > t.log 2>&1 &
    python studies/headroom_study.py --report                        # tables and plots so far
    python studies/headroom_study.py --dry-run --out /tmp/dry        # the machinery on TinyMath

The plan, its endpoints and windows are fixed in studies/headroom-plan.md before any run. The task is
:mod:`word_problems` (written into ``<out>/task`` on first use: 1,200 distinct training problems,
so a run of 80 rollouts x 8 prompts never repeats a prompt, and 512 held-out ones). Every run is
the paper's regime as in the paper-regime study (:func:`paper_regime_study.regime_args`:
temperature 1.0, token-mean, 8 prompts x 8 completions in 8 optimiser steps per rollout, a
constant lr; TROLL at the library's defaults, eps 0.05, alpha 1, the official support at K 256;
clipping at 0.2), validated every :data:`VAL_EVERY` rollouts, and records every figure the
monitors log.

1. **The lr pilot**: both objectives at each of ``--pilot-lrs`` for ``--pilot-rollouts``
   rollouts on seed 0, validated on :data:`PILOT_ROWS` problems of the *training* generator drawn
   apart from the task's training rows (``pilot/holdout.jsonl``), never on the held-out set.
   The lr (one for both objectives) is :func:`choose_lr`'s: among the lrs at which both
   constraints act on at least :data:`ACTIVE_MIN` of the tokens, the one with the best mean pilot
   accuracy over the two objectives.
2. **The main comparison**: both objectives at that lr on ``--seeds`` (5 by default) for
   ``--rollouts`` (80), seeds varying the prompts, their order and the sampling.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "examples"))  # the task generators
import headroom_tables  # noqa: E402
import paper_regime_study as paper  # noqa: E402
import study_kit  # noqa: E402
import word_problems  # noqa: E402
from paper_regime_tables import ACCURACY, active_share, compare_arms  # noqa: E402
from study_kit import Grid, Run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VAL_EVERY = 10
PILOT_ROWS = 128
ACTIVE_MIN = 1e-3
"""The least mean share of tokens each constraint must act on at a pilot lr for it to be chosen."""
METRICS = paper.METRICS


def task_folder(args) -> Path:
    """The task (``<out>/task``), written on first use; the pilot's held-out rows beside it."""
    folder = args.out / "task"
    if not (folder / "task.yaml").exists():
        if args.dry_run:
            folder.mkdir(parents=True, exist_ok=True)
            rows = word_problems.problems(64 + 16, "train", level=3)
            for name, part in (("train", rows[:64]), ("val", rows[64:])):
                (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
            (folder / "task.yaml").write_text("data: {source: train.jsonl, val_file: val.jsonl}\n")
        else:
            word_problems.make_task(folder)
    return folder


def pilot_holdout(args) -> Path:
    """:data:`PILOT_ROWS` problems of the training generator (seed 2) that the task's training
    rows do not hold."""
    path = args.out / "pilot" / "holdout.jsonl"
    if not path.exists():
        train = task_folder(args) / ("train.jsonl" if args.dry_run else "data/train.jsonl")
        taken = {json.loads(line)["question"] for line in train.read_text().splitlines()}
        drawn = word_problems.problems(4 * PILOT_ROWS, "train", seed=2)
        rows = [r for r in drawn if r["question"] not in taken][
            : 16 if args.dry_run else PILOT_ROWS
        ]
        path.parent.mkdir(parents=True, exist_ok=True)
        study_kit.write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(args, name: str, objective: str, lr: float, seed: int, rollouts: int, extra=()) -> Run:
    folder = task_folder(args)
    config = ["--config", str(ROOT / "configs" / "tinymath.yaml")] if args.dry_run else []
    if args.dry_run:  # TinyMath's tokenizer spells words out: long prompts, short replies
        extra = ("--data.max_prompt_tokens", "256", "--model.sampling.max_new_tokens", "8", *extra)
    data = ("train.jsonl", "val.jsonl") if args.dry_run else ("data/train.jsonl", "data/val.jsonl")
    run_args = (
        *config,
        *(() if args.dry_run else ("--config", str(folder / "task.yaml"))),
        "--model.model", str(args.model),
        "--data.source", str(folder / data[0]),
        "--data.val_file", str(folder / data[1]),
        "--data.num_val", "null",
        "--data.prompt_field", "question",
        "--data.answer_field", "answer",
        "--model.rewards", json.dumps({"last_number": 1.0}),
        "--seed_everything", str(seed),
        "--model.objective", objective,
        "--model.optimizer.init_args.lr", repr(lr),
        *paper.regime_args(args.prompts),
        "--trainer.val_check_interval", str(VAL_EVERY),
        *extra,
    )  # fmt: skip
    fields = {"objective": objective, "lr": lr, "seed": seed}
    return Run(name, run_args, rollouts * paper.STEPS, rollouts, fields)


def pilot_runs(args) -> list[Run]:
    holdout = ("--data.val_file", str(pilot_holdout(args)))
    return [
        run(args, f"pilot-{o}-lr{lr:g}", o, lr, 0, args.pilot_rollouts, holdout)
        for lr in args.pilot_lrs
        for o in paper.OBJECTIVES
    ]


def choose_lr(pilots: Sequence[dict]) -> float | None:
    """Among the lrs at which every objective's constraint acts on at least :data:`ACTIVE_MIN`
    of the tokens, the one with the best mean pilot accuracy (the mean of the last 2
    validations) over the objectives; None when no lr has both acting."""
    by_lr: dict[float, list[dict]] = {}
    for r in pilots:
        by_lr.setdefault(r["fields"]["lr"], []).append(r)
    acting = {
        lr: runs
        for lr, runs in by_lr.items()
        if len(runs) == len(paper.OBJECTIVES) and all(active_share(r) >= ACTIVE_MIN for r in runs)
    }
    if not acting:
        return None
    return max(acting, key=lambda lr: statistics.fmean(paper.pilot_score(r) for r in acting[lr]))


def main_runs(args, lr: float) -> list[Run]:
    return [
        run(args, f"{o}-lr{lr:g}-s{s}", o, lr, s, args.rollouts)
        for s in args.seeds
        for o in paper.OBJECTIVES
    ]


def to_train(args, lr: float) -> list[Run]:
    """The main runs of ``--objectives`` on ``--seeds``; the report keeps every objective."""
    return [r for r in main_runs(args, lr) if r.fields["objective"] in args.objectives]


def grid(args, phase: str) -> Grid:
    def start() -> dict:
        base = pilot_runs(args)[0] if phase == "pilot" else main_runs(args, 1e-6)[0]
        return study_kit.validate(base, ACCURACY)

    settings = {"phase": phase, "prompts": args.prompts, "dry_run": args.dry_run}
    return Grid(args.out / phase, settings, METRICS, start, args.prior_seconds)


def report(args) -> None:
    pilots = grid(args, "pilot").finished(pilot_runs(args))
    if pilots:
        print(paper.pilot_table(pilots))
    lr = choose_lr(pilots) if len(pilots) == len(pilot_runs(args)) else None
    print(f"chosen lr: {lr}")
    if lr is None:
        return
    records = grid(args, "main").finished(main_runs(args, lr))
    if not records:
        return
    compare_arms(records, lr, args.out / "main", headroom_tables.SECONDARY)
    headroom_tables.report(records, lr, args.out / "main")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "studies/results/smollm2/headroom")
    p.add_argument("--model", type=Path, default=word_problems.SMOLLM2)
    p.add_argument("--prompts", type=int, default=8, help="prompts per rollout (x 8 samples)")
    p.add_argument("--rollouts", type=int, default=80, help="rollouts per main run")
    p.add_argument("--pilot-rollouts", type=int, default=20)
    p.add_argument("--pilot-lrs", type=float, nargs="+", default=[1e-6, 3e-6, 1e-5])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    paper.add_objectives(p)
    p.add_argument("--prior-seconds", type=float, default=90.0, help="s / rollout, no run done")
    p.add_argument("--phase", choices=("pilot", "main"), default="pilot")
    p.add_argument("--estimate", action="store_true", help="print the hours and stop")
    p.add_argument("--report", action="store_true", help="tables and plots of finished runs")
    p.add_argument("--dry-run", action="store_true", help="TinyMath, tiny budgets: seconds")
    args = p.parse_args(argv)
    study_kit.check_dry_run_out(p, args)
    if args.dry_run:
        args.model = "tinymath"
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.report:
        return report(args)
    pilot, pilots = grid(args, "pilot"), pilot_runs(args)
    if args.estimate:
        total, left = pilot.estimate(pilots)
        rate = total * 3600 / max(sum(r.rollouts for r in pilots), 1)
        hours = len(args.seeds) * len(paper.OBJECTIVES) * args.rollouts * rate / 3600
        print(f"pilot: {total:.1f} h ({left:.1f} h left); main: about {hours:.1f} h")
        return None
    with study_kit.resumable():
        if args.phase == "pilot":
            pilot.run_all(pilots)
        else:
            lr = choose_lr(pilot.finished(pilots))
            if lr is None or len(pilot.finished(pilots)) < len(pilots):
                sys.exit(
                    "the main comparison needs every pilot finished, with an lr where both act"
                )
            grid(args, "main").run_all(to_train(args, lr))
    report(args)
    return None


if __name__ == "__main__":
    main()
