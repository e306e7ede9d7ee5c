"""The machinery of the training studies: a grid of ``lightning-troll fit`` runs that resumes,
records its results and draws them.

A study is a list of :class:`Run` records (a name, the command-line arguments that make it, the
fields it is recorded with) and a :class:`Grid` that runs them one after another, in-process:

- each run keeps ``<out>/runs/<name>/`` (a CSV log per attempt, ``checkpoints/last.ckpt``);
  Ctrl-C or SIGTERM lets the rollout in progress finish, saves, and ends the study (exit status
  128 + the signal), before the next run when that rollout was a run's last, and at once while
  no run trains (:mod:`study_stops`: :class:`Interrupted`, :func:`resumable`); running the same
  study again skips finished runs and resumes the interrupted one from its checkpoint;
- a finished run's record (its fields, seconds, and per rollout the kept metrics) goes to
  ``runs/<name>/result.json``, and the grid's ``results.json`` and ``metrics.csv`` are rewritten
  (to a ``.partial`` file, then moved into place, so a stop mid-write leaves the old file whole;
  under the folder's lock, so that processes sharing a study's folder write in turn);
- ``runs/`` need not be kept: a copy of ``results.json`` and ``metrics.csv`` holds the finished
  runs, and a later call takes them from there;
- ``settings.json`` records what every run shares; a grid with other settings refuses to
  continue in the same folder;
- :meth:`Grid.estimate` prints the grid's hours before any run starts;
- outputs of an older layout are read as they are: ``settings.json`` and ``start.json`` kept in
  ``runs/`` move up, and a record that keeps its fields beside its name (``legacy_fields``) is
  read with them moved into ``fields``.

Reading the logs (:mod:`study_logs`, whose names this module gives too): :func:`read_history`
and :func:`attempts_spent`. Tables and plots (:mod:`study_figures`, whose names this module gives
too): :func:`mean_std`, :func:`values`, :func:`run_mean`, :func:`curve`, :func:`markdown_table`,
:func:`plot_curves` and :func:`plot_panels`. Nothing here knows a particular study.
"""

from __future__ import annotations

import csv
import gc
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study_figures import (  # noqa: E402
    Line,
    Panel,
    curve,
    markdown_table,
    mean_std,
    plot_curves,
    plot_panels,
    run_mean,
    values,
)
from study_files import locked, write_atomic  # noqa: E402
from study_logs import (  # noqa: E402
    TIME,
    attempts_spent,
    kept,
    measured_attempts,
    read_history,
)
from study_stops import Interrupted, resumable  # noqa: E402

__all__ = [
    "Grid",
    "Interrupted",
    "Line",
    "Panel",
    "Run",
    "attempts_spent",
    "curve",
    "markdown_table",
    "mean_std",
    "plot_curves",
    "plot_panels",
    "read_history",
    "resumable",
    "run_mean",
    "validate",
    "values",
    "write_atomic",
]


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


def check_dry_run_out(parser, args) -> None:
    """Refuses ``--dry-run`` with ``--out`` at its default: a dry run must not mix with the
    study's results."""
    if args.dry_run and args.out == parser.get_default("out"):
        parser.error("--dry-run needs its own --out (it must not mix with the study's results)")


def cli(args: list[str]):
    """``lightning_troll.cli.run(args)`` with the study's own command line hidden from it."""
    from lightning_troll.cli import run as cli_run

    saved, sys.argv = sys.argv, sys.argv[:1]
    try:
        return cli_run(args)
    finally:
        sys.argv = saved


def validate(run: Run, *metrics: str) -> dict:
    """The history row of rollout 0: ``metrics`` (names it must log, or prefixes, :func:`kept`)
    of a validation of ``run``'s start (no logs, no checkpoint)."""
    quiet = ["--trainer.logger", "false", "--trainer.enable_checkpointing", "false"]
    quiet += ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
    figures = cli(["validate", *run.args, *quiet]).trainer.callback_metrics
    row = {m: float(figures[m]) for m in metrics if not m.endswith("/")}  # KeyError if not logged
    return {"rollout": 0, **row, **{k: float(v) for k, v in figures.items() if kept(k, metrics)}}


def columns(records: Sequence[dict], metrics: Sequence[str]) -> list[str]:
    """The metric columns of ``records``' histories: ``metrics``' names in their order, each
    prefix replaced by the names under it that the histories hold, sorted."""
    seen = {k for r in records for row in r["history"] for k in row if k != "rollout"}
    out: list[str] = []
    for m in metrics:
        names = sorted(k for k in seen if k.startswith(m)) if m.endswith("/") else [m]
        out += [n for n in names if n not in out]
    return out


