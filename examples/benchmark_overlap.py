"""Sampling beside training: the iteration time of a stale-data run whose engine samples the next
rollout while the trainer trains, against the same run done in turn.

Both arms train SmolLM2-135M-Instruct with GRPO and TROLL at ``old_policy.max_staleness 1`` (the
next rollout sampled by the weights before this rollout's update, in both), on the iteration
benchmark's prompts (8 prompts x 8 completions, 32 new tokens, 4 optimiser steps per rollout):

- ``in turn``: the engine (``--engine``: ``hf`` or ``vllm``) in the trainer's process, torch on
  ``--threads`` threads;
- ``overlapped``: ``model.engine.options: {process: true, threads: t}``, the engine in a
  process of its own on ``t`` threads and the trainer on ``--threads - t``, so that the two
  arms use the same cores (:mod:`lightning_troll.engines.process`).

Each arm runs in a fresh process, the arms in turn, ``--repeats`` times; an arm's figure is the
median over its iterations after the first of every run (the first starts the engine's process
and loads its model). Prints a table and writes ``--json``, after every run with what has run so
far (``"complete": false``, each iteration's figures under ``rows``), so that a benchmark cut
short keeps its finished runs::

    python examples/benchmark_overlap.py --json examples/results/smollm2/overlap.json
    python examples/benchmark_overlap.py --tiny          # TinyMath, seconds, any machine
    python examples/benchmark_overlap.py --engine vllm   # vLLM (make setup-vllm)
    python examples/benchmark_overlap.py --accelerator cuda --max-new-tokens 256   # one GPU

On one GPU both processes share the device: the trainer's and the engine's kernels interleave, so
the overlap pays only as far as neither keeps the device busy on its own (the HF engine's decoding
is paced by the host at these shapes).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning_troll.training.module import EngineConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))

from iteration_workers import SMOLLM2  # noqa: E402

ARMS = ("in turn", "overlapped")
VLLM_KV_CACHE_GIB = 1.0
"""vLLM's KV cache: 64 sequences of SmolLM2 at these lengths need far less."""
PARTS = (
    "time/generation", "time/forward_passes", "time/training", "engine/process_wait_s",
    "engine/weight_push_s", "engine/process_prefetched",
)  # fmt: skip
"""What the run logs of an iteration: sampling (overlapped: the wait for the engine, and the
request when it was not sent ahead), the teacher-forced passes, the optimiser steps, the wait, the
weights sent, and whether the rollout was sampled ahead."""


