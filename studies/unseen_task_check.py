"""The paper-regime study's conclusion checked on a task of one's own, at the library's defaults.

    python studies/unseen_task_check.py --make-task /tmp/largest   # a task the study never saw
    python studies/unseen_task_check.py --task /tmp/largest --estimate
    nohup python studies/unseen_task_check.py --task /tmp/largest > check.log 2>&1 &
    python studies/unseen_task_check.py --task /tmp/largest --report

``--task`` is any folder laid out as ``examples/own_task/`` is (docs/own-task.md): a config
(``--config``, default ``task.yaml``) that names the data, the held-out rows and the reward, with
paths relative to the folder, where the runs start. Every run trains TROLL or clipping on that
task in the study's fixed regime (``studies/paper_regime_study.py``): GRPO with 8 completions a
prompt, sampling temperature 1.0, token-mean aggregation, 8 optimiser steps per rollout and a
constant learning rate (``--lr``, the study's choice for both objectives), validated every 5
rollouts. Everything else is the task's config or the library's default: TROLL's projection
at its defaults (``support: official``, ``max_tokens`` 256, eps 0.05, alpha 1), clipping at 0.2.

``--make-task`` writes a task the study never trained on: which of three two-digit numbers is the
largest (or the smallest), in SmolLM2's chat template, with a reward of its own (``reward.py``:
1 when the reply's last number is the answer). Asked for the largest, SmolLM2-135M-Instruct
answered 12 of 48 greedily before training (32 tokens).

The runs go one after another, resumable (:mod:`study_kit`), into ``--out`` (default
``<task>/check``): ``results.json``, ``metrics.csv``, ``table.md`` and the plots, in the study's
format (the same table and columns).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paper_regime_study as paper  # noqa: E402
import study_kit  # noqa: E402
from paper_regime_tables import ACCURACY, compare_arms  # noqa: E402
from study_kit import Grid, Run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct"

TASK_CONFIG = """\
# Which of three numbers is the largest (or the smallest): a task of its own, written by
# studies/unseen_task_check.py --make-task. From this folder:
#   lightning-troll fit --config task.yaml --model.model <a model folder>
seed_everything: 0
trainer:
  accelerator: cpu
  max_steps: 240             # optimiser steps: 8 per rollout, so 30 rollouts
  val_check_interval: 5
  check_val_every_n_epoch: null
model:
  model: HuggingFaceTB/SmolLM2-135M-Instruct
  group_size: 8
  sampling: {{max_new_tokens: {tokens}}}
  rewards: {{reward:answer_is_last_number: 1.0}}
  optimization: {{minibatch_size: 8}}
  optimizer:
    class_path: torch.optim.AdamW
    init_args: {{lr: 3.0e-6, weight_decay: 0.0}}
  lr_scheduler: null
data:
  source: data/train.jsonl
  val_file: data/val.jsonl
  num_val: null
  prompt_field: question
  template: "{{question}} Answer with only the number."
  chat_template: true
  batch_size: 8
  val_batch_size: 64
  max_prompt_tokens: 64
"""

TASK_REWARD = '''"""The reward of the task: 1.0 when the reply's last number is the answer, else 0.0."""

import re


def answer_is_last_number(prompt: str, completion: str, row: dict) -> float:
    numbers = re.findall(r"-?\\d+", completion)
    return float(bool(numbers) and numbers[-1] == row["answer"])
