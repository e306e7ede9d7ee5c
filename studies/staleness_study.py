"""TROLL and clipping as the data grows stale: the headroom task with a lagging sampler.

    python studies/staleness_study.py --estimate                       # hours, then stop
    nohup python studies/staleness_study.py --seeds 0 > s0.log 2>&1 &      # a share
    nohup python studies/staleness_study.py --seeds 0 --objectives troll > t.log 2>&1 &  # a half
    python studies/staleness_study.py --report                          # tables and plot so far
    python studies/staleness_study.py --dry-run --out /tmp/dry --s0-here   # the machinery

The plan, its endpoints and windows are fixed in studies/staleness-plan.md before any run. Every run
is a run of the headroom study (:func:`headroom_study.run`: its task, its regime, the lr its pilot
chose, validated every 10 rollouts on its 512 held-out problems) for ``--rollouts`` (40), with the
KL at each rollout's start logged (``trust_region_monitor.kl_start``), in one of the arms of
:data:`staleness_tables.ARMS`. The arm ``s0`` (no lag) is the headroom study's main comparison cut at rollout 40
(``--headroom``); ``--s0-here`` runs it here instead.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "examples"))  # the task generators
import headroom_study as headroom  # noqa: E402
import paper_regime_study as paper  # noqa: E402
import study_kit  # noqa: E402
import word_problems  # noqa: E402
from paper_regime_tables import ACCURACY  # noqa: E402
from staleness_tables import ARMS, ENDPOINT, plot, report  # noqa: E402
from study_kit import Grid, Run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DRY_LR = 1e-5
"""The dry run's lr (no headroom pilot is run for it)."""


def headroom_args(args) -> argparse.Namespace:
    """The headroom study's own arguments (its defaults), pointed at ``--headroom``."""
    argv = ["--out", str(args.headroom), "--prompts", str(args.prompts)]
    argv += ["--dry-run"] if args.dry_run else ["--model", str(args.model)]
    return headroom.parse_args(argv)


def study_lr(args) -> float:
    """The lr the headroom study's pilot chose; the study stops with a reason without one."""
    if args.dry_run:
        return DRY_LR
    h = headroom_args(args)
    pilots = headroom.grid(h, "pilot").finished(headroom.pilot_runs(h))
    lr = headroom.choose_lr(pilots) if len(pilots) == len(headroom.pilot_runs(h)) else None
    if lr is None:
        sys.exit(f"the headroom study's pilot has not chosen an lr (in {args.headroom}/pilot)")
    return lr


def arm_args(arm: str, prompts: int) -> tuple[str, ...]:
    staleness, anchor, steps = ARMS[arm]
    minibatch = prompts * paper.GROUP // steps
    return (
        "--old_policy.max_staleness", str(staleness),
        "--model.corrections.anchor", anchor,
        "--model.optimization.minibatch_size", str(minibatch),
        "--trust_region_monitor.kl_start", "true",
    )  # fmt: skip


def runs(args, lr: float) -> list[Run]:
    """The runs of ``--arms`` on ``--seeds`` (``s0`` only with ``--s0-here``)."""
    h, found = headroom_args(args), []
    for seed in args.seeds:
        for arm in args.arms:
            if arm == "s0" and not args.s0_here:
                continue
            steps = ARMS[arm][2]
            for objective in args.objectives:
                extra = arm_args(arm, args.prompts)
                run = headroom.run(h, f"{arm}-{objective}-s{seed}", objective, lr, seed,
                                   args.rollouts, extra)  # fmt: skip
                found.append(replace(run, max_steps=args.rollouts * steps,
                                     fields={**run.fields, "arm": arm}))  # fmt: skip
    return found


def headroom_s0(args, lr: float) -> list[dict]:
    """The headroom study's finished main runs on ``--seeds``, cut at ``--rollouts``, as arm s0."""
    h = headroom_args(args)
    records = headroom.grid(h, "main").finished(headroom.main_runs(h, lr))
    return [cut(r, args.rollouts) for r in records if r["fields"]["seed"] in args.seeds]


def whole_study(args, lr: float, study: Grid) -> list[dict]:
    """Every finished run of the study, whatever ``--arms``, ``--seeds`` and ``--objectives``
    pick (``s0`` on every seed the study holds): the study's figure is drawn from these, so that
    one run's end does not redraw it with that run's selection only."""
    seeds = {r["fields"]["seed"] for r in study.recorded().values()} | set(args.seeds)
    every = argparse.Namespace(**{**vars(args), "arms": list(ARMS), "seeds": sorted(seeds),
                                  "objectives": list(paper.OBJECTIVES)})  # fmt: skip
    records = study.finished(runs(every, lr))
    return records if args.s0_here else records + headroom_s0(every, lr)


def cut(record: dict, rollouts: int) -> dict:
    """``record`` up to rollout ``rollouts``, as arm ``s0``."""
    history = [row for row in record["history"] if row["rollout"] <= rollouts]
    return {**record, "history": history, "fields": {**record["fields"], "arm": "s0"}}


def grid(args, lr: float) -> Grid:
    def start() -> dict:
        return study_kit.validate(runs(args, lr)[0], ACCURACY)

    settings = {"rollouts": args.rollouts, "prompts": args.prompts, "dry_run": args.dry_run}
    return Grid(args.out, settings, paper.METRICS, start, args.prior_seconds)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "studies/results/smollm2/staleness")
    p.add_argument("--headroom", type=Path, default=ROOT / "studies/results/smollm2/headroom",
                   help="the headroom study's results: its task, its lr, its runs for s0")  # fmt: skip
    p.add_argument("--model", type=Path, default=word_problems.SMOLLM2)
    p.add_argument("--prompts", type=int, default=8, help="prompts per rollout (x 8 samples)")
    p.add_argument("--rollouts", type=int, default=40, help="rollouts per run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    paper.add_objectives(p)
    p.add_argument("--s0-here", action="store_true", help="run the arm s0 here")
    p.add_argument("--prior-seconds", type=float, default=90.0, help="s / rollout, no run done")
    p.add_argument("--estimate", action="store_true", help="print the hours and stop")
    p.add_argument("--report", action="store_true", help="the endpoints of the finished runs")
    p.add_argument("--dry-run", action="store_true", help="TinyMath, tiny budgets: seconds")
    args = p.parse_args(argv)
    study_kit.check_dry_run_out(p, args)
    if args.dry_run:  # two rollouts: no validation reaches the endpoint, the machinery runs
        args.model, args.rollouts = "tinymath", 2
        if args.headroom == p.get_default("headroom"):
            args.headroom = args.out / "headroom"
    elif args.rollouts < max(ENDPOINT):
        p.error(f"--rollouts must reach the endpoint's last validation, {max(ENDPOINT)}; "
                f"got {args.rollouts}")  # fmt: skip
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    lr = study_lr(args)
    study, planned = grid(args, lr), runs(args, lr)
    if args.estimate:
        total, left = study.estimate(planned)
        print(f"{total:.1f} h in all, {left:.1f} h left")
        return
    if not args.report:
        with study_kit.resumable():
            study.run_all(planned)
    records = study.finished(planned)
    if not args.s0_here:
        records += headroom_s0(args, lr)
    print(report(records))
    drawn = [] if args.dry_run else whole_study(args, lr, study)
    if drawn:
        print(f"wrote {plot(drawn, args.out / 'staleness.png')} (every finished run)")


if __name__ == "__main__":
    main()
