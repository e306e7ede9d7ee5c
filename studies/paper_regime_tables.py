"""The paper-regime study's tables and plots, from its records (``studies/paper_regime_study.py``;
``studies/unseen_task_check.py`` reports in the same format).

A record is a finished run's (:mod:`study_kit`): its ``fields`` (objective, lr, seed, and
``support``, ``cause`` or ``steps`` where a run changes them) and its ``history`` per rollout.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study_figures import window_mean as figures_window_mean  # noqa: E402
from study_kit import (  # noqa: E402
    TIME,
    markdown_table,
    mean_std,
    plot_curves,
    run_mean,
    values,
    write_atomic,
)
from study_stats import paired  # noqa: E402

ACCURACY, REWARD = "val/accuracy", "reward/mean"
ACTIVE = {"troll": "trust_region/active_frac", "clip": "clip/active_frac"}
"""The share of tokens each objective's constraint acts on (TROLL: projected; clipping: clipped)."""
PLOTS = (
    (ACCURACY, "held-out accuracy", "accuracy", None),
    (REWARD, "mean reward", "reward", None),
    ("entropy", "entropy", "entropy", None),
    ("trust_region/kl_end_mean", "KL(new || old) at the rollout's end", "kl_end", 0.05),
)
"""(metric, label, file name, bound) of each plot of :func:`plot_arms`."""
CONFIDENCE = ("below_0.5", "0.5_0.8", "0.8_0.95", "above_0.95")
"""The bins of the old policy's probability of the sampled token (``trust_region/by_confidence``)."""
ADVANTAGE = ("positive", "negative", "zero")
"""The bins of the advantage's sign (``trust_region/by_advantage``)."""


def pilot_score(record: dict) -> float:
    """Held-out accuracy of a pilot: the mean of its last 2 validations."""
    return statistics.fmean(values(record, ACCURACY)[-2:])


def active_share(record: dict) -> float:
    """The mean share of tokens the run's constraint acted on, over its rollouts."""
    return run_mean(record, ACTIVE[record["fields"]["objective"]]) or 0.0


