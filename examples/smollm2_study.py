"""TROLL against PPO-style clipping with GRPO on SmolLM2-135M-Instruct, over seeds.

    python examples/smollm2_study.py                        # the grid (hours; make smollm2 first)
    nohup python examples/smollm2_study.py > study.log 2>&1 &   # the same, in the background
    python examples/smollm2_study.py --estimate             # how long the grid takes, then stop
    python examples/smollm2_study.py --report               # outputs of the runs finished so far
    python examples/smollm2_study.py --dry-run --out /tmp/dry   # the machinery on TinyMath

Every run is ``configs/smollm2.yaml`` (GRPO on small-number arithmetic in the chat template, the
``last_number`` reward; TROLL with eps 0.05, alpha 1, K 64, delta 1e-5; clip range 0.2; AdamW at
1e-5 after a 5-step warm-up; a shared snapshot) with ``--steps`` optimiser steps per rollout
instead of its two (the rollout's 64 sequences in minibatches of 64 / steps: the first
minibatch on-policy, the others off-policy, where the trust region and the clip act) and
``--rollouts`` rollouts, validated every ``--val-every`` rollouts on all 115 held-out problems
(greedy). The grid: {clip, TROLL} x ``--seeds``, plus a stress cell on seed 0 for both
objectives: ``--stress steps`` (the default) takes ``--stress-steps`` optimiser steps per rollout
(8: minibatches of 8, further off-policy), ``--stress lr`` trains at 3x the config's learning
rate, ``--stress none`` leaves it out. Then, for each seed, a TROLL run at each KL bound of
``--troll-eps`` (default 0.2, four times the config's: is TROLL's region what holds it back
late in training?) and at each regression weight of ``--troll-alpha`` (default 0: no pull
toward the projection); either option with no value leaves its runs out.

Per rollout each run logs (a CSV logger), and the study keeps: ``reward/mean``,
``val/accuracy``, the KL of the weights after the rollout's last optimiser step to the behaviour
policy for both objectives (``trust_region/kl_end_{mean,max}`` between the sparse supports and
``trust_region/kl_end_sampled``, an unbiased estimate over the whole vocabulary;
``trust_region_monitor.kl_end``), TROLL's KL after projection, projected and infeasible shares,
clip's k3 estimate and clipped share, ``entropy``, completion length and ``time/iteration``
(sampling and optimiser steps of the rollout).

Runs go one after another, in-process. Each keeps ``runs/<name>/checkpoints/last.ckpt``, written
every ``--checkpoint-every`` rollouts and when the run is stopped: Ctrl-C or SIGTERM lets the
rollout in progress finish, saves, and ends the study (exit status 130 or 143). Running the same
command again skips the runs whose ``result.json`` exists and resumes an interrupted one from its
``last.ckpt`` (each attempt logs to a new ``logs/version_<k>``; the history merges them, the later
attempt's rows replacing the rollouts it ran again). A finished run's checkpoint is deleted
(``--keep-checkpoints`` keeps it). ``runs/`` need not be kept: a copy of the other outputs
(``results.json`` with ``metrics.csv``, ``settings.json``, ``start.json``) holds the finished runs,
and the study and ``--report`` take them from there. The study prints an estimate of the whole
grid's time before the first run (from the runs done, else from ``--prior-seconds`` per rollout) and
how long it took at the end.

Outputs in ``--out`` (default ``examples/results/smollm2/study``): ``runs/``, ``settings.json`` (the
budget; another refuses to continue), ``start.json`` (the start's validation), ``metrics.csv`` (one
row per run and rollout), ``results.json`` (per run: settings, final and late accuracy, seconds;
both rewritten as each run finishes, keeping runs of other grids), ``table.md`` (per cell and
objective, mean and spread over seeds), ``runs.md`` (per run, then the seeds' means) and the plots
``reward.png``, ``accuracy.png``, ``kl_end.png``, ``kl_end_max.png``, ``entropy.png`` and
``time.png`` (one panel per cell, clip against TROLL and TROLL at the other bounds, mean and
standard deviation over seeds).

``--dry-run`` runs the same machinery on ``configs/tinymath.yaml`` with the shipped TinyMath
policy (or ``--model``), 3 rollouts of 2 prompts, seconds per run; its output is no evidence of
anything. Needs matplotlib (``pip install lightning-troll[study]``).
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import math
import re
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
OBJECTIVES = ("clip", "troll")
STRESS = ("steps", "lr", "none")
STRESS_LR_FACTOR = 3.0
TROLL_EPS = (0.2,)
"""TROLL's bound in the looser-region cell: at or above the KL that clip 0.2 lets a token of
probability up to 0.95 reach (README, "Why TROLL loses here")."""
TROLL_ALPHA = (0.0,)
"""TROLL's regression weight in the no-pull cell: the policy is not drawn toward the projection
(README, "Why TROLL loses here")."""
ACCURACY = "val/accuracy"
TIME = "time/iteration"
REWARD = "reward/mean"
KL_END, KL_END_MAX = "trust_region/kl_end_mean", "trust_region/kl_end_max"
KL_SAMPLED = "trust_region/kl_end_sampled"
LENGTH = "completion/mean_length"
LATE = 3
"""Validations at the end of a run that the table's late accuracy averages."""
METRICS = (
    ACCURACY,
    "reward/mean",
    "entropy",
    LENGTH,
    "trust_region/kl_end_mean",
    "trust_region/kl_end_max",
    "trust_region/kl_end_sampled",
    "trust_region/kl_after_mean",
    "trust_region/kl_after_max",
    "trust_region/bound",
    "trust_region/active_frac",
    "trust_region/infeasible_frac",
    "clip/active_frac",
    "clip/approx_kl",
    "time/rollout",
    TIME,
)
"""The logged metrics kept per rollout (a run logs only some: clip or trust region)."""
PRIOR_SECONDS = 60.0
"""Seconds per rollout, validation included, before any run has been timed: the README's
``configs/smollm2.yaml`` run took 58 s per rollout on the project's 2-core CPU under load."""


