"""TROLL against PPO-style clipping on TinyMath, across advantage estimators and seeds.

    python examples/tinymath_study.py --out study            # the full grid (about 95 minutes)
    python examples/tinymath_study.py --no-main --no-ablation --out fair   # the fair baselines only
    python examples/tinymath_study.py --quick --out quick    # GRPO only, fewer rollouts
    python examples/tinymath_study.py --support-only         # the sparse support sizes only

Every run starts from the shipped TinyMath warm start with ``configs/tinymath.yaml`` plus one
estimator preset (``configs/{grpo,dr_grpo,gspo,reinforce_pp}.yaml``), so the trust region and the
clip range are that config's (the paper's defaults: eps 0.05, alpha 1, K 64, delta 1e-5; clip 0.2).
The grid is {GRPO, Dr.GRPO, GSPO, REINFORCE++} x {clip, TROLL} x seeds, plus a GRPO + TROLL
ablation over K in {4, 16, 64} and eps in {0.01, 0.05, 0.25} (seed 0; K 64 / eps 0.05 is the main
run) and a learning-rate stress test: GRPO x {clip, TROLL} at 3x and 10x the config's learning
rate (3e-4 and 1e-3; seed 0), where the steps grow large and the trust region or the clip has to
hold them. Two fair-baseline cells over the seeds (``--fair``) complete it: GSPO + clip with
GSPO's own clip range for sequence ratios (3e-4 below, 4e-4 above 1, as its paper uses, instead
of the config's 0.2), and an off-policy stress cell, GRPO x {clip, TROLL} at 8 optimiser steps
per rollout instead of 4 (minibatches of 128 sequences: seven of them off-policy). ``--no-main
--no-ablation`` runs only those. Runs go one after another, in-process, through
``lightning_troll.cli.run``.

Budget, chosen so that a run takes about two minutes on a quiet 2-core CPU (107-140 s; 32 runs in
about 70 minutes): 100 rollouts of 128 prompts x 8 completions, four minibatches of 256 sequences
per rollout (so 400 optimiser steps; the first minibatch of a rollout is on-policy, the other three
are off-policy, and that is where the trust region and the clip act), validation on 1024 held-out
prompts every 10 rollouts (greedy answers; one accuracy then has a standard error of about 0.015). A
machine busy with other work can take several times as long: lower ``--rollouts`` or
``--batch-size`` there. ``--quick``: GRPO only, 30 rollouts, validation every 5, no ablation or
stress test. Curves are drawn against rollouts (rollout 0 is the warm start, whose held-out accuracy
is measured once); "rollouts to reach" is the first validated rollout with held-out accuracy >=
``--threshold`` (0.55: the warm start is at 0.503 on the first 1024 test prompts, and the runs of
the default budget level off at 0.53-0.57). The table also gives each cell's mean of the last three
validated accuracies (by default rollouts 80, 90, 100), which one noisy validation moves less.

Outputs in ``--out``: ``runs/<name>/`` (the CSVLogger's file and ``result.json``, written last: a
run whose ``result.json`` exists is skipped, so an interrupted grid continues where it stopped),
``metrics.csv`` (one row per run and rollout), ``results.json`` (per run: settings, final
held-out accuracy, rollouts to the threshold, seconds), ``table.md``, ``support.json`` and the plots
``accuracy.png``, ``kl_after.png``, ``entropy.png``, ``active_frac.png``, ``ablation.png``,
``learning_rate.png`` and ``fair.png`` (each where its runs are in the grid).
Needs matplotlib (``pip install lightning-troll[study]``).
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import math
import shutil
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
ESTIMATORS = {
    "grpo": "grpo.yaml",
    "dr_grpo": "dr_grpo.yaml",
    "gspo": "gspo.yaml",
    "reinforce_pp": "reinforce_pp.yaml",
}
OBJECTIVES = ("clip", "troll")
ABLATION_K = (4, 16, 64)
ABLATION_EPS = (0.01, 0.05, 0.25)
STRESS_LR = (3e-4, 1e-3)
"""Learning rates of the stress test (``configs/tinymath.yaml`` trains at 1e-4)."""
GSPO_CLIP = (3e-4, 4e-4)
"""GSPO's own clip range for its sequence ratios (low, high), as its paper uses."""
STRESS_STEPS = 8
"""Optimiser steps per rollout of the off-policy stress cell (the budget's minibatches: 4)."""
ACCURACY = "val/accuracy"
LATE = 3
"""Validations at the end of a run that the table's second accuracy column averages."""
METRICS = (
    ACCURACY,
    "reward/mean",
    "entropy",
    "trust_region/kl_after_mean",
    "trust_region/kl_after_max",
    "trust_region/bound",
    "trust_region/active_frac",
    "clip/active_frac",
    "clip/approx_kl",
    "sparsity/support_mean",
)
"""The logged metrics kept per rollout (a run logs only some of them: clip or trust region)."""


