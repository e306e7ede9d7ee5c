"""Benchmark: what TROLL costs over ratio clipping in one whole training step.

A training step is what ``MinibatchLoop.step`` (``lightning_troll.training.optimization``) runs on one
minibatch: the policy's forward over prompt + response (hidden states; the output layer on
``--chunk-size`` response tokens at a time, the default chunked log-prob path of
``model.optimization.logits_chunk_size``), the objective, the backward pass, gradient-norm clipping and an
AdamW step. Both objectives run on the same model (same weights), the same synthetic rollout
and the same seed, at vocabularies V = 151,936 (Qwen's) and 32,000.

The rollout: ``--sequences`` random prompts of 16 tokens and responses of ``--length`` tokens
(seed 0); the old log-probs and, for TROLL, the cached sparse rows come from
``behaviour_outputs`` of the snapshot (a frozen copy of the policy), so TROLL's sparse rows are
real; advantages are standard normal. The policy then moves away from the snapshot (every
weight plus ``--perturb`` times its tensor's standard deviation of normal noise), so the
projection is active on some tokens; the share of projected tokens is printed. The tied
embedding is drawn with standard deviation ``2 / sqrt(hidden)`` (logits of standard deviation
about 2), so that the old policy's mass sits on a few hundred tokens rather than spread near
uniformly over the vocabulary, as a fresh initialisation would have it.

Model: the output layer's share of a step's compute is chosen like a 4B model's. Per response
token, the matrix multiplies of a decoder layer cost ``hidden * (2 * q + 2 * kv + 3 * mlp)``
multiply-adds (q = query heads x head size, kv = key/value heads x head size) and the output
layer ``hidden * V``; attention scores, norms and the loss are left out. Qwen3-4B (hidden 2560,
36 layers, 32 query and 8 key/value heads of 128, MLP 9728, V = 151,936, tied embeddings):
a layer costs 2560 * (8192 + 2048 + 29184) = 100.9M, 36 layers 3,633M, the output layer
2560 * 151,936 = 389.0M, so the output layer is 389.0 / 4,022 = 9.67% of the matmul work. The
benchmark model (``tiny_causal_lm``: ``--hidden``, ``--layers``, 2 heads, key/value heads =
query heads) takes the MLP width that gives the same share at V = 151,936:
``mlp = (hidden * V * (1 / share - 1) / layers - 4 * hidden**2) / (3 * hidden)``, unless
``--mlp`` is given. The same model with V = 32,000 has a smaller share; both are printed. The
output layer's cost relative to the elementwise work over the vocabulary (log-softmax, TROLL's
top-K and projection) grows with the hidden size: a small hidden size, as here, makes that
elementwise work, and with it TROLL's extra, weigh more than in a 4B model.

Time: in one process, both objectives, each with its own copy of the policy and its own AdamW,
run ``--warmup`` steps, then ``--repeats`` steps interleaved (clip, troll, clip, ...); the
median wall time of a step is reported. Peak memory: each objective runs in a fresh Python
process that builds the model, the snapshot, the rollout and the optimiser, resets its peak
resident set size to the current one (``5`` written to ``/proc/self/clear_refs``) and reads
it (``VmHWM``) as the baseline, then runs one step (``MALLOC_MMAP_THRESHOLD_`` fixed at glibc's
default of 128 KiB, so that every larger buffer is a fresh ``mmap`` returned to the system when
freed, and memory freed while building is not silently reused): the peak above the baseline is the step's
extra memory (gradients, AdamW's two moments, activations, the logit chunks and, for TROLL,
its projection buffers). The weights, the snapshot and the rollout are in the baseline. The
ratios are TROLL / clip.

Run (from the repository root; about 5 minutes on 2 CPU cores, 5 GiB of memory at peak)::

    python examples/benchmark_overhead.py
    python examples/benchmark_overhead.py --json overhead.json

Allocator caveat (CPU, glibc): buffers this large are fresh ``mmap`` regions returned to the
system when freed, so each step pays page faults that a GPU's caching allocator does not; see
``examples/benchmark_projection.py`` for the environment variables that keep freed memory in
the process. Memory here is CPU memory; on a GPU it would come from
``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
from peak_memory import peak_mib, reset_peak

from lightning_troll.models import tiny_causal_lm
from lightning_troll.objectives import LossInputs, build_objective
from lightning_troll.rollouts.rollout import behaviour_outputs, linear_head, response_hidden
from lightning_troll.trust_region.sparse import sparsify

VOCABS = (151_936, 32_000)
PROMPT = 16
HEADS = 2
LOGIT_STD = 2.0  # standard deviation of the initial logits (tied embedding x sqrt(hidden))
QWEN3_4B = {"hidden": 2560, "layers": 36, "q": 32 * 128, "kv": 8 * 128, "mlp": 9728}
OBJECTIVES = ("clip", "troll")
MMAP_THRESHOLD = 128 * 1024  # bytes; glibc's default, fixed so that it does not grow


def layer_macs(hidden: int, q: int, kv: int, mlp: int) -> int:
    """Multiply-adds per token of one decoder layer's matrix multiplies."""
    return hidden * (2 * q + 2 * kv + 3 * mlp)