class Interrupted(RuntimeError):
    """A run stopped before its last rollout (a signal); its ``last.ckpt`` resumes it."""

    def __init__(self, name: str, exit_code: int) -> None:
        super().__init__(f"{name} stopped before its last rollout")
        self.name, self.exit_code = name, exit_code


@dataclass(frozen=True)
class Budget:
    """How much each run trains and validates."""

    rollouts: int = 30
    steps: int = 4
    """Optimiser steps per rollout of the main cells (the rollout split evenly)."""
    val_every: int = 5
    prompts: int = 8
    """Prompts per rollout (``data.batch_size``), each with the config's group_size completions."""
    num_val: int | None = None
    """Held-out prompts per validation; None: the config's (all of them)."""
    checkpoint_every: int = 5
    dry_run: bool = False

    def __post_init__(self) -> None:
        for name in ("rollouts", "steps", "val_every", "prompts", "checkpoint_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be an integer >= 1; got {value!r}"
                )
        self.minibatch(self.steps)

    @property
    def config(self) -> Path:
        return CONFIGS / ("tinymath.yaml" if self.dry_run else "smollm2.yaml")

    def sequences(self) -> int:
        return self.prompts * yaml.safe_load(self.config.read_text())["model"]["group_size"]

    def minibatch(self, steps: int) -> int:
        """Sequences per optimiser step for ``steps`` steps per rollout."""
        if self.sequences() % steps:
            raise ValueError(
                f"--steps and --stress-steps must divide the {self.sequences()} sequences of a "
                f"rollout (--prompts x group size); got {steps}"
            )
        return self.sequences() // steps


@dataclass(frozen=True)
class RunSpec:
    """One training run of the grid."""

    objective: str
    seed: int
    steps: int
    lr: float | None = None
    """AdamW's learning rate; None: the config's."""
    eps: float | None = None
    """TROLL's KL bound; None: the config's."""
    alpha: float | None = None
    """TROLL's regression weight; None: the config's."""

    @property
    def name(self) -> str:
        lr = "" if self.lr is None else f"-lr{self.lr:g}"
        eps = "" if self.eps is None else f"-eps{self.eps:g}"
        alpha = "" if self.alpha is None else f"-alpha{self.alpha:g}"
        return f"{self.objective}-steps{self.steps}{lr}{eps}{alpha}-s{self.seed}"


def config_lr(budget: Budget) -> float:
    return float(yaml.safe_load(budget.config.read_text())["model"]["optimizer"]["init_args"]["lr"])


def grid(
    seeds: Sequence[int],
    budget: Budget,
    stress: str,
    stress_steps: int,
    troll_eps: Sequence[float] = (),
    troll_alpha: Sequence[float] = (),
) -> list[RunSpec]:
    """Clip and TROLL for each seed (in pairs, so a partial grid compares like with like), then
    the stress cell's two runs on seed 0, then a TROLL run per seed at each KL bound of
    ``troll_eps`` and at each regression weight of ``troll_alpha`` (the main cells' steps)."""
    if stress not in STRESS:
        raise ValueError(f"--stress must be one of {list(STRESS)}; got {stress!r}")
    for eps in troll_eps:
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"--troll-eps must be numbers > 0 (KL bounds); got {eps!r}")
    for alpha in troll_alpha:
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha >= 0:
            raise ValueError(f"--troll-alpha must be numbers >= 0 (weights); got {alpha!r}")
    specs = [RunSpec(o, s, budget.steps) for s in dict.fromkeys(seeds) for o in OBJECTIVES]
    if stress == "steps":
        budget.minibatch(stress_steps)
        specs += [RunSpec(o, 0, stress_steps) for o in OBJECTIVES]
    elif stress == "lr":
        lr = float(
            f"{STRESS_LR_FACTOR * config_lr(budget):.6g}"
        )  # 3e-05, not 3.0000000000000004e-05
        specs += [RunSpec(o, 0, budget.steps, lr) for o in OBJECTIVES]
    specs += [
        RunSpec("troll", s, budget.steps, eps=float(e))
        for e in dict.fromkeys(troll_eps)
        for s in dict.fromkeys(seeds)
    ]
    specs += [
        RunSpec("troll", s, budget.steps, alpha=float(a))
        for a in dict.fromkeys(troll_alpha)
        for s in dict.fromkeys(seeds)
    ]
    return specs


