"""Benchmark: peak memory and time of the loss and of the behaviour outputs, chunked vs full logits.

A tiny Llama-like policy (:func:`lightning_troll.models.tiny_causal_lm`, 2 layers, hidden size
64) with the Qwen2 vocabulary of V = 151,936 tokens scores ``--sequences`` x ``--length``
response tokens (2,048 by default). Its transformer is negligible next to the output layer, so
what is measured is what the (tokens x vocabulary) logits cost. Four measurements per objective
(``troll``, ``clip``):

- ``loss``: the policy's forward, the objective and the backward pass, as
  ``TrollModule.loss_of`` runs them: full logits (``response_logits`` + ``objective(...)``) or
  hidden states and chunks of ``--chunk-size`` tokens (``response_hidden`` +
  ``objective.forward_hidden``, each chunk recomputed in the backward pass).
- ``behaviour``: ``behaviour_outputs`` without gradient, the old token log-probs and, for TROLL,
  the sparse top-K of every token, from the full logits or in chunks.

Method: every measurement runs in a fresh Python process, so peaks never mix. The process builds
the model and the inputs (for the loss, also the old policy's outputs), resets its peak resident
set size to the current one (``5`` written to ``/proc/self/clear_refs``; where that is refused,
the peak of the construction stays in the baseline, which is printed), then reads
``resource.getrusage(RUSAGE_SELF).ru_maxrss`` as the baseline. It runs the measured step once
and reports ``ru_maxrss`` minus the baseline: the extra memory the step needed at its peak.
Buffers this large are separate ``mmap`` regions that glibc returns to the system when they are
freed, so the resident set size follows the live tensors closely. Then the step runs
``--repeats`` more times and the median wall time is reported (the first run, which pays one-off
costs, is not timed). Memory is CPU memory in MiB; a GPU's allocator behaves alike, but its
figures would come from ``torch.cuda.max_memory_allocated``.

Run (from the repository root; a few minutes on 2 CPU cores, about 6 GiB of memory at peak)::

    python examples/benchmark_logprob_memory.py
    python examples/benchmark_logprob_memory.py --sequences 4 --length 128 --json memory.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch
from peak_memory import peak_mib, reset_peak

from lightning_troll.models import tiny_causal_lm
from lightning_troll.objectives import LossInputs, build_objective
from lightning_troll.rollouts.rollout import (
    behaviour_outputs,
    linear_head,
    response_hidden,
    response_logits,
)
from lightning_troll.trust_region.sparse import sparsify

VOCAB = 151_936
PROMPT = 16
OLD_CHUNK = 128  # tokens per chunk when the worker prepares the old policy's outputs


@dataclass(frozen=True)
class Row:
    """One measurement: an objective, a stage, full logits or chunks."""

    objective: str
    stage: str
    chunk_size: int | None
    tokens: int
    peak_mib: float
    step_ms: float
    baseline_mib: float
    peak_reset: bool


def _inputs(sequences: int, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (sequences, PROMPT + length), generator=g)
    attention = torch.ones_like(ids)
    response = torch.ones(sequences, length, dtype=torch.bool)
    return ids, attention, response


def worker(objective_name: str, stage: str, chunk_size: int | None, args) -> Row:
    """Builds everything, then measures one stage; runs in its own process."""
    torch.manual_seed(0)
    model = tiny_causal_lm(VOCAB, hidden_size=64, num_layers=2, num_heads=2)
    ids, attention, response = _inputs(args.sequences, args.length)
    length = response.shape[1]

    def sparse(rows, tokens):
        return sparsify(rows, max_tokens=64, mass_delta=1e-5, keep=tokens)

    sparsify_fn = sparse if objective_name == "troll" else None
    if stage == "behaviour":

        def step() -> None:
            behaviour_outputs(model, ids, attention, response, 1.0, sparsify_fn, chunk_size)

    else:
        model.train()
        old_logprobs, old = behaviour_outputs(
            model, ids, attention, response, 1.0, sparse, OLD_CHUNK
        )
        with torch.no_grad():  # the policy moved since the rollout
            model.lm_head.weight.add_(0.02 * torch.randn_like(model.lm_head.weight))
        advantages = torch.randn(args.sequences, generator=torch.Generator().manual_seed(1))
        targets = LossInputs(
            tokens=ids[:, -length:],
            mask=response,
            advantages=advantages,
            old_logprobs=old_logprobs,
            old=old,
        )
        objective = build_objective(objective_name)

        def step() -> None:
            model.zero_grad(set_to_none=True)
            if chunk_size is None:
                logits = response_logits(model, ids, attention, length, 1.0)  # (B, T, V)
                loss, _ = objective(logits, targets)
            else:
                hidden = response_hidden(model, ids, attention, length)  # (B, T, H)
                loss, _ = objective.forward_hidden(
                    hidden, linear_head(model), 1.0, targets, chunk_size=chunk_size
                )
            loss.backward()

    reset = reset_peak()
    baseline = peak_mib()
    step()
    peak = peak_mib() - baseline
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return Row(
        objective_name,
        stage,
        chunk_size,
        int(response.sum()),
        round(peak, 1),
        round(1000 * statistics.median(times), 1),
        round(baseline, 1),
        reset,
    )


def measure(objective_name: str, stage: str, chunk_size: int | None, args) -> Row:
    """Runs :func:`worker` in a fresh interpreter and reads its result."""
    command = [
        sys.executable,
        __file__,
        "--worker",
        f"{objective_name},{stage},{chunk_size}",
        "--sequences",
        str(args.sequences),
        "--length",
        str(args.length),
        "--repeats",
        str(args.repeats),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return Row(**json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=8, help="sequences B")
    parser.add_argument("--length", type=int, default=256, help="response tokens per sequence T")
    parser.add_argument("--chunk-size", type=int, default=1024, help="tokens per chunk")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs after the first")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        name, stage, chunk = args.worker.split(",")
        row = worker(name, stage, None if chunk == "None" else int(chunk), args)
        print(json.dumps(asdict(row)))
        return

    rows = []
    print(f"V = {VOCAB}, {args.sequences * args.length} response tokens, peak above baseline")
    chunks = f"chunks of {args.chunk_size}"
    print(f"| objective | stage | full logits | {chunks} | full time | chunked time |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in ("troll", "clip"):
        for stage in ("loss", "behaviour"):
            full, chunked = (measure(name, stage, c, args) for c in (None, args.chunk_size))
            rows += [full, chunked]
            print(
                f"| {name} | {stage} | {full.peak_mib:.0f} MiB | {chunked.peak_mib:.0f} MiB | "
                f"{full.step_ms:.0f} ms | {chunked.step_ms:.0f} ms |",
                flush=True,
            )
    baselines = sorted({f"{r.baseline_mib:.0f}" for r in rows})
    reset = "reset before each step" if all(r.peak_reset for r in rows) else "NOT reset"
    print(f"baselines (MiB): {', '.join(baselines)}; peak {reset}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)


if __name__ == "__main__":
    main()
