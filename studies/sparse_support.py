"""The sparse support at a real vocabulary: what TROLL's projection keeps, what it loses, what it costs.

    python studies/sparse_support.py                  # SmolLM2-135M-Instruct (make smollm2)
    python studies/sparse_support.py --lr 3e-5 --json studies/results/smollm2/sparse_support_lr3e-5.json

On SmolLM2-135M-Instruct's own rollouts (V = 49,152) for ``configs/smollm2.yaml``'s prompts, at
each sampling temperature (0.7, the config's, and 1.0): the policy samples ``--prompts`` x
``--group-size`` completions of at most ``--max-new-tokens`` tokens; their logits at every
response token are kept as the old (behaviour) policy; then ``--steps`` AdamW steps at ``--lr``
(default: the config's, with no warm-up; clipped GRPO on minibatches of ``--minibatch-size``
sequences, gradient norm clipped to 1) move the policy away from it, and its logits at the same
tokens are the new policy (:mod:`policy_logits`). For every ``max_tokens`` K in {16, 64, 256}
and ``mass_delta`` in {1e-3, 1e-5} the script then compares
:class:`~lightning_troll.trust_region.projection.TrustRegionProjection` (sparse; the old rows from
:func:`~lightning_troll.trust_region.projection.sparsify`, as a rollout caches them) with the exact dense
projection :func:`~lightning_troll.trust_region.projection.kl_projection` over the whole vocabulary, on the
same (N, V) float32 logits, with eps and alpha from the config:

- ``cap_frac`` (capped): share of tokens whose K most probable old tokens hold less than
  1 - delta of the mass, so that the support stops at the cap, not at the mass target;
- ``outside_mean`` / ``outside_max``: old-policy mass outside the cached support (1 - coverage);
- ``support_mean``: tokens |U| the projection ran on;
- ``logprob_err``: |sparse - dense| projected log-prob of the sampled token (mean and max);
- ``kl_after_err``: |sparse - dense| KL(pi_proj || pi_old) after projection (the sparse one is the
  KL between the lumped distributions, the quantity its bound holds);
- ``grad_err``: ||g_sparse - g_dense|| / ||g_dense|| of TROLL's loss (token mean of
  ``-ratio * A + alpha * KL(pi_new || sg(pi_proj))``) with respect to the (N, V) logits;
- ``projected`` / ``projected_dense``: share of tokens each projects (eta* > 0);
- ``full_kl_after_{mean,p90,max}``, ``over_bound_frac`` (> 1.001 eps) and
  ``over_bound_10pct_frac`` (> 1.1 eps): the KL to the old policy, over the whole vocabulary,
  of the distribution the sparse projection stands for (its projected mass on U, the rest
  bucket's shared out in proportion to pi_new), rebuilt here independently of the layer
  (``rebuilt_logprob_err_max`` checks the rebuild against the layer's token log-prob);
- ``ms_per_1k`` / ``cpu_ms_per_1k``: wall and process CPU time of the sparse layer's forward and
  backward per 1,000 tokens (rows in chunks of 1,024, as ``model.optimization.logits_chunk_size`` makes them;
  the fastest of 2 passes), ``dense_*`` the dense projection's;
- ``cache_mib_per_1m``: the cached old rows (int64 ids, float32 log-probs, the tail) per million
  response tokens; ``peak_mib`` (in the JSON only): the resident set size above its level
  before the sparse forward and backward over all N rows (their (n, V) buffers, which do not
  depend on K, dominate it); a high-water mark of the whole process, it reads 0 where an earlier
  setting already reached it.

It prints a table and writes JSON (``--json``, default ``studies/results/smollm2/sparse_support.json``).
Wall-clock figures depend on the machine and what else runs on it; CPU time depends less on that.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import yaml
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "examples"))  # the task generators
from peak_memory import PeakRss  # noqa: E402
from policy_logits import Logits, build_module, prompt_batch, rollout_logits  # noqa: E402

from lightning_troll.trust_region.projection import TrustRegionProjection, kl_projection, sparsify  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

CONFIG = ROOT / "configs" / "smollm2.yaml"
MAX_TOKENS = (16, 64, 256)
MASS_DELTAS = (1e-3, 1e-5)
TEMPERATURES = (0.7, 1.0)
CHUNK = 1024
"""Rows per chunk of the timed projections (``model.optimization.logits_chunk_size``'s default)."""
REFERENCE_CHUNK = 512
"""Rows per chunk of the full-vocabulary check, which holds several (rows, V) arrays at once."""
REPEATS = 2
"""Timed passes per projection; the fastest counts (other work on the machine slows some)."""


def support_stats(old: Tensor, max_tokens: int, mass_delta: float) -> dict[str, float]:
    """Share of rows whose support stops at the cap: the mass outside their K most probable tokens
    (summed from those tokens themselves) exceeds mass_delta. (N, V) logits."""
    k = min(max_tokens, old.shape[-1])
    logp = torch.log_softmax(old, -1)  # (N, V)
    top = logp.topk(k, dim=-1).indices  # (N, k)
    outside = logp.scatter(-1, top, -math.inf).logsumexp(-1)  # (N,) log of the mass left out
    capped = outside > (math.log(mass_delta) if mass_delta > 0 else -math.inf)
    return {"cap_frac": capped.float().mean().item()}


def _token_loss(logp: Tensor, regression: Tensor, data: Logits, old_lp: Tensor, alpha: float):
    """TROLL's per-token loss summed over rows (the token mean's numerator)."""
    ratio = (logp - old_lp).exp()
    return (-(ratio * data.advantages) + alpha * regression).sum()


def timed(fn, repeats: int = REPEATS):
    """``fn()``'s result, its fastest wall time and process CPU time over ``repeats`` calls (s;
    CPU time counts every thread, and waiting for a core does not count) and the first call's
    peak resident memory above its start (MiB)."""
    wall, cpu = [], []
    for i in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        if i == 0:
            with PeakRss() as memory:
                result = fn()
        else:
            fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return result, min(wall), min(cpu), memory.mib


def dense_pass(data: Logits, eps: float, alpha: float) -> dict[str, Tensor]:
    """Dense projection of every row: projected token log-prob, KL before and after, and the
    gradient of the loss with respect to the new logits."""
    b_all = torch.log_softmax(data.old, -1)
    old_lp = b_all.gather(-1, data.tokens[:, None]).squeeze(-1)
    out = {name: [] for name in ("logprob", "kl_before", "kl_after", "grad")}
    for s in range(0, data.new.shape[0], CHUNK):
        rows = slice(s, s + CHUNK)
        x = data.new[rows].clone().requires_grad_(True)
        b = b_all[rows]
        logp = kl_projection(x, data.old[rows], eps)  # (n, V)
        a = torch.log_softmax(x, -1)
        token = data.tokens[rows, None]
        regression = (a.exp() * (a - logp.detach())).sum(-1)
        part = Logits(data.old[rows], x, data.tokens[rows], data.advantages[rows], 0, 0)
        logprob = logp.gather(-1, token).squeeze(-1)
        _token_loss(logprob, regression, part, old_lp[rows], alpha).backward()
        with torch.no_grad():
            out["kl_after"].append(
                torch.where(logp > -math.inf, logp.exp() * (logp - b), 0).sum(-1)
            )
            out["kl_before"].append((a.exp() * (a - b)).sum(-1))
            out["logprob"].append(logprob)
        out["grad"].append(x.grad)
    return {name: torch.cat(values).detach() for name, values in out.items()}


def sparse_pass(data: Logits, old, layer: TrustRegionProjection, alpha: float):
    """The layer over all rows in chunks, forward and backward: its per-row results and the loss
    gradient in the new logits. ``old``: cached sparse rows, or dense's (N, V) old logits."""
    x = data.new.clone().requires_grad_(True)
    old_lp = torch.log_softmax(data.old, -1).gather(-1, data.tokens[:, None]).squeeze(-1)
    results = []
    for s in range(0, x.shape[0], CHUNK):
        rows = torch.arange(x.shape[0])[s : s + CHUNK]
        old_rows = old[rows] if isinstance(old, Tensor) else old.select(rows)  # dense: old logits
        result = layer(x[rows], old_rows, data.tokens[rows])
        part = Logits(data.old[rows], x[rows], data.tokens[rows], data.advantages[rows], 0, 0)
        _token_loss(result.logprob, result.regression_kl, part, old_lp[rows], alpha).backward()
        results.append(result.detach())
    names = ("logprob", "kl_after", "eta", "support_size", "coverage")
    out = {name: torch.cat([getattr(r, name) for r in results]) for name in names}
    out["grad"] = x.grad
    return out


def members(vocab: int, *ids: Tensor) -> Tensor:
    """(m, V) bool: the token ids of the (m, k) ``ids`` tensors; padding (-1) marks nothing."""
    mask = torch.zeros(ids[0].shape[0], vocab + 1, dtype=torch.bool)
    for idx in ids:
        mask.scatter_(-1, torch.where(idx >= 0, idx, vocab), True)
    return mask[:, :vocab]


def full_vocabulary_kl(data: Logits, old, eps: float, max_tokens: int, mass_delta: float):
    """(N,) KL(pi || pi_old) over the whole vocabulary of the distribution pi the sparse projection
    stands for, and (N,) its projected token log-prob (a check on the layer).

    Rebuilt here independently of the layer: U = S_old + S_new + {token}, the lumped problem on
    U plus the rest bucket (old tail spread evenly over the V - |S_old| tokens it covers), its
    projection, then pi = the projected mass on U, and the rest bucket's projected mass shared
    out in proportion to pi_new; the KL is taken against the true old distribution."""
    from lightning_troll.trust_region.kl_solver import project_log_probs

    n, vocab = data.new.shape
    kl, token_lp = [], []
    new_support = sparsify(data.new, max_tokens, mass_delta).indices
    for s in range(0, n, REFERENCE_CHUNK):
        rows = slice(s, s + REFERENCE_CHUNK)
        m = data.new[rows].shape[0]
        a_full = torch.log_softmax(data.new[rows], -1)  # (m, V)
        b_true = torch.log_softmax(data.old[rows], -1)  # (m, V)

        in_old = members(vocab, old.indices[rows])
        in_u = members(vocab, old.indices[rows], new_support[rows], data.tokens[rows, None])
        kept = in_old.sum(-1, keepdim=True)  # (m, 1) |S_old|
        spread = old.tail_logmass[rows, None] - (vocab - kept).clamp_min(1).log()  # (m, 1)
        n_rest = (vocab - in_u.sum(-1, keepdim=True)).float()
        a_rest = torch.where(in_u, -math.inf, a_full).logsumexp(-1, keepdim=True)  # (m, 1)
        b_u = torch.where(in_old, b_true, torch.where(in_u, spread, -math.inf))
        b_rest = torch.where(n_rest > 0, spread + n_rest.log(), -math.inf)
        # the problem on U's columns (ids ascending, padded with V) and the rest bucket
        width = int(in_u.sum(-1).max())
        ids = torch.where(in_u, torch.arange(vocab), vocab).sort(-1).values[:, :width]  # (m, L)
        real = ids < vocab
        cols = ids.clamp_max(vocab - 1)
        a = torch.cat([torch.where(real, a_full.gather(-1, cols), -math.inf), a_rest], -1)
        b = torch.cat([torch.where(real, b_u.gather(-1, cols), -math.inf), b_rest], -1)
        logp = project_log_probs(a, b, torch.full((m,), eps))[0]  # (m, L + 1)
        on_u = torch.full((m, vocab + 1), -math.inf).scatter(-1, ids, logp[:, :-1])[:, :vocab]
        full = torch.where(in_u, on_u, logp[:, -1:] + a_full - a_rest)  # (m, V)
        p = full.exp()
        kl.append(torch.where(p > 0, p * (full - b_true), 0.0).sum(-1))
        token_lp.append(full.gather(-1, data.tokens[rows, None]).squeeze(-1))
    return torch.cat(kl), torch.cat(token_lp)


def compare(
    data: Logits,
    eps: float,
    alpha: float,
    grid: Sequence[tuple[int, float]],
    repeats: int = REPEATS,
) -> list[dict]:
    """One record per (max_tokens, mass_delta) of ``grid``: support, errors, time and memory."""
    dense, dense_s, dense_cpu, dense_mib = timed(lambda: dense_pass(data, eps, alpha), repeats)
    n = data.tokens.numel()
    g_dense = dense["grad"].double()
    records = []
    for max_tokens, mass_delta in grid:
        old = sparsify(data.old, max_tokens, mass_delta, keep=data.tokens)  # as a rollout caches
        layer = TrustRegionProjection(eps, max_tokens, mass_delta, support="union")
        sparse, seconds, cpu, mib = timed(lambda: sparse_pass(data, old, layer, alpha), repeats)  # noqa: B023
        full_kl, rebuilt = full_vocabulary_kl(data, old, eps, max_tokens, mass_delta)
        lp_err = (sparse["logprob"] - dense["logprob"]).abs()
        kl_err = (sparse["kl_after"] - dense["kl_after"]).abs()
        outside = (1 - sparse["coverage"]).clamp_min(0)
        # relative to the gradient's size; NaN when it is 0 (all advantages 0, nothing projected)
        grad_err = (sparse["grad"].double() - g_dense).norm() / g_dense.norm()
        cache = old.indices.numel() * 8 + (old.logprobs.numel() + old.num_rows) * 4  # bytes
        records.append(
            {
                "temperature": data.temperature,
                "max_tokens": max_tokens,
                "mass_delta": mass_delta,
                "tokens": n,
                **support_stats(data.old, max_tokens, mass_delta),
                "outside_mean": outside.mean().item(),
                "outside_max": outside.max().item(),
                "support_mean": sparse["support_size"].mean().item(),
                "support_max": sparse["support_size"].max().item(),
                "logprob_err_mean": lp_err.mean().item(),
                "logprob_err_max": lp_err.max().item(),
                "kl_after_err_mean": kl_err.mean().item(),
                "kl_after_err_max": kl_err.max().item(),
                "kl_after_max": sparse["kl_after"].max().item(),
                "kl_after_max_dense": dense["kl_after"].max().item(),
                "full_kl_after_mean": full_kl.mean().item(),
                "full_kl_after_max": full_kl.max().item(),
                "full_kl_after_p90": full_kl.quantile(0.9).item(),
                "over_bound_frac": (full_kl > eps * (1 + 1e-3)).float().mean().item(),
                "over_bound_10pct_frac": (full_kl > eps * 1.1).float().mean().item(),
                "rebuilt_logprob_err_max": (rebuilt - sparse["logprob"]).abs().max().item(),
                "grad_err": grad_err.item(),
                "projected": (sparse["eta"] > 0).float().mean().item(),
                "projected_dense": (dense["kl_before"] > eps).float().mean().item(),
                "ms_per_1k": 1e6 * seconds / n,
                "cpu_ms_per_1k": 1e6 * cpu / n,
                "dense_ms_per_1k": 1e6 * dense_s / n,
                "dense_cpu_ms_per_1k": 1e6 * dense_cpu / n,
                "cache_mib_per_1m": cache / n * 1e6 / 2**20,
                "peak_mib": mib,
                "dense_peak_mib": dense_mib,
            }
        )
    return records


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

COLUMNS = (
    ("T", "temperature", "g"),
    ("K", "max_tokens", "d"),
    ("delta", "mass_delta", "g"),
    ("capped", "cap_frac", ".2f"),
    ("outside mean", "outside_mean", ".1e"),
    ("outside max", "outside_max", ".3f"),
    ("mean abs U", "support_mean", ".0f"),
    ("logprob err mean", "logprob_err_mean", ".1e"),
    ("logprob err max", "logprob_err_max", ".1e"),
    ("KL after err max", "kl_after_err_max", ".1e"),
    ("grad err", "grad_err", ".1e"),
    ("projected", "projected", ".3f"),
    ("projected dense", "projected_dense", ".3f"),
    ("full KL p90", "full_kl_after_p90", ".4f"),
    ("full KL max", "full_kl_after_max", ".3f"),
    ("over 1.1 eps", "over_bound_10pct_frac", ".3f"),
    ("CPU ms / 1k", "cpu_ms_per_1k", ".0f"),
    ("dense CPU ms / 1k", "dense_cpu_ms_per_1k", ".0f"),
    ("cache MiB / 1M", "cache_mib_per_1m", ".0f"),
)


def table(records: Sequence[dict]) -> str:
    head = "| " + " | ".join(title for title, _, _ in COLUMNS) + " |"
    rule = "| " + " | ".join("---" for _ in COLUMNS) + " |"
    lines = [head, rule]
    for record in records:
        cells = [format(record[key], spec) for _, key, spec in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--json",
        type=Path,
        default=ROOT / "studies" / "results" / "smollm2" / "sparse_support.json",
        help="where the figures go",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    config = yaml.safe_load(CONFIG.read_text())
    model = args.model or str(ROOT / config["model"]["model"])
    if not Path(model, "config.json").is_file():
        sys.exit(f"no model folder at {model}: run `make smollm2` first, or pass --model")
    region = config["model"]["trust_region"]
    lr = args.lr or float(config["model"]["optimizer"]["init_args"]["lr"])
    eps, alpha = float(region["eps"]), float(region.get("alpha", 1.0))
    grid = [(k, d) for d in MASS_DELTAS for k in MAX_TOKENS]
    torch.set_grad_enabled(True)
    start = time.perf_counter()
    records, runs = [], []
    batch = prompt_batch(model, config, args.prompts, args.seed)
    for temperature in args.temperatures:
        module = build_module(model, config, temperature, args.max_new_tokens, args.group_size)
        data = rollout_logits(module, batch, args.steps, lr, args.minibatch_size, args.seed)
        del module
        kl_new_old = (
            torch.log_softmax(data.new, -1).exp()
            * (torch.log_softmax(data.new, -1) - torch.log_softmax(data.old, -1))
        ).sum(-1)
        runs.append(
            {
                "temperature": temperature,
                "sequences": data.sequences,
                "tokens": data.tokens.numel(),
                "kl_new_old_mean": kl_new_old.mean().item(),
                "kl_new_old_median": kl_new_old.median().item(),
                "kl_new_old_max": kl_new_old.max().item(),
                "sample_s": data.seconds["sample"],
                "steps_s": data.seconds["steps"],
            }
        )
        print(
            f"T={temperature}: {data.tokens.numel()} response tokens; KL(new || old) per token "
            f"mean {runs[-1]['kl_new_old_mean']:.4f}, max {runs[-1]['kl_new_old_max']:.3f} "
            f"(sampled in {data.seconds['sample']:.0f} s, {args.steps} steps in "
            f"{data.seconds['steps']:.0f} s)",
            flush=True,
        )
        records += compare(data, eps, alpha, grid)
        vocab = data.old.shape[-1]
        del data
    report = {
        "model": Path(model).name,
        "vocab_size": vocab,
        "settings": {
            **{k: v for k, v in vars(args).items() if k != "json"},
            "lr": lr,
            "eps": eps,
            "alpha": alpha,
            "chunk_rows": CHUNK,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "rollouts": runs,
        "rows": records,
        "seconds": time.perf_counter() - start,
    }
    print(table(records))
    print(f"total {report['seconds']:.0f} s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")
    return records


if __name__ == "__main__":
    main()
