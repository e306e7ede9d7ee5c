"""Why TROLL falls behind clipping late on SmolLM2's arithmetic: a pre-registered branch test.

    python studies/late_gap_branches.py --estimate                  # hours, then stop
    nohup python studies/late_gap_branches.py --seeds 0 > s0.log 2>&1 &   # one process a seed
    python studies/late_gap_branches.py --report                    # tables and plots so far
    python studies/late_gap_branches.py --dry-run --out /tmp/dry    # the machinery on TinyMath

The plan, its endpoints and what each outcome means are fixed in studies/late-gap-plan.md before
any run. In the paper-regime study's main-grid settings (:mod:`paper_regime_study`: SmolLM2, the
arithmetic task, temperature 1.0, token-mean, 8 optimiser steps per rollout, TROLL at eps 0.05,
alpha 1, K 64 on the official support, a constant lr of 3e-6), each seed's **trunk** is TROLL
for :data:`TRUNK` rollouts (``--trunk``), its checkpoint kept. From that checkpoint, four
**branches** train :data:`BRANCH` more rollouts each (``--branch``) (:data:`ARMS`): unchanged (the control), switched to clipping,
TROLL at eps 0.2, TROLL at alpha 0. A branch starts from a copy of the trunk's checkpoint whose
stored options carry the arm's change (:func:`branch_checkpoint`; a resumed run keeps the
options its checkpoint stores), so weights, optimiser, snapshot, prompt order and random states
all carry over, and every arm of a seed samples the same rollout 31.

Each run keeps every metric the monitors log (``trust_region/``, ``clip/``, ``sparsity/``: the
confidence and advantage bins among them). Runs go one after another in-process on
:mod:`study_kit`'s machinery (resume, records); ``--seeds`` splits the grid between processes.
``--out`` (default ``studies/results/smollm2/late_gap``) holds ``trunks/`` and ``branches/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paper_regime_study as paper  # noqa: E402
import study_kit  # noqa: E402
from study_kit import Grid, Run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LR = 3e-6
TRUNK = 30
"""Rollouts of a trunk: where the branches start."""
BRANCH = 30
"""Rollouts of a branch after the trunk."""
ARMS: dict[str, dict] = {
    "control": {},
    "clip": {"objective": "clip"},
    "eps0.2": {"trust_region.eps": 0.2},
    "alpha0": {"trust_region.alpha": 0.0},
}
"""Each branch's change to the trunk's model options (``group.field`` for a field of an option
record)."""
METRICS = (*paper.METRICS, "loss/")
"""The paper-regime study's (every figure the monitors log), and the losses."""


def trunk_run(args, seed: int) -> Run:
    return paper.run(args, f"trunk-troll-lr{LR:g}-s{seed}", "troll", LR, seed, args.trunk)


def branch_runs(args, seed: int) -> list[Run]:
    """The arms of ``seed``, each continuing its trunk to ``--trunk`` + ``--branch`` rollouts."""
    runs = []
    for arm, changes in ARMS.items():
        objective = changes.get("objective", "troll")
        extra = tuple(
            part
            for key, value in changes.items()
            if key != "objective"
            for part in (f"--model.{key}", repr(value))
        )
        total = args.trunk + args.branch
        run = paper.run(args, f"{arm}-s{seed}", objective, LR, seed, total, extra, arm=arm)
        runs.append(dataclasses.replace(run, rollouts=args.branch))
    return runs


def branch_checkpoint(source: Path, target: Path, changes: dict) -> None:
    """Copies the checkpoint ``source`` to ``target`` with ``changes`` made to the model options
    it stores (``name`` or ``group.field``). Raises ``KeyError`` for an option it lacks."""
    checkpoint = torch.load(source, map_location="cpu", weights_only=False)
    options = checkpoint["hyper_parameters"]
    for key, value in changes.items():
        group, _, name = key.rpartition(".")
        if not group:
            if name not in options:
                raise KeyError(f"the checkpoint stores no model option {name!r}")
            options[name] = value
            continue
        record = options[group]
        if isinstance(record, dict):
            if name not in record:
                raise KeyError(f"the checkpoint's model.{group} has no field {name!r}")
            record[name] = value
        else:
            options[group] = dataclasses.replace(record, **{name: value})
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    torch.save(checkpoint, partial)
    partial.replace(target)


