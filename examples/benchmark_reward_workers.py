"""What reward worker processes save: a slow reward scored serially and across workers.

A reward that takes 50 ms a call (a verifier, a sandbox, a remote check) scores one rollout of 64
completions, first in the trainer's process (``model.reward_options.workers: 0``), then across two
worker processes (``model.reward_options.workers: 2``), in one run. The workers are started (and
warmed up) before the timed call, as they are after a run's first rollout; their start-up is
printed apart.

    .venv/bin/python examples/benchmark_reward_workers.py [--completions 64] [--delay 0.05]
        [--workers 2] [--json out.json]

The calls sleep, so the figures hold on a busy machine too.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping
from typing import Any

from lightning_troll.tasks.rewards.registry import RewardScorer

DELAY = 0.05
"""Seconds one call of :func:`slow_reward` takes (``--delay`` sets it in every process)."""


def slow_reward(prompt: str, completion: str, row: Mapping[str, Any], *, delay: float) -> float:
    """1.0 after ``delay`` seconds: a stand-in for a slow verifier."""
    time.sleep(delay)
    return 1.0


def seconds(scorer: RewardScorer, size: int) -> float:
    """Wall seconds ``scorer`` takes over ``size`` completions."""
    start = time.perf_counter()
    out = scorer(["prompt"] * size, ["completion"] * size, [{}] * size)
    elapsed = time.perf_counter() - start
    assert out.total.tolist() == [1.0] * size
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--completions", type=int, default=64)
    parser.add_argument("--delay", type=float, default=DELAY, help="seconds per reward call")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    reward = {slow_reward: 1.0}  # pickled by reference: the workers import this script
    options = {"kwargs": {"slow_reward": {"delay": args.delay}}}
    serial = seconds(RewardScorer(reward, **options), args.completions)
    pool = RewardScorer(reward, workers=args.workers, **options)
    start = time.perf_counter()
    seconds(pool, args.workers)  # starts and warms every worker
    startup = time.perf_counter() - start
    parallel = seconds(pool, args.completions)
    pool.close()
    figures = {
        "completions": args.completions,
        "delay_s": args.delay,
        "serial_s": round(serial, 3),
        "workers": args.workers,
        "workers_s": round(parallel, 3),
        "speedup": round(serial / parallel, 2),
        "worker_startup_s": round(startup, 3),
    }
    print(
        f"{args.completions} completions x {args.delay * 1000:g} ms: serial {serial:.2f} s, "
        f"{args.workers} workers {parallel:.2f} s ({serial / parallel:.2f}x); "
        f"worker start-up (once per run) {startup:.2f} s"
    )
    if args.json:
        with open(args.json, "w") as file:
            json.dump(figures, file, indent=2)


if __name__ == "__main__":
    main()
