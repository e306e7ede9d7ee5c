"""Tables and plots of ``studies/tinymath_study.py``'s run records (:mod:`study_kit`'s format).

- :func:`summarise` and :func:`format_table` (``table.md``): per cell (estimator, objective, K,
  eps, learning rate, clip range, steps per rollout), over seeds: the final held-out accuracy,
  the mean of the last ``LATE`` validations and the rollouts to a threshold;
- :func:`write_plots`: ``accuracy.png``, ``entropy.png``, ``kl_after.png`` and
  ``active_frac.png`` (a panel per estimator, clip against TROLL, mean and standard deviation
  over seeds), ``ablation.png``, ``learning_rate.png`` and ``fair.png``, each where its runs are
  among the records (matplotlib).

Where a run kept the config's learning rate or clip range (``lr`` or ``clip_low`` None), the
tables show ``configs/tinymath.yaml``'s.
"""

from __future__ import annotations

import functools
import math
import statistics
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study_kit import Line, Panel, curve, markdown_table, mean_std, plot_panels  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tinymath.yaml"
OBJECTIVES = ("clip", "troll")
ACCURACY = "val/accuracy"
LATE = 3
"""Validations at the end of a run that the table's second accuracy column averages."""
GSPO_CLIP = (3e-4, 4e-4)
"""GSPO's own clip range for its sequence ratios (low, high), as its paper uses."""
STRESS_STEPS = 8
"""Optimiser steps per rollout of the off-policy stress cell (the budget's minibatches: 4)."""
COLOURS = {"clip": "tab:blue", "troll": "tab:orange"}
"""One colour per objective in every plot."""


@functools.cache
def base_config() -> dict:
    """``configs/tinymath.yaml``, parsed (once)."""
    return yaml.safe_load(CONFIG.read_text())


def learning_rate(fields: dict) -> float:
    """The learning rate a run (its fields, or a table row) trained at: its own, else the
    config's."""
    lr = fields.get("lr")
    return float(base_config()["model"]["optimizer"]["init_args"]["lr"]) if lr is None else lr


def clip_range(row: dict) -> str:
    """A clip row's range as ``low`` or ``low/high`` (the config's where the run kept it)."""
    low = row.get("clip_low")
    low = float(base_config()["model"]["clip"]["eps_low"]) if low is None else low
    high = row.get("clip_high")
    return f"{low:g}" if high is None or math.isclose(high, low) else f"{low:g}/{high:g}"


def rollouts_to_threshold(history: Iterable[dict[str, float]], threshold: float) -> int | None:
    """The first rollout whose held-out accuracy is >= ``threshold``; None if none is."""
    for row in history:
        if ACCURACY in row and row[ACCURACY] >= threshold:
            return int(row["rollout"])
    return None


def final_accuracy(history: Sequence[dict[str, float]], last: int = 1) -> float:
    """The mean of the ``last`` logged held-out accuracies (by default the last one alone)."""
    found = [row[ACCURACY] for row in history if ACCURACY in row]
    if not found:
        raise ValueError("the run logged no val/accuracy")
    return statistics.fmean(found[-last:])


CELL = ("estimator", "objective", "max_tokens", "eps", "lr", "clip_low", "clip_high", "steps")
"""The fields that make a cell of the table: all but the seed."""


def summarise(records: Sequence[dict], threshold: float) -> list[dict]:
    """One row per cell (:data:`CELL`): over seeds, the final accuracy and the mean of each run's
    last ``LATE`` validations (less noisy than one), rollouts to the threshold (mean over the
    seeds that reached it) and how many seeds reached it."""
    cells: dict[tuple, list[dict]] = {}
    for r in records:
        cells.setdefault(tuple(r["fields"].get(k) for k in CELL), []).append(r)
    rows = []
    for cell, members in cells.items():
        mean, std = mean_std([final_accuracy(r["history"]) for r in members])
        late_mean, late_std = mean_std([final_accuracy(r["history"], LATE) for r in members])
        reached = [rollouts_to_threshold(r["history"], threshold) for r in members]
        reached = [s for s in reached if s is not None]
        rows.append(
            {
                **dict(zip(CELL, cell, strict=True)),
                "seeds": len(members),
                "accuracy_mean": mean,
                "accuracy_std": std,
                "late_mean": late_mean,
                "late_std": late_std,
                "rollouts_to_threshold": statistics.fmean(reached) if reached else None,
                "reached": len(reached),
            }
        )
    return rows


