"""The machinery of the training studies: a grid of ``lightning-troll fit`` runs that resumes,
records its results and draws them.

A study is a list of :class:`Run` records (a name, the command-line arguments that make it, the
fields it is recorded with) and a :class:`Grid` that runs them one after another, in-process:

- each run keeps ``<out>/runs/<name>/`` (a CSV log per attempt, ``checkpoints/last.ckpt``);
  Ctrl-C or SIGTERM lets the rollout in progress finish, saves, and ends the study (exit status
  128 + the signal); running the same study again skips finished runs and resumes the
  interrupted one from its checkpoint;
- a finished run's record (its fields, seconds, and per rollout the kept metrics) goes to
  ``runs/<name>/result.json``, and the grid's ``results.json`` and ``metrics.csv`` are rewritten
  (to a ``.partial`` file, then moved into place, so a stop mid-write leaves the old file whole);
- ``runs/`` need not be kept: a copy of ``results.json`` and ``metrics.csv`` holds the finished
  runs, and a later call takes them from there;
- ``settings.json`` records what every run shares; a grid with other settings refuses to
  continue in the same folder;
- :meth:`Grid.estimate` prints the grid's hours before any run starts.

Tables and plots: :func:`mean_std`, :func:`values`, :func:`run_mean`, :func:`curve` and
:func:`plot_curves` (matplotlib, ``pip install lightning-troll[study]``). Nothing here knows a
particular study.
"""

from __future__ import annotations

import csv
import gc
import json
import math
import re
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "Grid",
    "Interrupted",
    "Run",
    "curve",
    "mean_std",
    "plot_curves",
    "read_history",
    "run_mean",
    "values",
    "write_atomic",
]

TIME = "time/iteration"
"""The metric that times a rollout (sampling and optimiser steps)."""


class Interrupted(RuntimeError):
    """A run stopped before its last rollout (a signal); its ``last.ckpt`` resumes it."""

    def __init__(self, name: str, exit_code: int) -> None:
        super().__init__(f"{name} stopped before its last rollout")
        self.name, self.exit_code = name, exit_code


@dataclass(frozen=True)
class Run:
    """One training run of a grid."""

    name: str
    """Unique within the grid; the folder ``runs/<name>``."""
    args: tuple[str, ...]
    """``lightning-troll fit`` arguments (logger, checkpoints and resume are added)."""
    max_steps: int
    """Optimiser steps of the whole run (``trainer.max_steps``): reaching them finishes it."""
    rollouts: int
    """Rollouts of the whole run (for the estimate)."""
    fields: dict = field(default_factory=dict)
    """Recorded with the run (objective, seed, lr, ...): the columns of tables and CSV."""


def write_atomic(path: Path, text: str) -> None:
    """Writes ``text`` beside ``path``, then moves it into place."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def cli(args: list[str]):
    """``lightning_troll.cli.run(args)`` with the study's own command line hidden from it."""
    from lightning_troll.cli import run as cli_run

    saved, sys.argv = sys.argv, sys.argv[:1]
    try:
        return cli_run(args)
    finally:
        sys.argv = saved


def read_history(log_root: Path, metrics: Sequence[str]) -> list[dict[str, float]]:
    """Per rollout, ``metrics`` of every attempt's CSV log (``log_root/version_<k>``) merged in
    attempt order, a later attempt's rows replacing the rollouts it ran again. Lightning's
    logging step counts rollouts from 0: rollout r (from 1) is step r - 1."""
    versions = sorted(
        (int(m.group(1)), p)
        for p in log_root.glob("version_*")
        if (m := re.fullmatch(r"version_(\d+)", p.name)) and (p / "metrics.csv").exists()
    )
    rollouts: dict[int, dict[str, float]] = {}
    for _, path in versions:
        rows: dict[int, dict[str, float]] = {}
        with (path / "metrics.csv").open() as f:
            for row in csv.DictReader(f):
                rollout = int(row["step"]) + 1
                merged = rows.setdefault(rollout, {"rollout": rollout})
                merged.update({k: float(v) for k, v in row.items() if k in metrics and v != ""})
        rollouts.update(rows)
    return [rollouts[r] for r in sorted(rollouts)]