def training_args(
    spec: RunSpec, budget: Budget, model: str | None, run_dir: Path, version: int = 0
) -> list[str]:
    """The ``lightning-troll fit`` arguments of one attempt at a run (``version``: its log)."""
    logger = {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": str(run_dir), "name": "logs", "version": version},
    }
    args = [
        "fit",
        "--config", str(budget.config),
        "--seed_everything", str(spec.seed),
        "--model.objective", spec.objective,
        "--model.optimization.minibatch_size", str(budget.minibatch(spec.steps)),
        "--trainer.max_steps", str(spec.steps * budget.rollouts),
        "--trainer.val_check_interval", str(budget.val_every),
        "--trainer.check_val_every_n_epoch", "null",
        "--trainer.logger", json.dumps(logger),
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--checkpoint.dirpath", str(run_dir / "checkpoints"),
        "--checkpoint.every_n_rollouts", str(budget.checkpoint_every),
        "--trust_region_monitor.kl_end", "true",
        "--trust_region_monitor.histogram_every_n_rollouts", "0",
        "--rollout.log_samples", "0",
        "--data.batch_size", str(budget.prompts),
    ]  # fmt: skip
    if model is not None:
        args += ["--model.model", model]
    if budget.num_val is not None:
        args += [
            "--data.num_val",
            str(budget.num_val),
            "--data.val_batch_size",
            str(budget.num_val),
        ]
    if budget.dry_run:
        args += ["--data.num_train", "64"]
    if spec.lr is not None:
        args += ["--model.optimizer.init_args.lr", str(spec.lr)]
    if spec.eps is not None:
        args += ["--model.trust_region.eps", str(spec.eps)]
    if spec.alpha is not None:
        args += ["--model.trust_region.alpha", str(spec.alpha)]
    return args


def read_history(log_root: Path) -> list[dict[str, float]]:
    """Per rollout, the metrics of every attempt's CSV log (``log_root/version_<k>``) merged in
    attempt order, so a later attempt's rows replace the rollouts it ran again.

    Lightning's logging step counts rollouts from 0 (a validation after a rollout logs at that
    rollout's step): rollout r (from 1) is logging step r - 1.
    """
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
                merged.update({k: float(v) for k, v in row.items() if k in METRICS and v != ""})
        rollouts.update(rows)
    return [rollouts[r] for r in sorted(rollouts)]


def cli(args: list[str]):
    """``lightning_troll.cli.run(args)`` with this script's own arguments hidden from it."""
    from lightning_troll.cli import run as cli_run

    saved, sys.argv = sys.argv, sys.argv[:1]
    try:
        return cli_run(args)
    finally:
        sys.argv = saved


def attempts(run_dir: Path) -> list[float]:
    path = run_dir / "attempts.json"
    return json.loads(path.read_text()) if path.exists() else []


def train(spec: RunSpec, budget: Budget, model: str | None, run_dir: Path, start: dict) -> dict:
    """Trains (or resumes) one run and returns its record; raises :class:`Interrupted` if the
    run stops early (its checkpoint then resumes it on the next call)."""
    logs = run_dir / "logs"
    version = len(list(logs.glob("version_*"))) if logs.exists() else 0
    args = training_args(spec, budget, model, run_dir, version)
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    if checkpoint.exists():
        args += ["--ckpt_path", str(checkpoint)]
    began = time.perf_counter()
    done = cli(args)
    seconds = [*attempts(run_dir), time.perf_counter() - began]
    (run_dir / "attempts.json").write_text(json.dumps(seconds))
    steps, stopped = done.trainer.global_step, done.checkpoint_callback
    signal = stopped.stopped_by if stopped is not None else None
    del done
    gc.collect()
    if steps < spec.steps * budget.rollouts:
        raise Interrupted(spec.name, 128 + int(signal) if signal else 1)
    history = [start, *read_history(logs)]
    return {
        **asdict(spec),
        "name": spec.name,
        "seconds": sum(seconds),
        "attempts": len(seconds),
        "final_accuracy": final_accuracy(history),
        "late_accuracy": final_accuracy(history, LATE),
        "history": history,
    }


def final_accuracy(history: Sequence[dict], last: int = 1) -> float:
    """The mean of the ``last`` logged held-out accuracies."""
    values = [row[ACCURACY] for row in history if ACCURACY in row]
    if not values:
        raise ValueError("the run logged no val/accuracy")
    return statistics.fmean(values[-last:])


def initial_accuracy(budget: Budget, model: str | None, run_dir: Path) -> dict[str, float]:
    """The start's held-out accuracy, as the history row of rollout 0 (the same for every run)."""
    args = training_args(RunSpec("troll", 0, budget.steps), budget, model, run_dir)
    done = cli(["validate", *args[1:]])
    return {"rollout": 0, ACCURACY: float(done.trainer.callback_metrics[ACCURACY])}