def format_table(rows: Sequence[dict], threshold: float, steps: int = 4) -> str:
    """A Markdown table of ``summarise``'s rows (``steps``: the budget's steps per rollout)."""
    header = ["estimator", "objective", "K", "eps", "clip range", "lr", "steps / rollout"]
    header += ["seeds", "final accuracy", f"last {LATE} validations", f"rollouts to {threshold:g}"]
    cells = []
    for r in rows:
        reach = (
            "not reached"
            if r["rollouts_to_threshold"] is None
            else f"{r['rollouts_to_threshold']:.0f} ({r['reached']}/{r['seeds']})"
        )
        troll = r["objective"] == "troll"
        k, eps = (str(r["max_tokens"]), f"{r['eps']:g}") if troll else ("-", "-")
        cells.append(
            [r["estimator"], r["objective"], k, eps, "-" if troll else clip_range(r)]
            + [f"{learning_rate(r):g}", str(r.get("steps") or steps), str(r["seeds"])]
            + [f"{r['accuracy_mean']:.3f} ± {r['accuracy_std']:.3f}"]
            + [f"{r['late_mean']:.3f} ± {r['late_std']:.3f}", reach]
        )
    return markdown_table(header, cells)


# -- plots ---------------------------------------------------------------------------------------


def is_main(fields: dict) -> bool:
    """True for runs with the config's trust region (K 64, eps 0.05), learning rate, clip range
    and steps per rollout, i.e. not ablation, stress or fair-baseline runs."""
    return (
        fields["max_tokens"] == 64
        and math.isclose(fields["eps"], 0.05)
        and all(fields.get(key) is None for key in ("lr", "clip_low", "clip_high", "steps"))
    )


def of(records: Sequence[dict], **wanted) -> list[dict]:
    """The records whose fields have the ``wanted`` values."""
    return [r for r in records if all(r["fields"].get(k) == v for k, v in wanted.items())]


def estimator_panels(records: Sequence[dict], series, ylabel: str, bound: bool) -> list[Panel]:
    """One panel per estimator; per ``(objective, metric, label)`` of ``series``, the mean over
    seeds of that objective's ``metric`` (an objective's later series dashed, then dotted).
    ``bound``: a line at the trust region's bound, as TROLL runs logged it."""
    panels = []
    for estimator in dict.fromkeys(r["fields"]["estimator"] for r in records):
        lines, drawn = [], dict.fromkeys(OBJECTIVES, 0)
        for objective, metric, label in series:
            runs = of(records, estimator=estimator, objective=objective)
            if curve(runs, metric)[0]:
                style = ("-", "--", ":")[drawn[objective] % 3]
                lines.append(Line(runs, metric, f"{objective}: {label}", COLOURS[objective], style))
                drawn[objective] += 1
        eps = curve(of(records, estimator=estimator, objective="troll"), "trust_region/bound")[1]
        hlines = [(eps[0], "bound eps")] if bound and eps else []
        panels.append(Panel(estimator, ylabel, lines, hlines))
    return panels


def ablation_panel(records: Sequence[dict]) -> Panel:
    """Held-out accuracy of every GRPO + TROLL run of seed 0 (K and eps vary)."""
    runs = of(records, estimator="grpo", objective="troll", seed=0, lr=None, steps=None)
    lines = [
        Line(
            [r], ACCURACY, f"K {r['fields']['max_tokens']}, eps {r['fields']['eps']:g}", band=False
        )
        for r in runs
    ]
    return Panel("", "held-out accuracy", lines)


