"""Plots and tabulates a training run's TensorBoard scalars against rollouts.

    python examples/plot_run.py runs/lightning_troll/version_0 --out curve.png
    python examples/plot_run.py RUN_A RUN_B --labels troll clip --out both.png --json both.json
    python examples/plot_run.py examples/results/smollm2 --start-accuracy 0.435 --out curve.png

Reads the event files under each run folder (what ``lightning-troll fit`` writes), draws the
sampled reward per rollout (with a moving average) and the held-out accuracy on one figure, the
trust region's largest per-token KL (or clip's KL estimate) on a second panel, and prints a per-validation table: the
rollout, the mean sampled reward of the rollouts since the previous validation, the accuracy and
the wall-clock minutes since the first rollout. Needs matplotlib (``pip install -e ".[study]"``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REWARD, ACCURACY = "reward/mean", "val/accuracy"
KL = ("trust_region/kl_after_max", "clip/approx_kl")


def read_scalars(run: Path) -> dict[str, list[tuple[int, float, float]]]:
    """``{tag: [(step, wall_time, value), ...]}`` from every event file under ``run``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(run.rglob("events.out.tfevents.*"))
    if not files:
        raise SystemExit(f"plot_run: no TensorBoard event files under {run}")
    scalars: dict[str, list[tuple[int, float, float]]] = {}
    for file in files:
        events = EventAccumulator(str(file), size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(
                (e.step, e.wall_time, e.value) for e in events.Scalars(tag)
            )
    return {tag: sorted(values) for tag, values in scalars.items()}


def summarise(scalars: dict[str, list[tuple[int, float, float]]]) -> dict[str, object]:
    """Per-rollout rewards and KL, and one row per validation (rollouts are numbered from 1).

    Lightning logs at the count of finished batches: a rollout's reward at that count before it
    (0 for the first), a validation after rollout k at k - 1.
    """
    rewards = scalars.get(REWARD, [])
    if not rewards:
        raise SystemExit(f"plot_run: the run logged no {REWARD!r}")
    start, steps = rewards[0][1], [s for s, _, _ in rewards]
    per_step = max(1, steps[1] - steps[0]) if len(steps) > 1 else 1  # optimiser steps a rollout
    kl_tag = next((t for t in KL if t in scalars), None)
    rows, previous = [], 0
    for step, wall, accuracy in scalars.get(ACCURACY, []):
        rollout = step // per_step + 1
        since = [v for s, _, v in rewards if previous < s // per_step + 1 <= rollout]
        rows.append(
            {
                "rollout": rollout,
                "reward_since_last": sum(since) / len(since) if since else None,
                "accuracy": accuracy,
                "minutes": (wall - start) / 60,
            }
        )
        previous = rollout
    return {
        "reward": [v for _, _, v in rewards],
        "kl_tag": kl_tag,
        "kl": [v for _, _, v in scalars.get(kl_tag, [])] if kl_tag else [],
        "validations": rows,
        "minutes": (rewards[-1][1] - start) / 60,
    }


def moving_average(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def plot(summaries: dict[str, dict], out: Path, window: int, start: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
    for i, (label, summary) in enumerate(summaries.items()):
        colour = f"C{i}"
        rollouts = range(1, len(summary["reward"]) + 1)
        top.plot(rollouts, summary["reward"], color=colour, alpha=0.25, lw=1)
        top.plot(
            rollouts,
            moving_average(summary["reward"], window),
            color=colour,
            label=f"{label}: sampled reward ({window}-rollout mean)",
        )
        val = ([{"rollout": 0, "accuracy": start}] if start is not None else []) + list(
            summary["validations"]
        )
        top.plot(
            [r["rollout"] for r in val],
            [r["accuracy"] for r in val],
            "o--",
            color=colour,
            label=f"{label}: held-out accuracy (greedy)",
        )
        if summary["kl"]:
            bottom.plot(range(1, len(summary["kl"]) + 1), summary["kl"], color=colour, label=label)
    top.set_ylabel("reward / accuracy")
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    bottom.set_ylabel("per-token KL")
    bottom.set_xlabel("rollout")
    bottom.grid(alpha=0.3)
    tags = {s["kl_tag"] for s in summaries.values() if s["kl_tag"]}
    bottom.set_title(", ".join(sorted(tags)), fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (a version_N folder)")
    parser.add_argument("--labels", nargs="+", help="one label per run (default: folder names)")
    parser.add_argument("--out", type=Path, help="write the plot here (PNG)")
    parser.add_argument("--json", type=Path, help="write the summaries here")
    parser.add_argument("--window", type=int, default=5, help="moving-average width in rollouts")
    parser.add_argument(
        "--start-accuracy",
        type=float,
        help="held-out accuracy before training (lightning-troll validate), drawn at rollout 0",
    )
    args = parser.parse_args()
    labels = args.labels or [run.name for run in args.runs]
    if len(labels) != len(args.runs):
        parser.error(f"--labels: {len(labels)} labels for {len(args.runs)} runs")
    if args.window < 1:
        parser.error(f"--window must be >= 1; got {args.window}")
    summaries = {
        label: summarise(read_scalars(run)) for label, run in zip(labels, args.runs, strict=True)
    }
    for label, summary in summaries.items():
        reward = summary["reward"]
        print(f"{label}: {len(reward)} rollouts in {summary['minutes']:.1f} min")
        print("| rollout | mean reward since last validation | held-out accuracy | minutes |")
        print("| ---: | ---: | ---: | ---: |")
        for row in summary["validations"]:
            since = row["reward_since_last"]
            shown = "-" if since is None else f"{since:.3f}"
            print(f"| {row['rollout']} | {shown} | {row['accuracy']:.3f} | {row['minutes']:.1f} |")
    if args.out:
        plot(summaries, args.out, args.window, args.start_accuracy)
        print(f"plot: {args.out}")
    if args.json:
        args.json.write_text(json.dumps(summaries, indent=2) + "\n")


if __name__ == "__main__":
    main()
