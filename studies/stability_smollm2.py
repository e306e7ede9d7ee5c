"""The stability map's two SmolLM2-135M-Instruct items (``studies/stability-plan.md``,
"SmolLM2-135M-Instruct"): 32 optimiser steps per rollout on the word problems at 5 seeds, and one
more corner that the TinyMath map points to, at 3 seeds.

    python studies/stability_smollm2.py                          # both items' endpoints so far
    nohup python studies/stability_smollm2.py --corner > corner.log 2>&1 &   # item 2's runs
    ... --corner --seeds 0 --objectives troll    # a share of them: one process per core
    python studies/stability_smollm2.py --corner --estimate      # its hours, then stop

Item 1's runs are the stale-data study's ``steps32`` arm, run by its own script: seeds 0-2 are in
``studies/results/smollm2/staleness/``; seeds 3 and 4 run with ``python
studies/staleness_study.py --arms steps32 --seeds 3 4 --out studies/results/stability/smollm2``.

Item 2's cell is the one :func:`stability_tables.corner` picks from the finished TinyMath map (the
script refuses to start before the map is complete). Its runs are the headroom study's word
problems, regime and start (:func:`headroom_study.run`), 40 rollouts on seeds 0-2, with the cell's
optimiser steps per rollout, its staleness (the behaviour anchor, as on TinyMath), its estimator
(GSPO: one importance ratio per sequence; GRPO: the word problems' own token ratios) and the
headroom pilot's learning rate times the cell's ratio to TinyMath's 1e-4. They are written to
``studies/results/stability/smollm2-corner/``; the same command resumes them.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "examples"))  # the task generators
import headroom_study as headroom  # noqa: E402
import paper_regime_study as paper  # noqa: E402
import stability_map  # noqa: E402
import stability_tables as tinymath  # noqa: E402
import staleness_study  # noqa: E402
import study_kit  # noqa: E402
from study_figures import markdown_table  # noqa: E402
from study_kit import Grid, Run  # noqa: E402
from study_stats import paired  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ACCURACY = "val/accuracy"
ROLLOUTS = 40
ENDPOINTS = tinymath.Endpoints(final=(30, 40), entropy_window=(36, 40), learned_margin=0.038)
"""Items 1 and 2: the map's endpoints with this task's numbers; the learned margin is two
standard errors of one validation of the 512 held-out problems at the start's accuracy."""
ITEM1_SEEDS = {"studies/results/smollm2/staleness": (0, 1, 2),
               "studies/results/stability/smollm2": (3, 4)}  # fmt: skip
"""Item 1: the stale-data study's folder holding each seed's ``steps32`` runs."""
CORNER_SEEDS = (0, 1, 2)
CORNER_OUT = ROOT / "studies/results/stability/smollm2-corner"
OBJECTIVES = ("troll", "clip")
"""The order of a paired difference: TROLL minus clipping."""
NAMES = {"troll": "TROLL", "clip": "clipping"}


def outcome(record: dict, start: float) -> tinymath.Outcome:
    """The plan's item 1 endpoints of one finished run (item 2 uses the same)."""
    return tinymath.outcome(record, start, ENDPOINTS)


def by_seed(records: Sequence[dict]) -> dict[str, dict[int, dict]]:
    """Objective -> seed -> record."""
    table: dict[str, dict[int, dict]] = {o: {} for o in OBJECTIVES}
    for r in records:
        table[r["fields"]["objective"]][int(r["fields"]["seed"])] = r
    return table