def base_config() -> dict:
    """``configs/tinymath.yaml``, parsed."""
    return yaml.safe_load((CONFIGS / "tinymath.yaml").read_text())


@dataclass(frozen=True)
class Budget:
    """How much each run trains and validates."""

    rollouts: int = 100
    """Rollouts per run (``minibatches`` optimiser steps each)."""
    batch_size: int = 128
    """Prompts per rollout (each with the config's group_size completions)."""
    val_every: int = 10
    """Rollouts between validations."""
    num_val: int = 1024
    """Held-out prompts of each validation."""
    num_train: int = 16000
    """Training prompts drawn from."""
    minibatches: int = 4
    """Optimiser steps per rollout (the rollout's sequences split evenly); all but the first
    are off-policy."""

    def __post_init__(self) -> None:
        for name in ("rollouts", "batch_size", "val_every", "num_val", "num_train", "minibatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be an integer >= 1; got {value!r}"
                )
        sequences = self.batch_size * base_config()["model"]["group_size"]
        if sequences % self.minibatches:
            raise ValueError(
                f"--minibatches must divide the {sequences} sequences of a rollout (--batch-size "
                f"{self.batch_size} x group size); got {self.minibatches}"
            )


@dataclass(frozen=True)
class RunSpec:
    """One training run of the grid."""

    estimator: str
    objective: str
    seed: int
    max_tokens: int = 64
    eps: float = 0.05
    lr: float | None = None
    """AdamW's learning rate; None: the config's."""
    clip_low: float | None = None
    """The clip range below 1 (``model.clip.eps_low``); None: the config's."""
    clip_high: float | None = None
    """The clip range above 1 (``model.clip.eps_high``); None: the config's."""
    steps: int | None = None
    """Optimiser steps per rollout; None: the budget's ``minibatches``."""

    @property
    def name(self) -> str:
        """Directory name, unique per setting."""
        lr = "" if self.lr is None else f"-lr{self.lr:g}"
        clip = "" if self.clip_low is None else f"-clip{self.clip_low:g}_{self.clip_high:g}"
        steps = "" if self.steps is None else f"-steps{self.steps}"
        return (
            f"{self.estimator}-{self.objective}-K{self.max_tokens}-eps{self.eps:g}{lr}{clip}{steps}"
            f"-s{self.seed}"
        )


def grid(
    estimators: Sequence[str],
    seeds: Sequence[int],
    ablation: bool,
    fair: bool = False,
    main: bool = True,
) -> list[RunSpec]:
    """The main grid, then the ablation runs that are not already in it (no duplicates) and the
    learning-rate stress runs; ``fair`` adds, over ``seeds``, GSPO + clip at GSPO's own clip range
    and the off-policy stress cell (GRPO, clip and TROLL, ``STRESS_STEPS`` steps per rollout)."""
    unknown = [e for e in estimators if e not in ESTIMATORS]
    if unknown:
        raise ValueError(f"--estimators: unknown {unknown}; allowed: {sorted(ESTIMATORS)}")
    specs = (
        [RunSpec(e, o, s) for e in estimators for o in OBJECTIVES for s in seeds] if main else []
    )
    if fair:
        low, high = GSPO_CLIP
        specs += [RunSpec("gspo", "clip", s, clip_low=low, clip_high=high) for s in seeds]
        specs += [RunSpec("grpo", o, s, steps=STRESS_STEPS) for o in OBJECTIVES for s in seeds]
    if ablation:
        extra = [RunSpec("grpo", "troll", 0, max_tokens=k) for k in ABLATION_K]
        extra += [RunSpec("grpo", "troll", 0, eps=eps) for eps in ABLATION_EPS]
        specs += [s for s in dict.fromkeys(extra) if s not in specs]
        specs += [RunSpec("grpo", o, 0, lr=lr) for lr in STRESS_LR for o in OBJECTIVES]
    return specs


