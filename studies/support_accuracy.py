"""The projection's three supports measured against the exact dense projection, on a real model.

    python studies/support_accuracy.py                 # SmolLM2-135M-Instruct (make smollm2)
    python studies/support_accuracy.py --report        # the table of the saved JSON

On SmolLM2-135M-Instruct's own rollouts (V = 49,152) for ``configs/smollm2.yaml``'s prompts, at
each sampling temperature (1.0 and 0.7): the policy samples ``--prompts`` x ``--group-size``
completions; their logits at every response token are the old (behaviour) policy; ``--steps``
AdamW steps of clipped GRPO at ``--lr`` move the policy away from it, and its logits at the same
tokens are the new policy (both as :mod:`sparse_support` makes them). Then, for every support of
:class:`~lightning_troll.trust_region.projection.TrustRegionProjection` and every ``max_tokens`` K in
{16, 64, 256} (``mass_delta`` 1e-5, the sampled token kept, the old rows cached by
:func:`~lightning_troll.trust_region.projection.sparsify` as a rollout caches them), over all response tokens
in chunks of 1,024 rows:

- ``grad_err``: ||g - g_dense|| / ||g_dense|| of TROLL's loss (token mean of
  ``-ratio * A + alpha * KL(pi_new || sg(pi_proj))``, eps and alpha from the config) with
  respect to the (N, V) new logits, against ``support='dense'``;
- ``logprob_err``: |log pi_proj(token) - dense's| (mean, max) of the sampled token;
- ``kl_after_max`` / ``kl_after_mean``: the KL after projection on the support's own categories
  (what its bound holds), beside the dense projection's;
- ``projected``: share of tokens whose bound is active (eta* > 0);
- ``cpu_ms_per_1k`` / ``ms_per_1k``: process CPU and wall time of the forward and backward per
  1,000 tokens (fastest of 2); ``peak_mib``: the resident memory above its level before them.

The dense projection's own time and memory are in each temperature's ``dense`` record. Time
figures need a quiet machine. Writes ``--json`` (default
``studies/results/smollm2/support_accuracy.json``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sparse_support import (  # noqa: E402  (the rollouts and timing of the sparse-support study)
    CONFIG,
    ROOT,
    Logits,
    build_module,
    prompt_batch,
    rollout_logits,
    sparse_pass,
    timed,
)

from lightning_troll.trust_region.projection import SUPPORTS, TrustRegionProjection, sparsify  # noqa: E402

MAX_TOKENS = (16, 64, 256)
MASS_DELTA = 1e-5
TEMPERATURES = (1.0, 0.7)
CHUNK = 1024
GOAL = 0.05
"""The gradient error a sparse default must stay within at temperature 1.0."""
DEFAULT_JSON = ROOT / "studies" / "results" / "smollm2" / "support_accuracy.json"


def projection_pass(data: Logits, layer: TrustRegionProjection, old, alpha: float) -> dict:
    """:func:`sparse_support.sparse_pass` (any support), its gradient in float64."""
    out = sparse_pass(data, old, layer, alpha)
    out["grad"] = out["grad"].double()
    return out


def measure(data: Logits, eps: float, alpha: float, max_tokens: Sequence[int]) -> list[dict]:
    """The dense record and one record per sparse support and K for one rollout's logits."""
    n = data.tokens.numel()
    dense_layer = TrustRegionProjection(eps, support="dense")
    dense, seconds, cpu, mib = timed(lambda: projection_pass(data, dense_layer, data.old, alpha))
    records = [
        {
            "temperature": data.temperature,
            "support": "dense",
            "max_tokens": data.old.shape[-1],
            "tokens": n,
            "grad_err": 0.0,
            "logprob_err_mean": 0.0,
            "logprob_err_max": 0.0,
            "kl_after_mean": dense["kl_after"].mean().item(),
            "kl_after_max": dense["kl_after"].max().item(),
            "projected": (dense["eta"] > 0).float().mean().item(),
            "support_mean": float(data.old.shape[-1]),
            "ms_per_1k": 1e6 * seconds / n,
            "cpu_ms_per_1k": 1e6 * cpu / n,
            "peak_mib": mib,
        }
    ]
    g_dense = dense["grad"]
    for k in max_tokens:
        old = sparsify(data.old, k, MASS_DELTA, keep=data.tokens)  # as a rollout caches them
        for support in (s for s in SUPPORTS if s != "dense"):
            layer = TrustRegionProjection(eps, k, MASS_DELTA, support=support)
            sparse, seconds, cpu, mib = timed(lambda: projection_pass(data, layer, old, alpha))  # noqa: B023
            err = (sparse["logprob"] - dense["logprob"]).abs()
            records.append(
                {
                    "temperature": data.temperature,
                    "support": support,
                    "max_tokens": k,
                    "tokens": n,
                    "grad_err": ((sparse["grad"] - g_dense).norm() / g_dense.norm()).item(),
                    "logprob_err_mean": err.mean().item(),
                    "logprob_err_max": err.max().item(),
                    "kl_after_mean": sparse["kl_after"].mean().item(),
                    "kl_after_max": sparse["kl_after"].max().item(),
                    "projected": (sparse["eta"] > 0).float().mean().item(),
                    "support_mean": sparse["support_size"].mean().item(),
                    "ms_per_1k": 1e6 * seconds / n,
                    "cpu_ms_per_1k": 1e6 * cpu / n,
                    "peak_mib": mib,
                }
            )
    return records


