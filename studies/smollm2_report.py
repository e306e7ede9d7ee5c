"""Tables and plots of ``studies/smollm2_study.py``'s run records (:mod:`study_kit`'s format).

- :func:`format_table` (``table.md``): per cell (steps per rollout, learning rate) and arm
  (objective, TROLL's eps or alpha where not the config's), mean and spread over seeds;
- :func:`format_runs` (``runs.md``): per run, then per cell and arm the means over its seeds;
- :func:`write_plots`: ``reward.png``, ``accuracy.png``, ``kl_end.png``, ``kl_end_max.png``,
  ``entropy.png`` and ``time.png``, a panel per cell, the arms' mean and standard deviation
  over seeds (matplotlib);
- :func:`grid_time`: how long the runs took, with and without paused rollouts.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study_kit import (  # noqa: E402
    TIME,
    Line,
    Panel,
    curve,
    markdown_table,
    mean_std,
    plot_panels,
    run_mean,
    values,
)

OBJECTIVES = ("clip", "troll")
ACCURACY, REWARD, LENGTH = "val/accuracy", "reward/mean", "completion/mean_length"
KL_END, KL_END_MAX = "trust_region/kl_end_mean", "trust_region/kl_end_max"
KL_SAMPLED = "trust_region/kl_end_sampled"
LATE = 3
"""Validations at the end of a run that the tables' late accuracy averages."""
TIME_CAP = 3.0
"""The time plot's y axis ends at this multiple of the median seconds per rollout."""
COLOURS = {"clip": "tab:blue", "troll": "tab:orange"}
MORE_COLOURS = ("tab:green", "tab:red", "tab:purple", "tab:brown")
"""The colours of further arms (``troll eps ...``), in the order they first appear."""


def final_accuracy(history: Sequence[dict], last: int = 1) -> float:
    """The mean of the ``last`` logged held-out accuracies."""
    found = [row[ACCURACY] for row in history if ACCURACY in row]
    if not found:
        raise ValueError("the run logged no val/accuracy")
    return statistics.fmean(found[-last:])


def grid_time(records: Sequence[dict], start_seconds: float = 0.0) -> str:
    """How long the runs of ``records`` (and the start's validation) took: wall time, and without
    pauses (each rollout above ``TIME_CAP`` x the median rollout counted at the median)."""
    wall = start_seconds + sum(r["seconds"] for r in records)
    times = [t for r in records for t in values(r, TIME)]
    if not times:
        return f"the runs took {wall / 3600:.2f} h of training and validation"
    median = statistics.median(times)
    paused = sum(t - median for t in times if t > TIME_CAP * median)
    return (
        f"the runs took {wall / 3600:.2f} h of training and validation, "
        f"{(wall - paused) / 3600:.2f} h without the paused rollouts"
    )


# -- tables -------------------------------------------------------------------------------------


def run_median(record: dict, metric: str) -> float | None:
    """The median of ``metric`` over a run's rollouts that log it (robust to a paused one)."""
    found = values(record, metric)
    return statistics.median(found) if found else None


def cell_of(record: dict) -> tuple:
    """The training budget a run shares with the others of its panel: steps and learning rate."""
    return record["fields"]["steps"], record["fields"].get("lr")


def arm_of(record: dict) -> str:
    """What a run trains with inside its cell: the objective, and TROLL's bound and regression
    weight where not the config's (``troll eps 0.2``, ``troll alpha 0``)."""
    f = record["fields"]
    changed = [f"{k} {f[k]:g}" for k in ("eps", "alpha") if f.get(k) is not None]
    return " ".join([f["objective"], *changed])


