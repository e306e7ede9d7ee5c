"""The stability map's cells, its endpoints and its tables (``studies/stability-plan.md``):
what ``stability_map.py --report`` writes from the records, in ``map.md`` (the verdict, the
regions, per cell the counts, the paired differences of the final accuracy, the entropy and the
KL at a rollout's end, the SmolLM2 corner), ``constraints.md`` (the constraints' shares of tokens
by confidence and advantage), ``map.png`` (the heat maps) and ``curves-<panel>.png``."""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study_figures import markdown_table, window_mean  # noqa: E402
from study_stats import paired, sign_test  # noqa: E402
from tinymath_report import ACCURACY  # noqa: E402

LRS = (3e-5, 1e-4, 2e-4, 3e-4)
STEPS = (1, 4, 32)
PANELS = {"grpo-s0": ("grpo", 0), "gspo-s0": ("gspo", 0), "grpo-s4": ("grpo", 4)}
"""Panel -> (estimator, old_policy.max_staleness), in the order the grid runs them."""
SEEDS = (0, 1, 2, 3, 4)
OBJECTIVES = ("troll", "clip")
LATE = (41, 60)
STABLE_SEEDS = 4
"""Seeds of 5 that must learn for a cell to be in an objective's stable region."""
COLLAPSE_SEEDS = 3
"""Seeds of 5 that must collapse for a cell to be in an objective's collapse region."""
CONFIDENCE_BINS = ("below_0.5", "0.5_0.8", "0.8_0.95", "above_0.95")
ADVANTAGE_SIGNS = ("negative", "zero", "positive")
ACTS = {"troll": ("trust_region/active_frac", "projected"), "clip": ("clip/active_frac", "clipped")}
"""Per objective: its share of tokens its constraint acts on, and the name of that share in the
``by_confidence``/``by_advantage`` figures."""
CORNER_GAP = 2
"""Seeds of 5 by which the objectives' learned counts must differ for the SmolLM2 corner to be the
cell where they differ most (the plan's item 2)."""
CORNER_SEEDS = 3
"""Seeds of 5 one objective must learn on for a cell to be the corner when none differs."""
SMOLLM2_ANCHOR_LR = 1e-4
"""TinyMath's learning rate that the headroom pilot's learning rate stands for on SmolLM2."""


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


@dataclass(frozen=True)
class Endpoints:
    """A plan's endpoints per run: ``F`` is the mean of the validations at the rollouts of
    ``final``; learned: ``F >= start + learned_margin``; collapsed: ``F <= start -
    collapse_margin`` or the mean entropy over the rollouts ``entropy_window`` (inclusive) below
    ``entropy_floor``."""

    final: tuple[int, int]
    entropy_window: tuple[int, int]
    learned_margin: float
    collapse_margin: float = 0.05
    entropy_floor: float = 0.01


TINYMATH = Endpoints(final=(50, 60), entropy_window=(56, 60), learned_margin=0.031)
"""The map's endpoints; the learned margin is two standard errors of one validation of 1,024
prompts."""


@dataclass(frozen=True)
class Outcome:
    """A run's endpoints: its final accuracy, its entropy at the end and its class."""

    final: float
    entropy: float | None
    learned: bool
    collapsed: bool


def outcome(record: dict, start: float, endpoints: Endpoints = TINYMATH) -> Outcome:
    """The ``endpoints`` of one finished run against the warm start's accuracy ``start``."""
    e = endpoints
    final = window_mean(record, ACCURACY, e.final, at=e.final)
    if final is None:
        raise ValueError(f"{record['name']}: no validation at rollouts {e.final}")
    entropy = window_mean(record, "entropy", e.entropy_window)
    flat = entropy is not None and entropy < e.entropy_floor
    collapsed = final <= start - e.collapse_margin or flat
    learned = final >= start + e.learned_margin and not collapsed
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


def mean_entropy(found: dict[int, dict], start: float) -> float | None:
    """The mean over a cell's finished runs of one objective (seed -> record) of each run's
    entropy at the end; None where none logs it."""
    values = [outcome(r, start).entropy for r in found.values()]
    values = [e for e in values if e is not None]
    return statistics.fmean(values) if values else None


def entropies(objectives: dict[str, dict[int, dict]], start: float) -> str:
    means = [mean_entropy(objectives.get(o, {}), start) for o in OBJECTIVES]
    return " / ".join("-" if e is None else f"{e:.3f}" for e in means)