class Grid:
    """Runs, resumes and records a list of :class:`Run`.

    Args:
        out: the study's folder.
        settings: what every run shares (kept in ``settings.json``; other settings are refused).
        metrics: the logged metrics kept per rollout: names, or prefixes ending in ``/``
            that keep every metric under them (:func:`kept`).
        start_row: a history row for rollout 0 (e.g. the start's held-out accuracy), or None.
        prior_seconds: seconds per rollout assumed by the estimate before any run has finished.
        checkpoint_every: rollouts between checkpoints.
        legacy_fields: the fields an older record kept beside its name (read into ``fields``).
        figures: a finished run's headline figures from its history (its final accuracy, ...),
            kept in its record and ``results.json``.
    """

    def __init__(
        self,
        out: Path,
        settings: dict,
        metrics: Sequence[str],
        start_row: Callable[[], dict] | None = None,
        prior_seconds: float = 60.0,
        checkpoint_every: int = 5,
        legacy_fields: Sequence[str] = (),
        figures: Callable[[list[dict]], dict] | None = None,
    ) -> None:
        self.out, self.settings, self.metrics = Path(out), settings, tuple(metrics)
        self.start_row, self.prior_seconds = start_row, prior_seconds
        self.checkpoint_every = checkpoint_every
        self.legacy_fields, self.figures = tuple(legacy_fields), figures
        self.stopped_by: int | None = None
        """The signal that came during the last run :meth:`train` finished (it finished anyway)."""

    def read(self, record: dict) -> dict:
        """``record`` in this format: an older one's ``legacy_fields`` moved into ``fields``."""
        if "fields" in record:
            return record
        rest = {k: v for k, v in record.items() if k not in self.legacy_fields}
        return {**rest, "fields": {k: record.get(k) for k in self.legacy_fields}}

    def kept(self, name: str) -> Path:
        """``out/<name>``; one that an older layout kept in ``out/runs/`` is moved there first."""
        path, legacy = self.out / name, self.out / "runs" / name
        if legacy.exists() and not path.exists():
            legacy.replace(path)
        return path

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
                entry.update(
                    {k: float(v) for k, v in row.items() if kept(k, self.metrics) and v != ""}
                )
                histories.setdefault(row["name"], []).append(entry)
        return {
            r["name"]: self.read({**r, "history": histories[r["name"]]})
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
                records.append(self.read(json.loads(path.read_text())))
            elif run.name in recorded:
                records.append(recorded[run.name])
        return records

    def write(self, records: Sequence[dict]) -> None:
        """``results.json`` and ``metrics.csv``: ``records``, then the runs the outputs already
        held that ``records`` lacks (a run of another grid is kept), under the folder's lock
        (:func:`locked`)."""
        with locked(self.out):
            names = {r["name"] for r in records}
            records = [*records, *(r for n, r in self.recorded().items() if n not in names)]
            keys = sorted({k for r in records for k in r.get("fields", {})})
            path = self.out / "metrics.csv"
            partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
            with partial.open("w", newline="") as f:
                names = columns(records, self.metrics)
                writer = csv.DictWriter(f, fieldnames=["name", *keys, "rollout", *names])
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
                max(0.0, r["seconds"] - sum(values(r, TIME)))
                / max(sum(row["rollout"] > 0 for row in r["history"]), 1)
                for r in done
            ]
            rate = (statistics.median(times) if times else 0.0) + statistics.median(outside)
        names = {r["name"] for r in done}
        total = sum(run.rollouts for run in runs) * rate / 3600
        left = sum(run.rollouts for run in runs if run.name not in names) * rate / 3600
        return total, left

    # -- running -------------------------------------------------------------------------------
    def check_settings(self) -> None:
        """Records the settings in ``settings.json``, or refuses runs made with others."""
        path = self.kept("settings.json")
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

    def run_all(
        self,
        runs: Sequence[Run],
        keep_checkpoints: bool = False,
        prepare: Callable[[Run, Path], None] | None = None,
    ) -> list[dict]:
        """Trains every run that has not finished (resuming interrupted ones); returns the
        records of all of them. Raises :class:`Interrupted` when a signal stops a run, or came
        during a run's last rollout and a run is left to do.
        ``prepare(run, run_dir)`` is called before a run starts anew (no checkpoint of its
        own): it may put a ``checkpoints/last.ckpt`` there for the run to start from."""
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
            if not resumed and prepare is not None:
                prepare(run, run_dir)
            print(f"{tag}: {'resumed' if resumed else 'started'}", flush=True)
            record = self.train(run, run_dir, start)
            write_atomic(run_dir / "result.json", json.dumps(record, indent=1))
            self.write(self.finished(runs))
            if not keep_checkpoints:
                shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
            print(f"{tag}: finished in {record['seconds'] / 60:.1f} min", flush=True)
            left = [r for r in runs[i + 1 :] if r.name not in done]
            if self.stopped_by and left:
                raise Interrupted(run.name, 128 + self.stopped_by, finished=True)
        return self.finished(runs)

    def _start(self) -> list[dict]:
        """The history row of rollout 0, made once; ``start.json`` keeps it with its seconds."""
        if self.start_row is None:
            return []
        path = self.kept("start.json")
        if not path.exists():
            began = time.perf_counter()
            row = self.start_row()
            write_atomic(path, json.dumps({**row, "seconds": time.perf_counter() - began}))
        row = json.loads(path.read_text())
        return [{k: v for k, v in row.items() if k == "rollout" or kept(k, self.metrics)}]

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
        measured = measured_attempts(attempts_file, logs)
        began = time.perf_counter()
        done = cli(args)
        measured[str(version)] = time.perf_counter() - began
        write_atomic(attempts_file, json.dumps(measured))
        steps, stopper = done.trainer.global_step, done.checkpoint_callback
        signal = stopper.stopped_by if stopper is not None else None
        del done
        gc.collect()
        self.stopped_by = int(signal) if signal else None
        if steps < run.max_steps:
            raise Interrupted(run.name, 128 + int(signal) if signal else 1)
        history = [*start, *read_history(logs, self.metrics)]
        seconds, attempts = attempts_spent(logs, measured)
        return {
            "name": run.name,
            "fields": run.fields,
            "seconds": seconds,
            "attempts": attempts,
            **(self.figures(history) if self.figures else {}),
            "history": history,
        }
