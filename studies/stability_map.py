"""Where TROLL and clipping stay stable on TinyMath: a map over the learning rate, the optimiser
steps per rollout, the estimator and the staleness of the data. The plan, its endpoints and its
test are fixed in ``studies/stability-plan.md`` before any run.

    python studies/stability_map.py --estimate                  # hours, then stop
    nohup python studies/stability_map.py > stability.log 2>&1 &   # the whole grid, resumable
    python studies/stability_map.py --panels grpo-s0 --seeds 0  # a share of it
    python studies/stability_map.py --report                    # tables and maps of what finished

Every run is ``configs/tinymath.yaml`` with an estimator preset, one learning rate, one number of
optimiser steps per rollout (the rollout's 1,024 sequences split evenly, one epoch) and one
staleness, trained for 60 rollouts on :mod:`study_kit`'s machinery (``runs/<name>/`` per run,
``results.json`` and ``metrics.csv`` for the finished ones; the same command again skips finished
runs and resumes an interrupted one). The order is the plan's: panel by panel, within a panel
seed by seed, a cell's two objectives one after the other. ``--report`` classifies every finished
run (learned, collapsed, neither), writes ``map.md`` (per panel the counts of each cell, the
verdict once all 360 runs are in, the secondary readings) and ``map.png`` (the heat maps).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import study_kit  # noqa: E402
from study_figures import markdown_table, pyplot, window_mean  # noqa: E402
from study_kit import Grid, Run  # noqa: E402
from study_stats import paired, sign_test  # noqa: E402
from tinymath_report import ACCURACY  # noqa: E402
from tinymath_study import Budget, RunSpec, make_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LRS = (3e-5, 1e-4, 2e-4, 3e-4)
STEPS = (1, 4, 32)
PANELS = {"grpo-s0": ("grpo", 0), "gspo-s0": ("gspo", 0), "grpo-s4": ("grpo", 4)}
"""Panel -> (estimator, old_policy.max_staleness), in the order the grid runs them."""
SEEDS = (0, 1, 2, 3, 4)
OBJECTIVES = ("troll", "clip")
BUDGET = Budget(rollouts=60, batch_size=128, val_every=10, num_val=1024, num_train=16000)
ENDPOINT = (50, 60)
"""The validations whose mean is a run's final held-out accuracy ``F``."""
ENTROPY_WINDOW = (56, 60)
LATE = (41, 60)
LEARNED_MARGIN = 0.031
"""Two standard errors of one validation of 1,024 prompts."""
COLLAPSE_MARGIN = 0.05
ENTROPY_FLOOR = 0.01
STABLE_SEEDS = 4
"""Seeds of 5 that must learn for a cell to be in an objective's stable region."""
COLLAPSE_SEEDS = 3
"""Seeds of 5 that must collapse for a cell to be in an objective's collapse region."""
METRICS = (ACCURACY, "reward/mean", "entropy", "rollout/staleness", "trust_region/", "clip/")
"""Kept per rollout: the validations, the training reward, entropy, staleness and every
constraint figure (the KL at a rollout's end, by confidence bin and advantage sign)."""


@dataclass(frozen=True)
class Cell:
    """One cell of the map."""

    panel: str
    lr: float
    steps: int

    @property
    def name(self) -> str:
        return f"{self.panel}-lr{self.lr:g}-steps{self.steps}"


def cells(panels: Sequence[str] = tuple(PANELS)) -> list[Cell]:
    return [Cell(p, lr, steps) for p in panels for lr in LRS for steps in STEPS]


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


@dataclass(frozen=True)
class Outcome:
    """A run's endpoints: its final accuracy, its entropy at the end and its class."""

    final: float
    entropy: float | None
    learned: bool
    collapsed: bool


