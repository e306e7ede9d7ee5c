"""TROLL against PPO-style clipping with GRPO on SmolLM2-135M-Instruct, over seeds.

    python studies/smollm2_study.py                        # the grid (hours; make smollm2 first)
    nohup python studies/smollm2_study.py > study.log 2>&1 &   # the same, in the background
    python studies/smollm2_study.py --estimate             # how long the grid takes, then stop
    python studies/smollm2_study.py --report               # outputs of the runs finished so far
    python studies/smollm2_study.py --dry-run --out /tmp/dry   # the machinery on TinyMath

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

Per rollout each run keeps ``METRICS``: reward, held-out accuracy, the KL of the weights after
the rollout's last optimiser step to the behaviour policy for both objectives
(``trust_region/kl_end_{mean,max}`` between the sparse supports, ``trust_region/kl_end_sampled``
an unbiased estimate over the whole vocabulary; ``trust_region_monitor.kl_end``), TROLL's KL
after projection, projected and infeasible shares, clip's k3 estimate and clipped share, entropy,
completion length and ``time/iteration`` (sampling and optimiser steps of the rollout).

The runs go one after another, in-process, on :mod:`study_kit`'s machinery: a checkpoint every
``--checkpoint-every`` rollouts and on Ctrl-C or SIGTERM (exit status 130 or 143), the same
command resumes; a finished run's checkpoint is deleted (``--keep-checkpoints`` keeps it);
``results.json`` and ``metrics.csv`` (with ``settings.json`` and ``start.json``) hold every
finished run without ``runs/``. The study prints an estimate of the grid's time before the first
run (from the runs done, else ``--prior-seconds`` per rollout) and how long it took at the end.

Outputs in ``--out`` (default ``studies/results/smollm2/study``): ``runs/``, ``settings.json``,
``start.json`` (the start's validation), ``metrics.csv`` (a row per run and rollout),
``results.json`` (per run: fields, final and late accuracy, seconds), ``table.md`` (per cell and
arm, mean and spread over seeds), ``runs.md`` (per run, then the seeds' means) and the plots
``reward.png``, ``accuracy.png``, ``kl_end.png``, ``kl_end_max.png``, ``entropy.png`` and
``time.png`` (a panel per cell, the arms' mean and standard deviation over seeds). Outputs of
the study before :mod:`study_kit` (fields beside each run's name) are read as they are.

``--dry-run`` runs the same machinery on ``configs/tinymath.yaml`` with the shipped TinyMath
policy (or ``--model``), 3 rollouts of 2 prompts, seconds per run; its output is no evidence of
anything. Needs matplotlib (``pip install lightning-troll[study]``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import study_kit  # noqa: E402
from smollm2_report import (  # noqa: E402
    ACCURACY,
    KL_END,
    KL_END_MAX,
    KL_SAMPLED,
    LATE,
    LENGTH,
    REWARD,
    final_accuracy,
    format_runs,
    format_table,
    grid_time,
    summarise,
    write_plots,
)
from study_kit import TIME, Grid, Run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
OBJECTIVES = ("clip", "troll")
STRESS = ("steps", "lr", "none")
STRESS_LR_FACTOR = 3.0
TROLL_EPS = (0.2,)
"""TROLL's bound in the looser-region cell: at or above the KL that clip 0.2 lets a token of
probability up to 0.95 reach (studies/results.md, "Why TROLL loses here")."""
TROLL_ALPHA = (0.0,)
"""TROLL's regression weight in the no-pull cell: the policy is not drawn toward the projection
(studies/results.md, "Why TROLL loses here")."""
METRICS = (
    ACCURACY,
    REWARD,
    "entropy",
    LENGTH,
    KL_END,
    KL_END_MAX,
    KL_SAMPLED,
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
"""Seconds per rollout, validation included, before any run has been timed: the
``configs/smollm2.yaml`` run took 58 s per rollout on the project's 2-core CPU under load."""


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
    """One training run of the grid (its fields in the records)."""

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


FIELDS = tuple(f.name for f in fields(RunSpec))
"""A run's fields, which records before :mod:`study_kit` kept beside its name."""


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
    seeds = list(dict.fromkeys(seeds))
    specs = [RunSpec(o, s, budget.steps) for s in seeds for o in OBJECTIVES]
    if stress == "steps":
        budget.minibatch(stress_steps)
        specs += [RunSpec(o, 0, stress_steps) for o in OBJECTIVES]
    elif stress == "lr":
        lr = float(
            f"{STRESS_LR_FACTOR * config_lr(budget):.6g}"
        )  # 3e-05, not 3.0000000000000004e-05
        specs += [RunSpec(o, 0, budget.steps, lr) for o in OBJECTIVES]
    for e in dict.fromkeys(troll_eps):
        specs += [RunSpec("troll", s, budget.steps, eps=float(e)) for s in seeds]
    for a in dict.fromkeys(troll_alpha):
        specs += [RunSpec("troll", s, budget.steps, alpha=float(a)) for s in seeds]
    return specs


