"""The headroom study's verdict and the figures its plan names beside the main and paired tables
(studies/headroom-plan.md): the verdict by the plan's rule, the headroom check, where each constraint
acts over rollouts 61-80, and a plot of it.

A record is a finished run's (:mod:`study_kit`); the arms are TROLL and clipping at the lr the
pilot chose, paired by seed (:func:`paper_regime_tables.seed_pairs`).
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paper_regime_tables as tables  # noqa: E402
import study_kit  # noqa: E402
from paper_regime_tables import ACCURACY, CONFIDENCE, REWARD, window_mean  # noqa: E402
from study_figures import Line, Panel, markdown_table, plot_panels  # noqa: E402
from study_stats import Paired, paired, seeds_short  # noqa: E402

LATE = (60, 80)
"""The primary window: held-out accuracy over the validations at rollouts 60, 70 and 80."""
SEEDS, MIN_SAME_SIGN, P_MAX = 5, 4, 0.05
"""The plan's rule: an arm is ahead on 5 paired seeds if the mean difference has its sign with a
paired t-test p below 0.05 and at least 4 of the 5 seeds share that sign."""
CEILING = 0.85
"""Late accuracy at or above this means the task did not keep its headroom for that objective."""
ZERO_STD, ZERO_STD_WINDOW = "reward/frac_zero_std", (71, 80)
"""The share of groups with no reward spread, and the rollouts it is reported over."""
ARITHMETIC = Path(__file__).resolve().parent / "results" / "smollm2" / "late_gap" / "branches"
ARITHMETIC_WINDOW = (51, 60)
"""The arithmetic task's late rollouts, whose share of groups without spread is reported beside
this task's: the late-gap branches (TROLL, the control; clipping from rollout 30), the one grid
on that task that recorded the share."""
SECONDARY = (REWARD, ZERO_STD, "entropy", "trust_region/kl_end_mean")
"""The figures the paired table gives in windows of 10 rollouts."""
BINS_WINDOW = (61, 80)
MASK = {"troll": "projected", "clip": "clipped"}
"""The bins' mask each objective acts with: TROLL projects; clipping stops the gradient."""
COLOUR = {"troll": "C0", "clip": "C1"}
"""Each objective's colour in the plot, its band the same."""


def verdict(result: Paired | None) -> str:
    """The plan's outcome for TROLL minus clipping, late accuracy paired by seed."""
    if result is None:
        return f"no verdict: the runs share no validation in rollouts {LATE[0]}-{LATE[1]}"
    n = len(result.diffs)
    if n != SEEDS:
        return seeds_short(SEEDS, n)
    for sign, name in ((1, "TROLL ahead"), (-1, "clipping ahead")):
        same = sum(d * sign > 0 for d in result.diffs)
        if result.mean * sign > 0 and result.p_t < P_MAX and same >= MIN_SAME_SIGN:
            return f"{name}: {result.text()}"
    spread = statistics.stdev(result.diffs)
    return (
        f"no difference shown: mean {result.mean:+.3f}, standard deviation {spread:.3f} over "
        f"{n} seeds ({result.text()})"
    )


def paired_runs(
    records: Sequence[dict], troll: str, clip: str
) -> tuple[list[tuple[dict, dict]], set[int]]:
    """(TROLL run, clipping run) per seed both ran, and the validations all of them share."""
    pairs = tables.seed_pairs(records, troll, clip)
    return pairs, set(tables.shared_rollouts([r for pair in pairs for r in pair]))


def late_pairs(records: Sequence[dict], troll: str, clip: str) -> tuple[Paired | None, list[int]]:
    """TROLL minus clipping, late accuracy at the validations every paired run shares (None
    where they have none in :data:`LATE`), and the seeds in order."""
    pairs, shared = paired_runs(records, troll, clip)
    late = [[window_mean(r, ACCURACY, LATE, shared) for r in pair] for pair in pairs]
    seeds = [x["fields"]["seed"] for x, _ in pairs]
    if not any(LATE[0] <= x <= LATE[1] for x in shared):
        return None, seeds
    return paired([a for a, _ in late], [b for _, b in late]), seeds


