"""The staleness study's report by the rules of studies/staleness-plan.md: each arm's endpoints, the
check that a level's sampler differs measurably from the current policy, the primary and secondary
paired comparisons with the plan's verdicts, the secondary figures, and the plots.

A record is a finished run's (:mod:`study_kit`) with ``fields`` ``arm``, ``objective`` and
``seed``; the arm ``s0`` may be the headroom study's runs cut at rollout 40.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paper_regime_study as paper  # noqa: E402
from paper_regime_tables import ACCURACY, ACTIVE, REWARD, training_windows  # noqa: E402
from study_figures import Line, Panel, markdown_table, plot_panels, window_mean  # noqa: E402
from study_stats import Paired, paired, seeds_short  # noqa: E402

ARMS = {
    "s0": (0, "behaviour", paper.STEPS),
    "s2": (2, "behaviour", paper.STEPS),
    "s4": (4, "behaviour", paper.STEPS),
    "s4-proximal": (4, "proximal", paper.STEPS),
    "steps32": (0, "behaviour", 32),
}
"""Arm -> (old_policy.max_staleness, corrections.anchor, optimiser steps per rollout), in the plan's
order; the first is the baseline (no lag)."""
STALE = tuple(a for a, (lag, anchor, _) in ARMS.items() if lag and anchor == "behaviour")
"""The levels the staleness check measures (s2, s4). The KL at a rollout's start is taken against
the objective's anchor, which under the proximal anchor is the current weights (0 by
construction), so an arm under it shares the check of the arm with its sampler's lag."""
PROXIMAL = {a: next(b for b in STALE if ARMS[b][0] == lag)
            for a, (lag, anchor, _) in ARMS.items() if anchor == "proximal"}  # fmt: skip
"""Arm under the proximal anchor -> the arm with the same sampler lag (s4-proximal -> s4)."""
ENDPOINT = (30, 40)
"""The validations whose mean held-out accuracy is a run's endpoint."""
KL_WINDOW = (11, 40)
"""The rollouts over which the KL at a rollout's start is averaged (the staleness check)."""
KL_START = "trust_region/kl_start_mean"
STALE_FACTOR = 2.0
"""A level's KL at the start must exceed this many times s0's to count as stale."""
LATE = (21, 40)
"""The rollouts of the secondary KL at a rollout's end and share of tokens acted on."""
ENTROPY = "entropy"
TRUNCATED = "completion/truncated_frac"
P_MAX = 0.05
SEEDS = 3
OBJECTIVES = ("troll", "clip")


def endpoint(record: dict) -> float | None:
    """The mean held-out accuracy over the validations at the rollouts of :data:`ENDPOINT`."""
    found = [row[ACCURACY] for row in record["history"]
             if row["rollout"] in ENDPOINT and row.get(ACCURACY) is not None]  # fmt: skip
    return statistics.fmean(found) if len(found) == len(ENDPOINT) else None


def by_key(records: Sequence[dict]) -> dict[tuple[str, str, int], dict]:
    """(arm, objective, seed) -> record."""
    return {(r["fields"]["arm"], r["fields"]["objective"], r["fields"]["seed"]): r
            for r in records}  # fmt: skip


def runs_of(records: Sequence[dict], arm: str, objective: str) -> list[dict]:
    """The runs of ``arm`` and ``objective``, by seed."""
    found = [
        r for r in records if (r["fields"]["arm"], r["fields"]["objective"]) == (arm, objective)
    ]
    return sorted(found, key=lambda r: r["fields"]["seed"])


def gaps(records: Sequence[dict]) -> dict[str, dict[int, float]]:
    """arm -> seed -> ``acc(TROLL) - acc(clipping)``, where both runs reached the endpoint."""
    acc = {key: endpoint(r) for key, r in by_key(records).items()}
    out: dict[str, dict[int, float]] = {}
    for (arm, objective, seed), value in acc.items():
        other = acc.get((arm, "clip", seed))
        if objective == "troll" and value is not None and other is not None:
            out.setdefault(arm, {})[seed] = value - other
    return out