def check_settings(path: Path, settings: dict) -> None:
    """Records the settings in ``path``, or refuses to continue runs made with others."""
    if path.exists():
        stored = json.loads(path.read_text())
        if stored != settings:
            raise ValueError(
                f"--out: {path.parent} holds runs made with {stored}, not {settings}; use another "
                "--out or the same settings"
            )
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings))


def estimate_seconds(
    specs: Sequence[RunSpec], budget: Budget, records: Sequence[dict], prior: float
):
    """(seconds for the whole grid, seconds per rollout used), from the finished runs: the median
    rollout's ``time/iteration`` plus the median run's time outside rollouts (validation, start-up)
    per rollout; else ``prior``. Medians, so that a run paused for a while (SIGSTOP) or a slow
    rollout does not inflate the estimate."""
    if not records:
        return prior * budget.rollouts * len(specs), prior
    rollouts = [t for r in records for t in _values(r, TIME)]
    outside = [
        max(0.0, r["seconds"] - sum(row.get(TIME, 0.0) for row in r["history"])) / budget.rollouts
        for r in records
    ]
    rate = (statistics.median(rollouts) if rollouts else 0.0) + statistics.median(outside)
    return rate * budget.rollouts * len(specs), rate


def recorded_runs(out: Path) -> dict[str, dict]:
    """The finished runs that the study's own outputs hold, by name: ``results.json`` with each
    run's history read back from ``metrics.csv``. These outputs are what a copy of the study
    keeps (``runs/``, with the checkpoints, logs and each run's ``result.json``, is not kept
    under version control)."""
    results, metrics = out / "results.json", out / "metrics.csv"
    if not (results.exists() and metrics.exists()):
        return {}
    histories: dict[str, list[dict]] = {}
    with metrics.open(newline="") as f:
        for row in csv.DictReader(f):
            entry: dict = {"rollout": int(row["rollout"])}
            entry.update({k: float(row[k]) for k in METRICS if row.get(k, "") != ""})
            histories.setdefault(row["name"], []).append(entry)
    return {
        r["name"]: {**r, "history": histories[r["name"]]}
        for r in json.loads(results.read_text())
        if r["name"] in histories
    }


def restore_runs(specs: Sequence[RunSpec], out: Path) -> list[str]:
    """Writes ``runs/<name>/result.json`` for each run of ``specs`` that the outputs record as
    finished but ``runs/`` lacks (a fresh copy of the study); returns their names."""
    recorded = recorded_runs(out)
    restored = []
    for spec in specs:
        result = out / "runs" / spec.name / "result.json"
        if spec.name in recorded and not result.exists():
            result.parent.mkdir(parents=True, exist_ok=True)
            result.write_text(json.dumps(recorded[spec.name], indent=1))
            restored.append(spec.name)
    return restored


def kept(out: Path, name: str) -> Path:
    """``out/<name>``, a file the study keeps beside its outputs; one that an earlier version
    kept in ``out/runs/`` is moved there first."""
    path, legacy = out / name, out / "runs" / name
    if legacy.exists() and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        legacy.replace(path)
    return path


def finished_records(specs: Sequence[RunSpec], out: Path) -> list[dict]:
    """The records of the runs of ``specs`` that have finished (their ``result.json``)."""
    paths = [out / "runs" / s.name / "result.json" for s in specs]
    return [json.loads(p.read_text()) for p in paths if p.exists()]


def run_all(
    specs: Sequence[RunSpec],
    budget: Budget,
    model: str | None,
    out: Path,
    prior: float = PRIOR_SECONDS,
    keep_checkpoints: bool = False,
) -> list[dict]:
    """Trains every run without a ``result.json`` (resuming interrupted ones); returns all
    records. Prints the grid's estimated time first and the time taken at the end."""
    runs = out / "runs"
    check_settings(kept(out, "settings.json"), {"model": model, "budget": asdict(budget)})
    restored = restore_runs(specs, out)
    if restored:
        print(f"taken from {out}'s results: {', '.join(restored)}", flush=True)
    done = finished_records(specs, out)
    total, rate = estimate_seconds(specs, budget, done, prior)
    source = f"{len(done)} runs done" if done else "--prior-seconds"
    print(
        f"grid: {len(specs)} runs x {budget.rollouts} rollouts, about {rate:.0f} s per rollout "
        f"({source}): {total / 3600:.1f} h in all, {(len(specs) - len(done)) * budget.rollouts * rate / 3600:.1f} h left",
        flush=True,
    )
    start_file = kept(out, "start.json")
    if not start_file.exists():
        shutil.rmtree(runs / "start", ignore_errors=True)
        began = time.perf_counter()
        start = initial_accuracy(budget, model, runs / "start")
        start["seconds"] = time.perf_counter() - began
        start_file.write_text(json.dumps(start))
    start = json.loads(start_file.read_text())
    start_row = {"rollout": 0, ACCURACY: start[ACCURACY]}
    records = []
    for i, spec in enumerate(specs):
        result = runs / spec.name / "result.json"
        if result.exists():
            print(f"[{i + 1}/{len(specs)}] {spec.name}: done before, skipped", flush=True)
        else:
            run_dir = result.parent
            resumed = (run_dir / "checkpoints" / "last.ckpt").exists()
            if not resumed:
                shutil.rmtree(run_dir, ignore_errors=True)  # no checkpoint: start over
            run_dir.mkdir(parents=True, exist_ok=True)
            print(
                f"[{i + 1}/{len(specs)}] {spec.name}: {'resumed' if resumed else 'started'}",
                flush=True,
            )
            record = train(spec, budget, model, run_dir, start_row)
            result.write_text(json.dumps(record, indent=1))
            write_records(finished_records(specs, out), out)
            if not keep_checkpoints:
                shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
            print(
                f"[{i + 1}/{len(specs)}] {spec.name}: accuracy {record['final_accuracy']:.3f} in "
                f"{record['seconds'] / 60:.1f} min",
                flush=True,
            )
        records.append(json.loads(result.read_text()))
    print(grid_time(records, start.get("seconds", 0.0)), flush=True)
    return records