def training_args(spec: RunSpec, budget: Budget, model: str, run_dir: Path) -> list[str]:
    """The ``lightning-troll fit`` arguments of one run."""
    group = base_config()["model"]["group_size"]
    steps = spec.steps or budget.minibatches
    if (budget.batch_size * group) % steps:
        raise ValueError(
            f"{spec.name}: {steps} steps per rollout do not divide the rollout's "
            f"{budget.batch_size * group} sequences; change --batch-size"
        )
    logger = {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": str(run_dir), "name": "logs", "version": 0},
    }
    return [
        "fit",
        "--config", str(CONFIGS / "tinymath.yaml"),
        "--config", str(CONFIGS / ESTIMATORS[spec.estimator]),
        "--seed_everything", str(spec.seed),
        "--model.model", model,
        "--model.objective", spec.objective,
        "--model.trust_region.max_tokens", str(spec.max_tokens),
        "--model.trust_region.eps", str(spec.eps),
        "--model.optimization.minibatch_size", str(budget.batch_size * group // steps),
        "--trainer.max_steps", str(steps * budget.rollouts),
        "--trainer.val_check_interval", str(budget.val_every),
        "--trainer.logger", json.dumps(logger),
        "--trainer.default_root_dir", str(run_dir),
        "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--data.batch_size", str(budget.batch_size),
        "--data.num_train", str(budget.num_train),
        "--data.num_val", str(budget.num_val),
        "--data.val_batch_size", str(budget.num_val),
        *([] if spec.lr is None else ["--model.optimizer.init_args.lr", str(spec.lr)]),
        *([] if spec.clip_low is None else ["--model.clip.eps_low", str(spec.clip_low)]),
        *([] if spec.clip_high is None else ["--model.clip.eps_high", str(spec.clip_high)]),
    ]  # fmt: skip


def read_history(metrics_csv: Path) -> list[dict[str, float]]:
    """The CSVLogger's rows merged per rollout: ``[{"rollout": r, metric: value, ...}]``.

    Lightning's logging step counts training batches, i.e. rollouts, from 0 (validation after a
    rollout logs at that rollout's step): rollout r (from 1) is logging step r - 1.
    """
    rollouts: dict[int, dict[str, float]] = {}
    with metrics_csv.open() as f:
        for row in csv.DictReader(f):
            rollout = int(row["step"]) + 1
            merged = rollouts.setdefault(rollout, {"rollout": rollout})
            merged.update({k: float(v) for k, v in row.items() if k in METRICS and v != ""})
    return [rollouts[r] for r in sorted(rollouts)]


def rollouts_to_threshold(history: Iterable[dict[str, float]], threshold: float) -> int | None:
    """The first rollout whose held-out accuracy is >= ``threshold``; None if none is."""
    for row in history:
        if ACCURACY in row and row[ACCURACY] >= threshold:
            return int(row["rollout"])
    return None


def final_accuracy(history: Sequence[dict[str, float]], last: int = 1) -> float:
    """The mean of the ``last`` logged held-out accuracies (by default the last one alone)."""
    values = [row[ACCURACY] for row in history if ACCURACY in row]
    if not values:
        raise ValueError("the run logged no val/accuracy")
    return statistics.fmean(values[-last:])


def with_start(history: list[dict[str, float]], start: dict[str, float]) -> list[dict[str, float]]:
    """``history`` (rollouts from 1) after the warm start's row ``start`` (rollout 0)."""
    return [start, *history]


def cli(args: list[str]):
    """``lightning_troll.cli.run(args)`` with this script's own arguments hidden from it."""
    from lightning_troll.cli import run as cli_run

    saved, sys.argv = sys.argv, sys.argv[:1]
    try:
        return cli_run(args)
    finally:
        sys.argv = saved


def train(spec: RunSpec, budget: Budget, model: str, run_dir: Path, start: dict) -> dict:
    """Trains one run and returns its record (``start``: the warm start's accuracy, rollout 0)."""
    began = time.perf_counter()
    cli(training_args(spec, budget, model, run_dir))
    history = with_start(read_history(run_dir / "logs" / "version_0" / "metrics.csv"), start)
    return {
        **asdict(spec),
        "name": spec.name,
        "seconds": time.perf_counter() - began,
        "final_accuracy": final_accuracy(history),
        "history": history,
    }


def initial_accuracy(budget: Budget, model: str, run_dir: Path) -> dict[str, float]:
    """The warm start's held-out accuracy, as the history row of rollout 0 (same for every run)."""
    args = training_args(RunSpec("grpo", "troll", 0), budget, model, run_dir)
    done = cli(["validate", *args[1:]])
    return {"rollout": 0, ACCURACY: float(done.trainer.callback_metrics[ACCURACY])}


def check_settings(path: Path, settings: dict) -> None:
    """Records the run settings in ``path``, or refuses to continue runs made with others."""
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


def run_all(specs: Sequence[RunSpec], budget: Budget, model: str, out: Path) -> list[dict]:
    """Trains every run without a ``result.json`` in ``out/runs/<name>``; returns all records."""
    runs = out / "runs"
    check_settings(runs / "settings.json", {"model": model, "budget": asdict(budget)})
    start_file = runs / "start.json"
    if not start_file.exists():
        shutil.rmtree(runs / "start", ignore_errors=True)
        start = initial_accuracy(budget, model, runs / "start")
        start_file.write_text(json.dumps(start))
    start = json.loads(start_file.read_text())
    records = []
    for i, spec in enumerate(specs):
        result = runs / spec.name / "result.json"
        if result.exists():
            print(f"[{i + 1}/{len(specs)}] {spec.name}: done before, skipped")
        else:
            shutil.rmtree(result.parent, ignore_errors=True)  # an interrupted run starts over
            record = train(spec, budget, model, result.parent, start)
            result.write_text(json.dumps(record, indent=1))
            print(f"[{i + 1}/{len(specs)}] {spec.name}: accuracy {record['final_accuracy']:.3f} "
                  f"in {record['seconds']:.0f} s")  # fmt: skip
        records.append(json.loads(result.read_text()))
    return records


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarise(records: Sequence[dict], threshold: float) -> list[dict]:
    """One row per (estimator, objective, K, eps, lr, clip range, steps) cell: over seeds, the final accuracy and the
    mean of each run's last ``LATE`` validations (less noisy than one), rollouts to the threshold
    (mean over the seeds that reached it) and how many seeds reached it."""
    cells: dict[tuple, list[dict]] = {}
    for r in records:
        cell = (r["estimator"], r["objective"], r["max_tokens"], r["eps"], r.get("lr"))
        cell += (r.get("clip_low"), r.get("clip_high"), r.get("steps"))
        cells.setdefault(cell, []).append(r)
    rows = []
    for (estimator, objective, k, eps, lr, low, high, steps), members in cells.items():
        mean, std = mean_std([r["final_accuracy"] for r in members])
        late_mean, late_std = mean_std([final_accuracy(r["history"], LATE) for r in members])
        reached = [rollouts_to_threshold(r["history"], threshold) for r in members]
        reached = [s for s in reached if s is not None]
        rows.append(
            {
                "estimator": estimator,
                "objective": objective,
                "max_tokens": k,
                "eps": eps,
                "lr": lr,
                "clip_low": low,
                "clip_high": high,
                "steps": steps,
                "seeds": len(members),
                "accuracy_mean": mean,
                "accuracy_std": std,
                "late_mean": late_mean,
                "late_std": late_std,
                "rollouts_to_threshold": statistics.fmean(reached) if reached else None,
                "reached": len(reached),
            }
        )
    return rows


@functools.cache
def config_learning_rate() -> float:
    """AdamW's learning rate in ``configs/tinymath.yaml`` (read once)."""
    return float(base_config()["model"]["optimizer"]["init_args"]["lr"])


def learning_rate(record: dict) -> float:
    """The learning rate a run (record or row) trained at: its own, else the config's."""
    return config_learning_rate() if record.get("lr") is None else record["lr"]


def clip_range(row: dict) -> str:
    """A clip row's range as ``low`` or ``low/high`` (the config's where the run kept it)."""
    low = row.get("clip_low")
    low = float(base_config()["model"]["clip"]["eps_low"]) if low is None else low
    high = row.get("clip_high")
    return f"{low:g}" if high is None or math.isclose(high, low) else f"{low:g}/{high:g}"


def format_table(rows: Sequence[dict], threshold: float, steps: int = Budget.minibatches) -> str:
    """A Markdown table of ``summarise``'s rows (``steps``: the budget's steps per rollout)."""
    lines = [
        "| estimator | objective | K | eps | clip range | lr | steps / rollout | seeds "
        f"| final accuracy | last {LATE} validations | rollouts to {threshold:g} |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        reach = (
            "not reached"
            if r["rollouts_to_threshold"] is None
            else f"{r['rollouts_to_threshold']:.0f} ({r['reached']}/{r['seeds']})"
        )
        k, eps = (r["max_tokens"], f"{r['eps']:g}") if r["objective"] == "troll" else ("-", "-")
        clip = clip_range(r) if r["objective"] == "clip" else "-"
        lr = learning_rate(r)
        lines.append(
            f"| {r['estimator']} | {r['objective']} | {k} | {eps} | {clip} | {lr:g} | "
            f"{r.get('steps') or steps} | {r['seeds']} | "
            f"{r['accuracy_mean']:.3f} ± {r['accuracy_std']:.3f} | "
            f"{r['late_mean']:.3f} ± {r['late_std']:.3f} | {reach} |"
        )
    return "\n".join(lines) + "\n"


def write_metrics_csv(records: Sequence[dict], path: Path) -> None:
    """One row per run and rollout: the run's settings, the rollout and ``METRICS``."""
    keys = ["name", "estimator", "objective", "seed", "max_tokens", "eps", "lr"]
    keys += ["clip_low", "clip_high", "steps", "rollout"]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*keys, *METRICS])
        writer.writeheader()
        for r in records:
            for row in r["history"]:
                writer.writerow({**{k: r.get(k) for k in keys[:-1]}, **row})