def run_arm(spec: dict) -> list[float]:
    """One run of one arm (in this process): the wall time of each iteration, in seconds."""
    import torch
    from iteration_workers import INSTRUCTION, pick_rows
    from lightning.pytorch import Callback, Trainer

    from lightning_troll.callbacks import OldPolicyRefresh, RolloutGeneration
    from lightning_troll.engines.sampling import SamplingConfig
    from lightning_troll.tasks.data import PromptDataModule
    from lightning_troll.training.module import OptimizationConfig, TrollModule

    overlapped = spec["arm"] == "overlapped"
    torch.set_num_threads(
        spec["threads"] - spec["engine_threads"] if overlapped else spec["threads"]
    )
    torch.manual_seed(0)

    class Timer(Callback):
        """Each iteration's wall time, and the parts the run logged."""

        def __init__(self) -> None:
            self.rows: list[dict[str, float]] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            logged = trainer.callback_metrics
            row = {"total": time.perf_counter() - self.start}
            row |= {name: float(logged.get(name, 0.0)) for name in PARTS}
            self.rows.append(row)

    if spec["tiny"]:
        data = PromptDataModule(source="tinymath", batch_size=8, num_train=64, num_val=0)
        model, rewards = "tinymath", {"tinymath": 1.0}
    else:
        path = Path(tempfile.mkdtemp(prefix="overlap-")) / "prompts.jsonl"
        rows = pick_rows(8 * (spec["iterations"] + 1))  # one epoch: each rollout asked ahead
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        data = PromptDataModule(
            source=str(path), num_train=None, num_val=0, prompt_field="question",
            template="{question}" + INSTRUCTION, chat_template=True, tokenizer=spec["model"],
            batch_size=8,
        )  # fmt: skip
        model, rewards = spec["model"], {"last_number": 1.0}
    options = {"kv_cache_gib": VLLM_KV_CACHE_GIB} if spec["engine"] == "vllm" else {}
    if overlapped:
        options |= {"process": True, "threads": spec["engine_threads"]}
    module = TrollModule(
        model=model, objective="troll", group_size=8, rewards=rewards,
        sampling=SamplingConfig(temperature=1.0, max_new_tokens=spec["max_new_tokens"]),
        optimization=OptimizationConfig(epochs_per_rollout=spec["steps"]),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0),
        engine=EngineConfig(spec["engine"], options or None),
    )  # fmt: skip
    timer = Timer()
    trainer = Trainer(
        accelerator=spec["accelerator"], devices=1, max_steps=spec["iterations"] * spec["steps"],
        callbacks=[timer, RolloutGeneration(log_samples=0), OldPolicyRefresh(max_staleness=1)],
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    if not spec["tiny"]:
        shutil.rmtree(path.parent, ignore_errors=True)
    return timer.rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=SMOLLM2, help="a model folder")
    parser.add_argument("--tiny", action="store_true", help="TinyMath (a smoke run)")
    parser.add_argument("--iterations", type=int, default=6, help="per run; the first left out")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each arm, in turn")
    parser.add_argument("--steps", type=int, default=4, help="optimiser steps per rollout")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="cores both arms use")
    parser.add_argument("--engine-threads", type=int, default=1, help="the engine's, overlapped")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="the rollout engine")
    parser.add_argument(
        "--accelerator", choices=("cpu", "cuda"), default="cpu", help="where both arms run"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:  # one run of one arm, in a fresh process
        print(json.dumps(run_arm(json.loads(args.worker))))
        return {}
    if args.iterations < 2 or args.repeats < 1:
        parser.error("--iterations must be >= 2 (the first is left out) and --repeats >= 1")
    if not 1 <= args.engine_threads < args.threads:
        parser.error(f"--engine-threads must be in [1, --threads); got {args.engine_threads}")
    if not args.tiny and not args.model.is_dir():
        parser.error(f"--model {args.model}: no model folder there; run `make smollm2` first")
    rows: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    settings = {k: str(v) for k, v in vars(args).items() if k not in ("worker", "json")}
    for repeat in range(args.repeats):
        for arm in ARMS:
            spec = {"arm": arm, "tiny": args.tiny, "model": str(args.model),
                    "iterations": args.iterations, "steps": args.steps,
                    "max_new_tokens": args.max_new_tokens, "threads": args.threads,
                    "engine_threads": args.engine_threads,
                    "accelerator": args.accelerator, "engine": args.engine}  # fmt: skip
            done = subprocess.run(
                [sys.executable, __file__, "--worker", json.dumps(spec)],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(f"{arm}: the run failed:\n{done.stderr[-3000:]}")
            run = json.loads(done.stdout.strip().splitlines()[-1])
            rows[arm] += run[1:]
            totals = ", ".join(f"{r['total']:.2f}" for r in run)
            print(f"run {repeat + 1}, {arm}: {totals}", flush=True)
            if args.json:  # what has run so far, kept if the benchmark is cut short
                write_json(args.json, {"settings": settings, "rows": rows, "complete": False})
    times = {arm: [r["total"] for r in arm_rows] for arm, arm_rows in rows.items()}
    medians = {arm: statistics.median(t) for arm, t in times.items()}
    parts = {arm: {p: statistics.median(r[p] for r in rows[arm]) for p in PARTS} for arm in ARMS}
    ratio = medians["overlapped"] / medians["in turn"]
    print("\n| arm | iterations | median s | " + " | ".join(PARTS) + " |")
    print("| --- | ---: | ---: |" + " ---: |" * len(PARTS))
    for arm in ARMS:
        cells = " | ".join(f"{parts[arm][p]:.2f}" for p in PARTS)
        print(f"| {arm} | {len(times[arm])} | {medians[arm]:.2f} | {cells} |")
    print(f"overlapped / in turn: x{ratio:.3f}")
    prefetched = {arm: statistics.mean(r["engine/process_prefetched"] for r in rows[arm])
                  for arm in ARMS}  # fmt: skip
    report = {"settings": settings, "times_s": times, "median_s": medians,
              "parts_median_s": parts, "ratio": ratio, "prefetched": prefetched,
              "rows": rows, "complete": True}  # fmt: skip
    if args.json:
        write_json(args.json, report)
    return report


def write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