def pilot_table(pilots: Sequence[dict]) -> str:
    lines = [
        "| objective | lr | held-out accuracy (last 2 validations) | constraint acts on | "
        "KL end, mean | reward, last 5 rollouts |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in sorted(pilots, key=lambda r: (r["fields"]["objective"], r["fields"]["lr"])):
        f = r["fields"]
        kl = run_mean(r, "trust_region/kl_end_mean")
        lines.append(
            f"| {f['objective']} | {f['lr']:g} | {pilot_score(r):.3f} | {active_share(r):.2%} | "
            f"{kl if kl is not None else float('nan'):.4f} | {run_mean(r, REWARD, 5):.3f} |"
        )
    return "\n".join(lines) + "\n"


def support(fields: dict) -> str:
    """The support a run's projection used: ``-`` for clipping, which projects nothing. A main run
    names it in ``support``, a cause test in ``cause``."""
    if fields["objective"] == "clip":
        return "-"
    return "dense" if "dense" in (fields.get("support"), fields.get("cause")) else "official"


def cause_table(causes: Sequence[dict], pilots: Sequence[dict], lr: float, steps: int) -> str:
    """The cause tests beside the pilots they change, at ``lr`` (accuracy: last 2 validations)."""
    lines = [
        "| run | objective | steps per rollout | support | held-out accuracy | entropy at rollout "
        "5 | entropy, last 5 | constraint acts on | KL end, mean |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    same = sorted((r for r in pilots if r["fields"]["lr"] == lr), key=lambda r: r["name"])
    for r in same + list(causes):
        f, entropy, nan = r["fields"], values(r, "entropy"), float("nan")
        kl = run_mean(r, "trust_region/kl_end_mean")
        lines.append(
            f"| {r['name']} | {f['objective']} | {f.get('steps', steps)} | "
            f"{support(f)} | {pilot_score(r):.3f} | "
            f"{entropy[4] if len(entropy) > 4 else nan:.2f} | {run_mean(r, 'entropy', 5) or nan:.2f}"
            f" | {active_share(r):.2%} | {kl if kl is not None else nan:.4f} |"
        )
    return "\n".join(lines) + "\n"


def arm(record: dict) -> str:
    f = record["fields"]
    return f"{f['objective']}{' dense' if support(f) == 'dense' else ''} lr {f['lr']:g}"


def by_arm(records: Sequence[dict]) -> dict[str, list[dict]]:
    """``records`` grouped by :func:`arm`, in the order the arms first appear."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(arm(r), []).append(r)
    return groups


def thirds(rollouts: Sequence[int]) -> list[tuple[int, int]]:
    """``rollouts`` (the shared validation points, sorted) cut into three windows of as equal a
    count as they allow, each ``(first, last)``: fixed by the run's length, not by where a gap
    is widest."""
    n = len(rollouts)
    cuts = [round(i * n / 3) for i in range(4)]
    return [(rollouts[a], rollouts[b - 1]) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


def main_table(records: Sequence[dict]) -> str:
    """Per arm: held-out accuracy over the first and the last third of the validations every
    run shares (:func:`thirds`), per seed for the last, and the arm's means of the rest."""
    shared = shared_rollouts(records)
    windows = thirds(shared) or [(0, 0)]  # no shared validation after the start: NaN
    early, late = windows[0], windows[-1]
    lines = [
        f"| arm | seeds | accuracy, rollouts {late[0]}-{late[1]}, per seed | mean ± std | accuracy,"
        f" rollouts {early[0]}-{early[1]} | reward, last 10 | entropy, last 10 | KL end mean / "
        "largest | constraint acts on | median s / rollout |",
        "| --- | ---: | --- | --- | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for name, runs in by_arm(records).items():
        late_acc = [window_mean(r, ACCURACY, late, shared) for r in runs]
        mean, std = mean_std(late_acc)
        first = mean_std([window_mean(r, ACCURACY, early, shared) for r in runs])[0]
        kl = mean_std([run_mean(r, "trust_region/kl_end_mean") or 0.0 for r in runs])[0]
        kl_max = max(max(values(r, "trust_region/kl_end_max") or [0.0]) for r in runs)
        seconds = statistics.median(t for r in runs for t in values(r, TIME))
        lines.append(
            f"| {name} | {len(runs)} | {', '.join(f'{x:.3f}' for x in late_acc)} | {mean:.3f} ± "
            f"{std:.3f} | {first:.3f} | {mean_std([run_mean(r, REWARD, 10) for r in runs])[0]:.3f} |"
            f" {mean_std([run_mean(r, 'entropy', 10) for r in runs])[0]:.3f} | {kl:.4f} / "
            f"{kl_max:.2f} | {mean_std([active_share(r) for r in runs])[0]:.2%} | {seconds:.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot_arms(records: Sequence[dict], folder: Path, plots=PLOTS) -> None:
    """A PNG per plot of ``plots`` in ``folder``: each arm's curve (the mean over its seeds)."""
    groups = by_arm(records)
    for metric, label, name, bound in plots:
        print(f"wrote {plot_curves(groups, metric, label, folder / f'{name}.png', bound)}")


def training_windows(last: int) -> list[tuple[int, int]]:
    """Windows of 10 rollouts up to ``last``, for figures logged every rollout."""
    return [(a, min(a + 9, last)) for a in range(1, last + 1, 10)]


def shared_rollouts(records: Sequence[dict], metric: str = ACCURACY) -> list[int]:
    """The rollouts (after 0) at which every run of ``records`` logged ``metric``: the points
    runs compare on (a run stopped and resumed once validated on its way out too)."""
    found = [{row["rollout"] for row in r["history"] if metric in row} for r in records]
    return sorted(x for x in set.intersection(*found) if x > 0) if found else []


def window_mean(record: dict, metric: str, window: tuple[int, int], at=None) -> float:
    """:func:`study_figures.window_mean`, NaN instead of None where no rollout of the window logs
    ``metric``, so that it carries through these tables' means."""
    found = figures_window_mean(record, metric, window, at)
    return math.nan if found is None else found


def bins_table(groups: dict[str, Sequence[dict]], window=(0, math.inf), label="arm") -> str:
    """Per group of runs and constraint mask (TROLL: ``projected``; clipping: ``clipped`` and
    ``outside``): the mean share of each confidence and advantage bin's tokens the constraint
    acts on over the rollouts in ``window`` (inclusive), and each bin's share of the tokens;
    ``label`` heads the groups' column."""
    rows = []
    for name, runs in groups.items():
        keys = {k for r in runs for row in r["history"] for k in row}
        masks = sorted({k.rsplit("/", 1)[1] for k in keys
                        if k.startswith("trust_region/by_confidence/")} - {"tokens"})  # fmt: skip
        for mask in [*masks, "tokens"]:
            cells = []
            for group, bins in (("by_confidence", CONFIDENCE), ("by_advantage", ADVANTAGE)):
                for b in bins:
                    key = f"trust_region/{group}/{b}/{mask}"
                    found = [v for r in runs if not math.isnan(v := window_mean(r, key, window))]
                    cells.append(f"{statistics.fmean(found):.2%}" if found else "-")
            rows.append([name, mask, *cells])
    header = [label, "share of", *(f"p {c}" for c in CONFIDENCE), "A > 0", "A < 0", "A = 0"]
    return markdown_table(header, rows, "ll" + "r" * 7)


def seed_pairs(records: Sequence[dict], a: str, b: str) -> list[tuple[dict, dict]]:
    """(run of arm ``a``, run of arm ``b``) per seed both arms ran, by seed."""
    by_seed: dict[int, dict[str, dict]] = {}
    for r in records:
        by_seed.setdefault(r["fields"]["seed"], {})[arm(r)] = r
    return [(runs[a], runs[b]) for _, runs in sorted(by_seed.items()) if a in runs and b in runs]


def paired_table(
    records: Sequence[dict], a: str, b: str, figures: Sequence[str] = (REWARD, "entropy")
) -> str:
    """Arm ``a`` against arm ``b``, paired by seed: held-out accuracy over the :func:`thirds` of
    the validations every run shares, then each of ``figures`` over windows of 10 rollouts;
    each row the two means, the per-seed differences ``a - b``, their mean and the paired t and
    sign tests."""
    pairs = seed_pairs(records, a, b)
    points = shared_rollouts([r for pair in pairs for r in pair])
    shared, last = set(points), max(row["rollout"] for x, _ in pairs for row in x["history"])
    lines = [
        f"| figure | rollouts | {a} | {b} | difference: mean (per seed); tests |",
        "| --- | --- | ---: | ---: | --- |",
    ]
    rows = [(ACCURACY, w, shared) for w in thirds(points)]
    rows += [(m, w, None) for m in figures for w in training_windows(last)]
    for metric, window, at in rows:
        first = [window_mean(x, metric, window, at) for x, _ in pairs]
        second = [window_mean(y, metric, window, at) for _, y in pairs]
        where = f"{window[0]}-{window[1]}"
        if at is not None:
            where = ", ".join(str(x) for x in sorted(shared) if window[0] <= x <= window[1])
        lines.append(
            f"| {metric} | {where} | {statistics.fmean(first):.3f} | "
            f"{statistics.fmean(second):.3f} | {paired(first, second).text()} |"
        )
    return "\n".join(lines) + "\n"


def compare_arms(
    records: Sequence[dict],
    lr: float | None,
    folder: Path,
    figures: Sequence[str] = (REWARD, "entropy"),
) -> None:
    """Writes into ``folder`` and prints the main table (``table.md``), TROLL against clipping
    paired by seed at ``lr`` where both ran there (``paired.md``, with ``figures`` in windows of
    10 rollouts), and the plots."""
    text = main_table(records)
    write_atomic(folder / "table.md", text)
    print(text)
    troll, clip = (f"{o} lr {lr:g}" for o in ("troll", "clip")) if lr is not None else ("", "")
    if lr is not None and seed_pairs(records, troll, clip):
        text = paired_table(records, troll, clip, figures)
        write_atomic(folder / "paired.md", text)
        print(
            f"TROLL against clipping, paired by seed, on the validations every run shares:\n{text}"
        )
    plot_arms(records, folder)