def grid_time(records: Sequence[dict], start_seconds: float = 0.0) -> str:
    """How long the runs of ``records`` (and the start's validation) took: wall time, and without
    pauses (each rollout above ``TIME_CAP`` x the median rollout counted at the median)."""
    wall = start_seconds + sum(r["seconds"] for r in records)
    times = [t for r in records for t in _values(r, TIME)]
    if not times:
        return f"the runs took {wall / 3600:.2f} h of training and validation"
    median = statistics.median(times)
    paused = sum(t - median for t in times if t > TIME_CAP * median)
    return (
        f"the runs took {wall / 3600:.2f} h of training and validation, "
        f"{(wall - paused) / 3600:.2f} h without the paused rollouts"
    )


# --------------------------------------------------------------------------------------------
# Summary, table, plots
# --------------------------------------------------------------------------------------------


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value); NaN for none."""
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _values(record: dict, metric: str) -> list[float]:
    """The values of ``metric`` over a run's rollouts that log it, in rollout order."""
    return [row[metric] for row in record["history"] if metric in row]


def run_mean(record: dict, metric: str, last: int | None = None) -> float | None:
    """The mean of ``metric`` over a run's rollouts (the last ``last`` of those that log it)."""
    values = _values(record, metric)
    values = values[-last:] if last else values
    return statistics.fmean(values) if values else None


def run_median(record: dict, metric: str) -> float | None:
    """The median of ``metric`` over a run's rollouts that log it (robust to a paused one)."""
    values = _values(record, metric)
    return statistics.median(values) if values else None


def cell_of(record: dict) -> tuple:
    """The training budget a run shares with the others of its panel: steps and learning rate."""
    return record["steps"], record.get("lr")


def arm_of(record: dict) -> str:
    """What a run trains with inside its cell: the objective, and TROLL's bound and regression
    weight where not the config's (``troll eps 0.2``, ``troll alpha 0``)."""
    changed = [f"{k} {record[k]:g}" for k in ("eps", "alpha") if record.get(k) is not None]
    return " ".join([record["objective"], *changed])


def _over_seeds(members: Sequence[dict], fn) -> tuple[float, float]:
    """Mean and std over runs of ``fn(run)`` (runs where it is None left out)."""
    return mean_std([v for v in (fn(r) for r in members) if v is not None])


def summarise(records: Sequence[dict]) -> list[dict]:
    """One row per (cell, arm): means over seeds of what each run did (``objective``: the arm)."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((*cell_of(r), arm_of(r)), []).append(r)
    rows = []
    for (steps, lr, objective), members in groups.items():
        over_seeds = partial(_over_seeds, members)

        kl_max = [
            max(
                row["trust_region/kl_end_max"]
                for row in r["history"]
                if "trust_region/kl_end_max" in row
            )
            for r in members
            if any("trust_region/kl_end_max" in row for row in r["history"])
        ]
        rows.append(
            {
                "objective": objective,
                "steps": steps,
                "lr": lr,
                "seeds": len(members),
                "accuracy": over_seeds(lambda r: r["final_accuracy"]),
                "late_accuracy": over_seeds(lambda r: r["late_accuracy"]),
                "late_reward": over_seeds(lambda r: run_mean(r, "reward/mean", 5)),
                "kl_end": over_seeds(lambda r: run_mean(r, "trust_region/kl_end_mean")),
                "kl_end_sampled": over_seeds(lambda r: run_mean(r, "trust_region/kl_end_sampled")),
                "kl_end_max": max(kl_max) if kl_max else math.nan,
                "rollout_s": over_seeds(lambda r: run_median(r, TIME)),
                "minutes": over_seeds(lambda r: r["seconds"] / 60),
            }
        )
    return rows


def format_table(rows: Sequence[dict], budget: Budget) -> str:
    """A Markdown table of ``summarise``'s rows."""
    lr0 = config_lr(budget)
    lines = [
        "| objective | steps / rollout | lr | seeds | final accuracy | last 3 validations "
        "| reward, last 5 rollouts | KL end (support) | KL end (sampled) | max KL end "
        "| median s / rollout | minutes / run |",
        "| --- | ---: | ---: | ---: | --- | --- | --- | --- | --- | ---: | ---: | ---: |",
    ]

    def pm(pair: tuple[float, float], spec: str = ".3f") -> str:
        return f"{pair[0]:{spec}} ± {pair[1]:{spec}}"

    for r in rows:
        lr = lr0 if r["lr"] is None else r["lr"]
        lines.append(
            f"| {r['objective']} | {r['steps']} | {lr:g} | {r['seeds']} | {pm(r['accuracy'])} | "
            f"{pm(r['late_accuracy'])} | {pm(r['late_reward'])} | {pm(r['kl_end'], '.4f')} | "
            f"{pm(r['kl_end_sampled'], '.4f')} | {r['kl_end_max']:.3f} | "
            f"{r['rollout_s'][0]:.0f} | {r['minutes'][0]:.0f} |"
        )
    return "\n".join(lines) + "\n"