def output_share(hidden: int, layers: int, q: int, kv: int, mlp: int, vocab: int) -> float:
    """The output layer's share of a token's matmul multiply-adds."""
    head = hidden * vocab
    return head / (layers * layer_macs(hidden, q, kv, mlp) + head)


def qwen3_4b_share(vocab: int = VOCABS[0]) -> float:
    """Qwen3-4B's output-layer share (9.67% at V = 151,936)."""
    return output_share(vocab=vocab, **QWEN3_4B)


def matching_mlp(hidden: int, layers: int, vocab: int = VOCABS[0]) -> int:
    """The MLP width that gives a ``hidden`` x ``layers`` model Qwen3-4B's output share."""
    body = hidden * vocab * (1 / qwen3_4b_share(vocab) - 1) / layers  # per layer
    return max(1, round((body - 4 * hidden**2) / (3 * hidden)))


@dataclass(frozen=True)
class Result:
    """One objective's measurements at one vocabulary."""

    objective: str
    vocab: int
    step_ms: float
    peak_mib: float
    baseline_mib: float
    peak_reset: bool
    projected_frac: float


SUPPORT = {"troll": {"support": "union", "max_tokens": 64}}
"""TROLL's support in this benchmark: the union at K = 64, the settings its published figures
were measured with (docs/benchmarks.md); the library's default is the official support at 256."""