def summarise(records: Sequence[dict]) -> list[dict]:
    """One row per (cell, arm): means over seeds of what each run did (``objective``: the arm)."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((*cell_of(r), arm_of(r)), []).append(r)
    rows = []
    for (steps, lr, objective), members in groups.items():

        def over_seeds(fn, members=members) -> tuple[float, float]:
            return mean_std([v for v in map(fn, members) if v is not None])

        kl_max = [max(values(r, KL_END_MAX)) for r in members if values(r, KL_END_MAX)]
        rows.append(
            {
                "objective": objective,
                "steps": steps,
                "lr": lr,
                "seeds": len(members),
                "accuracy": over_seeds(lambda r: final_accuracy(r["history"])),
                "late_accuracy": over_seeds(lambda r: final_accuracy(r["history"], LATE)),
                "late_reward": over_seeds(lambda r: run_mean(r, REWARD, 5)),
                "kl_end": over_seeds(lambda r: run_mean(r, KL_END)),
                "kl_end_sampled": over_seeds(lambda r: run_mean(r, KL_SAMPLED)),
                "kl_end_max": max(kl_max) if kl_max else math.nan,
                "rollout_s": over_seeds(lambda r: run_median(r, TIME)),
                "minutes": over_seeds(lambda r: r["seconds"] / 60),
            }
        )
    return rows


def format_table(rows: Sequence[dict], config_lr: float) -> str:
    """A Markdown table of ``summarise``'s rows (``config_lr``: the lr of runs that keep it)."""

    def pm(pair: tuple[float, float], spec: str = ".3f") -> str:
        return f"{pair[0]:{spec}} ± {pair[1]:{spec}}"

    header = (
        "objective | steps / rollout | lr | seeds | final accuracy | last 3 validations | reward, "
        "last 5 rollouts | KL end (support) | KL end (sampled) | max KL end | median s / rollout "
        "| minutes / run"
    )
    cells = [
        [
            r["objective"],
            str(r["steps"]),
            f"{config_lr if r['lr'] is None else r['lr']:g}",
            str(r["seeds"]),
            pm(r["accuracy"]),
            pm(r["late_accuracy"]),
            pm(r["late_reward"]),
            pm(r["kl_end"], ".4f"),
            pm(r["kl_end_sampled"], ".4f"),
            f"{r['kl_end_max']:.3f}",
            f"{r['rollout_s'][0]:.0f}",
            f"{r['minutes'][0]:.0f}",
        ]
        for r in rows
    ]
    return markdown_table(header.split(" | "), cells, "lrrrlllllrrr")


def run_figures(records: Sequence[dict]) -> dict:
    """What one row of :func:`format_runs` shows, over the rollouts of ``records`` (one run, or
    all seeds of a cell: then accuracies and rewards are means over the runs, KL medians over
    the pooled rollouts)."""

    def over_runs(fn) -> float:
        return statistics.fmean(fn(r) for r in records)

    accuracies = [values(r, ACCURACY) for r in records]
    pooled = {m: [v for r in records for v in values(r, m)] for m in (KL_END, KL_SAMPLED)}
    medians = [run_median(r, TIME) for r in records]
    return {
        "accuracy": [statistics.fmean(a) for a in zip(*accuracies, strict=True)],
        "late": over_runs(lambda r: final_accuracy(r["history"], LATE)),
        "reward_first": over_runs(lambda r: statistics.fmean(values(r, REWARD)[:5])),
        "reward_all": over_runs(lambda r: statistics.fmean(values(r, REWARD))),
        "reward_last": over_runs(lambda r: statistics.fmean(values(r, REWARD)[-10:])),
        "kl_end": statistics.median(pooled[KL_END]) if pooled[KL_END] else math.nan,
        "kl_sampled": statistics.median(pooled[KL_SAMPLED]) if pooled[KL_SAMPLED] else math.nan,
        "kl_end_max": max((v for r in records for v in values(r, KL_END_MAX)), default=math.nan),
        "entropy": over_runs(lambda r: statistics.fmean(values(r, "entropy")[-10:])),
        "length": over_runs(lambda r: statistics.fmean(values(r, LENGTH)[-10:])),
        "seconds": (min(medians), max(medians)),
    }


def format_runs(records: Sequence[dict]) -> str:
    """A row per run, then per cell and arm a row of the means over its seeds."""

    def row(name: str, f: dict) -> list[str]:
        low, high = f["seconds"]
        seconds = f"{low:.0f}" if round(low) == round(high) else f"{low:.0f}-{high:.0f}"
        return [
            name,
            ", ".join(f"{a:.3f}" for a in f["accuracy"]),
            f"{f['late']:.3f}",
            f"{f['reward_first']:.3f} / {f['reward_all']:.3f} / {f['reward_last']:.3f}",
            f"{f['kl_end']:.3f} / {f['kl_sampled']:.3f}",
            f"{f['kl_end_max']:.2f}",
            f"{f['entropy']:.3f}",
            f"{f['length']:.1f}",
            seconds,
        ]

    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((cell_of(r), arm_of(r)), []).append(r)
    rows = [row(r["name"], run_figures([r])) for runs in groups.values() for r in runs]
    for runs in groups.values():
        if len(runs) > 1:
            cell = runs[0]["name"].rsplit("-s", 1)[0]
            rows.append(row(f"{cell}, mean of {len(runs)} seeds", run_figures(runs)))
    header = (
        "run | held-out accuracy at each validation | last 3 validations | reward: first 5 / all "
        "/ last 10 rollouts | KL end, support / sampled (median rollout) | largest KL end | "
        "entropy, last 10 rollouts | completion tokens, last 10 rollouts | median s / rollout"
    )
    return markdown_table(header.split(" | "), rows, "llrllrrrr")