def run_figures(records: Sequence[dict]) -> dict:
    """What one row of :func:`format_runs` shows, over the rollouts of ``records`` (one run, or
    all seeds of a cell: then accuracies and rewards are means over the runs, KL medians over
    the pooled rollouts)."""

    def over_runs(fn) -> float:
        return statistics.fmean(fn(r) for r in records)

    accuracies = [_values(r, ACCURACY) for r in records]
    pooled = {m: [v for r in records for v in _values(r, m)] for m in (KL_END, KL_SAMPLED)}
    medians = [run_median(r, TIME) for r in records]
    return {
        "accuracy": [statistics.fmean(a) for a in zip(*accuracies, strict=True)],
        "late": over_runs(lambda r: final_accuracy(r["history"], LATE)),
        "reward_first": over_runs(lambda r: statistics.fmean(_values(r, REWARD)[:5])),
        "reward_all": over_runs(lambda r: statistics.fmean(_values(r, REWARD))),
        "reward_last": over_runs(lambda r: statistics.fmean(_values(r, REWARD)[-10:])),
        "kl_end": statistics.median(pooled[KL_END]) if pooled[KL_END] else math.nan,
        "kl_sampled": statistics.median(pooled[KL_SAMPLED]) if pooled[KL_SAMPLED] else math.nan,
        "kl_end_max": max((v for r in records for v in _values(r, KL_END_MAX)), default=math.nan),
        "entropy": over_runs(lambda r: statistics.fmean(_values(r, "entropy")[-10:])),
        "length": over_runs(lambda r: statistics.fmean(_values(r, LENGTH)[-10:])),
        "seconds": (min(medians), max(medians)),
    }


def format_runs(records: Sequence[dict]) -> str:
    """A row per run, then per cell and objective a row of the means over its seeds."""
    lines = [
        "| run | held-out accuracy at each validation | last 3 validations | reward: first 5 / "
        "all / last 10 rollouts | KL end, support / sampled (median rollout) | largest KL end "
        "| entropy, last 10 rollouts | completion tokens, last 10 rollouts | median s / rollout |",
        "| --- | --- | ---: | --- | --- | ---: | ---: | ---: | ---: |",
    ]

    def row(name: str, f: dict) -> str:
        low, high = f["seconds"]
        seconds = f"{low:.0f}" if round(low) == round(high) else f"{low:.0f}-{high:.0f}"
        return (
            f"| {name} | {', '.join(f'{a:.3f}' for a in f['accuracy'])} | {f['late']:.3f} | "
            f"{f['reward_first']:.3f} / {f['reward_all']:.3f} / {f['reward_last']:.3f} | "
            f"{f['kl_end']:.3f} / {f['kl_sampled']:.3f} | {f['kl_end_max']:.2f} | "
            f"{f['entropy']:.3f} | {f['length']:.1f} | {seconds} |"
        )

    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((cell_of(r), arm_of(r)), []).append(r)
    for runs in groups.values():
        lines += [row(r["name"], run_figures([r])) for r in runs]
    for runs in groups.values():
        if len(runs) > 1:
            cell = runs[0]["name"].rsplit("-s", 1)[0]
            lines.append(row(f"{cell}, mean of {len(runs)} seeds", run_figures(runs)))
    return "\n".join(lines) + "\n"


def write_records(records: Sequence[dict], out: Path) -> None:
    """``results.json`` and ``metrics.csv``: ``records``, then the runs the outputs already held
    that ``records`` lacks (a run of another grid is kept, not dropped). Each file is written
    beside its place and then moved there, so a stop mid-write leaves the old one whole."""
    names = {r["name"] for r in records}
    records = [*records, *(r for n, r in recorded_runs(out).items() if n not in names)]
    write_metrics_csv(records, out / "metrics.csv")
    results = [{k: v for k, v in r.items() if k != "history"} for r in records]
    partial = out / "results.json.partial"
    partial.write_text(json.dumps(results, indent=1))
    partial.replace(out / "results.json")