def outcome(record: dict, start: float) -> Outcome:
    """The plan's endpoints of one finished run against the warm start's accuracy ``start``."""
    final = window_mean(record, ACCURACY, ENDPOINT, at=ENDPOINT)
    if final is None:
        raise ValueError(f"{record['name']}: no validation at rollouts {ENDPOINT}")
    entropy = window_mean(record, "entropy", ENTROPY_WINDOW)
    flat = entropy is not None and entropy < ENTROPY_FLOOR
    collapsed = final <= start - COLLAPSE_MARGIN or flat
    learned = final >= start + LEARNED_MARGIN and not collapsed
    return Outcome(final, entropy, learned, collapsed)


def start_accuracy(records: Sequence[dict]) -> float:
    """The warm start's accuracy (rollout 0, the same in every record)."""
    found = {row[ACCURACY] for r in records for row in r["history"] if row["rollout"] == 0}
    if len(found) != 1:
        raise ValueError(f"the records hold {len(found)} start accuracies; expected one")
    return found.pop()


def by_cell(records: Sequence[dict]) -> dict[Cell, dict[str, dict[int, dict]]]:
    """Cell -> objective -> seed -> record."""
    table: dict[Cell, dict[str, dict[int, dict]]] = {}
    for r in records:
        f = r["fields"]
        cell = Cell(f["panel"], float(f["lr"]), int(f["steps"]))
        table.setdefault(cell, {}).setdefault(f["objective"], {})[int(f["seed"])] = r
    return table


def unshared_first_rollouts(records: Sequence[dict]) -> list[str]:
    """The pairs (cell and seed) whose two objectives' first rollouts differ in mean reward:
    the plan says a pair shares its first rollout's samples."""
    bad = []
    for cell, objectives in by_cell(records).items():
        for seed in set(objectives.get("troll", {})) & set(objectives.get("clip", {})):
            first = [window_mean(objectives[o][seed], "reward/mean", (1, 1)) for o in OBJECTIVES]
            if None in first or not math.isclose(first[0], first[1], abs_tol=1e-9):
                bad.append(f"{cell.name}-s{seed}")
    return sorted(bad)


def regions(records: Sequence[dict], start: float, seeds: int = len(SEEDS)):
    """Per objective, the cells of its stable region and of its collapse region, among the cells
    whose ``seeds`` runs of both objectives have finished; and those complete cells."""
    complete, stable, collapse = [], {o: set() for o in OBJECTIVES}, {o: set() for o in OBJECTIVES}
    for cell, objectives in by_cell(records).items():
        if any(len(objectives.get(o, {})) < seeds for o in OBJECTIVES):
            continue
        complete.append(cell)
        for o in OBJECTIVES:
            found = [outcome(r, start) for r in objectives[o].values()]
            if sum(x.learned for x in found) >= STABLE_SEEDS:
                stable[o].add(cell)
            if sum(x.collapsed for x in found) >= COLLAPSE_SEEDS:
                collapse[o].add(cell)
    return complete, stable, collapse


def compare(region: dict[str, set], what: str) -> tuple[str, float]:
    """The sign test over the cells in one objective's ``region`` and not the other's: its
    sentence and p."""
    troll, clip = len(region["troll"] - region["clip"]), len(region["clip"] - region["troll"])
    p = sign_test([1.0] * troll + [-1.0] * clip)
    if p < 0.05 and troll != clip:
        leader = "TROLL" if troll > clip else "clipping"
        verdict = f"{leader}'s {what} is larger"
    else:
        verdict = "no difference shown"
    sizes = f"TROLL {len(region['troll'])} cells, clipping {len(region['clip'])}"
    return (
        f"{verdict} ({sizes}; cells in one only: {troll} TROLL's, {clip} clipping's; sign "
        f"test p {p:.3f})",
        p,
    )


def verdict(records: Sequence[dict], start: float) -> str:
    """The pre-registered verdict, or why there is none yet."""
    complete, stable, _ = regions(records, start)
    if len(complete) < len(cells()):
        return f"no verdict: {len(complete)} of {len(cells())} cells have all 5 seeds of both"
    return compare(stable, "stable region")[0]


