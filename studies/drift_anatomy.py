"""Where a rollout's drift from the behaviour policy comes from: clip against TROLL, step by step.

    python studies/drift_anatomy.py --checkpoint runs/<run>/checkpoints/last.ckpt
    python studies/drift_anatomy.py --checkpoint ... --alphas 10 --json studies/results/smollm2/drift_anatomy.json
    python studies/drift_anatomy.py --report studies/results/smollm2/drift_anatomy.json   # its table
    python studies/drift_anatomy.py --boundary     # the KL clip's range allows, against eps

TROLL bounds the KL of each step's *target*, the projection of the policy's distribution at a
token onto the ball KL <= eps around the behaviour policy; clipping cuts the gradient of tokens
whose ratio left [1 - eps_low, 1 + eps_high]. Neither sees a token before the step whose
minibatch holds it, and by then the earlier steps of the rollout, taken on other sequences, may
have moved it already. This script separates the two.

From a training checkpoint (its weights, optimiser and scheduler state), for each of
``--repeats`` rollouts sampled from the checkpoint's policy (the same rollout for both
objectives), it takes the rollout's ``--steps`` optimiser steps once with clipping and once with
TROLL, on the same shuffled minibatches, and measures per response token KL(pi || pi_old) of
every minibatch (:func:`lightning_troll.rollouts.drift.drift_from_behaviour`: between the lumped sparse
distributions, what TROLL's projection bounds, and the sampled estimate over the whole
vocabulary from the sampled tokens' log-ratios) at three moments:

- ``arrive``: before the minibatch's own step (what the earlier steps, on other sequences, did
  to it; zero for the first, on-policy minibatch);
- ``own``: right after its own step;
- ``end``: after the rollout's last step (for the last minibatch, ``own`` and ``end`` are what
  ``trust_region_monitor.kl_end`` logs during training).

Per objective and minibatch position it prints the mean, the largest and the share of tokens
above eps of each; at the rollout's end, the sampled estimate over the whole vocabulary and, of
the sampled tokens' ratios pi(o_t) / pi_old(o_t), the share outside the checkpoint's clip range
and the largest; and, over the tokens that arrive above eps, their mean KL before and after
their own step: clipping cuts such a token's gradient, TROLL's loss keeps one through the
projection and adds its regression term, ``alpha`` x KL(pi || sg(projection)), which pulls the
policy toward the projection. ``--alphas`` adds TROLL at other regression weights. Everything
else follows the checkpoint's options (``model.*`` as stored in it, eps and alpha included); the
checkpoint itself is only read. JSON goes to ``--json``.

``--boundary`` needs no checkpoint: for a token of probability p under the behaviour policy
whose ratio moves to clip's boundary (the other tokens scaled to keep the sum, as the lumped
distribution does), it prints the KL that costs, and the ratios a KL bound eps allows that token
(``--bounds``), next to clip's range (``--clip-range``); the maths is in ``clip_boundary.py``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "studies"))
# --boundary's maths is in clip_boundary.py; its names stay importable from here
from clip_boundary import BOUNDARY_PROBS as BOUNDARY_PROBS  # noqa: E402
from clip_boundary import allowed_ratios as allowed_ratios  # noqa: E402
from clip_boundary import boundary_table  # noqa: E402
from clip_boundary import moved_kl as moved_kl  # noqa: E402

from lightning_troll.rollouts.drift import drift_from_behaviour, sampled_kl  # noqa: E402

MOMENTS = ("arrive", "own", "end")


def variants(alphas: Sequence[float]) -> dict[str, dict]:
    """Name -> (objective, trust-region overrides): clip, TROLL as stored, TROLL at each alpha."""
    named = {"clip": {"objective": "clip"}, "troll": {"objective": "troll"}}
    for alpha in alphas:
        named[f"troll alpha {alpha:g}"] = {"objective": "troll", "alpha": alpha}
    return named


def load_module(checkpoint: Path, stored: dict, variant: dict, model: str | None):
    """(module, optimiser, scheduler or None): the checkpoint's module as ``variant`` says
    (objective, and alpha when given), caching sparse old rows for the KL, with its optimiser
    and scheduler in the checkpoint's state. ``stored`` is the checkpoint, read once."""
    from lightning_troll.training.module import TrollModule

    overrides: dict = {"objective": variant["objective"]}
    if "alpha" in variant:
        region = stored["hyper_parameters"]["trust_region"]
        region = region if isinstance(region, dict) else vars(region)
        overrides["trust_region"] = {**region, "alpha": variant["alpha"]}
    path = model or stored["hyper_parameters"]["model"]
    if not Path(path).exists() and (ROOT / path).exists():
        path = str(ROOT / path)  # a config's relative folder, from another working directory
    overrides["model"] = path
    module = TrollModule.load_from_checkpoint(checkpoint, map_location="cpu", **overrides)
    module.keep_old_distributions()
    configured = module.configure_optimizers()
    optimizer = configured["optimizer"] if isinstance(configured, dict) else configured
    # a copy: AdamW updates its state in place, and every variant starts from the stored one
    optimizer.load_state_dict(copy.deepcopy(stored["optimizer_states"][0]))
    scheduler = None
    if isinstance(configured, dict):
        scheduler = configured["lr_scheduler"]["scheduler"]
        scheduler.load_state_dict(stored["lr_schedulers"][0])
    return module, optimizer, scheduler