def write_metrics_csv(records: Sequence[dict], path: Path) -> None:
    """One row per run and rollout: the run's settings, the rollout and ``METRICS`` (written to
    ``<path>.partial``, then moved to ``path``)."""
    keys = ["name", "objective", "seed", "steps", "lr", "eps", "alpha", "rollout"]
    partial = path.with_name(path.name + ".partial")
    with partial.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*keys, *METRICS])
        writer.writeheader()
        for r in records:
            for row in r["history"]:
                writer.writerow({**{k: r.get(k) for k in keys[:-1]}, **row})
    partial.replace(path)


def curve(records: Sequence[dict], metric: str) -> tuple[list[int], list[float], list[float]]:
    """Mean and standard deviation over runs of ``metric`` at each rollout every run logged it."""
    per_run = [
        {row["rollout"]: row[metric] for row in r["history"] if metric in row} for r in records
    ]
    steps = sorted(set.intersection(*(set(p) for p in per_run))) if per_run else []
    stats = [mean_std([p[s] for p in per_run]) for s in steps]
    return steps, [m for m, _ in stats], [s for _, s in stats]


COLOURS = {"clip": "tab:blue", "troll": "tab:orange"}
MORE_COLOURS = ("tab:green", "tab:red", "tab:purple", "tab:brown")
"""The colours of further arms (``troll eps ...``), in the order they first appear."""
TIME_CAP = 3.0
"""The time plot's y axis ends at this multiple of the median seconds per rollout."""


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def cell_title(cell: tuple, budget: Budget) -> str:
    steps, lr = cell
    return f"{steps} steps / rollout, lr {config_lr(budget) if lr is None else lr:g}"


def plot_cells(
    records: Sequence[dict],
    series: Sequence[tuple[str, str]],
    ylabel: str,
    path: Path,
    budget: Budget,
    bounds: Sequence[float] = (),
    log: bool = False,
    cap: float | None = None,
) -> None:
    """One panel per cell; in each, per arm (:func:`arm_of`) and ``(metric, label)`` of
    ``series``, the mean over seeds with a +-1 std band (later series of an arm dashed, then
    dotted); a horizontal line at each of TROLL's ``bounds``. ``cap``
    ends the y axis at that multiple of the median value of the panel's runs, and says in the
    title how many rollouts lie above it (a run paused for a while would flatten the rest)."""
    plt = pyplot()
    cells = list(dict.fromkeys(cell_of(r) for r in records))
    arms = list(dict.fromkeys([*OBJECTIVES, *(arm_of(r) for r in records)]))
    colours = {**dict(zip(arms[2:], MORE_COLOURS, strict=False)), **COLOURS}
    fig, axes = plt.subplots(1, len(cells), figsize=(4.5 * len(cells), 3.3), squeeze=False)
    for ax, cell in zip(axes[0], cells, strict=True):
        for arm in arms:
            runs = [r for r in records if cell_of(r) == cell and arm_of(r) == arm]
            drawn = 0
            for metric, label in series:
                steps, mean, std = curve(runs, metric)
                if not steps:
                    continue
                colour = colours.get(arm, "tab:gray")
                style = ("-", "--", ":")[drawn % 3]
                drawn += 1
                seeds = f" ({len(runs)} seeds)" if len(runs) > 1 else ""
                ax.plot(steps, mean, style, color=colour, label=f"{arm}: {label}{seeds}")
                low = [m - s for m, s in zip(mean, std, strict=True)]
                high = [m + s for m, s in zip(mean, std, strict=True)]
                ax.fill_between(steps, low, high, color=colour, alpha=0.2)
        for bound in sorted(set(bounds)):
            ax.axhline(
                bound, color="k", linestyle="--", linewidth=1, label=f"TROLL's eps {bound:g}"
            )
        if log:
            ax.set_yscale("log")
        title = cell_title(cell, budget)
        if cap is not None:
            values = [
                row[metric]
                for r in records
                if cell_of(r) == cell
                for row in r["history"]
                for metric, _ in series
                if metric in row
            ]
            if values:
                top = cap * statistics.median(values)
                ax.set_ylim(0, top)
                above = sum(v > top for v in values)
                if above:
                    title += f"\n{above} rollouts above {top:.0f} (paused runs) off the chart"
        ax.set_title(title, fontsize="small")
        ax.set_xlabel("rollout")
        ax.set_ylabel(ylabel)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plots(records: Sequence[dict], out: Path, budget: Budget) -> list[Path]:
    """The study's PNGs in ``out``; returns their paths."""
    bounds = sorted(
        {row.get("trust_region/bound") for r in records for row in r["history"]} - {None}
    )
    plots = {
        "reward.png": ([("reward/mean", "mean sampled reward")], "reward", (), False),
        "accuracy.png": ([(ACCURACY, "held-out accuracy")], "accuracy", (), False),
        "kl_end.png": (
            [
                ("trust_region/kl_end_mean", "mean KL(new || old), support"),
                ("trust_region/kl_end_sampled", "mean KL(new || old), sampled"),
            ],
            "per-token KL at the rollout's end",
            bounds,
            True,
        ),
        "kl_end_max.png": (
            [
                ("trust_region/kl_end_max", "max KL(new || old), support"),
                ("trust_region/kl_after_max", "max KL(proj || old)"),
            ],
            "largest per-token KL",
            bounds,
            True,
        ),
        "entropy.png": ([("entropy", "entropy")], "entropy per token", (), False),
        "time.png": ([(TIME, "s / rollout")], "wall seconds per rollout", (), False),
    }
    paths = []
    for name, (series, ylabel, lines, log) in plots.items():
        cap = TIME_CAP if name == "time.png" else None
        plot_cells(records, series, ylabel, out / name, budget, bounds=lines, log=log, cap=cap)
        paths.append(out / name)
    return paths


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None, help="output folder")
    p.add_argument("--model", default=None, help="model folder (default: the config's)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rollouts", type=int, default=None, help="rollouts per run (30)")
    p.add_argument("--steps", type=int, default=Budget.steps, help="optimiser steps per rollout")
    p.add_argument("--val-every", type=int, default=None, help="rollouts between validations (5)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per rollout (config's 8)")
    p.add_argument("--num-val", type=int, default=None, help="held-out prompts (config's: all)")
    p.add_argument("--checkpoint-every", type=int, default=None, help="rollouts between saves (5)")
    p.add_argument("--stress", choices=STRESS, default="steps", help="the stress cell")
    p.add_argument("--stress-steps", type=int, default=8, help="its steps per rollout")
    p.add_argument(
        "--troll-alpha",
        type=float,
        nargs="*",
        default=list(TROLL_ALPHA),
        help="a TROLL run per seed at each of these regression weights (default: %(default)s; "
        "none: give the option no value)",
    )
    p.add_argument(
        "--troll-eps",
        type=float,
        nargs="*",
        default=list(TROLL_EPS),
        help="a TROLL run per seed at each of these KL bounds (default: %(default)s; none: "
        "give the option no value)",
    )
    p.add_argument("--prior-seconds", type=float, default=PRIOR_SECONDS, help="s / rollout guess")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep finished runs' last.ckpt")
    p.add_argument("--estimate", action="store_true", help="print the estimate only")
    p.add_argument(
        "--report",
        action="store_true",
        help="write the table, CSV and plots from the runs finished so far; train nothing",
    )
    p.add_argument("--dry-run", action="store_true", help="TinyMath, 3 tiny rollouts per run")
    args = p.parse_args(argv)
    tiny = args.dry_run
    args.out = args.out or ROOT / "examples" / "results" / "smollm2" / (
        "dry_run" if tiny else "study"
    )
    args.rollouts = args.rollouts or (3 if tiny else Budget.rollouts)
    args.val_every = args.val_every or (1 if tiny else Budget.val_every)
    args.prompts = args.prompts or (2 if tiny else Budget.prompts)
    args.num_val = args.num_val or (4 if tiny else None)
    args.checkpoint_every = args.checkpoint_every or (1 if tiny else Budget.checkpoint_every)
    if tiny and args.model is None:
        args.model = "tinymath"
    return args


