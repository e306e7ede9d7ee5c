"""Benchmark: what the sparse TROLL projection costs next to the plain log-softmax path.

At a large vocabulary (V = 151,936 by default, the Qwen2 vocabulary) and several token counts N,
this script times three forward + backward passes over ``(N, V)`` logits:

(a) ``baseline``: the log-softmax path a clipped policy-gradient objective needs anyway,
    ``log_softmax(logits).gather(tokens)`` -> ``sum(logprob * advantage)`` -> backward.
(b) ``troll``: :func:`~lightning_troll.sparsify` of the old policy's logits (no grad) plus
    :class:`~lightning_troll.trust_region.projection.TrustRegionProjection` on the new logits, and the backward
    of ``sum(logprob * advantage) + sum(regression_kl)``.
(c) ``projection``: (b) without ``sparsify``. ``sparsify`` runs once per rollout, while the
    projection runs in every minibatch epoch, so (c) is the recurring cost.

It prints, per N, the median wall time of each over ``--repeats`` runs (after warm-up runs), the
ratios (b)/(a) and (c)/(a), the overhead ((b) - (a))/(a) that TROLL adds if the log-softmax path
is kept as well, and, from the projection result, the mean support size |U|, the mean old-policy
coverage of the kept tokens, the share of rows whose KL bound was violated (eta* > 0) and the
largest KL after projection.

The projection takes the library's defaults (``model.trust_region``: eps, max_tokens, mass_delta,
support) unless told otherwise.

The logits are LLM-like rather than iid Gaussian (which would spread the mass over thousands of
tokens): every row is a background of ``2 * normal`` noise normalised to total mass 1, plus 3 to 8
tokens whose logits lie 12 to 20 nats above the background's log-sum-exp, so that a handful of
tokens carry more than 99.99% of the mass. The new policy's logits are the old ones plus
``0.3 * normal`` noise, enough for some rows to violate the default bound. The
sampled tokens are drawn from the old policy.

Run (from the repository root)::

    python examples/benchmark_projection.py
    python examples/benchmark_projection.py --tokens 64 256 --repeats 3 --dtype bfloat16
    python examples/benchmark_projection.py --json benchmark.json

Memory: each ``(N, V)`` float32 tensor takes ``4 * N * V`` bytes (620 MB at N = 1024); a run
holds the old and new logits plus a few such buffers at a time.

Allocator caveat (CPU, glibc): by default every buffer this large is a fresh ``mmap`` that is
returned to the system when freed, so each run pays page faults on every new ``(N, V)`` buffer.
That cost can dominate the cheap baseline and make the ratios look smaller than they are. To time
with reused memory, as the caching allocator of a GPU does, keep freed memory in the process::

    MALLOC_MMAP_THRESHOLD_=4294967295 MALLOC_TRIM_THRESHOLD_=68719476736 \
        python examples/benchmark_projection.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from lightning_troll.trust_region import defaults
from lightning_troll.trust_region.projection import (
    SUPPORTS,
    ProjectionResult,
    TrustRegionProjection,
)
from lightning_troll.trust_region.sparse import SparseDistribution, sparsify

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_SAMPLE_CHUNK = 128  # rows per chunk when sampling tokens, to bound temporary memory


@dataclass(frozen=True)
class Row:
    """One line of the result table (times in milliseconds)."""

    tokens: int
    vocab: int
    dtype: str
    baseline_ms: float
    troll_ms: float
    projection_ms: float
    troll_ratio: float
    projection_ratio: float
    overhead: float
    mean_support: float
    mean_coverage: float
    violated_frac: float
    max_kl_after: float


@dataclass(frozen=True)
class Problem:
    """The inputs of one benchmark size."""

    old_logits: Tensor  # (N, V), constant
    new_logits: Tensor  # (N, V), leaf requiring grad
    tokens: Tensor  # (N,) int64
    advantages: Tensor  # (N,) float32


def make_problem(
    n: int, vocab: int, dtype: torch.dtype, device: torch.device, seed: int
) -> Problem:
    """Peaked, LLM-like old logits, slightly perturbed new logits and tokens sampled from old."""
    gen = torch.Generator(device=device).manual_seed(seed)
    # Background: 2 * normal, normalised so that the whole background has mass 1 (log-sum-exp 0).
    old = torch.randn(n, vocab, generator=gen, device=device).mul_(2.0)
    old.sub_(torch.logsumexp(old, dim=-1, keepdim=True))
    # 3..8 boosted tokens per row whose logits lie +12..+20 nats over the background's log-sum-exp:
    # the background then holds at most exp(-12) ~ 6e-6 of the mass. "amax" keeps a repeated id
    # deterministic and leaves the -inf of unused slots out.
    max_boost = 8
    count = torch.randint(3, max_boost + 1, (n, 1), generator=gen, device=device)
    ids = torch.randint(0, vocab, (n, max_boost), generator=gen, device=device)
    boost = torch.empty(n, max_boost, device=device).uniform_(12.0, 20.0, generator=gen)
    boost = torch.where(torch.arange(max_boost, device=device) < count, boost, float("-inf"))
    old.scatter_reduce_(-1, ids, boost, reduce="amax")
    # New policy: the old one plus a small perturbation.
    new = torch.randn(n, vocab, generator=gen, device=device).mul_(0.3).add_(old)
    # Tokens sampled from the old policy by the Gumbel-max trick, a chunk of rows at a time.
    tokens = torch.empty(n, dtype=torch.long, device=device)
    for start in range(0, n, _SAMPLE_CHUNK):
        chunk = old[start : start + _SAMPLE_CHUNK]
        u = torch.rand(chunk.shape, generator=gen, device=device).clamp_min_(1e-20)
        tokens[start : start + _SAMPLE_CHUNK] = (chunk - u.log_().neg_().log_()).argmax(-1)
        del u
    advantages = torch.randn(n, generator=gen, device=device)
    old, new = old.to(dtype), new.to(dtype)
    return Problem(old, new.requires_grad_(True), tokens, advantages)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_baseline(p: Problem) -> None:
    """(a) log_softmax -> gather -> sum(logprob * advantage) -> backward."""
    logprob = torch.log_softmax(p.new_logits, dim=-1).gather(-1, p.tokens[:, None]).squeeze(-1)
    (logprob.float() * p.advantages).sum().backward()


def run_projection(
    p: Problem, proj: TrustRegionProjection, old: SparseDistribution
) -> ProjectionResult:
    """(c) projection forward on the new logits + backward of the TROLL loss terms."""
    result = proj(p.new_logits, old, p.tokens)
    ((result.logprob * p.advantages).sum() + result.regression_kl.sum()).backward()
    return result.detach()


def run_troll(p: Problem, proj: TrustRegionProjection) -> ProjectionResult:
    """(b) sparsify of the old logits + (c)."""
    old = sparsify(p.old_logits, proj.max_tokens, proj.mass_delta, keep=p.tokens)
    return run_projection(p, proj, old)


def time_once(fn: Callable[[], object], p: Problem, device: torch.device) -> float:
    """Wall time of one call in milliseconds; the gradient of the leaf is dropped first."""
    p.new_logits.grad = None
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    elapsed = time.perf_counter() - start
    p.new_logits.grad = None
    return 1e3 * elapsed


def bench_size(
    n: int, args: argparse.Namespace, proj: TrustRegionProjection, device: torch.device
) -> Row:
    dtype = _DTYPES[args.dtype]
    p = make_problem(n, args.vocab, dtype, device, args.seed + n)
    old = sparsify(p.old_logits, proj.max_tokens, proj.mass_delta, keep=p.tokens)
    cases: dict[str, Callable[[], object]] = {
        "baseline": lambda: run_baseline(p),
        "troll": lambda: run_troll(p, proj),
        "projection": lambda: run_projection(p, proj, old),
    }
    for _ in range(args.warmup):
        for fn in cases.values():
            time_once(fn, p, device)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):  # interleaved, so that drift hits every case alike
        for name, fn in cases.items():
            times[name].append(time_once(fn, p, device))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    result = run_troll(p, proj)
    p.new_logits.grad = None
    base = med["baseline"]
    return Row(
        tokens=n,
        vocab=args.vocab,
        dtype=args.dtype,
        baseline_ms=med["baseline"],
        troll_ms=med["troll"],
        projection_ms=med["projection"],
        troll_ratio=med["troll"] / base,
        projection_ratio=med["projection"] / base,
        overhead=(med["troll"] - base) / base,
        mean_support=result.support_size.mean().item(),
        mean_coverage=result.coverage.double().mean().item(),
        violated_frac=(result.eta > 0).double().mean().item(),
        max_kl_after=result.kl_after.max().item(),
    )


_COLUMNS = (
    ("N", 6, "tokens", "d"),
    ("(a) base ms", 12, "baseline_ms", ".1f"),
    ("(b) troll ms", 13, "troll_ms", ".1f"),
    ("(c) proj ms", 12, "projection_ms", ".1f"),
    ("(b)/(a)", 8, "troll_ratio", ".2f"),
    ("(c)/(a)", 8, "projection_ratio", ".2f"),
    ("((b)-(a))/(a)", 14, "overhead", "+.2f"),
    ("mean |U|", 9, "mean_support", ".2f"),
    ("coverage", 11, "mean_coverage", ".8f"),
    ("viol.", 6, "violated_frac", ".0%"),
    ("max KL after", 13, "max_kl_after", ".4f"),
)


def format_header() -> str:
    return " ".join(f"{title:>{width}}" for title, width, _, _ in _COLUMNS)


def format_row(row: Row) -> str:
    return " ".join(f"{format(getattr(row, key), fmt):>{width}}" for _, width, key, fmt in _COLUMNS)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151_936, help="vocabulary size V")
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=[64, 256, 1024], help="token counts N"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per case")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs per case first")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument("--eps", type=float, default=defaults.EPS, help="KL bound per token")
    parser.add_argument("--max-tokens", type=int, default=defaults.MAX_TOKENS,
                        help="tokens kept per row")  # fmt: skip
    parser.add_argument("--mass-delta", type=float, default=defaults.MASS_DELTA,
                        help="mass left out per row")  # fmt: skip
    parser.add_argument("--support", choices=SUPPORTS, default=defaults.SUPPORT,
                        help="the tokens the projection runs on (model.trust_region.support)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    if args.vocab < 16 or min(args.tokens) < 1:
        parser.error("--vocab must be >= 16 and every --tokens value >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    device = torch.device(args.device)
    proj = TrustRegionProjection(args.eps, args.max_tokens, args.mass_delta, support=args.support)
    print(
        f"torch {torch.__version__} | device {device} | threads {torch.get_num_threads()} | "
        f"cpu count {os.cpu_count()}"
    )
    print(
        f"V = {args.vocab:,} | dtype {args.dtype} | {proj} | median of {args.repeats} runs "
        f"after {args.warmup} warm-up runs | seed {args.seed}"
    )
    if device.type == "cpu" and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        print(
            "note: glibc returns large buffers to the system, so page faults are timed too; see "
            "the module docstring for MALLOC_MMAP_THRESHOLD_"
        )
    print(format_header())
    rows = []
    for n in args.tokens:
        row = bench_size(n, args, proj, device)
        rows.append(row)
        print(format_row(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
        print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
