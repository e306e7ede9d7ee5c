"""Where TROLL and clipping stay stable on TinyMath: a map over the learning rate, the optimiser
steps per rollout, the estimator and the staleness of the data. The plan, its endpoints and its
test are fixed in ``studies/stability-plan.md`` before any run.

    python studies/stability_map.py --estimate                  # hours, then stop
    nohup python studies/stability_map.py > stability.log 2>&1 &   # the whole grid, resumable
    python studies/stability_map.py --panels grpo-s0 --seeds 0  # a share of it
    python studies/stability_map.py --seeds 4 --objectives clip  # one process's share
    python studies/stability_map.py --report                    # tables and maps of what finished

Every run is ``configs/tinymath.yaml`` with an estimator preset, one learning rate, one number of
optimiser steps per rollout (the rollout's 1,024 sequences split evenly, one epoch) and one
staleness, trained for 60 rollouts on :mod:`study_kit`'s machinery (``runs/<name>/`` per run,
``results.json`` and ``metrics.csv`` for the finished ones; the same command again skips finished
runs and resumes an interrupted one). The order is the plan's: panel by panel, within a panel
seed by seed, a cell's two objectives one after the other. ``--report`` classifies every finished
run (learned, collapsed, neither) and writes what :mod:`stability_tables` makes of the records:
``map.md`` (per panel the counts of each cell, the verdict once all 360 runs are in, the secondary
readings, the SmolLM2 corner, and :mod:`stability_control`'s reading of the control column) and
``constraints.md``; and the figures, ``map.png`` (the heat maps), ``entropy.png`` (the entropy at
the end per cell) and ``curves-<panel>.png`` (held-out accuracy per cell).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import study_kit  # noqa: E402
from stability_control import divergence  # noqa: E402
from stability_tables import (  # noqa: E402
    LRS,
    OBJECTIVES,
    PANELS,
    SEEDS,
    STEPS,
    Cell,
    by_cell,
    cells,
    constraint_report,
    mean_entropy,
    outcome,
    report,
    start_accuracy,
)
from study_figures import curve, pyplot  # noqa: E402
from study_kit import Grid, Run  # noqa: E402
from tinymath_report import ACCURACY  # noqa: E402
from tinymath_study import Budget, RunSpec, make_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BUDGET = Budget(rollouts=60, batch_size=128, val_every=10, num_val=1024, num_train=16000)
METRICS = (ACCURACY, "reward/mean", "entropy", "rollout/staleness", "trust_region/", "clip/")
"""Kept per rollout: the validations, the training reward, entropy, staleness and every
constraint figure (the KL at a rollout's end, by confidence bin and advantage sign)."""


def make(cell: Cell, objective: str, seed: int, model: str = "tinymath") -> Run:
    """The run of ``objective`` on ``seed`` in ``cell``: the TinyMath study's run of that
    estimator, learning rate and steps, with the panel's staleness and the KL at a rollout's
    end."""
    estimator, staleness = PANELS[cell.panel]
    spec = RunSpec(estimator, objective, seed, lr=cell.lr, steps=cell.steps)
    base = make_run(spec, BUDGET, model)
    extra = ("--old_policy.max_staleness", str(staleness), "--trust_region_monitor.kl_end", "true")
    fields = {"panel": cell.panel, "lr": cell.lr, "steps": cell.steps, "objective": objective,
              "seed": seed, "estimator": estimator, "staleness": staleness}  # fmt: skip
    name = f"{cell.name}-{objective}-s{seed}"
    return Run(name, base.args + extra, base.max_steps, base.rollouts, fields)


def runs(panels: Sequence[str], seeds: Sequence[int], model: str = "tinymath") -> list[Run]:
    """The plan's order: panel, then seed, then cell, then objective."""
    return [make(cell, objective, seed, model)
            for panel in panels for seed in seeds for cell in cells([panel])
            for objective in OBJECTIVES]  # fmt: skip


def study_grid(out: Path, model: str = "tinymath") -> Grid:
    def start() -> dict:
        return study_kit.validate(make(cells()[0], "troll", 0, model), ACCURACY)

    settings = {"model": model, "budget": asdict(BUDGET), "study": "stability map"}
    return Grid(out, settings, METRICS, start, prior_seconds=1.3)


def plot(records: Sequence[dict], path: Path) -> Path:
    """Per panel and objective, heat maps of the share of seeds that learned and that collapsed
    (rows: learning rate; columns: steps per rollout)."""
    start, table = start_accuracy(records), by_cell(records)
    plt = pyplot()
    fig, axes = plt.subplots(len(PANELS), 4, figsize=(13, 3.2 * len(PANELS)), squeeze=False)
    for i, panel in enumerate(PANELS):
        for j, (o, kind) in enumerate(
            [(o, k) for k in ("learned", "collapsed") for o in OBJECTIVES]
        ):
            grid = [[math.nan] * len(STEPS) for _ in LRS]
            ax = axes[i][j]
            for a, lr in enumerate(LRS):
                for b, steps in enumerate(STEPS):
                    found = table.get(Cell(panel, lr, steps), {}).get(o, {})
                    if found:
                        hits = [getattr(outcome(r, start), kind) for r in found.values()]
                        grid[a][b] = sum(hits) / len(hits)
                        ax.text(b, a, f"{sum(hits)}/{len(hits)}", ha="center", va="center",
                                color="white" if grid[a][b] > 0.5 else "black", fontsize=8)  # fmt: skip
            ax.imshow(grid, vmin=0, vmax=1, cmap="Greens" if kind == "learned" else "Reds",
                      origin="lower")  # fmt: skip
            ax.set_xticks(range(len(STEPS)), [str(s) for s in STEPS])
            ax.set_yticks(range(len(LRS)), [f"{lr:g}" for lr in LRS])
            ax.set_title(f"{panel}: {o}, share {kind}", fontsize=9)
            ax.set_xlabel("optimiser steps per rollout")
            ax.set_ylabel("learning rate")
    total = len(cells()) * len(OBJECTIVES) * len(SEEDS)
    done = "all" if len(records) == total else "incomplete: shares over the seeds finished"
    fig.suptitle(f"{len(records)} of {total} runs ({done})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def entropy_means(records: Sequence[dict]) -> dict[tuple[Cell, str], float]:
    """(cell, objective) -> the mean over its finished seeds of each run's mean entropy over
    rollouts 56-60, where any logs it."""
    start = start_accuracy(records)
    means = {(cell, o): mean_entropy(found, start)
             for cell, objectives in by_cell(records).items() for o, found in objectives.items()}  # fmt: skip
    return {key: e for key, e in means.items() if e is not None}


def plot_entropy(records: Sequence[dict], path: Path) -> Path:
    """Per panel, heat maps of :func:`entropy_means` of TROLL and of clipping on one scale, and
    of TROLL minus clipping, each cell's value written in it."""
    means = entropy_means(records)
    if not means:
        raise ValueError("no finished run logs its entropy over rollouts 56-60")
    top = max(means.values())
    plt = pyplot()
    fig, axes = plt.subplots(len(PANELS), 3, figsize=(10, 3.2 * len(PANELS)), squeeze=False)
    for i, panel in enumerate(PANELS):
        for j, what in enumerate((*OBJECTIVES, "troll - clip")):
            grid = [[math.nan] * len(STEPS) for _ in LRS]
            ax = axes[i][j]
            for a, lr in enumerate(LRS):
                for b, steps in enumerate(STEPS):
                    cell = Cell(panel, lr, steps)
                    if what in OBJECTIVES:
                        value, label = means.get((cell, what)), "{:.3f}"
                    else:
                        pair = [means.get((cell, o)) for o in OBJECTIVES]
                        value, label = None if None in pair else pair[0] - pair[1], "{:+.3f}"
                    if value is not None:
                        grid[a][b] = value
                        ax.text(b, a, label.format(value), ha="center", va="center", fontsize=8)
            if what in OBJECTIVES:
                ax.imshow(grid, vmin=0, vmax=top, cmap="Blues", origin="lower")
            else:
                ax.imshow(grid, vmin=-0.2, vmax=0.2, cmap="RdBu", origin="lower")
            ax.set_xticks(range(len(STEPS)), [str(s) for s in STEPS])
            ax.set_yticks(range(len(LRS)), [f"{lr:g}" for lr in LRS])
            ax.set_title(f"{panel}: entropy at the end, {what}", fontsize=9)
            ax.set_xlabel("optimiser steps per rollout")
            ax.set_ylabel("learning rate")
    fig.suptitle("mean entropy over rollouts 56-60 (nats), mean over the finished seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_curves_by_cell(records: Sequence[dict], out: Path) -> list[Path]:
    """Per panel, ``curves-<panel>.png``: a plot per cell (rows: learning rate; columns: steps)
    of each objective's held-out accuracy over the validations, mean over its finished seeds
    with a band of one standard deviation, the warm start dashed."""
    start, table = start_accuracy(records), by_cell(records)
    plt = pyplot()
    paths = []
    for panel in PANELS:
        if not any(c.panel == panel for c in table):
            continue
        fig, axes = plt.subplots(len(LRS), len(STEPS), figsize=(10, 2.4 * len(LRS)),
                                 sharex=True, sharey=True, squeeze=False)  # fmt: skip
        for a, lr in enumerate(LRS):
            for b, steps in enumerate(STEPS):
                ax = axes[len(LRS) - 1 - a][b]  # the highest learning rate on top
                objectives = table.get(Cell(panel, lr, steps), {})
                for o in OBJECTIVES:
                    found = list(objectives.get(o, {}).values())
                    at, mean, std = curve(found, ACCURACY) if found else ([], [], [])
                    if not at:
                        continue
                    line = ax.plot(at, mean, label=f"{o} ({len(found)})")[0]
                    ax.fill_between(at, [m - s for m, s in zip(mean, std, strict=True)],
                                    [m + s for m, s in zip(mean, std, strict=True)],
                                    color=line.get_color(), alpha=0.15)  # fmt: skip
                ax.axhline(start, color="grey", linestyle="--", linewidth=1)
                ax.set_title(f"lr {lr:g}, {steps} steps", fontsize=9)
                if objectives:
                    ax.legend(fontsize=7)
        for ax in axes[-1]:
            ax.set_xlabel("rollout")
        for row in axes:
            row[0].set_ylabel("held-out accuracy")
        estimator, staleness = PANELS[panel]
        fig.suptitle(f"{panel}: {estimator}, staleness {staleness}")
        fig.tight_layout()
        path = out / f"curves-{panel}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "studies/results/stability/tinymath")
    p.add_argument("--panels", nargs="+", choices=list(PANELS), default=list(PANELS))
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    p.add_argument("--objectives", nargs="+", choices=list(OBJECTIVES), default=list(OBJECTIVES),
                   help="the objectives this process trains (processes share the folder)")  # fmt: skip
    p.add_argument("--model", default="tinymath", help="warm start (name or directory)")
    p.add_argument("--estimate", action="store_true", help="print the hours, then stop")
    p.add_argument("--report", action="store_true", help="tables and maps of finished runs")
    args = p.parse_args(argv)
    unknown = sorted(set(args.seeds) - set(SEEDS))
    if unknown:
        p.error(f"--seeds: the plan's seeds are {list(SEEDS)}; got {unknown}")
    return args


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    todo = [r for r in runs(args.panels, args.seeds, args.model)
            if r.fields["objective"] in args.objectives]  # fmt: skip
    study = study_grid(args.out, args.model)
    if args.estimate:
        total, left = study.estimate(todo)
        print(f"{len(todo)} runs: {total:.1f} hours of one process, {left:.1f} left")
        return []
    if args.report:
        records = study.finished(runs(list(PANELS), list(SEEDS), args.model))
        if not records:
            sys.exit(f"--report: no finished run in {args.out}")
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        with study_kit.resumable():
            study.run_all(todo)
        records = study.finished(runs(list(PANELS), list(SEEDS), args.model))
    text = report(records) + divergence(records)
    study_kit.write_atomic(args.out / "map.md", text)
    print(text)
    study_kit.write_atomic(args.out / "constraints.md", constraint_report(records))
    print(f"wrote {plot(records, args.out / 'map.png')}, {args.out / 'constraints.md'}")
    print(f"wrote {plot_entropy(records, args.out / 'entropy.png')}")
    for path in plot_curves_by_cell(records, args.out):
        print(f"wrote {path}")
    return records


if __name__ == "__main__":
    main()