def make_run(spec: RunSpec, budget: Budget, model: str | None) -> Run:
    """The grid's run of ``spec``: its ``lightning-troll fit`` arguments (the grid adds the
    logger, the checkpoints and ``trainer.max_steps``) and its fields."""
    args = [
        "--config", str(budget.config),
        "--seed_everything", str(spec.seed),
        "--model.objective", spec.objective,
        "--model.optimization.minibatch_size", str(budget.minibatch(spec.steps)),
        "--trainer.val_check_interval", str(budget.val_every),
        "--trainer.check_val_every_n_epoch", "null",
        "--trust_region_monitor.kl_end", "true",
        "--trust_region_monitor.histogram_every_n_rollouts", "0",
        "--rollout.log_samples", "0",
        "--data.batch_size", str(budget.prompts),
    ]  # fmt: skip
    if model is not None:
        args += ["--model.model", model]
    if budget.num_val is not None:
        args += ["--data.num_val", str(budget.num_val)]
        args += ["--data.val_batch_size", str(budget.num_val)]
    if budget.dry_run:
        args += ["--data.num_train", "64"]
    if spec.lr is not None:
        args += ["--model.optimizer.init_args.lr", str(spec.lr)]
    if spec.eps is not None:
        args += ["--model.trust_region.eps", str(spec.eps)]
    if spec.alpha is not None:
        args += ["--model.trust_region.alpha", str(spec.alpha)]
    return Run(spec.name, tuple(args), spec.steps * budget.rollouts, budget.rollouts, asdict(spec))


def headline(history: list[dict]) -> dict:
    """What ``results.json`` says of a finished run beside its fields."""
    return {
        "final_accuracy": final_accuracy(history),
        "late_accuracy": final_accuracy(history, LATE),
    }


def study_grid(budget: Budget, model: str | None, out: Path, prior: float = PRIOR_SECONDS) -> Grid:
    """The grid in ``out``: settings, kept metrics, the start's validation (rollout 0)."""

    def start() -> dict:
        first = make_run(RunSpec("troll", 0, budget.steps), budget, model)
        return study_kit.validate(first, ACCURACY)

    settings = {"model": model, "budget": asdict(budget)}
    return Grid(out, settings, METRICS, start, prior, budget.checkpoint_every, FIELDS, headline)


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
    p.add_argument("--report", action="store_true", help="tables and plots of finished runs")
    p.add_argument("--dry-run", action="store_true", help="TinyMath, 3 tiny rollouts per run")
    args = p.parse_args(argv)
    tiny = args.dry_run
    args.out = args.out or ROOT / "studies/results/smollm2" / ("dry_run" if tiny else "study")
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
        args.rollouts,
        args.steps,
        args.val_every,
        args.prompts,
        args.num_val,
        args.checkpoint_every,
        args.dry_run,
    )
    specs = grid(
        args.seeds, budget, args.stress, args.stress_steps, args.troll_eps, args.troll_alpha
    )
    runs = [make_run(spec, budget, args.model) for spec in specs]
    study = study_grid(budget, args.model, args.out, args.prior_seconds)
    if args.estimate:
        total, _ = study.estimate(runs)
        rate = total * 3600 / (len(runs) * budget.rollouts)
        print(f"{len(runs)} runs x {budget.rollouts} rollouts x {rate:.0f} s: {total:.1f} h")
        return []
    if args.report:
        records = study.finished(runs)
        if not records:
            sys.exit(f"--report: no finished run in {args.out} yet")
        print(f"{len(records)} of {len(runs)} runs finished", flush=True)
    else:
        with study_kit.resumable():
            records = study.run_all(runs, args.keep_checkpoints)
    start = study.kept("start.json")
    start_seconds = json.loads(start.read_text()).get("seconds", 0.0) if start.exists() else 0.0
    print(grid_time(records, start_seconds), flush=True)
    lr = config_lr(budget)
    table, runs_table = format_table(summarise(records), lr), format_runs(records)
    study_kit.write_atomic(args.out / "table.md", table)
    study_kit.write_atomic(args.out / "runs.md", runs_table)
    write_plots(records, args.out, lr)
    print(table)
    print(runs_table)
    return records


if __name__ == "__main__":
    main()