def curve(records: Sequence[dict], metric: str) -> tuple[list[int], list[float], list[float]]:
    """Mean and standard deviation over runs of ``metric`` at each rollout every run logged it."""
    per_run = [
        {row["rollout"]: row[metric] for row in r["history"] if metric in row} for r in records
    ]
    steps = sorted(set.intersection(*(set(p) for p in per_run))) if per_run else []
    stats = [mean_std([p[s] for p in per_run]) for s in steps]
    return steps, [m for m, _ in stats], [s for _, s in stats]


def is_main(record: dict) -> bool:
    """True for runs with the config's trust region (K 64, eps 0.05), learning rate, clip range
    and steps per rollout, i.e. not ablation, stress or fair-baseline runs."""
    return (
        record["max_tokens"] == 64
        and math.isclose(record["eps"], 0.05)
        and all(record.get(key) is None for key in ("lr", "clip_low", "clip_high", "steps"))
    )


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> None:
    """Writes ``fig`` to ``path`` as a PNG and frees it."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)


COLOURS = {"clip": "tab:blue", "troll": "tab:orange"}
"""One colour per objective in every plot."""


def band(ax, runs: Sequence[dict], metric: str, label: str, colour, style: str = "-") -> bool:
    """Draws the mean over ``runs`` of ``metric`` against rollout, with a +-1 std band; False
    (nothing drawn) when no rollout has it in every run."""
    steps, mean, std = curve(runs, metric)
    if not steps:
        return False
    ax.plot(steps, mean, style, color=colour, label=label)
    low = [m - s for m, s in zip(mean, std, strict=True)]
    high = [m + s for m, s in zip(mean, std, strict=True)]
    ax.fill_between(steps, low, high, color=colour, alpha=0.2)
    return True


def plot_grid(
    records: Sequence[dict],
    series: Sequence[tuple[str, str, str]],
    ylabel: str,
    path: Path,
    bound: bool = False,
) -> None:
    """One panel per estimator; per ``(objective, metric, label)`` of ``series``, the mean over
    seeds of that objective's ``metric`` with a +-1 std band (an objective's later series dashed).
    ``bound``: a line at the trust region's bound, as TROLL runs logged it."""
    plt = pyplot()
    estimators = list(dict.fromkeys(r["estimator"] for r in records))
    fig, axes = plt.subplots(1, len(estimators), figsize=(4 * len(estimators), 3.2), squeeze=False)
    for ax, estimator in zip(axes[0], estimators, strict=True):
        drawn: dict[str, int] = {}
        for objective, metric, label in series:
            runs = [
                r for r in records if r["estimator"] == estimator and r["objective"] == objective
            ]
            style = ("-", "--", ":")[drawn.get(objective, 0) % 3]
            colour = COLOURS.get(objective)
            if band(ax, runs, metric, f"{objective}: {label}", colour, style):
                drawn[objective] = drawn.get(objective, 0) + 1
        troll = [r for r in records if (r["estimator"], r["objective"]) == (estimator, "troll")]
        eps = curve(troll, "trust_region/bound")[1]
        if bound and eps:
            ax.axhline(eps[0], color="k", linestyle="--", linewidth=1, label="bound eps")
        ax.set_title(estimator)
        ax.set_xlabel("rollout")
        ax.set_ylabel(ylabel)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="x-small")
    save(fig, path)


