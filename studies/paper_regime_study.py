"""TROLL against clipping on SmolLM2-135M-Instruct in the paper's regime: an lr pilot, then seeds.

    python studies/paper_regime_study.py --estimate    # the grid's hours, then stop
    nohup python studies/paper_regime_study.py > paper.log 2>&1 &   # the study (many hours)
    python studies/paper_regime_study.py --report      # tables and plots of the runs so far
    python studies/paper_regime_study.py --dry-run --out /tmp/dry   # the machinery on TinyMath

Every run is ``configs/smollm2.yaml`` (small-number arithmetic in the chat template, the
``last_number`` reward, GRPO) in the settings of the paper's official code, as far as a 2-core
CPU allows: sampling temperature 1.0, token-mean aggregation, 8 optimiser steps per rollout
(``--prompts`` x 8 completions split into 8 minibatches), TROLL at eps 0.05, alpha 1, K 64,
delta 1e-5 on the paper's support (``support: official``), clipping at 0.2, AdamW at a constant
learning rate, and seeds that vary the prompts and their order as well as the sampling
(``data.seed`` follows ``seed_everything``). The paper trains 256 sequences per optimiser step for
about 1,000 rollouts; this study trains ``--prompts`` x 8 / 8 per step for ``--rollouts``.

1. **The lr pilot**: each objective at each of ``--pilot-lrs`` for ``--pilot-rollouts`` rollouts
   on seed 0, trained on the training file without ``--holdout`` rows (drawn once with seed 0)
   and validated on those rows, never on the validation set. Each pilot's held-out accuracy
   (the mean of its last 2 validations) is reported beside the share of tokens its constraint
   acts on (TROLL: projected, eta* > 0; clipping: clipped). An objective's lr is its best pilot
   among those whose constraint acts on at least ``ACTIVE_MIN`` of the tokens (else a comparison
   measures nothing: both are the plain policy gradient).
2. **The cause tests**: one change at a time to the pilots at ``--cause-lr`` (1e-5, where
   TROLL's entropy collapsed), on their data, seed and budget: one optimiser step per rollout,
   TROLL's exact projection (``support: dense``), and the control (:data:`CAUSES`).
3. **The main grid**: both objectives at their own lr on ``--seeds``, then TROLL with
   ``support: dense`` (the exact projection; a copied snapshot) at TROLL's lr on
   ``--dense-seeds``; validated on all 115 held-out problems every 5 rollouts (``--objectives``
   runs a part, so that two processes share the grid).

Each run logs per rollout (CSV): reward, held-out accuracy, entropy, completion length, the KL of
the weights at the rollout's end to the behaviour policy (both objectives: clipping's drift beside
TROLL's bound), the share of tokens the constraint acts on, and wall time. The runs go one after
another, in-process, on :mod:`study_kit`'s machinery (resume, records, estimate); ``--out``
(default ``studies/results/smollm2/paper_regime``) holds ``pilot/``, ``causes/`` and ``main/``,
each with ``results.json``, ``metrics.csv`` and ``table.md``, and the plots. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import study_kit  # noqa: E402
from paper_regime_tables import (  # noqa: E402
    ACCURACY,
    REWARD,
    active_share,
    cause_table,
    compare_arms,
    pilot_score,
    pilot_table,
)
from study_kit import Grid, Run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OBJECTIVES = ("clip", "troll")
GROUP = 8
STEPS = 8
VAL_EVERY = 5
ACTIVE_MIN = 1e-3
"""The least mean share of tokens an objective's constraint must act on for its pilot lr to be
chosen."""
DENSE = ("--model.trust_region.support", "dense", "--model.snapshot.mode", "copy")
METRICS = (
    ACCURACY,
    REWARD,
    "entropy",
    "completion/mean_length",
    "trust_region/kl_end_mean",
    "trust_region/kl_end_max",
    "trust_region/kl_end_sampled",
    "trust_region/kl_after_max",
    "trust_region/active_frac",
    "trust_region/infeasible_frac",
    "clip/active_frac",
    "time/rollout",
    study_kit.TIME,
    "reward/frac_zero_std",
    "completion/truncated_frac",
    "trust_region/",
    "clip/",
    "sparsity/",
)
"""The metrics every run keeps per rollout; a name ending in ``/`` keeps every metric under it,
so that no figure the monitors log is dropped (the constraint bins among them)."""


def regime_args(prompts: int) -> list[str]:
    """The paper's training regime as far as this study keeps it: temperature 1.0, token-mean,
    ``prompts`` x :data:`GROUP` sequences in :data:`STEPS` optimiser steps, a constant lr, and the
    logging every run of the study (and ``unseen_task_check``) keeps."""
    return [
        "--model.sampling.temperature", "1.0",
        "--model.loss.aggregation", "token_mean",
        "--model.lr_scheduler", "null",
        "--model.optimization.minibatch_size", str(prompts * GROUP // STEPS),
        "--model.group_size", str(GROUP),
        "--data.batch_size", str(prompts),
        "--trainer.val_check_interval", str(VAL_EVERY),
        "--trainer.check_val_every_n_epoch", "null",
        "--trust_region_monitor.kl_end", "true",
        "--trust_region_monitor.histogram_every_n_rollouts", "0",
        "--rollout.log_samples", "0",
    ]  # fmt: skip


def common_args(args: argparse.Namespace) -> list[str]:
    """What every run shares: the config, the paper's regime and TROLL's settings, the logging."""
    config = "tinymath.yaml" if args.dry_run else "smollm2.yaml"
    common = [
        "--config", str(ROOT / "configs" / config),
        *regime_args(args.prompts),
        "--model.trust_region.eps", "0.05",
        "--model.trust_region.alpha", "1.0",
        "--model.trust_region.max_tokens", "64",
        "--model.trust_region.mass_delta", "1e-5",
        "--model.trust_region.support", "official",
        "--model.clip.eps_low", "0.2",
    ]  # fmt: skip
    if args.dry_run:
        common += ["--data.num_train", "64", "--data.num_val", "16", "--data.val_batch_size", "16"]
    return common


def run(args, name: str, objective: str, lr: float, seed: int, rollouts: int, extra=(), **more):
    """A run of ``objective`` at ``lr`` on ``seed`` (``extra``: more command-line arguments;
    ``more``: fields of its record, ``steps`` the optimiser steps per rollout if ``extra`` sets
    them other than :data:`STEPS`)."""
    run_args = (
        *common_args(args),
        "--seed_everything", str(seed),
        "--model.objective", objective,
        "--model.optimizer.init_args.lr", repr(lr),
        *extra,
    )  # fmt: skip
    fields = {"objective": objective, "lr": lr, "seed": seed, **more}
    return Run(name, run_args, rollouts * more.get("steps", STEPS), rollouts, fields)


def pilot_files(args) -> tuple[Path, Path]:
    """The pilot's training and held-out files: ``--holdout`` rows of the training file drawn
    once with seed 0 (written into ``<out>/pilot``, kept if present)."""
    folder = args.out / "pilot"
    train, holdout = folder / "train.jsonl", folder / "holdout.jsonl"
    if not (train.exists() and holdout.exists()):
        source = ROOT / "examples" / "data" / "arithmetic" / "train.jsonl"
        if args.dry_run:
            from lightning_troll.models.tinymath import generate_problems

            rows = [json.dumps(p) for p in generate_problems(80, seed=0)]
        else:
            rows = source.read_text().splitlines()
        held = set(random.Random(0).sample(range(len(rows)), args.holdout))
        folder.mkdir(parents=True, exist_ok=True)
        study_kit.write_atomic(
            train, "\n".join(r for i, r in enumerate(rows) if i not in held) + "\n"
        )
        study_kit.write_atomic(
            holdout, "\n".join(r for i, r in enumerate(rows) if i in held) + "\n"
        )
    return train, holdout


def pilot_data(args) -> tuple[str, ...]:
    """Arguments that train on the pilot's training rows and validate on its held-out ones."""
    train, holdout = pilot_files(args)
    return "--data.source", str(train), "--data.val_file", str(holdout), "--data.num_val", "null"