'''


def extreme_of_three(rng: random.Random) -> dict:
    """A row: which of three distinct two-digit numbers is the largest (or the smallest)."""
    a, b, c = rng.sample(range(10, 100), 3)
    largest = rng.random() < 0.5
    word, answer = ("largest", max(a, b, c)) if largest else ("smallest", min(a, b, c))
    return {"question": f"Which is the {word} of {a}, {b} and {c}?", "answer": str(answer)}


def make_task(folder: Path, train: int = 2000, val: int = 128, tokens: int = 32) -> Path:
    """Writes the task into ``folder`` (data, reward and ``task.yaml``); refuses one that exists."""
    if folder.exists() and any(folder.iterdir()):
        raise SystemExit(f"--make-task: {folder} exists and is not empty; name a new folder")
    rng = random.Random(0)
    rows = [extreme_of_three(rng) for _ in range(train + val)]
    (folder / "data").mkdir(parents=True)
    for name, part in (("train", rows[:train]), ("val", rows[train:])):
        text = "".join(json.dumps(r) + "\n" for r in part)
        (folder / "data" / f"{name}.jsonl").write_text(text)
    (folder / "reward.py").write_text(TASK_REWARD)
    (folder / "task.yaml").write_text(TASK_CONFIG.format(tokens=tokens))
    return folder


def check_runs(args: argparse.Namespace) -> list[Run]:
    """Clipping and TROLL on each seed, in the study's regime, at the library's defaults."""
    runs = []
    for seed in args.seeds:
        for objective in paper.OBJECTIVES:
            run_args = (
                "--config", str(args.task / args.config),
                "--model.model", str(args.model),
                "--seed_everything", str(seed),
                "--model.objective", objective,
                "--model.optimizer.init_args.lr", repr(args.lr),
                *paper.regime_args(args.prompts),
                *args.extra,
            )  # fmt: skip
            fields = {"objective": objective, "lr": args.lr, "seed": seed}
            runs.append(
                Run(
                    f"{objective}-s{seed}",
                    run_args,
                    args.rollouts * paper.STEPS,
                    args.rollouts,
                    fields,
                )
            )
    return runs


def grid(args: argparse.Namespace) -> Grid:
    def start() -> dict:
        return study_kit.validate(check_runs(args)[0], ACCURACY)

    settings = {"task": str(args.task), "config": args.config, "model": str(args.model),
                "prompts": args.prompts, "lr": args.lr, "extra": list(args.extra)}  # fmt: skip
    return Grid(args.out, settings, paper.METRICS, start)


def report(args: argparse.Namespace) -> None:
    records = grid(args).finished(check_runs(args))
    if not records:
        print("no run has finished yet")
        return
    compare_arms(records, args.lr, args.out)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--make-task", type=Path, metavar="FOLDER", help="write the task, then stop")
    p.add_argument("--task", type=Path, help="the task's folder (runs start there)")
    p.add_argument("--config", default="task.yaml", help="the task's config, in its folder")
    p.add_argument("--model", type=Path, default=SMOLLM2, help="the model folder to train")
    p.add_argument("--out", type=Path, help="results (default: <task>/check)")
    p.add_argument("--lr", type=float, default=3e-6, help="both objectives' constant lr")
    p.add_argument("--prompts", type=int, default=8, help="prompts per rollout (x 8 samples)")
    p.add_argument("--rollouts", type=int, default=30, help="rollouts per run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--estimate", action="store_true", help="print the hours and stop")
    p.add_argument("--report", action="store_true", help="the table and plots of finished runs")
    p.add_argument("extra", nargs="*", help="more fit options, after --, for every run")
    args = p.parse_args(argv)
    if args.make_task is None and args.task is None:
        p.error("name --task FOLDER (a task laid out as examples/own_task/) or --make-task FOLDER")
    if args.task is not None:
        args.task = args.task.resolve()
        if not (args.task / args.config).is_file():
            p.error(
                f"--task {args.task}: no {args.config} there (--config names the task's config)"
            )
    for name in ("prompts", "rollouts"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1; got {getattr(args, name)}")
    args.model = args.model.resolve() if args.model.exists() else args.model
    args.out = (args.out or (args.task / "check" if args.task else Path("."))).resolve()
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.make_task is not None:
        print(f"wrote the task into {make_task(args.make_task)}")
        if args.task is None:
            return
    if args.report:
        return report(args)
    g, runs = grid(args), check_runs(args)
    if args.estimate:
        total, left = g.estimate(runs)
        print(f"{len(runs)} runs, about {total:.1f} h in all, {left:.1f} h left")
        return None
    here = os.getcwd()
    os.chdir(args.task)  # the task's relative paths (data, reward module) are its folder's
    try:
        with study_kit.resumable():
            g.run_all(runs)
    finally:  # whatever ends the runs (a refusal too), the caller's folder is back
        os.chdir(here)
    report(args)
    return None


if __name__ == "__main__":
    main()