def trunk_grid(args) -> Grid:
    return Grid(args.out / "trunks", settings(args, "trunks"), METRICS, start_row(args))


def branch_grid(args) -> Grid:
    return Grid(args.out / "branches", settings(args, "branches"), METRICS)


def settings(args, phase: str) -> dict:
    return {
        "phase": phase,
        "prompts": args.prompts,
        "dry_run": args.dry_run,
        "lr": LR,
        "trunk": args.trunk,
        "branch": args.branch,
    }


def start_row(args):
    """The main grid's validation before training, where it exists; else one of our own."""

    def start() -> dict:
        kept = ROOT / "studies/results/smollm2/paper_regime/main/start.json"
        if kept.exists() and not args.dry_run:
            row = json.loads(kept.read_text())
            return {k: v for k, v in row.items() if k != "seconds"}
        return study_kit.validate(trunk_run(args, args.seeds[0]), paper.ACCURACY)

    return start


def run_seed(args, seed: int) -> None:
    trunks = trunk_grid(args)
    trunk = trunk_run(args, seed)
    trunks.run_all([trunk], keep_checkpoints=True)
    checkpoint = args.out / "trunks" / "runs" / trunk.name / "checkpoints" / "last.ckpt"

    def prepare(run: Run, run_dir: Path) -> None:
        if not checkpoint.exists():
            sys.exit(f"{checkpoint} is gone: remove {trunks.out / 'runs' / trunk.name} to rerun it")
        branch_checkpoint(
            checkpoint, run_dir / "checkpoints" / "last.ckpt", ARMS[run.fields["arm"]]
        )

    runs = [run for run in branch_runs(args, seed) if run.fields["arm"] in args.arms]
    branch_grid(args).run_all(runs, prepare=prepare)


def estimate(args) -> None:
    total, left = trunk_grid(args).estimate([trunk_run(args, s) for s in args.seeds])
    rate = total * 3600 / max(args.trunk * len(args.seeds), 1)
    hours = len(args.seeds) * len(ARMS) * args.branch * rate / 3600
    print(f"trunks: {total:.1f} h ({left:.1f} h left); branches: about {hours:.1f} h")


def report(args) -> None:
    from late_gap_tables import report as tables

    trunks = trunk_grid(args).finished([trunk_run(args, s) for s in args.seeds])
    branches = branch_grid(args).finished([r for s in args.seeds for r in branch_runs(args, s)])
    tables(args.out, trunks, branches)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "studies/results/smollm2/late_gap")
    p.add_argument("--prompts", type=int, default=8, help="prompts per rollout (x 8 samples)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS),
                   help="the arms to run (two processes may split a seed's arms once its trunk "
                   "is done)")  # fmt: skip
    p.add_argument("--trunk", type=int, default=TRUNK, help="rollouts of a trunk")
    p.add_argument("--branch", type=int, default=BRANCH, help="rollouts of a branch after it")
    p.add_argument("--estimate", action="store_true", help="print the hours and stop")
    p.add_argument("--report", action="store_true", help="tables and plots of finished runs")
    p.add_argument("--dry-run", action="store_true", help="TinyMath, tiny budgets: seconds")
    args = p.parse_args(argv)
    study_kit.check_dry_run_out(p, args)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.report:
        return report(args)
    if args.estimate:
        return estimate(args)
    with study_kit.resumable():
        for seed in args.seeds:
            run_seed(args, seed)
    report(args)


if __name__ == "__main__":
    main()