def prompt_batch(module, data_options: dict, count: int, seed: int):
    """``count`` training prompts drawn with ``seed``, as the run's data module builds them."""
    from lightning_troll.tasks.data import PromptDataModule
    from lightning_troll.tasks.data.prompts import draw_prompts

    options = {k: v for k, v in data_options.items() if not k.startswith("_")}
    options["tokenizer"] = module.hparams.model
    for key in ("source", "val_file"):
        value = options.get(key)
        if value and not Path(value).exists() and (ROOT / value).exists():
            options[key] = str(ROOT / value)
    data = PromptDataModule(**options)
    data.setup("fit")
    return draw_prompts(data.train_items, count, seed, "drift-anatomy")


def step(module, optimizer, scheduler, minibatch, clip_norm: float | None) -> None:
    """One optimiser step on ``minibatch``, as training takes it (in one pass: the gradient its
    micro-batches would accumulate), with the run's gradient clipping and scheduler."""
    module.policy.train()
    loss, _ = module.loss_of(minibatch)
    loss.backward()
    if clip_norm is not None:
        torch.nn.utils.clip_grad_norm_(module.policy.parameters(), clip_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()
    module.policy.eval()


def summarise(before: torch.Tensor, after: torch.Tensor, eps: float) -> dict:
    """Figures of one moment (``after``) and, for tokens that were above eps in ``before``, their
    mean before and after."""
    over = before > eps
    return {
        "mean": after.mean().item(),
        "max": after.max().item(),
        "over_frac": (after > eps).float().mean().item(),
        "arrived_over": int(over.sum()),
        "arrived_over_before": before[over].mean().item() if over.any() else None,
        "arrived_over_after": after[over].mean().item() if over.any() else None,
    }


def clip_range(module) -> tuple[float, float]:
    """(1 - eps_low, 1 + eps_high) of the checkpoint's ``model.clip``."""
    clip = module.hparams.clip
    clip = clip if isinstance(clip, dict) else vars(clip)
    low = float(clip["eps_low"])
    high = low if clip.get("eps_high") is None else float(clip["eps_high"])
    return 1.0 - low, 1.0 + high


def anatomy(module, optimizer, scheduler, rollout, steps: int, seed: int) -> list[dict]:
    """Per minibatch position: KL at ``arrive``, ``own`` and ``end`` (summaries), with the
    sampled tokens' ratios pi / pi_old."""
    clip_norm = module.minibatch_loop.config.gradient_clip_norm
    eps = module.old_rows.rule.eps
    low, high = clip_range(module)
    size = rollout.num_sequences // steps
    minibatches = rollout.minibatches(size, torch.Generator().manual_seed(seed))

    def drift(minibatch):  # (lumped KL, log-ratio of the sampled token), per token
        return drift_from_behaviour(
            module.policy,
            minibatch,
            module.old_rows.rule,
            module.optimization.logits_chunk_size,
            module.optimization.share_prompts,
        )

    arrive, own = [], []
    for minibatch in minibatches:
        arrive.append(drift(minibatch))
        step(module, optimizer, scheduler, minibatch, clip_norm)
        own.append(drift(minibatch))
    end = [drift(m) for m in minibatches]
    rows = []
    for k in range(len(minibatches)):
        row = {"position": k + 1, "tokens": int(arrive[k][0].numel())}
        first = arrive[k][0]
        for name, (lumped, log_ratio) in zip(MOMENTS, (arrive[k], own[k], end[k]), strict=True):
            row[name] = summarise(first, lumped, eps)
            ratio = log_ratio.double().exp()
            row[name]["sampled_mean"] = sampled_kl(log_ratio.double()).mean().item()
            row[name]["ratio_outside_clip"] = ((ratio < low) | (ratio > high)).float().mean().item()
            row[name]["ratio_max"] = ratio.max().item()
            row[name]["ratio_min"] = ratio.min().item()
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> dict:

    torch.set_grad_enabled(True)
    stored = torch.load(args.checkpoint, map_location="cpu", weights_only=False, mmap=True)
    data_options = stored.get("datamodule_hyper_parameters")
    if not data_options:
        sys.exit(f"--checkpoint: {args.checkpoint} holds no data module options")
    prompts = args.prompts or int(data_options.get("batch_size", 8))
    sequences = prompts * int(stored["hyper_parameters"]["group_size"])
    if sequences % args.steps:
        sys.exit(f"--steps: {args.steps} does not divide the rollout's {sequences} sequences")
    results = {"checkpoint": str(args.checkpoint), "global_step": stored["global_step"]}
    results["variants"] = variants(args.alphas)
    results["repeats"] = []
    started = time.perf_counter()
    for repeat in range(args.repeats):
        seed = args.seed + repeat
        entry, rollout = {"seed": seed, "objectives": {}}, None
        for name, variant in results["variants"].items():  # one module in memory at a time
            module, optimizer, scheduler = load_module(args.checkpoint, stored, variant, args.model)
            if rollout is None:  # sampled once: the same rollout, old rows and advantages for all
                batch = prompt_batch(module, data_options, prompts, seed)
                torch.manual_seed(seed)
                module.policy.eval()
                rollout, _ = module.collector.collect(batch)
                entry["sequences"] = rollout.num_sequences
            entry["objectives"][name] = anatomy(
                module, optimizer, scheduler, rollout, args.steps, seed
            )
            results["eps"] = module.old_rows.rule.eps
            del module, optimizer, scheduler
        results["repeats"].append(entry)
        print(
            f"rollout {repeat + 1}/{args.repeats}: {entry['sequences']} sequences, "
            f"{time.perf_counter() - started:.0f} s",
            flush=True,
        )
    results["seconds"] = time.perf_counter() - started
    return results


def table(results: dict) -> str:
    """Means over repeats, per objective and minibatch position."""
    eps = results["eps"]

    def mean(values):
        values = [v for v in values if v is not None]
        return statistics.fmean(values) if values else float("nan")

    lines = [
        f"| objective | minibatch | KL arriving: mean / max / share > {eps:g} | after its step "
        "| at the rollout's end | tokens arriving > eps: KL before -> after its step "
        "| sampled KL at the end (mean) | sampled tokens at the end: ratio outside the clip range "
        "/ largest ratio |",
        "| --- | ---: | --- | --- | --- | --- | ---: | --- |",
    ]
    for objective in results["repeats"][0]["objectives"]:
        rows = [r["objectives"][objective] for r in results["repeats"]]
        for k in range(len(rows[0])):
            cells = [r[k] for r in rows]

            def moment(name, cells=cells):
                return (  # a KL is >= 0: rounding's -1e-9 shows as 0
                    f"{max(0.0, mean(c[name]['mean'] for c in cells)):.4f} / "
                    f"{mean(c[name]['max'] for c in cells):.3f} / "
                    f"{100 * mean(c[name]['over_frac'] for c in cells):.1f}%"
                )

            def ratios(cells=cells):  # older JSON has no ratios
                if "ratio_max" not in cells[0]["end"]:
                    return "-"
                outside = 100 * mean(c["end"]["ratio_outside_clip"] for c in cells)
                return f"{outside:.1f}% / {max(c['end']['ratio_max'] for c in cells):.2f}"

            count = sum(c["own"]["arrived_over"] for c in cells)
            pulled = (
                f"{mean(c['own']['arrived_over_before'] for c in cells):.3f} -> "
                f"{mean(c['own']['arrived_over_after'] for c in cells):.3f} ({count} tokens)"
                if count
                else "none"
            )
            lines.append(
                f"| {objective} | {k + 1} | {moment('arrive')} | {moment('own')} | "
                f"{moment('end')} | {pulled} | {mean(c['end']['sampled_mean'] for c in cells):.4f} | "
                f"{ratios(cells)} |"
            )
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", type=Path, help="a training run's last.ckpt")
    p.add_argument(
        "--report", type=Path, default=None, help="print the table of a saved JSON; train nothing"
    )
    p.add_argument("--model", default=None, help="model folder (default: the checkpoint's)")
    p.add_argument("--steps", type=int, default=4, help="optimiser steps per rollout")
    p.add_argument("--repeats", type=int, default=3, help="rollouts, each from the checkpoint")
    p.add_argument("--prompts", type=int, default=None, help="prompts per rollout (the run's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first rollout")
    p.add_argument("--alphas", type=float, nargs="*", default=[], help="TROLL also at these alphas")
    p.add_argument("--json", type=Path, default=None, help="where the figures go")
    p.add_argument(
        "--boundary", action="store_true", help="print the KL at clip's range against eps; no run"
    )
    p.add_argument(
        "--clip-range", type=float, nargs=2, default=[0.8, 1.2], metavar=("LOW", "HIGH"),
        help="--boundary: clip's ratio range (0.8 1.2)",
    )  # fmt: skip
    p.add_argument(
        "--bounds", type=float, nargs="+", default=[0.05, 0.2], help="--boundary: KL bounds"
    )
    args = p.parse_args(argv)
    if args.boundary:
        low, high = args.clip_range
        if not 0 <= low < 1 < high:
            p.error(f"--clip-range must satisfy 0 <= LOW < 1 < HIGH; got {low:g} {high:g}")
        if any(not e > 0 for e in args.bounds):
            p.error(f"--bounds must be > 0; got {args.bounds}")
        return args
    if args.report is not None:
        if not args.report.is_file():
            p.error(f"--report: no file at {args.report}")
        return args
    if args.checkpoint is None:
        p.error("--checkpoint is required (or --report to print a saved JSON's table)")
    if not args.checkpoint.is_file():
        p.error(f"--checkpoint: no file at {args.checkpoint}")
    for name in ("steps", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1; got {getattr(args, name)}")
    if args.prompts is not None and args.prompts < 1:
        p.error(f"--prompts must be >= 1; got {args.prompts}")
    if any(not a >= 0 for a in args.alphas):
        p.error(f"--alphas must be >= 0; got {args.alphas}")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.boundary:
        print(boundary_table(*args.clip_range, args.bounds))
        return {}
    if args.report is not None:
        results = json.loads(args.report.read_text())
        print(table(results))
        return results
    results = run(args)
    text = table(results)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