def plot_ablation(records: Sequence[dict], path: Path) -> None:
    """Held-out accuracy against rollout for every GRPO + TROLL run of seed 0 (K and eps vary)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for r in records:
        if (r["estimator"], r["objective"], r["seed"]) == ("grpo", "troll", 0) and all(
            r.get(key) is None for key in ("lr", "steps")
        ):
            steps, accuracy, _ = curve([r], ACCURACY)
            ax.plot(steps, accuracy, label=f"K {r['max_tokens']}, eps {r['eps']:g}")
    ax.set_xlabel("rollout")
    ax.set_ylabel("held-out accuracy")
    ax.legend(fontsize="x-small")
    save(fig, path)


def plot_learning_rates(records: Sequence[dict], path: Path) -> None:
    """Held-out accuracy against rollout of the GRPO runs of seed 0, one panel per learning rate
    (the config's and the stress test's), clip against TROLL."""
    plt = pyplot()
    runs = [r for r in records if (r["estimator"], r["seed"]) == ("grpo", 0)]
    runs = [r for r in runs if (r["max_tokens"], r["eps"]) == (64, 0.05) and not r.get("steps")]
    rates = sorted({learning_rate(r) for r in runs}) or [learning_rate({})]
    fig, axes = plt.subplots(1, len(rates), figsize=(4 * len(rates), 3.2), squeeze=False)
    for ax, lr in zip(axes[0], rates, strict=True):
        for r in runs:
            if math.isclose(learning_rate(r), lr):
                steps, accuracy, _ = curve([r], ACCURACY)
                ax.plot(steps, accuracy, color=COLOURS.get(r["objective"]), label=r["objective"])
        ax.set_title(f"GRPO, lr {lr:g}")
        ax.set_xlabel("rollout")
        ax.set_ylabel("held-out accuracy")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="x-small")
    save(fig, path)


def plot_fair(records: Sequence[dict], path: Path) -> None:
    """The fair-baseline cells over seeds: GSPO + clip at GSPO's clip range (against GSPO +
    TROLL where the main grid ran it); GRPO at ``STRESS_STEPS`` steps per rollout, clip against
    TROLL, in held-out accuracy and per-token KL."""
    plt = pyplot()
    narrow = [r for r in records if r["estimator"] == "gspo" and r.get("clip_low") is not None]
    gspo_troll = [r for r in records if (r["estimator"], r["objective"]) == ("gspo", "troll")]
    stress = [r for r in records if r["estimator"] == "grpo" and r.get("steps") == STRESS_STEPS]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    low, high = GSPO_CLIP
    band(axes[0], narrow, ACCURACY, f"clip {low:g}/{high:g}", COLOURS["clip"])
    band(axes[0], [r for r in gspo_troll if is_main(r)], ACCURACY, "troll", COLOURS["troll"])
    axes[0].set_title("GSPO, its own clip range")
    for objective in OBJECTIVES:
        runs = [r for r in stress if r["objective"] == objective]
        band(axes[1], runs, ACCURACY, objective, COLOURS[objective])
    axes[1].set_title(f"GRPO, {STRESS_STEPS} steps per rollout")
    clip_runs = [r for r in stress if r["objective"] == "clip"]
    troll_runs = [r for r in stress if r["objective"] == "troll"]
    band(axes[2], clip_runs, "clip/approx_kl", "clip: mean k3 KL(old || new)", COLOURS["clip"])
    band(
        axes[2],
        troll_runs,
        "trust_region/kl_after_max",
        "troll: max KL(proj || old)",
        COLOURS["troll"],
    )
    band(
        axes[2],
        troll_runs,
        "trust_region/kl_after_mean",
        "troll: mean KL(proj || old)",
        COLOURS["troll"],
        "--",
    )
    axes[2].set_title(f"GRPO, {STRESS_STEPS} steps per rollout: per-token KL")
    for ax, ylabel in zip(
        axes, ("held-out accuracy", "held-out accuracy", "per-token KL"), strict=True
    ):
        ax.set_xlabel("rollout")
        ax.set_ylabel(ylabel)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="x-small")
    save(fig, path)


def write_plots(records: Sequence[dict], out: Path) -> list[Path]:
    """The study's PNGs in ``out`` (those its runs have data for); returns their paths."""
    main = [r for r in records if is_main(r)]
    panels = {
        "accuracy.png": ([(o, ACCURACY, "held-out accuracy") for o in OBJECTIVES], "accuracy"),
        "entropy.png": ([(o, "entropy", "entropy") for o in OBJECTIVES], "entropy"),
        "kl_after.png": (
            [
                ("clip", "clip/approx_kl", "mean k3 estimate of KL(old || new)"),
                ("troll", "trust_region/kl_after_max", "max KL(proj || old)"),
                ("troll", "trust_region/kl_after_mean", "mean KL(proj || old)"),
            ],
            "per-token KL",
        ),
        "active_frac.png": (
            [
                ("clip", "clip/active_frac", "share of tokens clipped"),
                ("troll", "trust_region/active_frac", "share of tokens projected"),
            ],
            "share of tokens",
        ),
    }
    paths = []
    for name, (series, ylabel) in panels.items():
        if main:
            plot_grid(main, series, ylabel, out / name, bound=name == "kl_after.png")
            paths.append(out / name)
    fair = [r for r in records if r.get("clip_low") is not None or r.get("steps")]
    if main or any(not is_main(r) and r not in fair for r in records):  # ablation, stress
        plot_ablation(records, out / "ablation.png")
        plot_learning_rates(records, out / "learning_rate.png")
        paths += [out / "ablation.png", out / "learning_rate.png"]
    if fair:
        plot_fair(records, out / "fair.png")
        paths.append(out / "fair.png")
    return paths


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (linear interpolation, like ``torch.quantile``)."""
    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), q))


@torch.no_grad()
def support_sizes(
    model: str = "tinymath", num_prompts: int = 256, mass_delta: float = 1e-5, seed: int = 0
) -> dict:
    """How many tokens ``sparsify`` keeps to cover ``1 - mass_delta`` of the policy's mass, at
    every response token of TinyMath rollouts sampled with ``configs/tinymath.yaml``'s settings
    (no cap on the count: ``max_tokens`` is the vocabulary size)."""
    from lightning_troll.models import load_policy, load_tokenizer
    from lightning_troll.rollout import SamplingConfig, response_logits, sample
    from lightning_troll.sparse import sparsify
    from lightning_troll.tinymath import generate_problems

    config = base_config()["model"]
    sampling = SamplingConfig(**config["sampling"])
    torch.manual_seed(seed)
    policy, tokenizer = load_policy(model), load_tokenizer(model)
    prompts = [row["prompt"] for row in generate_problems(num_prompts, seed, "train")]
    ids = tokenizer(prompts)["input_ids"]
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    input_ids, attention, response_mask, _ = sample(
        policy, ids, config["group_size"], sampling, pad, eos
    )
    logits = response_logits(
        policy, input_ids, attention, response_mask.shape[1], sampling.temperature
    )  # (B, T, V)
    rows = logits[response_mask]  # (N, V)
    sizes = sparsify(rows, max_tokens=rows.shape[-1], mass_delta=mass_delta).sizes.tolist()
    return {
        "model": model,
        "mass_delta": mass_delta,
        "vocab_size": rows.shape[-1],
        "tokens": len(sizes),
        "mean": statistics.fmean(sizes),
        "median": quantile(sizes, 0.5),
        "p90": quantile(sizes, 0.9),
        "max": max(sizes),
        # share of tokens whose support the ablation's caps K cut short
        **{f"share_above_{k}": sum(s > k for s in sizes) / len(sizes) for k in ABLATION_K},
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; ``--quick`` replaces the defaults it names."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("study"), help="output directory")
    p.add_argument("--estimators", nargs="+", default=list(ESTIMATORS), help="presets to run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rollouts", type=int, default=None, help="rollouts per run (default 100)")
    p.add_argument("--batch-size", type=int, default=Budget.batch_size, help="prompts/rollout")
    p.add_argument("--val-every", type=int, default=None, help="rollouts between validations")
    p.add_argument("--num-val", type=int, default=Budget.num_val, help="held-out prompts")
    p.add_argument("--num-train", type=int, default=Budget.num_train, help="training prompts")
    p.add_argument(
        "--minibatches", type=int, default=Budget.minibatches, help="optimiser steps per rollout"
    )
    p.add_argument("--threshold", type=float, default=0.55, help="accuracy for 'rollouts to reach'")
    p.add_argument(
        "--ablation",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the K/eps ablation and the learning-rate stress test (default: on; off with --quick)",
    )
    p.add_argument(
        "--fair",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"GSPO + clip at GSPO's clip range {GSPO_CLIP[0]:g}/{GSPO_CLIP[1]:g} and GRPO at "
        f"{STRESS_STEPS} steps per rollout, over --seeds (default: on; off with --quick)",
    )
    p.add_argument(
        "--main",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the estimator x objective x seed grid (--no-main: only --ablation and --fair)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="GRPO only, 30 rollouts, no ablation, stress test or fair baselines",
    )
    p.add_argument("--support-only", action="store_true", help="only the support-size report")
    p.add_argument("--support-prompts", type=int, default=256, help="prompts (x group size)")
    p.add_argument("--model", default="tinymath", help="warm start (name or directory)")
    args = p.parse_args(argv)
    if args.quick:
        args.estimators = ["grpo"] if args.estimators == list(ESTIMATORS) else args.estimators
        args.rollouts = args.rollouts or 30
        args.val_every = args.val_every or 5
        args.ablation = bool(args.ablation)
        args.fair = bool(args.fair)
    args.rollouts = args.rollouts or Budget.rollouts
    args.val_every = args.val_every or Budget.val_every
    args.ablation = True if args.ablation is None else args.ablation
    args.fair = True if args.fair is None else args.fair
    if not 0 <= args.threshold <= 1:
        p.error(f"--threshold must be in [0, 1]; got {args.threshold}")
    return args


def main(argv: Sequence[str] | None = None) -> list[dict]:
    """Runs the study; returns the run records."""
    args = parse_args(argv)
    budget = Budget(
        args.rollouts,
        args.batch_size,
        args.val_every,
        args.num_val,
        args.num_train,
        args.minibatches,
    )
    specs = grid(args.estimators, args.seeds, args.ablation, args.fair, args.main)
    if not specs:
        sys.exit("no runs: --no-main without --ablation or --fair leaves the grid empty")
    args.out.mkdir(parents=True, exist_ok=True)
    support = support_sizes(args.model, args.support_prompts)
    (args.out / "support.json").write_text(json.dumps(support, indent=1))
    print("sparse support for 1 - delta:", json.dumps(support))
    if args.support_only:
        return []
    records = run_all(specs, budget, args.model, args.out)
    rows = summarise(records, args.threshold)
    write_metrics_csv(records, args.out / "metrics.csv")
    results = [
        {k: v for k, v in r.items() if k != "history"}
        | {"rollouts_to_threshold": rollouts_to_threshold(r["history"], args.threshold)}
        for r in records
    ]
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    table = format_table(rows, args.threshold, budget.minibatches)
    (args.out / "table.md").write_text(table)
    write_plots(records, args.out)
    print(table)
    return records


if __name__ == "__main__":
    main()
