"""TROLL against PPO-style clipping on TinyMath, across advantage estimators and seeds.

    python studies/tinymath_study.py --out study            # the full grid (about 95 minutes)
    python studies/tinymath_study.py --no-main --no-ablation --out fair   # the fair baselines only
    python studies/tinymath_study.py --quick --out quick    # GRPO only, fewer rollouts
    python studies/tinymath_study.py --support-only         # the sparse support sizes only
    python studies/tinymath_study.py --no-main --no-ablation --out fair --report   # tables again

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
--no-ablation`` runs only those.

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

The runs go one after another, in-process, on :mod:`study_kit`'s machinery: each keeps
``runs/<name>/`` (its CSV log, a checkpoint every 5 rollouts, ``result.json`` when it finishes);
running the same command again skips finished runs and resumes an interrupted one (Ctrl-C or
SIGTERM: exit status 130 or 143). Outputs in ``--out``: ``runs/``, ``settings.json``,
``start.json``, ``metrics.csv`` (one row per run and rollout), ``results.json`` (per run: fields,
final held-out accuracy, rollouts to the threshold, seconds; these two hold every finished run
without ``runs/``), ``table.md``, ``support.json`` and the plots of :mod:`tinymath_report`.
``--report`` writes the table and plots of the runs finished so far and trains nothing. Outputs of
the study before :mod:`study_kit` (fields beside each run's name) are read as they are. Needs
matplotlib (``pip install lightning-troll[study]``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import study_kit  # noqa: E402
from study_kit import Grid, Run  # noqa: E402
from tinymath_report import (  # noqa: E402
    ACCURACY,
    GSPO_CLIP,
    OBJECTIVES,
    STRESS_STEPS,
    base_config,
    final_accuracy,
    format_table,
    rollouts_to_threshold,
    summarise,
    write_plots,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
ESTIMATORS = {
    "grpo": "grpo.yaml",
    "dr_grpo": "dr_grpo.yaml",
    "gspo": "gspo.yaml",
    "reinforce_pp": "reinforce_pp.yaml",
}
ABLATION_K = (4, 16, 64)
ABLATION_EPS = (0.01, 0.05, 0.25)
STRESS_LR = (3e-4, 1e-3)
"""Learning rates of the stress test (``configs/tinymath.yaml`` trains at 1e-4)."""
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
    """One training run of the grid (its fields in the records)."""

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


FIELDS = tuple(f.name for f in fields(RunSpec))
"""A run's fields, which records before :mod:`study_kit` kept beside its name."""


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


def make_run(spec: RunSpec, budget: Budget, model: str) -> Run:
    """The grid's run of ``spec``: its ``lightning-troll fit`` arguments (the grid adds the
    logger, the checkpoints and ``trainer.max_steps``) and its fields."""
    group = base_config()["model"]["group_size"]
    steps = spec.steps or budget.minibatches
    if (budget.batch_size * group) % steps:
        raise ValueError(
            f"{spec.name}: {steps} steps per rollout do not divide the rollout's "
            f"{budget.batch_size * group} sequences; change --batch-size"
        )
    args = [
        "--config", str(CONFIGS / "tinymath.yaml"),
        "--config", str(CONFIGS / ESTIMATORS[spec.estimator]),
        "--seed_everything", str(spec.seed),
        "--model.model", model,
        "--model.objective", spec.objective,
        "--model.trust_region.max_tokens", str(spec.max_tokens),
        "--model.trust_region.eps", str(spec.eps),
        "--model.optimization.minibatch_size", str(budget.batch_size * group // steps),
        "--trainer.val_check_interval", str(budget.val_every),
        "--data.batch_size", str(budget.batch_size),
        "--data.num_train", str(budget.num_train),
        "--data.num_val", str(budget.num_val),
        "--data.val_batch_size", str(budget.num_val),
    ]  # fmt: skip
    if spec.lr is not None:
        args += ["--model.optimizer.init_args.lr", str(spec.lr)]
    if spec.clip_low is not None:
        args += ["--model.clip.eps_low", str(spec.clip_low)]
    if spec.clip_high is not None:
        args += ["--model.clip.eps_high", str(spec.clip_high)]
    return Run(spec.name, tuple(args), steps * budget.rollouts, budget.rollouts, asdict(spec))


def study_grid(budget: Budget, model: str, out: Path, threshold: float) -> Grid:
    """The grid in ``out``: settings, kept metrics, the warm start's validation (rollout 0), and
    per finished run its final accuracy and rollouts to ``threshold`` (in ``results.json``)."""

    def start() -> dict:
        return study_kit.validate(make_run(RunSpec("grpo", "troll", 0), budget, model), ACCURACY)

    def headline(history: list[dict]) -> dict:
        return {
            "final_accuracy": final_accuracy(history),
            "rollouts_to_threshold": rollouts_to_threshold(history, threshold),
        }

    settings = {"model": model, "budget": asdict(budget)}
    prior = 1.3  # seconds per rollout of the default budget on a quiet 2-core CPU
    return Grid(out, settings, METRICS, start, prior, legacy_fields=FIELDS, figures=headline)


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
    from lightning_troll.engines.sampling import SamplingConfig, sample
    from lightning_troll.models import load_policy, load_tokenizer
    from lightning_troll.models.tinymath import generate_problems
    from lightning_troll.rollouts.rollout import response_logits
    from lightning_troll.trust_region.sparse import sparsify

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
    p.add_argument("--report", action="store_true", help="tables and plots of finished runs")
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
    """Runs (or resumes) the study; returns the run records."""
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
    runs = [make_run(spec, budget, args.model) for spec in specs]
    study = study_grid(budget, args.model, args.out, args.threshold)
    if args.report:
        records = study.finished(runs)
        if not records:
            sys.exit(f"--report: no finished run in {args.out} (results.json with metrics.csv)")
        print(f"{len(records)} of {len(runs)} runs finished", flush=True)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        support = support_sizes(args.model, args.support_prompts)
        study_kit.write_atomic(args.out / "support.json", json.dumps(support, indent=1))
        print("sparse support for 1 - delta:", json.dumps(support))
        if args.support_only:
            return []
        with study_kit.resumable():
            records = study.run_all(runs)
    table = format_table(summarise(records, args.threshold), args.threshold, budget.minibatches)
    study_kit.write_atomic(args.out / "table.md", table)
    write_plots(records, args.out)
    print(table)
    return records


if __name__ == "__main__":
    main()