def pilot_runs(args) -> list[Run]:
    data = pilot_data(args)
    return [
        run(args, f"pilot-{o}-lr{lr:g}", o, lr, 0, args.pilot_rollouts, data)
        for lr in args.pilot_lrs
        for o in OBJECTIVES
    ]


CAUSES = {
    "steps1": ("one optimiser step per rollout", OBJECTIVES),
    "dense": ("the exact projection (support: dense)", ("troll",)),
    "control": ("nothing: the pilots again, sampled as the other cause tests are", OBJECTIVES),
}
"""One change each to the pilots at ``--cause-lr``, testing a candidate cause of TROLL's entropy
collapse there, and the control: the pilots' settings, sampled as the other tests are (the pilots
drew theirs with an earlier decoding loop)."""


def cause_runs(args) -> list[Run]:
    """Each of :data:`CAUSES` on the pilot's data and seed, at ``--cause-lr``."""
    data, lr, runs = pilot_data(args), args.cause_lr, []
    one_step = ("--model.optimization.minibatch_size", str(args.prompts * GROUP))
    changes = {"steps1": (one_step, {"steps": 1}), "dense": (DENSE, {}), "control": ((), {})}
    for cause, (_, objectives) in CAUSES.items():
        extra, steps = changes[cause]
        runs += [
            run(args, f"cause-{cause}-{o}-lr{lr:g}", o, lr, 0, args.pilot_rollouts,
                (*data, *extra), cause=cause, **steps)
            for o in objectives
        ]  # fmt: skip
    return runs