def cell_counts(objectives: dict[str, dict[int, dict]], start: float) -> str:
    parts = []
    for o in OBJECTIVES:
        found = [outcome(r, start) for r in objectives.get(o, {}).values()]
        n = len(found)
        parts.append(f"{o} {sum(x.learned for x in found)}/{n} up, "
                     f"{sum(x.collapsed for x in found)}/{n} down")  # fmt: skip
    return "; ".join(parts)


def paired_final(objectives: dict[str, dict[int, dict]], start: float) -> str:
    seeds = sorted(set(objectives.get("troll", {})) & set(objectives.get("clip", {})))
    if len(seeds) < 2:
        return "-"
    a = [outcome(objectives["troll"][s], start).final for s in seeds]
    b = [outcome(objectives["clip"][s], start).final for s in seeds]
    return paired(a, b).text()


def entropies(objectives: dict[str, dict[int, dict]], start: float) -> str:
    out = []
    for o in OBJECTIVES:
        found = [outcome(r, start).entropy for r in objectives.get(o, {}).values()]
        found = [e for e in found if e is not None]
        out.append(f"{statistics.fmean(found):.3f}" if found else "-")
    return " / ".join(out)


def late_kl(objectives: dict[str, dict[int, dict]]) -> str:
    out = []
    for o in OBJECTIVES:
        found = [
            window_mean(r, "trust_region/kl_end_mean", LATE) for r in objectives.get(o, {}).values()
        ]
        found = [k for k in found if k is not None]
        out.append(f"{statistics.fmean(found):.4f}" if found else "-")
    return " / ".join(out)


def report(records: Sequence[dict]) -> str:
    """``map.md``: the verdict (or why none yet), then per panel a table of the cells."""
    start = start_accuracy(records)
    lines = [f"# The stability map: {len(records)} of {len(cells()) * 10} runs finished\n",
             f"Warm start {start:.4f}. Verdict (the plan's primary endpoint): "
             f"{verdict(records, start)}.\n"]  # fmt: skip
    complete, _, collapse = regions(records, start)
    if len(complete) == len(cells()):
        lines.append(f"Collapse regions (secondary): {compare(collapse, 'collapse region')[0]}.\n")
    unshared = unshared_first_rollouts(records)
    lines.append("Pairs whose first rollouts differ: " + (", ".join(unshared) or "none") + ".\n")
    table = by_cell(records)
    header = ["lr", "steps", "runs learned (up) and collapsed (down) of those finished",
              "F, TROLL - clipping, per seed", "entropy at the end, TROLL / clipping",
              "KL at a rollout's end 41-60, TROLL / clipping"]  # fmt: skip
    for panel in PANELS:
        rows = [[f"{c.lr:g}", str(c.steps), cell_counts(table[c], start),
                 paired_final(table[c], start), entropies(table[c], start), late_kl(table[c])]
                for c in cells([panel]) if c in table]  # fmt: skip
        if rows:
            estimator, staleness = PANELS[panel]
            lines.append(f"\n## {panel}: {estimator}, staleness {staleness}\n\n")
            lines.append(markdown_table(header, rows, "rr"))
    return "".join(lines)


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
            for a, lr in enumerate(LRS):
                for b, steps in enumerate(STEPS):
                    found = table.get(Cell(panel, lr, steps), {}).get(o, {})
                    if found:
                        hits = [getattr(outcome(r, start), kind) for r in found.values()]
                        grid[a][b] = sum(hits) / len(hits)
            ax = axes[i][j]
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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "studies/results/stability/tinymath")
    p.add_argument("--panels", nargs="+", choices=list(PANELS), default=list(PANELS))
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
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
    todo = runs(args.panels, args.seeds, args.model)
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
    text = report(records)
    study_kit.write_atomic(args.out / "map.md", text)
    print(text)
    print(f"wrote {plot(records, args.out / 'map.png')}")
    return records


if __name__ == "__main__":
    main()
