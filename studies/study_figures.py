"""Tables and plots of a study's run records (``{"name", "fields", ..., "history"}``, each row
of ``history`` one rollout: ``{"rollout": r, metric: value, ...}``), for :mod:`study_kit`.

Figures over runs: :func:`values`, :func:`run_mean`, :func:`mean_std`, :func:`curve`; a
Markdown table: :func:`markdown_table`; plots (matplotlib, ``pip install lightning-troll[study]``):
:func:`plot_curves` (one panel, one line per group of runs) and :func:`plot_panels` (panels of
:class:`Line` s, each the mean over its runs with a band of one standard deviation).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Line",
    "Panel",
    "curve",
    "markdown_table",
    "mean_std",
    "plot_curves",
    "plot_panels",
    "run_mean",
    "values",
    "window_mean",
]


def values(record: dict, metric: str) -> list[float]:
    """The values of ``metric`` over a run's rollouts that log it, in rollout order."""
    return [row[metric] for row in record["history"] if metric in row]


def run_mean(record: dict, metric: str, last: int | None = None) -> float | None:
    """The mean of ``metric`` over a run's rollouts (the last ``last`` of those that log it)."""
    found = values(record, metric)
    found = found[-last:] if last else found
    return statistics.fmean(found) if found else None


def window_mean(record: dict, metric: str, window: tuple[int, int], at=None) -> float | None:
    """The mean of ``metric`` over a run's rollouts in ``window`` (inclusive), only at the
    rollouts ``at`` when given, or None where none of them logs it."""
    low, high = window
    found = [row[metric] for row in record["history"]
             if low <= row["rollout"] <= high and row.get(metric) is not None
             and (at is None or row["rollout"] in at)]  # fmt: skip
    return statistics.fmean(found) if found else None


def mean_std(found: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value) of the values that are not NaN; NaN
    for none."""
    found = [x for x in found if not math.isnan(x)]
    if not found:
        return math.nan, math.nan
    return statistics.fmean(found), statistics.stdev(found) if len(found) > 1 else 0.0


def curve(records: Sequence[dict], metric: str) -> tuple[list[int], list[float], list[float]]:
    """Mean and standard deviation over runs of ``metric`` at each rollout every run logged it."""
    per_run = [{r["rollout"]: r[metric] for r in rec["history"] if metric in r} for rec in records]
    steps = sorted(set.intersection(*(set(p) for p in per_run))) if per_run else []
    stats = [mean_std([p[s] for p in per_run]) for s in steps]
    return steps, [m for m, _ in stats], [s for _, s in stats]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> str:
    """A Markdown table, one line per row and a final newline. ``align`` has a letter per column
    (``l`` or ``r``: ``---`` or ``---:``); columns past its end are left-aligned."""
    rule = ["---:" if align[i : i + 1] == "r" else "---" for i in range(len(header))]
    lines = [header, rule, *rows]
    return "".join("| " + " | ".join(line) + " |\n" for line in lines)


@dataclass(frozen=True)
class Line:
    """A line of a panel: the mean over ``runs`` of ``metric`` per rollout, where every run logged
    it, with a band of one standard deviation (``band=False``: the mean alone)."""

    runs: Sequence[dict]
    metric: str
    label: str | None = None
    colour: str | None = None
    style: str = "-"
    band: bool = True


@dataclass(frozen=True)
class Panel:
    """One panel of :func:`plot_panels`."""

    title: str
    ylabel: str
    lines: Sequence[Line]
    hlines: Sequence[tuple[float, str]] = ()
    """Dashed black references (a bound): ``(y, label)``."""
    log: bool = False
    top: float | None = None
    """Where the y axis ends (it then starts at 0); None: matplotlib's choice."""


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_panels(
    panels: Sequence[Panel],
    path: Path,
    size: tuple[float, float] = (4.0, 3.2),
    title_size: str | None = None,
) -> Path:
    """The panels side by side (each ``size`` inches) in one PNG; a line no rollout of which
    every run of it logged is left out, and a panel without labelled lines has no legend."""
    plt = pyplot()
    fig, axes = plt.subplots(
        1, len(panels), figsize=(size[0] * len(panels), size[1]), squeeze=False
    )
    for ax, panel in zip(axes[0], panels, strict=True):
        for line in panel.lines:
            steps, mean, std = curve(line.runs, line.metric)
            if not steps:
                continue
            ax.plot(steps, mean, line.style, color=line.colour, label=line.label)
            if line.band:
                low = [m - s for m, s in zip(mean, std, strict=True)]
                high = [m + s for m, s in zip(mean, std, strict=True)]
                ax.fill_between(steps, low, high, color=line.colour, alpha=0.2)
        for y, label in panel.hlines:
            ax.axhline(y, color="k", linestyle="--", linewidth=1, label=label)
        if panel.log:
            ax.set_yscale("log")
        if panel.top is not None:
            ax.set_ylim(0, panel.top)
        ax.set_title(panel.title, **({"fontsize": title_size} if title_size else {}))
        ax.set_xlabel("rollout")
        ax.set_ylabel(panel.ylabel)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_curves(
    groups: dict[str, Sequence[dict]],
    metric: str,
    ylabel: str,
    path: Path,
    hline: float | None = None,
    log: bool = False,
) -> Path:
    """One line per group (label -> runs): the mean over its runs of ``metric`` per rollout,
    with a band of one standard deviation; ``hline`` draws a dashed reference (a bound)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, runs in groups.items():
        steps, mean, std = curve(runs, metric)
        if not steps:
            continue
        line = ax.plot(steps, mean, label=f"{label} ({len(runs)})")[0]
        low = [m - s for m, s in zip(mean, std, strict=True)]
        high = [m + s for m, s in zip(mean, std, strict=True)]
        ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.15)
    if hline is not None:
        ax.axhline(hline, color="grey", linestyle="--", linewidth=1)
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("rollout")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