def choose_lrs(pilots: Sequence[dict]) -> dict[str, float]:
    """Per objective, the lr of its best pilot among those whose constraint acts."""
    chosen = {}
    for objective in OBJECTIVES:
        mine = [r for r in pilots if r["fields"]["objective"] == objective]
        acting = [r for r in mine if active_share(r) >= ACTIVE_MIN] or mine
        if acting:
            chosen[objective] = max(acting, key=pilot_score)["fields"]["lr"]
    return chosen


def main_runs(args, lrs: dict[str, float]) -> list[Run]:
    runs = [
        run(args, f"{o}-lr{lrs[o]:g}-s{s}", o, lrs[o], s, args.rollouts)
        for s in args.seeds
        for o in OBJECTIVES
        if o in args.objectives
    ]
    return runs + [
        run(args, f"troll-dense-lr{lrs['troll']:g}-s{s}", "troll", lrs["troll"], s,
            args.rollouts, DENSE, support="dense")
        for s in args.dense_seeds
        if "troll" in args.objectives
    ]  # fmt: skip


def grid(args, phase: str) -> Grid:
    def start() -> dict:
        mains = main_runs(args, {"clip": 1e-6, "troll": 1e-6}) if phase == "main" else []
        base = mains[0] if mains else pilot_runs(args)[0]
        done = study_kit.cli(["validate", *base.args])
        return {"rollout": 0, ACCURACY: float(done.trainer.callback_metrics[ACCURACY])}

    settings = {"phase": phase, "prompts": args.prompts, "dry_run": args.dry_run}
    return Grid(args.out / phase, settings, METRICS, start, args.prior_seconds)


# -- report ---------------------------------------------------------------------------------


def report(args) -> None:
    pilots = grid(args, "pilot").finished(pilot_runs(args))
    if pilots:
        text = pilot_table(pilots)
        study_kit.write_atomic(args.out / "pilot" / "table.md", text)
        print("lr pilot (held-out split of the training file):\n" + text)
    if len(pilots) < len(pilot_runs(args)):
        print(f"{len(pilots)} of {len(pilot_runs(args))} pilots finished")
        return
    causes = grid(args, "causes").finished(cause_runs(args))
    if causes:
        text = cause_table(causes, pilots, args.cause_lr, STEPS)
        study_kit.write_atomic(args.out / "causes" / "table.md", text)
        print(f"cause tests at lr {args.cause_lr:g} (held-out split of the training file):\n{text}")
    lrs = choose_lrs(pilots)
    print(f"chosen learning rates: {lrs}")
    records = grid(args, "main").finished(main_runs(args, lrs))
    if not records:
        return
    common = lrs["troll"] if lrs.get("troll") == lrs.get("clip") else None  # pairs: one lr
    compare_arms(records, common, args.out / "main")