def versus(
    values: dict[str, dict[int, float]], arm: str, base: str
) -> tuple[Paired, list[int]] | None:
    """``values[arm][s] - values[base][s]`` paired over the seeds both have."""
    seeds = sorted(set(values.get(arm, {})) & set(values.get(base, {})))
    if not seeds:
        return None
    return paired([values[arm][s] for s in seeds], [values[base][s] for s in seeds]), seeds


def verdict(result: Paired, better: str, worse: str) -> str:
    """The plan's rule on per-seed differences: ``better`` if every one of the 3 seeds is above 0
    and the paired t-test's p is below 0.05; ``worse`` on the mirrored rule; otherwise no
    difference shown, with the mean and spread."""
    n = len(result.diffs)
    if n != SEEDS:
        return seeds_short(SEEDS, n)
    if all(d > 0 for d in result.diffs) and result.p_t < P_MAX:
        return better
    if all(d < 0 for d in result.diffs) and result.p_t < P_MAX:
        return worse
    return (
        f"no difference shown: mean {result.mean:+.3f}, standard deviation "
        f"{statistics.stdev(result.diffs):.3f}"
    )


def kl_start(records: Sequence[dict], arm: str) -> float | None:
    """The mean over ``arm``'s runs of the KL at a rollout's start over :data:`KL_WINDOW`; for
    ``s0`` without the figure (the headroom study did not log it), 0: on-policy, the sampler is
    the policy at a rollout's start."""
    found = [v for r in records if r["fields"]["arm"] == arm
             if (v := window_mean(r, KL_START, KL_WINDOW)) is not None]  # fmt: skip
    if found:
        return statistics.fmean(found)
    return 0.0 if arm == "s0" and any(r["fields"]["arm"] == "s0" for r in records) else None


def stale_check(records: Sequence[dict]) -> tuple[str, set[str]]:
    """The staleness check's lines, and the arms whose sampler does not differ measurably from
    the current policy (their comparisons do not count as ones under stale data)."""
    base = kl_start(records, "s0")
    lines, flat = [], set()
    for arm in STALE:
        mine = kl_start(records, arm)
        if mine is None or base is None:
            continue
        stale = mine > STALE_FACTOR * base
        if not stale:
            flat |= {arm, *(a for a, same in PROXIMAL.items() if same == arm)}
        lines.append(
            f"- {arm}: KL at a rollout's start {mine:.2e} against s0's {base:.2e} "
            f"(rollouts {KL_WINDOW[0]}-{KL_WINDOW[1]}): "
            + ("stale" if stale else f"not measurably stale (not above {STALE_FACTOR:g} x s0's)")
        )
    return "\n".join(lines), flat


def comparisons(records: Sequence[dict]) -> list[str]:
    """The primary comparison and its verdict, then the secondary ones, each with the paired
    differences and tests; each objective's own loss of accuracy with staleness."""
    gap = gaps(records)
    _, flat = stale_check(records)
    lines = []
    rules = [("s4", "s0", "TROLL holds up better under staleness", "clipping holds up better")]
    rules += [(arm, "s0", None, None) for arm in ("s2", "s4-proximal", "steps32")]
    rules += [("s4-proximal", "s4", "TROLL stands better against clipping under the proximal "
               "anchor", "TROLL stands better against clipping under the behaviour anchor")]  # fmt: skip
    for arm, base, better, worse in rules:
        found = versus(gap, arm, base)
        if found is None:
            continue
        result, seeds = found
        line = f"gap({arm}) - gap({base}), seeds {seeds}: {result.text()}"
        if better is not None:
            line += f"; verdict: {verdict(result, better, worse)}"
        if arm in flat or base in flat:
            line += " (a level not measurably stale: not a comparison under stale data)"
        lines.append(line)
    for objective in OBJECTIVES:
        acc = {arm: {r["fields"]["seed"]: v for r in runs_of(records, arm, objective)
                     if (v := endpoint(r)) is not None} for arm in ("s4", "s0")}  # fmt: skip
        found = versus(acc, "s4", "s0")
        if found is not None:
            result, seeds = found
            lines.append(f"acc({objective}, s4) - acc({objective}, s0), seeds {seeds}: "
                         f"{result.text()}")  # fmt: skip
    return lines