def endpoints(records: Sequence[dict], start: float, seeds: Sequence[int]) -> tuple[str, str]:
    """(the counts and paired differences as text, the item 1 verdict) over ``seeds``: an
    objective is ahead here only if the paired t-test's p is below 0.05 and every seed that
    differs in learning favours it."""
    table = by_seed(records)
    counts = []
    for o in OBJECTIVES:
        found = [outcome(r, start) for r in table[o].values()]
        counts.append(f"{NAMES[o]} learned on {sum(x.learned for x in found)} of {len(found)}, "
                      f"collapsed on {sum(x.collapsed for x in found)}")  # fmt: skip
    both = [s for s in seeds if all(s in table[o] for o in OBJECTIVES)]
    if len(both) < len(seeds):
        return "; ".join(counts), f"no verdict: {len(both)} of {len(seeds)} seeds have both runs"
    got = {o: [outcome(table[o][s], start) for s in both] for o in OBJECTIVES}
    diff = paired([x.final for x in got["troll"]], [x.final for x in got["clip"]])
    differing = [t.learned for t, c in zip(got["troll"], got["clip"], strict=True)
                 if t.learned != c.learned]  # fmt: skip
    text = "; ".join(counts) + f"; F, TROLL - clipping, per seed: {diff.text()}"
    leader = "TROLL" if diff.mean > 0 else "clipping"
    favours = all(differing) if diff.mean > 0 else not any(differing)
    if not math.isnan(diff.p_t) and diff.p_t < 0.05 and diff.mean != 0 and favours:
        return text, f"{leader} ahead here"
    return text, "no difference shown"


# -- item 1 -----------------------------------------------------------------------------------
def item1_records() -> list[dict]:
    """The ``steps32`` runs of the seeds :data:`ITEM1_SEEDS` places in each folder."""
    records = []
    for folder, seeds in ITEM1_SEEDS.items():
        argv = ["--arms", "steps32", "--seeds", *map(str, seeds), "--out", str(ROOT / folder)]
        args = staleness_study.parse_args(argv)
        lr = staleness_study.study_lr(args)
        records += staleness_study.grid(args, lr).finished(staleness_study.runs(args, lr))
    return records


# -- item 2 -----------------------------------------------------------------------------------
def corner_cell() -> tuple[tinymath.Cell, str]:
    """The plan's corner from the finished TinyMath map; exits naming what is missing."""
    out = ROOT / "studies/results/stability/tinymath"
    records = stability_map.study_grid(out).finished(
        stability_map.runs(list(tinymath.PANELS), list(tinymath.SEEDS))
    )
    found = tinymath.corner(records, tinymath.start_accuracy(records)) if records else None
    if found is None:
        sys.exit(
            f"the SmolLM2 corner waits for the TinyMath map: {len(records)} of 360 runs in {out}"
        )
    return found