def late_kl(objectives: dict[str, dict[int, dict]]) -> str:
    out = []
    for o in OBJECTIVES:
        found = [
            window_mean(r, "trust_region/kl_end_mean", LATE) for r in objectives.get(o, {}).values()
        ]
        found = [k for k in found if k is not None]
        out.append(f"{statistics.fmean(found):.4f}" if found else "-")
    return " / ".join(out)


def named(found: set[Cell]) -> str:
    """`` [lr 3e-05 x 32 steps, ...]``, in the grid's order; empty for no cell."""
    if not found:
        return ""
    return " [" + ", ".join(f"lr {c.lr:g} x {c.steps} steps" for c in cells() if c in found) + "]"


def panel_regions(records: Sequence[dict], start: float) -> list[str]:
    """Per panel (secondary): the stable and collapse regions' sizes and discordant splits over
    the panel's complete cells, naming the cells in one region only."""
    complete, stable, collapse = regions(records, start)
    lines = []
    for panel in PANELS:
        mine = {c for c in complete if c.panel == panel}
        if not mine:
            continue
        parts = []
        for what, region in (("stable", stable), ("collapse", collapse)):
            r = {o: region[o] & mine for o in OBJECTIVES}
            troll, clip = r["troll"] - r["clip"], r["clip"] - r["troll"]
            parts.append(f"{what} TROLL {len(r['troll'])}, clipping {len(r['clip'])} "
                         f"(one only: {len(troll)} TROLL's{named(troll)}, "
                         f"{len(clip)} clipping's{named(clip)})")  # fmt: skip
        lines.append(f"- `{panel}`, {len(mine)} of {len(LRS) * len(STEPS)} cells complete: "
                     + "; ".join(parts))  # fmt: skip
    return lines


def entropy_difference(records: Sequence[dict], start: float) -> str:
    """Over the complete cells, per seed the mean over cells of each objective's entropy at the
    end; their paired difference (TROLL minus clipping), the plan's reading for "TROLL preserves
    entropy"."""
    complete, _, _ = regions(records, start)
    table = by_cell(records)
    if not complete:
        return "no complete cell"
    per_seed = {o: [] for o in OBJECTIVES}
    for seed in SEEDS:
        for o in OBJECTIVES:
            found = [outcome(table[c][o][seed], start).entropy for c in complete]
            if None in found:
                return "a run of a complete cell logged no entropy at the end"
            per_seed[o].append(statistics.fmean(found))
    means = " / ".join(f"{statistics.fmean(per_seed[o]):.3f}" for o in OBJECTIVES)
    return (f"over {len(complete)} complete cells, mean entropy at the end TROLL / clipping "
            f"{means}; per seed TROLL - clipping {paired(per_seed['troll'], per_seed['clip']).text()}")  # fmt: skip


def learned_counts(records: Sequence[dict], start: float) -> dict[Cell, dict[str, int]]:
    """Per complete cell, each objective's number of seeds that learned."""
    complete, _, _ = regions(records, start)
    table = by_cell(records)
    return {c: {o: sum(outcome(r, start).learned for r in table[c][o].values())
                for o in OBJECTIVES} for c in complete}  # fmt: skip


def corner(records: Sequence[dict], start: float) -> tuple[Cell, str] | None:
    """The plan's SmolLM2 corner (item 2), once every cell is complete: the cell where the
    objectives' learned counts differ most (ties: panel order, then the higher learning rate,
    then more steps); if none differs by ``CORNER_GAP`` seeds, the cell of the highest learning
    rate x steps where either learned on ``CORNER_SEEDS``. With its reason; None before."""
    counts = learned_counts(records, start)
    if len(counts) < len(cells()):
        return None
    order = {p: i for i, p in enumerate(PANELS)}

    def rank(c: Cell) -> tuple:
        return (-order[c.panel], c.lr, c.steps)  # larger is earlier in the plan's tie order

    gap = {c: abs(n["troll"] - n["clip"]) for c, n in counts.items()}
    widest = max(gap.values())
    if widest >= CORNER_GAP:
        cell = max((c for c in counts if gap[c] == widest), key=rank)
        n = counts[cell]
        return cell, (f"the objectives' learned seeds differ most here (TROLL {n['troll']} of 5, "
                      f"clipping {n['clip']} of 5)")  # fmt: skip
    able = [c for c, n in counts.items() if max(n.values()) >= CORNER_SEEDS]
    if not able:
        return None
    cell = max(able, key=lambda c: (c.lr * c.steps, rank(c)))
    return cell, (f"no cell differs by {CORNER_GAP} seeds; the highest learning rate x steps "
                  f"where either objective learned on {CORNER_SEEDS} of 5")  # fmt: skip