def secondary_table(records: Sequence[dict]) -> str:
    """Per arm and objective, means over seeds: the KL at a rollout's end, the share of tokens
    the constraint acts on, the entropy and the share of completions cut at the length limit over
    :data:`LATE`, and the training reward in windows of 10."""
    last = max((row["rollout"] for r in records for row in r["history"]), default=0)
    windows = training_windows(min(last, max(ENDPOINT)))
    rows = []
    for arm in ARMS:
        for objective in OBJECTIVES:
            runs = runs_of(records, arm, objective)
            if not runs:
                continue

            def mean(metric: str, window: tuple[int, int], runs=runs) -> str:
                found = [v for r in runs if (v := window_mean(r, metric, window)) is not None]
                return f"{statistics.fmean(found):.4g}" if found else "-"

            rows.append([
                arm, objective, str(len(runs)), mean("trust_region/kl_end_mean", LATE),
                mean(ACTIVE[objective], LATE), *(mean(m, LATE) for m in (ENTROPY, TRUNCATED)),
                *(mean(REWARD, w) for w in windows),
            ])  # fmt: skip
    late = f"{LATE[0]}-{LATE[1]}"
    header = ["arm", "objective", "seeds", f"KL end mean {late}", f"acts on {late}",
              f"entropy {late}", f"cut at the limit {late}",
              *(f"reward {a}-{b}" for a, b in windows)]  # fmt: skip
    return markdown_table(header, rows, "lll" + "r" * (4 + len(windows)))


def endpoint_table(records: Sequence[dict]) -> str:
    """Per arm and seed: each objective's endpoint, the gap, and the KL at a rollout's start."""
    lines = ["| arm | seed | TROLL | clipping | gap | KL at the start, rollouts 11-40 (TROLL / clipping) |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    keyed = by_key(records)
    for arm in ARMS:
        for seed in sorted({s for a, _, s in keyed if a == arm}):
            runs_ = [keyed.get((arm, o, seed)) for o in OBJECTIVES]
            accs = [None if r is None else endpoint(r) for r in runs_]
            kls = [None if r is None else window_mean(r, KL_START, KL_WINDOW) for r in runs_]
            gap = None if None in accs else accs[0] - accs[1]
            kl = " / ".join(_cell(k, ".2e") for k in kls)
            kl = f"{PROXIMAL[arm]}'s sampler (0 to the proximal anchor)" if arm in PROXIMAL else kl
            cells = [_cell(accs[0]), _cell(accs[1]), _cell(gap, "+.3f"), kl]
            lines.append(f"| {arm} | {seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def report(records: Sequence[dict]) -> str:
    """The plan's endpoints and comparisons over ``records`` (every arm's, s0's included)."""
    check, _ = stale_check(records)
    parts = [endpoint_table(records)]
    if check:
        parts.append(f"how stale each level is:\n{check}\n")
    parts.append("\n".join(["primary first:"] + [f"- {c}" for c in comparisons(records)]) + "\n")
    parts.append(f"secondary figures (means over seeds):\n\n{secondary_table(records)}")
    return "\n".join(parts)


def plot(records: Sequence[dict], path: Path) -> Path:
    """Held-out accuracy per arm (a panel each, both objectives, mean over seeds with a band of one
    standard deviation), then the KL at a rollout's start per arm for each objective (not under
    the proximal anchor, where it is 0 by construction)."""
    colour = {"troll": "C0", "clip": "C1"}
    runs = partial(runs_of, records)
    arms = [arm for arm in ARMS if any(r["fields"]["arm"] == arm for r in records)]
    panels = [
        Panel(f"{arm}: held-out accuracy", "accuracy",
              [Line(runs(arm, o), ACCURACY, o, colour[o]) for o in OBJECTIVES if runs(arm, o)])
        for arm in arms
    ]  # fmt: skip
    panels += [
        Panel(f"{o}: KL(sampler || policy) at a rollout's start", "KL",
              [Line(runs(arm, o), KL_START, arm, band=False) for arm in arms
               if runs(arm, o) and arm not in PROXIMAL])
        for o in OBJECTIVES
    ]  # fmt: skip
    return plot_panels(panels, path)


def _cell(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec)