def arithmetic_zero_std() -> dict[str, float]:
    """The arithmetic task's share of groups without spread over :data:`ARITHMETIC_WINDOW`, by
    objective (mean over its seeds): the late-gap control (TROLL) and its clipping branch."""
    recorded = study_kit.Grid(ARITHMETIC, {}, (ZERO_STD,)).recorded().values()
    out = {}
    for objective, branch in (("troll", "control"), ("clip", "clip")):
        found = [window_mean(r, ZERO_STD, ARITHMETIC_WINDOW) for r in recorded
                 if r["fields"].get("arm") == branch]  # fmt: skip
        found = [x for x in found if not math.isnan(x)]
        if found:
            out[objective] = statistics.fmean(found)
    return out


def headroom_check(records: Sequence[dict], troll: str, clip: str) -> str:
    """Per objective: late accuracy per seed and its mean against :data:`CEILING`, and the share of
    groups without spread late, beside the arithmetic task's."""
    pairs, shared = paired_runs(records, troll, clip)
    arithmetic = arithmetic_zero_std()
    rows = []
    for i, (objective, arm) in enumerate((("troll", troll), ("clip", clip))):
        runs = [pair[i] for pair in pairs]
        late = [window_mean(r, ACCURACY, LATE, shared) for r in runs]
        mean = statistics.fmean(late)
        zero = statistics.fmean(window_mean(r, ZERO_STD, ZERO_STD_WINDOW) for r in runs)
        kept = "yes" if mean < CEILING else f"no: {mean:.3f} >= {CEILING}"
        kept = "not reached" if math.isnan(mean) else kept
        theirs = arithmetic.get(objective)
        rows.append([
            arm, ", ".join(f"{x:.3f}" for x in late), f"{mean:.3f}", kept, f"{zero:.1%}",
            f"{theirs:.1%}" if theirs is not None else "-",
        ])  # fmt: skip
    w, a = ZERO_STD_WINDOW, ARITHMETIC_WINDOW
    header = [
        "arm", f"late accuracy {LATE[0]}-{LATE[1]}, per seed", "mean", f"below {CEILING}",
        f"groups without spread {w[0]}-{w[1]}", f"arithmetic task's, {a[0]}-{a[1]}",
    ]  # fmt: skip
    return markdown_table(header, rows, "llrlrr")


def plot_bins(records: Sequence[dict], troll: str, clip: str, path: Path) -> Path:
    """A panel per confidence bin: the share of its tokens each objective's constraint acts on per
    rollout (mean over seeds, band of one standard deviation)."""
    groups = {arm: [r for pair in tables.seed_pairs(records, troll, clip) for r in pair
                    if tables.arm(r) == arm] for arm in (troll, clip)}  # fmt: skip
    panels = [
        Panel(
            f"old p of the token: {b.replace('_', '-')}",
            "share of the bin's tokens acted on",
            [
                Line(
                    runs,
                    f"trust_region/by_confidence/{b}/{MASK[objective]}",
                    arm,
                    COLOUR[objective],
                )
                for arm, runs in groups.items()
                if runs
                for objective in [runs[0]["fields"]["objective"]]
            ],  # fmt: skip
        )
        for b in CONFIDENCE
    ]
    return plot_panels(panels, path)


def report(records: Sequence[dict], lr: float, folder: Path) -> None:
    """Writes into ``folder`` and prints the verdict (``verdict.md``), the headroom check, the
    constraint bins over :data:`BINS_WINDOW` and their plot (``bins.png``), and the share of
    groups without reward spread per rollout (``zero_std.png``)."""
    troll, clip = (f"{o} lr {lr:g}" for o in ("troll", "clip"))
    if not tables.seed_pairs(records, troll, clip):
        return
    result, seeds = late_pairs(records, troll, clip)
    groups = {arm: [r for r in records if tables.arm(r) == arm] for arm in (troll, clip)}
    text = (
        f"Late held-out accuracy, TROLL minus clipping, seeds {', '.join(map(str, seeds))}: "
        f"{verdict(result)}\n\nThe headroom check:\n\n{headroom_check(records, troll, clip)}\n"
        f"Where each constraint acts, rollouts {BINS_WINDOW[0]}-{BINS_WINDOW[1]}:\n\n"
        f"{tables.bins_table(groups, BINS_WINDOW)}"
    )
    study_kit.write_atomic(folder / "verdict.md", text)
    print(text)
    print(f"wrote {plot_bins(records, troll, clip, folder / 'bins.png')}")
    tables.plot_arms(
        records, folder, plots=[(ZERO_STD, "groups without reward spread", "zero_std", None)]
    )