def corner_args(cell: tinymath.Cell, prompts: int) -> tuple[str, ...]:
    """The options that put the word problems at ``cell``: its steps per rollout, staleness
    (behaviour anchor) and estimator (GSPO's sequence ratio)."""
    estimator, staleness = tinymath.PANELS[cell.panel]
    extra = (
        "--old_policy.max_staleness", str(staleness),
        "--model.corrections.anchor", "behaviour",
        "--model.optimization.minibatch_size", str(prompts * paper.GROUP // cell.steps),
    )  # fmt: skip
    return extra + (("--model.loss.importance", "sequence") if estimator == "gspo" else ())


def word_problems() -> argparse.Namespace:
    """The stale-data study's own arguments (its defaults): the headroom study's task, model
    and prompts per rollout, which item 2 keeps."""
    return staleness_study.parse_args([])


def corner_runs(args, cell: tinymath.Cell, lr: float) -> list[Run]:
    """Item 2's runs: each seed's two objectives side by side."""
    h, found = staleness_study.headroom_args(word_problems()), []
    corner_lr = lr * cell.lr / tinymath.SMOLLM2_ANCHOR_LR
    for seed in CORNER_SEEDS:
        for objective in OBJECTIVES:
            run = headroom.run(h, f"corner-{objective}-s{seed}", objective, corner_lr, seed,
                               ROLLOUTS, corner_args(cell, args.prompts))  # fmt: skip
            found.append(replace(run, max_steps=ROLLOUTS * cell.steps,
                                 fields={**run.fields, "cell": cell.name}))  # fmt: skip
    return found


def own_share(runs: Sequence[Run], args) -> list[Run]:
    """The runs of ``runs`` on ``--seeds`` and ``--objectives``: this process's share (a run's
    seed, prompts and settings do not depend on which process trains it)."""
    return [r for r in runs
            if r.fields["seed"] in args.seeds and r.fields["objective"] in args.objectives]  # fmt: skip


def corner_grid(args, cell: tinymath.Cell, lr: float) -> Grid:
    def start() -> dict:
        return study_kit.validate(corner_runs(args, cell, lr)[0], ACCURACY)

    settings = {"rollouts": ROLLOUTS, "prompts": args.prompts, "cell": cell.name}
    return Grid(args.out, settings, paper.METRICS, start, prior_seconds=90.0)


def report(item1: Sequence[dict], corner: Sequence[dict], cell: str | None) -> str:
    lines = ["# The stability map on SmolLM2-135M-Instruct\n"]
    if item1:
        start = tinymath.start_accuracy(item1)
        text, verdict = endpoints(item1, start, (0, 1, 2, 3, 4))
        lines.append(f"\n## Item 1: 32 steps per rollout, 5 seeds\n\nStart {start:.4f}. {text}.\n\n"
                     f"Verdict (the plan's rule for item 1): {verdict}.\n")  # fmt: skip
        lines.append("\n" + seed_table(item1, start))
    if corner:
        start = tinymath.start_accuracy(corner)
        text, _ = endpoints(corner, start, CORNER_SEEDS)
        lines.append(f"\n## Item 2: the corner `{cell}`, 3 seeds (readings)\n\nStart "
                     f"{start:.4f}. {text}.\n\n" + seed_table(corner, start))  # fmt: skip
    return "".join(lines)


def seed_table(records: Sequence[dict], start: float) -> str:
    table = by_seed(records)
    rows = []
    for seed in sorted(set(table["troll"]) | set(table["clip"])):
        row = [str(seed)]
        for o in OBJECTIVES:
            r = table[o].get(seed)
            x = outcome(r, start) if r else None
            row.append(
                "-"
                if x is None
                else f"{x.final:.3f}" + (" up" if x.learned else " down" if x.collapsed else "")
            )
            row.append("-" if x is None or x.entropy is None else f"{x.entropy:.3f}")
        rows.append(row)
    header = ["seed", "TROLL F", "TROLL entropy", "clipping F", "clipping entropy"]
    return markdown_table(header, rows, "rrrrr")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=CORNER_OUT, help="item 2's folder")
    p.add_argument("--corner", action="store_true", help="run item 2's runs (resumable)")
    p.add_argument("--estimate", action="store_true", help="with --corner: hours, then stop")
    p.add_argument("--seeds", type=int, nargs="+", choices=CORNER_SEEDS, default=list(CORNER_SEEDS),
                   help="with --corner: the seeds this process trains")  # fmt: skip
    paper.add_objectives(p)
    args = p.parse_args(argv)
    args.prompts = word_problems().prompts
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    item1 = item1_records()
    corner, cell = [], None
    if args.corner or (args.out / "results.json").exists():
        found, why = corner_cell()
        cell = found.name
        lr = staleness_study.study_lr(word_problems())
        study, planned = corner_grid(args, found, lr), corner_runs(args, found, lr)
        if args.estimate:
            total, left = study.estimate(planned)
            print(f"the corner {cell} ({why}): {total:.1f} h in all, {left:.1f} h left")
            return
        if args.corner:
            with study_kit.resumable():
                study.run_all(own_share(planned, args))
        corner = study.finished(planned)
    text = report(item1, corner, cell)
    study_kit.write_atomic(ROOT / "studies/results/stability/smollm2.md", text)
    print(text)


if __name__ == "__main__":
    main()
