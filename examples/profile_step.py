"""Where one training step's time goes: TROLL against clipping at a Qwen3 shape, profiled.

Builds the snapshot and a policy moved away from it (``--perturb``, as the GPU check's overhead
phase does), times ``--repeats`` steps of each objective in turn, then profiles one step of each
and prints, per objective, the median step time, the number of operator calls and of host
synchronisations (on CUDA: kernel launches and ``cudaStreamSynchronize``; on a CPU: ATen calls,
and the operators that wait on a GPU, scalar reads ``aten::_local_scalar_dense`` and
``aten::nonzero``, which indexing with a boolean mask runs too), and the profiler's tables.

On a GPU the step of a small model is bound by the host when an objective launches many small
kernels or waits on the device often; the counts say so on any machine, since they do not depend
on the device's speed::

    python examples/profile_step.py                       # qwen3-0.6b, 4 x 1,024 tokens
    python examples/profile_step.py --tiny                # tiny shapes, any CPU, seconds
    python examples/profile_step.py --tiny --tables 0     # counts only
    python examples/profile_step.py --compiled            # and TROLL with its solver compiled
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_models import (  # noqa: E402
    QWEN3,
    TINY_QWEN3,
    clock,
    device,
    make_rollout,
    snapshot_and_policy,
    train_step,
)

OBJECTIVES = ("clip", "troll")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")
CUDA_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize")
CPU_SYNCS = ("aten::_local_scalar_dense", "aten::nonzero")


def counts(events, cuda: bool) -> dict[str, int]:
    """Operator calls and host synchronisations among a profile's averaged events."""
    calls = {e.key: e.count for e in events}
    if cuda:
        return {
            "launches": sum(calls.get(k, 0) for k in LAUNCHES),
            "syncs": sum(calls.get(k, 0) for k in CUDA_SYNCS),
        }
    return {
        "aten_calls": sum(n for k, n in calls.items() if k.startswith("aten::")),
        "syncs": sum(calls.get(k, 0) for k in CPU_SYNCS),
    }


def profiled(step):
    """Runs ``step`` once under the profiler (waiting for the device at the end): its averaged
    events, and whether CUDA was profiled."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    return prof.key_averages(), cuda


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(QWEN3))
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and sequences")
    parser.add_argument("--perturb", type=float, default=0.1,
                        help="policy = snapshot + perturb x std noise (0.1: every token projected)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tables", type=int, default=20, help="rows per profiler table (0: none)")
    parser.add_argument("--compiled", action="store_true",
                        help="also TROLL with trust_region.compile_solver (the warm-up compiles)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1; got {args.repeats}")

    import torch

    from lightning_troll.objectives import build_objective

    shape = (TINY_QWEN3 if args.tiny else QWEN3)[args.shape]
    sequences, prompt, response, chunk = (2, 8, 24, 16) if args.tiny else (4, 128, 896, 1024)
    snapshot, policy = snapshot_and_policy(shape, args.perturb)
    g = torch.Generator(device=device()).manual_seed(0)
    ids = torch.randint(2, shape.vocab, (sequences, prompt + response), generator=g,
                        device=device())  # fmt: skip
    attention = torch.ones_like(ids)
    mask = torch.ones(sequences, response, dtype=torch.bool, device=device())
    rewards = torch.randn(sequences, generator=g, device=device())
    names = OBJECTIVES + (("troll_compiled",) if args.compiled else ())
    eager = {
        "troll": {"compile_solver": False}
    }  # the default compiles on a GPU: --compiled adds it
    objectives = {name: build_objective(name, **eager.get(name, {})) for name in OBJECTIVES}
    if args.compiled:
        objectives["troll_compiled"] = build_objective("troll", compile_solver=True)
    rollouts = {
        name: make_rollout(snapshot, o, ids, attention, mask, rewards, sequences, chunk)
        for name, o in objectives.items()
    }
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)

    def step(name: str):
        return train_step(policy, objectives[name], optimizer, rollouts[name], None, chunk)

    for name in names:  # warm-up
        step(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.repeats):  # in turn, so that all see the same machine
        for name in names:
            start = clock()
            step(name)
            times[name].append(clock() - start)
    report: dict[str, dict] = {}
    for name in names:
        events, cuda = profiled(lambda name=name: step(name))
        report[name] = {"median_ms": round(1000 * statistics.median(times[name]), 2),
                        **counts(events, cuda)}  # fmt: skip
        if args.tables:
            key = "cuda_time_total" if cuda else "cpu_time_total"
            print(f"==== {name}, by {key}")
            print(events.table(sort_by=key, row_limit=args.tables, max_name_column_width=60))
    where = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    print(f"{args.shape}{' (tiny)' if args.tiny else ''} on {where}, torch {torch.__version__}, "
          f"{sequences} x {prompt + response} tokens, perturb {args.perturb}")  # fmt: skip
    for name, row in report.items():
        print(f"{name:>14}: " + ", ".join(f"{k} {v}" for k, v in row.items()))
    ratio = report["troll"]["median_ms"] / report["clip"]["median_ms"]
    print(f"troll / clip step time: x{ratio:.3f}")
    if args.compiled:
        compiled = report["troll_compiled"]["median_ms"] / report["clip"]["median_ms"]
        print(f"troll (compiled solver) / clip step time: x{compiled:.3f}")
    return report


if __name__ == "__main__":
    main()