# -- plots --------------------------------------------------------------------------------------


def plot_cells(
    records: Sequence[dict],
    series: Sequence[tuple[str, str]],
    ylabel: str,
    path: Path,
    config_lr: float,
    bounds: Sequence[float] = (),
    log: bool = False,
    cap: float | None = None,
) -> Path:
    """One panel per cell; in each, per arm (:func:`arm_of`) and ``(metric, label)`` of
    ``series``, the mean over seeds with a +-1 std band (later series of an arm dashed, then
    dotted); a horizontal line at each of TROLL's ``bounds``. ``cap`` ends the y axis at that
    multiple of the median value of the panel's runs, and says in the title how many rollouts
    lie above it (a run paused for a while would flatten the rest)."""
    arms = list(dict.fromkeys([*OBJECTIVES, *(arm_of(r) for r in records)]))
    colours = {**dict(zip(arms[2:], MORE_COLOURS, strict=False)), **COLOURS}
    panels = []
    for cell in dict.fromkeys(cell_of(r) for r in records):
        mine, lines = [r for r in records if cell_of(r) == cell], []
        for arm in arms:
            runs = [r for r in mine if arm_of(r) == arm]
            seeds = f" ({len(runs)} seeds)" if len(runs) > 1 else ""
            drawn = [(metric, label) for metric, label in series if curve(runs, metric)[0]]
            for i, (metric, label) in enumerate(drawn):
                colour, style = colours.get(arm, "tab:gray"), ("-", "--", ":")[i % 3]
                lines.append(Line(runs, metric, f"{arm}: {label}{seeds}", colour, style))
        steps, lr = cell
        title, top = f"{steps} steps / rollout, lr {config_lr if lr is None else lr:g}", None
        found = [row[m] for r in mine for row in r["history"] for m, _ in series if m in row]
        if cap is not None and found:
            top = cap * statistics.median(found)
            if above := sum(v > top for v in found):
                title += f"\n{above} rollouts above {top:.0f} (paused runs) off the chart"
        hlines = [(bound, f"TROLL's eps {bound:g}") for bound in sorted(set(bounds))]
        panels.append(Panel(title, ylabel, lines, hlines, log, top))
    return plot_panels(panels, path, size=(4.5, 3.3), title_size="small")


def write_plots(records: Sequence[dict], out: Path, config_lr: float) -> list[Path]:
    """The study's PNGs in ``out`` (``config_lr``: the lr of runs that keep it); their paths."""
    bounds = sorted(
        {row.get("trust_region/bound") for r in records for row in r["history"]} - {None}
    )
    kl_end = [
        (KL_END, "mean KL(new || old), support"),
        (KL_SAMPLED, "mean KL(new || old), sampled"),
    ]
    kl_max = [
        (KL_END_MAX, "max KL(new || old), support"),
        ("trust_region/kl_after_max", "max KL(proj || old)"),
    ]
    plots = {
        "reward.png": ([(REWARD, "mean sampled reward")], "reward", (), False),
        "accuracy.png": ([(ACCURACY, "held-out accuracy")], "accuracy", (), False),
        "kl_end.png": (kl_end, "per-token KL at the rollout's end", bounds, True),
        "kl_end_max.png": (kl_max, "largest per-token KL", bounds, True),
        "entropy.png": ([("entropy", "entropy")], "entropy per token", (), False),
        "time.png": ([(TIME, "s / rollout")], "wall seconds per rollout", (), False),
    }
    paths = []
    for name, (series, ylabel, lines, log) in plots.items():
        cap = TIME_CAP if name == "time.png" else None
        paths.append(plot_cells(records, series, ylabel, out / name, config_lr, lines, log, cap))
    return paths