class Grid:
    """Runs, resumes and records a list of :class:`Run`.

    Args:
        out: the study's folder.
        settings: what every run shares (kept in ``settings.json``; other settings are refused).
        metrics: the logged metrics kept per rollout.
        start_row: a history row for rollout 0 (e.g. the start's held-out accuracy), or None.
        prior_seconds: seconds per rollout assumed by the estimate before any run has finished.
        checkpoint_every: rollouts between checkpoints.
    """

    def __init__(
        self,
        out: Path,
        settings: dict,
        metrics: Sequence[str],
        start_row: Callable[[], dict] | None = None,
        prior_seconds: float = 60.0,
        checkpoint_every: int = 5,
    ) -> None:
        self.out, self.settings, self.metrics = Path(out), settings, tuple(metrics)
        self.start_row, self.prior_seconds = start_row, prior_seconds
        self.checkpoint_every = checkpoint_every

    # -- records ---------------------------------------------------------------------------------
    def recorded(self) -> dict[str, dict]:
        """The finished runs ``results.json`` and ``metrics.csv`` hold, by name."""
        results, metrics = self.out / "results.json", self.out / "metrics.csv"
        if not (results.exists() and metrics.exists()):
            return {}
        histories: dict[str, list[dict]] = {}
        with metrics.open(newline="") as f:
            for row in csv.DictReader(f):
                entry: dict = {"rollout": int(row["rollout"])}
                entry.update({k: float(row[k]) for k in self.metrics if row.get(k, "") != ""})
                histories.setdefault(row["name"], []).append(entry)
        return {
            r["name"]: {**r, "history": histories[r["name"]]}
            for r in json.loads(results.read_text())
            if r["name"] in histories
        }

    def finished(self, runs: Sequence[Run]) -> list[dict]:
        """The records of the runs of ``runs`` that have finished, from ``runs/`` or, where a copy
        of the study lacks it, from ``results.json`` and ``metrics.csv``."""
        recorded, records = self.recorded(), []
        for run in runs:
            path = self.out / "runs" / run.name / "result.json"
            if path.exists():
                records.append(json.loads(path.read_text()))
            elif run.name in recorded:
                records.append(recorded[run.name])
        return records

    def write(self, records: Sequence[dict]) -> None:
        """``results.json`` and ``metrics.csv``: ``records``, then the runs the outputs already
        held that ``records`` lacks (a run of another grid is kept)."""
        names = {r["name"] for r in records}
        records = [*records, *(r for n, r in self.recorded().items() if n not in names)]
        keys = sorted({k for r in records for k in r.get("fields", {})})
        path = self.out / "metrics.csv"
        partial = path.with_name(path.name + ".partial")
        with partial.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["name", *keys, "rollout", *self.metrics])
            writer.writeheader()
            for r in records:
                for row in r["history"]:
                    writer.writerow({"name": r["name"], **r.get("fields", {}), **row})
        partial.replace(path)
        results = [{k: v for k, v in r.items() if k != "history"} for r in records]
        write_atomic(self.out / "results.json", json.dumps(results, indent=1))

    # -- estimate ------------------------------------------------------------------------------
    def estimate(self, runs: Sequence[Run]) -> tuple[float, float]:
        """(hours of the whole grid, hours left) from the finished runs' median seconds per
        rollout (``time/iteration``) plus their median time outside rollouts per rollout; from
        ``prior_seconds`` before any has finished. Medians: a paused rollout does not count."""
        done = self.finished(runs)
        rate = self.prior_seconds
        if done:
            times = [t for r in done for t in values(r, TIME)]
            outside = [
                max(0.0, r["seconds"] - sum(values(r, TIME))) / max(len(r["history"]), 1)
                for r in done
            ]
            rate = (statistics.median(times) if times else 0.0) + statistics.median(outside)
        names = {r["name"] for r in done}
        total = sum(run.rollouts for run in runs) * rate / 3600
        left = sum(run.rollouts for run in runs if run.name not in names) * rate / 3600
        return total, left

    # -- running -------------------------------------------------------------------------------
    def check_settings(self) -> None:
        path = self.out / "settings.json"
        if path.exists():
            stored = json.loads(path.read_text())
            if stored != self.settings:
                raise ValueError(
                    f"{self.out} holds runs made with {stored}, not {self.settings}; use another "
                    "output folder or the same settings"
                )
            return
        self.out.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(self.settings, indent=1))

    def run_all(self, runs: Sequence[Run], keep_checkpoints: bool = False) -> list[dict]:
        """Trains every run that has not finished (resuming interrupted ones); returns the
        records of all of them. Raises :class:`Interrupted` when a signal stops a run."""
        self.check_settings()
        total, left = self.estimate(runs)
        print(f"grid: {len(runs)} runs, about {total:.1f} h in all, {left:.1f} h left", flush=True)
        start = self._start()
        done = {r["name"] for r in self.finished(runs)}
        for i, run in enumerate(runs):
            tag = f"[{i + 1}/{len(runs)}] {run.name}"
            if run.name in done:
                print(f"{tag}: done before, skipped", flush=True)
                continue
            run_dir = self.out / "runs" / run.name
            resumed = (run_dir / "checkpoints" / "last.ckpt").exists()
            if not resumed:
                shutil.rmtree(run_dir, ignore_errors=True)  # no checkpoint: start over
            run_dir.mkdir(parents=True, exist_ok=True)
            print(f"{tag}: {'resumed' if resumed else 'started'}", flush=True)
            record = self.train(run, run_dir, start)
            write_atomic(run_dir / "result.json", json.dumps(record, indent=1))
            self.write(self.finished(runs))
            if not keep_checkpoints:
                shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
            print(f"{tag}: finished in {record['seconds'] / 60:.1f} min", flush=True)
        return self.finished(runs)

    def _start(self) -> list[dict]:
        if self.start_row is None:
            return []
        path = self.out / "start.json"
        if not path.exists():
            write_atomic(path, json.dumps(self.start_row()))
        return [json.loads(path.read_text())]

    def train(self, run: Run, run_dir: Path, start: list[dict]) -> dict:
        """Trains (or resumes) one run; its record. Raises :class:`Interrupted` if it stops
        before ``run.max_steps`` (its checkpoint resumes it on the next call)."""
        logs = run_dir / "logs"
        version = len(list(logs.glob("version_*"))) if logs.exists() else 0
        logger = {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(run_dir), "name": "logs", "version": version},
        }
        args = [
            "fit",
            *run.args,
            "--trainer.max_steps", str(run.max_steps),
            "--trainer.logger", json.dumps(logger),
            "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false",
            "--checkpoint.dirpath", str(run_dir / "checkpoints"),
            "--checkpoint.every_n_rollouts", str(self.checkpoint_every),
        ]  # fmt: skip
        checkpoint = run_dir / "checkpoints" / "last.ckpt"
        if checkpoint.exists():
            args += ["--ckpt_path", str(checkpoint)]
        attempts_file = run_dir / "attempts.json"
        attempts = json.loads(attempts_file.read_text()) if attempts_file.exists() else []
        began = time.perf_counter()
        done = cli(args)
        attempts.append(time.perf_counter() - began)
        write_atomic(attempts_file, json.dumps(attempts))
        steps, stopper = done.trainer.global_step, done.checkpoint_callback
        signal = stopper.stopped_by if stopper is not None else None
        del done
        gc.collect()
        if steps < run.max_steps:
            raise Interrupted(run.name, 128 + int(signal) if signal else 1)
        return {
            "name": run.name,
            "fields": run.fields,
            "seconds": sum(attempts),
            "attempts": len(attempts),
            "history": [*start, *read_history(logs, self.metrics)],
        }


# -- summaries ---------------------------------------------------------------------------------


def values(record: dict, metric: str) -> list[float]:
    """The values of ``metric`` over a run's rollouts that log it, in rollout order."""
    return [row[metric] for row in record["history"] if metric in row]


def run_mean(record: dict, metric: str, last: int | None = None) -> float | None:
    """The mean of ``metric`` over a run's rollouts (the last ``last`` of those that log it)."""
    found = values(record, metric)
    found = found[-last:] if last else found
    return statistics.fmean(found) if found else None


def mean_std(found: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value); NaN for none."""
    if not found:
        return math.nan, math.nan
    return statistics.fmean(found), statistics.stdev(found) if len(found) > 1 else 0.0


def curve(records: Sequence[dict], metric: str) -> tuple[list[int], list[float], list[float]]:
    """Mean and standard deviation over runs of ``metric`` at each rollout every run logged it."""
    per_run = [{r["rollout"]: r[metric] for r in rec["history"] if metric in r} for rec in records]
    steps = sorted(set.intersection(*(set(p) for p in per_run))) if per_run else []
    stats = [mean_std([p[s] for p in per_run]) for s in steps]
    return steps, [m for m, _ in stats], [s for _, s in stats]


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