COLUMNS = (
    ("T", "temperature", "g"),
    ("support", "support", "s"),
    ("K", "max_tokens", "d"),
    ("mean support", "support_mean", ".0f"),
    ("grad err", "grad_err", ".3f"),
    ("logprob err mean", "logprob_err_mean", ".1e"),
    ("logprob err max", "logprob_err_max", ".1e"),
    ("KL after mean", "kl_after_mean", ".4f"),
    ("KL after max", "kl_after_max", ".4f"),
    ("projected", "projected", ".3f"),
    ("CPU ms / 1k tokens", "cpu_ms_per_1k", ".0f"),
    ("wall ms / 1k tokens", "ms_per_1k", ".0f"),
    ("peak MiB", "peak_mib", ".0f"),
)


def table(records: Sequence[dict]) -> str:
    """A Markdown table of the records, one row each."""
    lines = [
        "| " + " | ".join(title for title, _, _ in COLUMNS) + " |",
        "| " + " | ".join("---" for _ in COLUMNS) + " |",
    ]
    for record in records:
        lines.append("| " + " | ".join(format(record[k], s) for _, k, s in COLUMNS) + " |")
    return "\n".join(lines)


def verdict(records: Sequence[dict]) -> str:
    """Which sparse supports keep the gradient within ``GOAL`` of dense at temperature 1.0."""
    hot = [r for r in records if r["temperature"] == 1.0 and r["support"] != "dense"]
    within = [f"{r['support']} K={r['max_tokens']}" for r in hot if r["grad_err"] <= GOAL]
    if not within:
        best = min(hot, key=lambda r: r["grad_err"])
        return (
            f"no sparse support is within {GOAL:.0%} of dense at T=1.0 (best: {best['support']} "
            f"K={best['max_tokens']}, {best['grad_err']:.1%})"
        )
    return f"within {GOAL:.0%} of dense at T=1.0: {', '.join(within)}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: configs/smollm2.yaml's)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per rollout")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=24, help="completion budget")
    p.add_argument("--steps", type=int, default=4, help="AdamW steps between old and new")
    p.add_argument("--lr", type=float, default=None, help="their learning rate (the config's)")
    p.add_argument("--minibatch-size", type=int, default=16, help="sequences per step")
    p.add_argument("--temperatures", type=float, nargs="+", default=list(TEMPERATURES))
    p.add_argument("--max-tokens", type=int, nargs="+", default=list(MAX_TOKENS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where the figures go")
    p.add_argument("--report", action="store_true", help="print the saved JSON's table and stop")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.report:
        records = json.loads(args.json.read_text())["rows"]
        print(table(records))
        print(verdict(records))
        return records
    config = yaml.safe_load(CONFIG.read_text())
    model = args.model or str(ROOT / config["model"]["model"])
    if not Path(model, "config.json").is_file():
        sys.exit(f"no model folder at {model}: run `make smollm2` first, or pass --model")
    region = config["model"]["trust_region"]
    lr = args.lr or float(config["model"]["optimizer"]["init_args"]["lr"])
    eps, alpha = float(region["eps"]), float(region.get("alpha", 1.0))
    torch.set_grad_enabled(True)
    start, records, rollouts = time.perf_counter(), [], []
    batch = prompt_batch(model, config, args.prompts, args.seed)
    for temperature in args.temperatures:
        module = build_module(model, config, temperature, args.max_new_tokens, args.group_size)
        data = rollout_logits(module, batch, args.steps, lr, args.minibatch_size, args.seed)
        del module
        a, b = torch.log_softmax(data.new, -1), torch.log_softmax(data.old, -1)
        kl = (a.exp() * (a - b)).sum(-1)  # (N,) KL(new || old) over the whole vocabulary
        rollouts.append(
            {
                "temperature": temperature,
                "tokens": data.tokens.numel(),
                "kl_new_old_mean": kl.mean().item(),
                "kl_new_old_max": kl.max().item(),
                "over_eps": (kl > eps).float().mean().item(),
            }
        )
        print(f"T={temperature}: {rollouts[-1]}", flush=True)
        records += measure(data, eps, alpha, args.max_tokens)
        print(table(records[-1 - 2 * len(args.max_tokens) :]), flush=True)
        vocab = data.old.shape[-1]
        del data
    report = {
        "model": Path(model).name,
        "vocab_size": vocab,
        "settings": {
            **{k: v for k, v in vars(args).items() if k not in ("json", "report")},
            "lr": lr,
            "eps": eps,
            "alpha": alpha,
            "mass_delta": MASS_DELTA,
            "chunk_rows": CHUNK,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "rollouts": rollouts,
        "rows": records,
        "seconds": time.perf_counter() - start,
    }
    print(table(records))
    print(verdict(records))
    print(f"total {report['seconds']:.0f} s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")
    return records


if __name__ == "__main__":
    main()