def main(argv: Sequence[str] | None = None) -> list[dict]:
    """Runs (or resumes) the study; returns the run records."""
    args = parse_args(argv)
    budget = Budget(
        rollouts=args.rollouts,
        steps=args.steps,
        val_every=args.val_every,
        prompts=args.prompts,
        num_val=args.num_val,
        checkpoint_every=args.checkpoint_every,
        dry_run=args.dry_run,
    )
    specs = grid(
        args.seeds, budget, args.stress, args.stress_steps, args.troll_eps, args.troll_alpha
    )
    if args.estimate:
        restore_runs(specs, args.out)
        done = finished_records(specs, args.out)
        total, rate = estimate_seconds(specs, budget, done, args.prior_seconds)
        print(
            f"{len(specs)} runs x {budget.rollouts} rollouts x {rate:.0f} s: {total / 3600:.1f} h"
        )
        return []
    if args.report:
        restore_runs(specs, args.out)
        records = finished_records(specs, args.out)
        if not records:
            sys.exit(f"--report: no finished run in {args.out} yet")
        start_file = kept(args.out, "start.json")
        start = json.loads(start_file.read_text()) if start_file.exists() else {}
        print(f"{len(records)} of {len(specs)} runs finished", flush=True)
        print(grid_time(records, start.get("seconds", 0.0)), flush=True)
    else:
        try:
            records = run_all(
                specs, budget, args.model, args.out, args.prior_seconds, args.keep_checkpoints
            )
        except Interrupted as stop:
            print(f"{stop}; run the same command again to resume it", flush=True)
            sys.exit(stop.exit_code)
    write_records(records, args.out)
    table = format_table(summarise(records), budget)
    (args.out / "table.md").write_text(table)
    runs_table = format_runs(records)
    (args.out / "runs.md").write_text(runs_table)
    write_plots(records, args.out, budget)
    print(table)
    print(runs_table)
    return records


if __name__ == "__main__":
    main()