def learning_rate_panels(records: Sequence[dict]) -> list[Panel]:
    """Held-out accuracy of the GRPO runs of seed 0, one panel per learning rate (the config's
    and the stress test's), clip against TROLL."""
    runs = of(records, estimator="grpo", seed=0, max_tokens=64, eps=0.05)
    runs = [r for r in runs if not r["fields"].get("steps")]
    rates = sorted({learning_rate(r["fields"]) for r in runs}) or [learning_rate({})]
    panels = []
    for lr in rates:
        mine = [r for r in runs if math.isclose(learning_rate(r["fields"]), lr)]
        lines = [
            Line(
                [r],
                ACCURACY,
                r["fields"]["objective"],
                COLOURS[r["fields"]["objective"]],
                band=False,
            )
            for r in mine
        ]
        panels.append(Panel(f"GRPO, lr {lr:g}", "held-out accuracy", lines))
    return panels


def fair_panels(records: Sequence[dict]) -> list[Panel]:
    """The fair-baseline cells over seeds: GSPO + clip at GSPO's clip range (against GSPO +
    TROLL where the main grid ran it); GRPO at ``STRESS_STEPS`` steps per rollout, clip against
    TROLL, in held-out accuracy and per-token KL."""
    narrow = [r for r in of(records, estimator="gspo") if r["fields"].get("clip_low") is not None]
    gspo_troll = [
        r for r in of(records, estimator="gspo", objective="troll") if is_main(r["fields"])
    ]
    clip, troll = (
        of(records, estimator="grpo", objective=o, steps=STRESS_STEPS) for o in OBJECTIVES
    )
    low, high = GSPO_CLIP
    stress = f"GRPO, {STRESS_STEPS} steps per rollout"
    return [
        Panel(
            "GSPO, its own clip range",
            "held-out accuracy",
            [
                Line(narrow, ACCURACY, f"clip {low:g}/{high:g}", COLOURS["clip"]),
                Line(gspo_troll, ACCURACY, "troll", COLOURS["troll"]),
            ],
        ),
        Panel(
            stress,
            "held-out accuracy",
            [
                Line(runs, ACCURACY, o, COLOURS[o])
                for o, runs in zip(OBJECTIVES, (clip, troll), strict=True)
            ],
        ),
        Panel(
            f"{stress}: per-token KL",
            "per-token KL",
            [
                Line(clip, "clip/approx_kl", "clip: mean k3 KL(old || new)", COLOURS["clip"]),
                Line(
                    troll,
                    "trust_region/kl_after_max",
                    "troll: max KL(proj || old)",
                    COLOURS["troll"],
                ),
                Line(
                    troll,
                    "trust_region/kl_after_mean",
                    "troll: mean KL(proj || old)",
                    COLOURS["troll"],
                    "--",
                ),
            ],
        ),
    ]


def write_plots(records: Sequence[dict], out: Path) -> list[Path]:
    """The study's PNGs in ``out`` (those its runs have data for); returns their paths."""
    main = [r for r in records if is_main(r["fields"])]
    kl_after = [
        ("clip", "clip/approx_kl", "mean k3 estimate of KL(old || new)"),
        ("troll", "trust_region/kl_after_max", "max KL(proj || old)"),
        ("troll", "trust_region/kl_after_mean", "mean KL(proj || old)"),
    ]
    active = [
        ("clip", "clip/active_frac", "share of tokens clipped"),
        ("troll", "trust_region/active_frac", "share of tokens projected"),
    ]
    grids = {
        "accuracy.png": ([(o, ACCURACY, "held-out accuracy") for o in OBJECTIVES], "accuracy"),
        "entropy.png": ([(o, "entropy", "entropy") for o in OBJECTIVES], "entropy"),
        "kl_after.png": (kl_after, "per-token KL"),
        "active_frac.png": (active, "share of tokens"),
    }
    paths = []
    for name, (series, ylabel) in grids.items() if main else ():
        panels = estimator_panels(main, series, ylabel, bound=name == "kl_after.png")
        paths.append(plot_panels(panels, out / name))
    fair = [
        r for r in records if r["fields"].get("clip_low") is not None or r["fields"].get("steps")
    ]
    if main or any(not is_main(r["fields"]) and r not in fair for r in records):  # ablation, stress
        paths.append(plot_panels([ablation_panel(records)], out / "ablation.png", size=(5, 3.2)))
        paths.append(plot_panels(learning_rate_panels(records), out / "learning_rate.png"))
    if fair:
        paths.append(plot_panels(fair_panels(records), out / "fair.png"))
    return paths
