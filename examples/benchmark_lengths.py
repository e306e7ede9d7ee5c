"""Benchmark: one GRPO iteration's time and peak memory against the completion length, with the
library's defaults, on SmolLM2-135M's architecture.

Each length runs ``lightning-troll fit`` in a fresh process for ``--iterations`` rollouts
(default 1) with the defaults a new user gets: 8 prompts x 8 completions, one minibatch,
micro-batches of ``model.optimization.micro_batch_tokens`` tokens, TROLL, the HF engine,
float32, one torch thread per core. The model is SmolLM2-135M-Instruct's architecture with
random weights (seed 0): it almost never samples its end-of-text token, so every completion runs
to the length asked for, and the cost is that of the length, not of what a trained model chooses
to write. The prompts are the arithmetic questions of ``configs/smollm2.yaml`` in the chat
template. Reported per length: the last iteration's generation, rest of the rollout and training
seconds (the module's ``time/*`` figures), the tokens sampled, and the process's peak resident
memory over its whole life (``VmHWM``), in GiB, with its CPU seconds in user and kernel mode and
its minor page faults (``getrusage``), whole run.

    python examples/benchmark_lengths.py --lengths 128 512 1024 2048 \\
        --json examples/results/smollm2/lengths.json --plot examples/results/smollm2/lengths.png
    python examples/benchmark_lengths.py --lengths 512 --set model.optimization.micro_batch_tokens=null

``--set option=value`` passes an option to every run (``model.optimization.micro_batch_tokens=null``
is the old default: the whole minibatch in one forward). Needs ``make smollm2`` (the architecture
and tokenizer are read from ``models/SmolLM2-135M-Instruct``).

``--ragged`` measures training alone, in this process, side by side: one minibatch of
``--sequences`` sequences (48 prompt tokens each) whose completions have a long tail (a log-normal
with median 200 tokens, cut at 2,048) against as many of equal length with the same real tokens,
for three ways of splitting them into forward passes (fixed parts of 2 sequences, padded; the token
budget, padded; the token budget, packed), with clipping's loss (TROLL's projection adds the same
per token either way)::

    python examples/benchmark_lengths.py --ragged --json examples/results/smollm2/ragged.json
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct"
PROMPTS = ROOT / "examples" / "data" / "arithmetic" / "train.jsonl"


def random_architecture(folder: Path) -> Path:
    """SmolLM2-135M-Instruct's config and tokenizer with random weights (seed 0), saved once."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(SMOLLM2))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(SMOLLM2).save_pretrained(folder)
    return folder


def worker(length: int, model: Path, iterations: int, extra: list[str]) -> dict:
    """One run of ``iterations`` rollouts at ``length`` new tokens, in this process."""
    from lightning_troll.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "fit",
            "--model.model", str(model),
            "--model.sampling.max_new_tokens", str(length),
            "--model.rewards", '{"last_number": 1.0}',
            "--model.reward_options.workers", "0",
            "--data.source", str(PROMPTS),
            "--data.prompt_field", "question",
            "--trainer.max_steps", str(iterations),
            "--trainer.limit_val_batches", "0",
            "--trainer.enable_progress_bar", "false",
            "--trainer.logger", "CSVLogger",
            "--trainer.logger.save_dir", tmp,
            "--checkpoint.dirpath", str(Path(tmp) / "checkpoints"),
            *[a for option in extra for a in ("--" + option.split("=")[0], option.split("=", 1)[1])],
        ]  # fmt: skip
        start = time.perf_counter()
        main(args)
        seconds = time.perf_counter() - start
        rows = list(csv.DictReader(next(Path(tmp).rglob("metrics.csv")).open()))
    last = {}
    for row in rows:  # the last value of each figure
        last.update({k: float(v) for k, v in row.items() if v not in ("", None)})
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "new_tokens": length,
        "generation_s": round(last["time/generation"], 2),
        "rest_of_rollout_s": round(last["time/rollout"] - last["time/generation"], 2),
        "training_s": round(last["time/training"], 2),
        "iteration_s": round(last["time/rollout"] + last["time/training"], 2),
        "mean_completion_tokens": round(last["completion/mean_length"], 1),
        "peak_gib": round(peak, 2),
        "run_s": round(seconds, 1),
        "user_cpu_s": round(usage.ru_utime, 1),
        "system_cpu_s": round(usage.ru_stime, 1),
        "minor_page_faults": usage.ru_minflt,
    }


def random_rollout(lengths, prompt: int, generator, vocab: int = 20000):
    """A rollout of ``len(lengths)`` sequences of ``prompt`` random prompt tokens (ids 10 to
    ``vocab``) and ``lengths`` (B,) random response tokens, right-padded, for training passes
    alone (behaviour log-probs -9, no sparse rows, random advantages, groups of 8)."""
    import torch

    from lightning_troll.rollouts.rollout import Rollout

    width = int(lengths.max())
    b = len(lengths)
    ids = torch.randint(10, vocab, (b, prompt + width), generator=generator)
    response = torch.arange(width) < lengths.unsqueeze(-1)  # (B, T)
    mask = torch.cat([torch.ones(b, prompt, dtype=torch.long), response.long()], -1)
    return Rollout(ids, mask, response, torch.full(response.shape, -9.0) * response, None,
                   torch.zeros(b), torch.randn(b, generator=generator),
                   torch.zeros(b, dtype=torch.bool), 1.0, 8)  # fmt: skip


