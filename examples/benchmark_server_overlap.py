"""Sampling on vLLM servers beside training: how much of the sampling the trainer hides, and what a
weight push costs.

Two arms, each a fit through ``TrollModule`` and a Lightning ``Trainer`` with the
``vllm_server`` engine (docs/engines.md), on the same servers:

- ``in turn``: ``old_policy.max_staleness 0``: each rollout is sampled after the previous
  rollout's update is pushed, and the trainer waits for all of it;
- ``overlapped``: ``max_staleness 1``: the next rollout is sampled by the servers while the
  trainer trains on this one (the engine's :meth:`submit`, in a thread).

Per iteration it records ``time/iteration``, the seconds the trainer waited for its sample
(``engine/server_wait_s``), the push (``engine/weight_push_s``) and whether the rollout was
sampled ahead. The overlap is ``1 - wait(overlapped) / wait(in turn)``: the share of the sampling
the trainer no longer waits for. Medians over the iterations after the first. Prints a table and
writes ``--json``::

    python examples/benchmark_server_overlap.py --tiny          # TinyMath, one CPU server
    python examples/benchmark_server_overlap.py --launch 2 --gpus 0 1 --accelerator cuda \\
        --push nccl --json examples/results/servers/overlap.json   # 2 GPUs sampling, 1 training
    python examples/benchmark_server_overlap.py --servers http://node2:8000 http://node2:8001

With ``--push nccl`` the servers must run with ``--weight-transfer-config '{"backend": "nccl"}'``
(``--launch`` adds it). Needs vLLM where servers are launched (``make setup-vllm``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer

from lightning_troll.callbacks import OldPolicyRefresh, RolloutGeneration
from lightning_troll.engines.base import EngineContext, build_engine
from lightning_troll.engines.sampling import SamplingConfig
from lightning_troll.models.loading import load_tokenizer
from lightning_troll.tasks.data.datamodule import PromptDataModule
from lightning_troll.training.module import EngineConfig, OptimizationConfig, TrollModule

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct"


class Rows(Callback):
    """Each iteration's figures, read at its end (after ``RolloutGeneration`` logged
    ``time/iteration``: the rollout and its optimiser steps)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        m = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        self.rows.append({"iteration_s": m["time/iteration"],  # sampling included
                          "wait_s": m.get("engine/server_wait_s", float("nan")),
                          "push_s": m.get("engine/weight_push_s", 0.0),
                          "prefetched": m.get("engine/server_prefetched", 0.0),
                          "staleness": m.get("rollout/staleness", 0.0)})  # fmt: skip


def run_arm(args, addresses: list[str], staleness: int) -> list[dict]:
    data = PromptDataModule(source="tinymath", tokenizer=args.model, batch_size=args.prompts,
                            num_train=args.prompts * (args.iterations + 1), num_val=0)  # fmt: skip
    options = {"servers": addresses, "push": args.push}
    if args.push == "nccl":
        options["nccl"] = {"master_address": args.master_address, "master_port": args.master_port}
    module = TrollModule(
        model=args.model,
        group_size=args.group,
        sampling=SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens),
        rewards={"tinymath": 1.0},
        optimization=OptimizationConfig(epochs_per_rollout=args.steps),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-5),
        engine=EngineConfig("vllm_server", options),
    )
    rows = Rows()
    trainer = Trainer(
        accelerator=args.accelerator, devices=1, max_steps=args.iterations * args.steps,
        callbacks=[RolloutGeneration(log_samples=0), OldPolicyRefresh(max_staleness=staleness),
                   rows],
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    torch.manual_seed(0)
    try:
        trainer.fit(module, datamodule=data)
    finally:
        module.engine.close()
    return rows.rows


def median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows[1:]] or [r[key] for r in rows]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="TinyMath, one CPU server, seconds")
    parser.add_argument("--model", default=str(SMOLLM2))
    parser.add_argument("--servers", nargs="*", default=None, help="addresses of running servers")
    parser.add_argument("--launch", type=int, default=2, help="servers to start, without --servers")
    parser.add_argument("--gpus", nargs="*", default=None, help="each launched server's GPUs")
    parser.add_argument("--serve-args", nargs="*", default=[])
    parser.add_argument("--push", choices=["folder", "nccl"], default="folder")
    parser.add_argument("--master-address", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, default=29600)
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4, help="optimiser steps per rollout")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.tiny:
        args.model, args.launch, args.prompts, args.group = "tinymath", 1, 4, 4
        args.max_new_tokens, args.steps, args.iterations = 16, 1, 4
    launcher = None
    if not args.servers:  # started here, and reached by address by both arms
        serve_args = list(args.serve_args)
        if args.push == "nccl":
            serve_args += ["--weight-transfer-config", '{"backend": "nccl"}']
        context = EngineContext(args.model, "float32" if args.tiny else "auto",
                                load_tokenizer(args.model))  # fmt: skip
        launcher = build_engine("vllm_server", context, {
            "launch": args.launch, "gpus": args.gpus, "serve_args": serve_args,
            "threads": 1 if args.accelerator != "cuda" else None,
            "log_dir": tempfile.mkdtemp(prefix="server-bench-")})  # fmt: skip
        launcher._ensure_started()
        args.servers = [s.address for s in launcher.servers]
    try:
        arms = {"in turn": run_arm(args, args.servers, 0),
                "overlapped": run_arm(args, args.servers, 1)}  # fmt: skip
    finally:
        if launcher is not None:
            launcher.close()
    summary = {arm: {k: median(rows, k) for k in ("iteration_s", "wait_s", "push_s")}
               for arm, rows in arms.items()}  # fmt: skip
    hidden = 1 - summary["overlapped"]["wait_s"] / max(summary["in turn"]["wait_s"], 1e-9)
    print(f"{'arm':<12}{'iteration':>12}{'waited for sample':>20}{'weight push':>14}")
    for arm, s in summary.items():
        print(f"{arm:<12}{s['iteration_s']:>11.2f}s{s['wait_s']:>19.2f}s{s['push_s']:>13.2f}s")
    print(f"overlap: {hidden:.0%} of the sampling hidden behind training "
          f"({len(args.servers)} server(s), push by {args.push})")  # fmt: skip
    if args.json:
        out = {"args": vars(args), "summary": summary, "overlap": hidden, "rows": arms}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