def add_objectives(p: argparse.ArgumentParser) -> None:
    """The option ``--objectives`` of every study: what one process trains, so that processes
    share a grid (each objective of a seed's pair in its own, side by side)."""
    p.add_argument("--objectives", nargs="+", choices=OBJECTIVES, default=list(OBJECTIVES),
                   help="the objectives to train; one process each shares the grid")  # fmt: skip


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "studies/results/smollm2/paper_regime")
    p.add_argument("--prompts", type=int, default=8, help="prompts per rollout (x 8 samples)")
    p.add_argument("--rollouts", type=int, default=60, help="rollouts per main run")
    p.add_argument("--pilot-rollouts", type=int, default=15)
    p.add_argument("--pilot-lrs", type=float, nargs="+", default=[1e-6, 3e-6, 1e-5])
    p.add_argument("--holdout", type=int, default=64, help="training rows the pilot holds out")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--dense-seeds", type=int, nargs="*", default=[0])
    add_objectives(p)
    p.add_argument("--prior-seconds", type=float, default=90.0, help="s / rollout, no run done")
    p.add_argument("--cause-lr", type=float, default=1e-5, help="the lr of the cause tests")
    p.add_argument("--phase", choices=("pilot", "causes", "main", "all"), default="all",
                   help="all: the pilot, the cause tests, then the main grid")  # fmt: skip
    p.add_argument("--estimate", action="store_true", help="print the grid's hours and stop")
    p.add_argument("--report", action="store_true", help="tables and plots of finished runs")
    p.add_argument("--dry-run", action="store_true", help="TinyMath, tiny budgets: seconds")
    args = p.parse_args(argv)
    if args.prompts * GROUP % STEPS:
        p.error(f"--prompts x {GROUP} must split into {STEPS} minibatches; got {args.prompts}")
    study_kit.check_dry_run_out(p, args)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.report:
        return report(args)
    pilot = grid(args, "pilot")
    pilots = pilot_runs(args)
    if args.estimate:
        total, left = pilot.estimate(pilots)
        main_count = len(main_runs(args, {o: 1e-6 for o in OBJECTIVES}))
        rate = total * 3600 / max(sum(r.rollouts for r in pilots), 1)
        main_hours = main_count * args.rollouts * rate / 3600
        causes = cause_runs(args)
        cause_hours = sum(r.rollouts for r in causes) * rate / 3600
        print(f"pilot: {len(pilots)} runs, {total:.1f} h ({left:.1f} h left); cause tests: "
              f"{len(causes)} runs, at most {cause_hours:.1f} h; main: {main_count} runs, about "
              f"{main_hours:.1f} h at {rate:.0f} s per rollout")  # fmt: skip
        return None
    with study_kit.resumable():
        if args.phase in ("pilot", "all"):
            pilot.run_all(pilots)
        if args.phase in ("causes", "all"):
            if len(pilot.finished(pilots)) < len(pilots):
                sys.exit("the cause tests change pilots: run --phase pilot first")
            grid(args, "causes").run_all(cause_runs(args))
        if args.phase in ("main", "all"):
            lrs = choose_lrs(pilot.finished(pilots))
            if len(lrs) < len(OBJECTIVES) or len(pilot.finished(pilots)) < len(pilots):
                sys.exit("the main grid needs every pilot finished: run --phase pilot first")
            print(f"chosen learning rates: {lrs}", flush=True)
            grid(args, "main").run_all(main_runs(args, lrs))
    report(args)


if __name__ == "__main__":
    main()