def ragged_training(model_dir: Path, sequences: int, repeats: int) -> list[dict]:
    """:func:`ragged_rows` on SmolLM2's architecture (``model_dir``), float32, on this CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    return ragged_rows(model, sequences, repeats)


def ragged_rows(model, sequences: int, repeats: int, clock=time.perf_counter) -> list[dict]:
    """Training time of one minibatch of ``sequences`` sequences whose completions have a long
    tail (a log-normal with median 200 tokens and sigma 1, cut at 2,048) against as many of equal
    length with the same real tokens, each way the loop can split them: side by side on
    ``model``'s device, the median of ``repeats`` forward and backward passes (one warm-up pass
    first), timed by ``clock`` (on a GPU one that waits for the device's queued work)."""
    import statistics
    from types import SimpleNamespace

    import torch

    from lightning_troll.objectives import build_objective
    from lightning_troll.rollouts.rollout import Rollout
    from lightning_troll.training.optimization import MinibatchLoop, OptimizationConfig
    from lightning_troll.training.policies import policy_loss

    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    tail = (torch.randn(sequences, generator=g) + torch.tensor(200.0).log()).exp()
    ragged = tail.round().clamp(1, 2048).long()
    prompt = 48
    equal = torch.full((sequences,), int(ragged.float().mean().round()))
    objective = build_objective("clip")  # the forward and backward passes, without TROLL's rows

    vocab = min(20000, model.config.vocab_size)  # the ids random_rollout draws: 10 to vocab

    def rollout(lengths: torch.Tensor) -> Rollout:
        return random_rollout(lengths, prompt, g, vocab).to(device)

    def time_of(part_rollout: Rollout, config: OptimizationConfig) -> float:
        loop, trainer = MinibatchLoop(config), SimpleNamespace(world_size=1)
        policies = SimpleNamespace(policy=model)
        times = []
        for _ in range(repeats):
            start = clock()
            for part in loop.micro_batches(trainer, part_rollout, model):
                loss, _ = policy_loss(policies, objective, part, 1024, True, config.pack_sequences)
                loss.backward()
            model.zero_grad(set_to_none=True)
            times.append(clock() - start)
        return statistics.median(times)

    def forward_tokens(part_rollout: Rollout, config: OptimizationConfig) -> int:
        """The positions the forward passes hold: each part's padded width, or its real tokens."""
        trainer = SimpleNamespace(world_size=1)
        parts = MinibatchLoop(config).micro_batches(trainer, part_rollout, model)
        if config.pack_sequences:
            return sum(int(part.attention_mask.sum()) for part in parts)
        return sum(part.attention_mask.numel() for part in parts)

    time_of(rollout(torch.full((4,), 64)), OptimizationConfig())  # warm-up
    ways = {
        "2 sequences a part, padded": OptimizationConfig(
            micro_batch_tokens=None, micro_batch_size=2
        ),
        "token budget, padded": OptimizationConfig(),
        "token budget, packed": OptimizationConfig(pack_sequences=True),
    }
    rows = []
    for name, config in ways.items():
        row = {"split": name, "real_tokens": int(ragged.sum()) + sequences * prompt}
        row["ragged_forward_tokens"] = forward_tokens(rollout(ragged), config)
        ragged_s, equal_s = time_of(rollout(ragged), config), time_of(rollout(equal), config)
        row |= {"ragged_s": round(ragged_s, 4), "equal_s": round(equal_s, 4),
                "ragged_over_equal": round(ragged_s / equal_s, 3)}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [r["new_tokens"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for key, label in (("generation_s", "generation"), ("training_s", "training"),
                       ("iteration_s", "iteration")):  # fmt: skip
        left.plot(lengths, [r[key] for r in rows], marker="o", label=label)
    left.set(xlabel="new tokens per completion", ylabel="seconds", title="time per iteration")
    left.legend()
    right.plot(lengths, [r["peak_gib"] for r in rows], marker="o")
    right.set(xlabel="new tokens per completion", ylabel="GiB", title="peak resident memory")
    right.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048])
    parser.add_argument("--iterations", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], metavar="OPTION=VALUE")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument(
        "--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "smollm2-random"
    )
    parser.add_argument("--ragged", action="store_true", help="long-tailed lengths vs equal ones")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--sequences", type=int, default=32, help="with --ragged")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ragged:
        rows = ragged_training(random_architecture(args.model_dir), args.sequences, args.repeats)
        if args.json:
            args.json.write_text(json.dumps({"ragged": rows}, indent=1) + "\n")
        return
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.model_dir, args.iterations, args.set)))
        return
    random_architecture(args.model_dir)
    rows = json.loads(args.json.read_text())["rows"] if args.json and args.json.exists() else []
    done = {r["new_tokens"] for r in rows}
    for length in args.lengths:
        if length in done:  # resumable: a length already in the JSON file is kept
            continue
        command = [sys.executable, __file__, "--worker", str(length), "--model-dir",
                   str(args.model_dir), "--iterations", str(args.iterations)]  # fmt: skip
        command += [f"--set={option}" for option in args.set]
        out = subprocess.run(command, capture_output=True, text=True, env=os.environ)
        if out.returncode:
            sys.exit(f"{length} new tokens: the run failed\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
        if args.json:
            rows.sort(key=lambda r: r["new_tokens"])
            args.json.write_text(json.dumps({"options": args.set, "rows": rows}, indent=1) + "\n")
    if args.plot:
        plot(sorted(rows, key=lambda r: r["new_tokens"]), args.plot)


if __name__ == "__main__":
    main()