def corner_line(records: Sequence[dict], start: float) -> str:
    """The SmolLM2 corner in a sentence: the cell, why, and what runs on SmolLM2."""
    found = corner(records, start)
    if found is None:
        return "the SmolLM2 corner is chosen once every cell is complete"
    cell, why = found
    estimator, staleness = PANELS[cell.panel]
    return (
        f"the SmolLM2 corner (the plan's item 2) is `{cell.name}`: {why}. On SmolLM2: "
        f"{cell.steps} optimiser steps per rollout, {estimator.upper()}, staleness "
        f"{staleness}, the headroom pilot's learning rate x {cell.lr / SMOLLM2_ANCHOR_LR:g}"
    )


def constraint_report(records: Sequence[dict]) -> str:
    """``constraints.md`` (a reading): per cell over rollouts 41-60, the mean over seeds of the
    share of tokens each objective's constraint acts on (TROLL: projected; clipping: clipped),
    overall, by the old policy's confidence in the token and by the advantage's sign; and the KL
    at a rollout's end."""
    table = by_cell(records)

    def share(objectives: dict[str, dict[int, dict]], o: str, metric: str) -> str:
        found = [window_mean(r, metric, LATE) for r in objectives.get(o, {}).values()]
        found = [x for x in found if x is not None]
        return f"{statistics.fmean(found):.3f}" if found else "-"

    def both(objectives, figure: str | None) -> str:
        out = []
        for o in OBJECTIVES:
            overall, name = ACTS[o]
            out.append(share(objectives, o, overall if figure is None else f"{figure}/{name}"))
        return " / ".join(out)

    header = (["lr", "steps", "all tokens"] + [f"confidence {b}" for b in CONFIDENCE_BINS]
              + [f"advantage {a}" for a in ADVANTAGE_SIGNS] + ["KL at a rollout's end"])  # fmt: skip
    lines = ["# The constraints at work: shares of tokens over rollouts 41-60 (a reading)\n\n",
             "Each entry is TROLL / clipping: the share of response tokens TROLL projected and "
             "the share clipping clipped, the mean over the cell's finished seeds of each run's "
             "mean over rollouts 41-60; by the old policy's probability of the token and by the "
             "sign of its advantage; then the mean KL of the policy from the old policy at a "
             "rollout's end (`trust_region/kl_end_mean`).\n"]  # fmt: skip
    for panel in PANELS:
        rows = []
        for c in cells([panel]):
            if c not in table:
                continue
            objectives = table[c]
            row = [f"{c.lr:g}", str(c.steps), both(objectives, None)]
            row += [both(objectives, f"trust_region/by_confidence/{b}") for b in CONFIDENCE_BINS]
            row += [both(objectives, f"trust_region/by_advantage/{a}") for a in ADVANTAGE_SIGNS]
            rows.append(row + [late_kl(objectives)])
        if rows:
            estimator, staleness = PANELS[panel]
            lines.append(f"\n## {panel}: {estimator}, staleness {staleness}\n\n")
            lines.append(markdown_table(header, rows, "rr"))
    return "".join(lines)


def report(records: Sequence[dict]) -> str:
    """``map.md``: the verdict (or why none yet), then per panel a table of the cells."""
    start = start_accuracy(records)
    lines = [f"# The stability map: {len(records)} of {len(cells()) * 10} runs finished\n",
             f"Warm start {start:.4f}. Verdict (the plan's primary endpoint): "
             f"{verdict(records, start)}.\n"]  # fmt: skip
    complete, _, collapse = regions(records, start)
    if len(complete) == len(cells()):
        lines.append(f"Collapse regions (secondary): {compare(collapse, 'collapse region')[0]}.\n")
    if complete:
        lines.append("\nPer panel (secondary, complete cells):\n\n" + "\n".join(
            panel_regions(records, start)) + "\n\n")  # fmt: skip
        lines.append(f"Entropy (secondary): {entropy_difference(records, start)}.\n")
    lines.append(f"Next: {corner_line(records, start)}.\n")
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
