"""What the constraint bins cost: ``ConstraintMonitor`` beside ``TrustRegionMonitor`` per rollout.

    python studies/benchmark_constraint_monitor.py            # prints a table
    python studies/benchmark_constraint_monitor.py --json out.json

Both monitors read the statistics of a rollout's optimiser steps after its last step. The
benchmark builds those statistics for rollouts of N response tokens (8 optimiser steps, each with
N / 8 tokens: per-token ratios, behaviour probabilities, advantages, projection records), as
TROLL and clipping return them, and times each monitor's ``on_train_batch_end`` on them, the
median of ``--repeats``, with a module that records what is logged. The monitors run on the
device the statistics live on; here the CPU. A rollout's own time is the scale to compare with:
SmolLM2-135M-Instruct's iteration of 64 sequences takes about a minute on two CPU cores
(docs/benchmarks.md), with about 1,300 response tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from lightning_troll.callbacks import ConstraintMonitor, TrustRegionMonitor
from lightning_troll.objectives import ClipStats, TrollStats
from lightning_troll.trust_region.projection import ProjectionResult

STEPS = 8


def _common(n: int, generator: torch.Generator) -> dict:
    ratio = torch.exp(0.1 * torch.randn(n, generator=generator))
    zero = torch.zeros(())
    return {
        "loss": zero, "policy_loss": zero, "regression_loss": zero, "ref_kl": zero,
        "entropy": zero, "ratio_mean": ratio.mean(), "ratio_min": ratio.min(),
        "ratio_max": ratio.max(), "num_tokens": torch.tensor(n), "token_ratio": ratio,
        "token_old_prob": torch.rand(n, generator=generator),
        "token_advantage": torch.randn(n, generator=generator).round(),
    }  # fmt: skip


def step_stats(objective: str, n: int, generator: torch.Generator):
    """The statistics one optimiser step of ``n`` response tokens returns."""
    common = _common(n, generator)
    if objective == "clip":
        r, adv = common["token_ratio"], common["token_advantage"]
        low, high = (adv < 0) & (r < 0.8), (adv > 0) & (r > 1.2)
        frac = lambda m: m.float().mean()  # noqa: E731
        return ClipStats(**common, clip_frac_low=frac(low), clip_frac_high=frac(high),
                         dual_clip_frac=torch.zeros(()), token_clipped=low | high,
                         token_outside=(r < 0.8) | (r > 1.2))  # fmt: skip
    kl = torch.rand(n, generator=generator) * 0.1
    eta = torch.where(kl > 0.05, torch.rand(n, generator=generator), torch.zeros(n))
    projection = ProjectionResult(
        logprob=-kl, new_logprob=-kl, old_logprob=-kl, regression_kl=kl, kl_before=kl,
        kl_after=kl.clamp_max(0.05), eta=eta, coverage=torch.ones(n),
        support_size=torch.full((n,), 8.0),
    )  # fmt: skip
    active = (eta > 0).float().mean()
    return TrollStats(**common, projection=projection, active_frac=active,
                      infeasible_frac=torch.zeros(()))  # fmt: skip


class Module(SimpleNamespace):
    def log_dict(self, values):
        self.logged.update(values)

    def log(self, name, value, **kwargs):
        self.logged[name] = value


def time_monitor(monitor, module, repeats: int) -> float:
    """The median seconds of ``monitor.on_train_batch_end`` over ``repeats`` calls."""
    times = []
    for _ in range(repeats + 1):  # the first call builds the monitor's state: not counted
        start = time.perf_counter()
        monitor.on_train_batch_end(None, module, None, None, 0)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1_280, 65_536, 1_048_576],
                   help="response tokens per rollout")  # fmt: skip
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", type=Path, help="write the figures here too")
    args = p.parse_args(argv)
    generator = torch.Generator().manual_seed(0)
    rows = []
    print("| objective | tokens per rollout | ConstraintMonitor ms | TrustRegionMonitor ms |")
    print("| --- | ---: | ---: | ---: |")
    for objective in ("troll", "clip"):
        for n in args.tokens:
            stats = [step_stats(objective, n // STEPS, generator) for _ in range(STEPS)]
            module = Module(last_stats=stats, logged={}, device=torch.device("cpu"),
                            objective=SimpleNamespace(projection=SimpleNamespace(eps=0.05)),
                            last_minibatch=None)  # fmt: skip
            bins = time_monitor(ConstraintMonitor(), module, args.repeats)
            region = time_monitor(TrustRegionMonitor(histogram_every_n_rollouts=0), module,
                                  args.repeats)  # fmt: skip
            rows.append({"objective": objective, "tokens": n, "constraint_monitor_s": bins,
                         "trust_region_monitor_s": region})  # fmt: skip
            print(f"| {objective} | {n:,} | {bins * 1e3:.2f} | {region * 1e3:.2f} |", flush=True)
    if args.json:
        args.json.write_text(
            json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