class Step:
    """One policy, its optimiser and objective, and a fixed rollout: one training step per call."""

    def __init__(self, objective_name: str, vocab: int, args) -> None:
        self.policy, snapshot = _models(vocab, args)
        self.objective = build_objective(objective_name, **SUPPORT.get(objective_name, {}))
        ids, attention, response = _rollout_inputs(vocab, args)
        sparse = self._sparsify if objective_name == "troll" else None
        old_logprobs, old = behaviour_outputs(
            snapshot, ids, attention, response, 1.0, sparse, args.chunk_size
        )
        advantages = torch.randn(args.sequences, generator=torch.Generator().manual_seed(1))
        self.inputs = (ids, attention, response.shape[1])
        self.targets = LossInputs(
            tokens=ids[:, -response.shape[1] :],
            mask=response,
            advantages=advantages,
            old_logprobs=old_logprobs,
            old=old,
        )
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=1e-6)
        self.chunk_size = args.chunk_size
        self.projected_frac = math.nan

    def _sparsify(self, rows, tokens):
        projection = self.objective.projection
        return sparsify(rows, projection.max_tokens, projection.mass_delta, keep=tokens)

    def __call__(self) -> None:
        hidden = response_hidden(self.policy, *self.inputs)  # (B, T, H)
        head = linear_head(self.policy)
        loss, stats = self.objective.forward_hidden(
            hidden, head, 1.0, self.targets, chunk_size=self.chunk_size
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        active = getattr(stats, "active_frac", None)
        self.projected_frac = math.nan if active is None else float(active)


def _models(vocab: int, args) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The policy (train mode) and its snapshot, which the policy has moved away from."""
    model = tiny_causal_lm(
        vocab, args.hidden, args.layers, HEADS, seed=0, intermediate_size=args.mlp
    )
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight  # (V, H), tied to the output layer
        embedding.copy_(
            torch.randn(embedding.shape, generator=g) * LOGIT_STD / math.sqrt(args.hidden)
        )
        snapshot = copy.deepcopy(model).eval().requires_grad_(False)
        for p in model.parameters():
            p.add_(args.perturb * p.std() * torch.randn(p.shape, generator=g))
    return model.train(), snapshot


def _rollout_inputs(vocab: int, args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.sequences, PROMPT + args.length), generator=g)
    response = torch.ones(args.sequences, args.length, dtype=torch.bool)
    return ids, torch.ones_like(ids), response


def timings(vocab: int, args) -> dict[str, tuple[float, float]]:
    """Median step time (ms) and projected share per objective, interleaved in this process."""
    steps = {name: Step(name, vocab, args) for name in OBJECTIVES}
    times: dict[str, list[float]] = {name: [] for name in OBJECTIVES}
    for i in range(args.warmup + args.repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    return {
        name: (1000 * statistics.median(times[name]), steps[name].projected_frac)
        for name in OBJECTIVES
    }


def peak_worker(objective_name: str, vocab: int, args) -> tuple[float, float, bool]:
    """Peak resident memory (MiB) of one step above the baseline; runs in a fresh process."""
    torch.manual_seed(0)
    step = Step(objective_name, vocab, args)
    reset = reset_peak()
    baseline = peak_mib()
    step()
    return peak_mib() - baseline, baseline, reset


def _settings(args) -> list[str]:
    return [
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
        "--mlp",
        str(args.mlp),
        "--sequences",
        str(args.sequences),
        "--length",
        str(args.length),
        "--chunk-size",
        str(args.chunk_size),
        "--perturb",
        str(args.perturb),
    ]


def peak(objective_name: str, vocab: int, args) -> tuple[float, float, bool]:
    """Runs :func:`peak_worker` in a fresh interpreter and reads its result."""
    command = [sys.executable, __file__, "--worker", f"{objective_name},{vocab}", *_settings(args)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"the memory worker for {objective_name} failed:\n{done.stderr}")
    return tuple(json.loads(done.stdout.strip().splitlines()[-1]))


def measure(vocab: int, args) -> list[Result]:
    """Both objectives at one vocabulary: time in this process, peak memory in fresh ones."""
    peaks = {name: peak(name, vocab, args) for name in OBJECTIVES}
    times = timings(vocab, args)
    results = []
    for name in OBJECTIVES:
        peak_value, baseline, reset = peaks[name]
        ms, projected = times[name]
        row = (round(ms, 1), round(peak_value, 1), round(baseline, 1), reset, round(projected, 4))
        results.append(Result(name, vocab, *row))
    return results


def _positive_int(option: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < 1:
            raise argparse.ArgumentTypeError(f"{option} must be an integer >= 1; got {text!r}")
        return value

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; sizes are checked before any work starts."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=_positive_int("--hidden"), default=64, help="hidden size")
    parser.add_argument("--layers", type=_positive_int("--layers"), default=2, help="layers")
    parser.add_argument(
        "--mlp", type=_positive_int("--mlp"), help="MLP width (default: Qwen3-4B's output share)"
    )
    parser.add_argument("--sequences", type=_positive_int("--sequences"), default=4, help="B")
    parser.add_argument(
        "--length", type=_positive_int("--length"), default=48, help="response tokens T"
    )
    parser.add_argument(
        "--chunk-size", type=_positive_int("--chunk-size"), default=1024, help="tokens per chunk"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per objective")
    parser.add_argument(
        "--repeats", type=_positive_int("--repeats"), default=5, help="timed steps per objective"
    )
    parser.add_argument("--perturb", type=float, default=0.1, help="policy noise, x weight std")
    parser.add_argument("--json", help="write the TROLL/clip ratios at V = 151,936 to this file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.hidden % (2 * HEADS):
        parser.error(f"--hidden must be a multiple of {2 * HEADS}; got {args.hidden}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0; got {args.warmup}")
    if not (math.isfinite(args.perturb) and args.perturb >= 0):
        parser.error(f"--perturb must be a finite number >= 0; got {args.perturb}")
    if args.mlp is None:
        args.mlp = matching_mlp(args.hidden, args.layers)
    return args


def main(argv: list[str] | None = None) -> None:
    """Measures both vocabularies and prints the table (and writes ``--json``)."""
    args = parse_args(argv)
    if args.worker:
        name, vocab = args.worker.split(",")
        print(json.dumps(peak_worker(name, int(vocab), args)))
        return
    q = kv = args.hidden
    shares = {v: output_share(args.hidden, args.layers, q, kv, args.mlp, v) for v in VOCABS}
    params = args.layers * layer_macs(args.hidden, q, kv, args.mlp)
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, {HEADS} heads, MLP {args.mlp} "
        f"({params / 1e6:.1f}M layer weights); output-layer share of matmul work: "
        + ", ".join(f"V = {v}: {100 * s:.2f}%" for v, s in shares.items())
        + f" (Qwen3-4B at V = {VOCABS[0]}: {100 * qwen3_4b_share():.2f}%)"
    )
    print(
        f"{args.sequences} x {args.length} response tokens after {PROMPT} prompt tokens, "
        f"chunks of {args.chunk_size}, AdamW; median of {args.repeats} steps after "
        f"{args.warmup} warm-up; torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}"
    )
    print("| V | clip step | TROLL step | ratio | clip peak | TROLL peak | ratio | projected |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    ratios = {}
    rows = []
    for vocab in VOCABS:
        clip, troll = measure(vocab, args)
        rows += [clip, troll]
        ratios[vocab] = (troll.step_ms / clip.step_ms, troll.peak_mib / clip.peak_mib)
        print(
            f"| {vocab} | {clip.step_ms:.0f} ms | {troll.step_ms:.0f} ms | "
            f"x{ratios[vocab][0]:.3f} | {clip.peak_mib:.0f} MiB | {troll.peak_mib:.0f} MiB | "
            f"x{ratios[vocab][1]:.3f} | {100 * troll.projected_frac:.1f}% |",
            flush=True,
        )
    baselines = ", ".join(f"{r.baseline_mib:.0f}" for r in rows)
    reset = "reset before each step" if all(r.peak_reset for r in rows) else "NOT reset"
    print(f"memory baselines (MiB): {baselines}; peak {reset}")
    if args.json:
        time_ratio, memory_ratio = ratios[VOCABS[0]]
        with open(args.json, "w") as f:
            json.dump({"time_ratio": time_ratio, "memory_ratio": memory_ratio}, f, indent=2)


if __name__ == "__main__":
    main()
