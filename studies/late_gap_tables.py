"""Tables and plots of the late-gap branch test (:mod:`late_gap_branches`), by the rules of
studies/late-gap-plan.md: the late window, the paired differences against the control, the clipping
arm's recovery, the secondary figures, the constraint bins, and the trunks' reproducibility.

A record is a finished run's (:mod:`study_kit`); a branch's history holds its own rollouts
(after the trunk's), a trunk's the start and its rollouts.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paper_regime_tables as tables  # noqa: E402
import study_kit  # noqa: E402
from paper_regime_tables import ACCURACY, REWARD, window_mean  # noqa: E402
from study_figures import Line, Panel, markdown_table, plot_panels  # noqa: E402
from study_stats import paired  # noqa: E402

LATE = (40, 60)
"""The primary window: held-out accuracy over the validations at rollouts 40-60."""
MIN_GAP = 0.02
"""The least gap between the main grid's clipping and the control for a recovery to be given."""
ARMS = ("control", "clip", "eps0.2", "alpha0")
MAIN = Path(__file__).resolve().parent / "results" / "smollm2" / "paper_regime" / "main"
SECONDARY = (
    (REWARD, (41, 60), "reward 41-60"),
    ("entropy", (51, 60), "entropy 51-60"),
    ("trust_region/kl_end_mean", (31, 60), "KL end mean 31-60"),
    ("reward/frac_zero_std", (31, 60), "groups without spread 31-60"),
)


def by_seed(records: Sequence[dict]) -> dict[int, dict[str, dict]]:
    """{seed: {arm: record}} of the branches."""
    out: dict[int, dict[str, dict]] = {}
    for r in records:
        out.setdefault(r["fields"]["seed"], {})[r["fields"]["arm"]] = r
    return dict(sorted(out.items()))


def main_grid(arm: str) -> dict[int, dict]:
    """The paper-regime main grid's runs of ``arm`` (``clip`` or ``troll``) at 3e-6, by seed."""
    grid = study_kit.Grid(MAIN, {}, ("val/accuracy", REWARD, "entropy"))
    return {
        r["fields"]["seed"]: r
        for r in grid.recorded().values()
        if r["fields"]["objective"] == arm and "support" not in r["fields"]
    }


def arm_table(records: Sequence[dict]) -> str:
    """Per arm: late accuracy per seed, the paired difference to the control, the secondary
    figures; then the clipping arm's recovery of the gap to the main grid's clipping."""
    seeds = by_seed(records)
    clip_main = main_grid("clip")
    rows = []
    control = {s: window_mean(arms["control"], ACCURACY, LATE) for s, arms in seeds.items()
               if "control" in arms}  # fmt: skip
    for arm in ARMS:
        mine = {s: arms[arm] for s, arms in seeds.items() if arm in arms}
        if not mine:
            continue
        late = {s: window_mean(r, ACCURACY, LATE) for s, r in mine.items()}
        both = [s for s in late if s in control]
        diff = paired([late[s] for s in both], [control[s] for s in both]).text()
        secondary = [
            f"{statistics.fmean(window_mean(r, m, w) for r in mine.values()):.4g}"
            for m, w, _ in SECONDARY
        ]
        each = ", ".join(f"s{s} {v:.3f}" for s, v in late.items())
        rows.append([arm, each, "-" if arm == "control" else diff, *secondary])
    header = [
        "arm",
        f"late accuracy {LATE[0]}-{LATE[1]}",
        "minus control",
        *(n for *_, n in SECONDARY),
    ]
    text = markdown_table(header, rows, "llll" + "r" * len(SECONDARY))
    lines = []
    for s, arms in seeds.items():
        if "clip" not in arms or s not in control or s not in clip_main:
            continue
        gap = window_mean(clip_main[s], ACCURACY, LATE) - control[s]
        got = window_mean(arms["clip"], ACCURACY, LATE) - control[s]
        recovery = f"{got / gap:.2f}" if gap >= MIN_GAP else f"not given (gap {gap:+.3f})"
        lines.append(f"- seed {s}: main grid's clipping minus control {gap:+.3f}, clip arm minus "
                     f"control {got:+.3f}, recovery {recovery}")  # fmt: skip
    return text + ("\nRecovery of the clipping arm:\n" + "\n".join(lines) + "\n" if lines else "")


def bins_table(records: Sequence[dict]) -> str:
    """Per arm and constraint mask: the mean share of each confidence and advantage bin's tokens
    the constraint acts on over the branches' rollouts, and the bin's share of tokens."""
    groups = {arm: [r for r in records if r["fields"]["arm"] == arm] for arm in ARMS}
    return tables.bins_table({arm: runs for arm, runs in groups.items() if runs})


def reproducibility(trunks: Sequence[dict]) -> str:
    """Each trunk against the main grid's TROLL run of its seed: the largest per-rollout
    difference of the mean reward over rollouts 1-30, the first rollout that differs, and the
    held-out accuracy at rollouts 5-30 side by side."""
    main = main_grid("troll")
    lines = []
    for t in sorted(trunks, key=lambda r: r["fields"]["seed"]):
        seed = t["fields"]["seed"]
        if seed not in main:
            continue
        ours = {row["rollout"]: row for row in t["history"]}
        theirs = {row["rollout"]: row for row in main[seed]["history"]}
        common = [
            r for r in range(1, 31) if REWARD in ours.get(r, {}) and REWARD in theirs.get(r, {})
        ]
        diffs = {r: abs(ours[r][REWARD] - theirs[r][REWARD]) for r in common}
        first = next((r for r in common if diffs[r] > 0), None)
        accuracy = ", ".join(
            f"{r}: {ours[r][ACCURACY]:.3f}/{theirs[r][ACCURACY]:.3f}"
            for r in range(5, 31, 5)
            if ACCURACY in ours.get(r, {}) and ACCURACY in theirs.get(r, {})
        )
        lines.append(
            f"- seed {seed}: largest reward difference {max(diffs.values(), default=0):.3f} "
            f"(rollouts 1-10: {max((diffs[r] for r in common if r <= 10), default=0):.3f}); "
            f"first differing rollout {first}; held-out accuracy trunk/main {accuracy}"
        )
    return "\n".join(lines) + "\n"


def plot(out: Path, trunks: Sequence[dict], records: Sequence[dict]) -> None:
    """Held-out accuracy, reward and entropy per arm (trunk then branch, mean over seeds)."""
    trunk = {t["fields"]["seed"]: t["history"] for t in trunks}
    joined = {
        arm: [
            {**r, "history": [*trunk.get(r["fields"]["seed"], []), *r["history"]]}
            for r in records
            if r["fields"]["arm"] == arm
        ]
        for arm in ARMS
    }
    figures = ((ACCURACY, "held-out accuracy"), (REWARD, "reward"), ("entropy", "entropy"))
    panels = [
        Panel(label, label, [Line(runs, metric, arm) for arm, runs in joined.items() if runs])
        for metric, label in figures
    ]
    print(f"wrote {plot_panels(panels, out / 'curves.png')}")


def report(out: Path, trunks: list[dict], branches: list[dict]) -> None:
    print(f"{len(trunks)} trunks and {len(branches)} branches finished")
    if trunks:
        text = reproducibility(trunks)
        study_kit.write_atomic(out / "reproducibility.md", text)
        print("trunks against the main grid's TROLL runs:\n" + text)
    if branches:
        text = arm_table(branches)
        study_kit.write_atomic(out / "table.md", text)
        print(text)
        text = bins_table(branches)
        study_kit.write_atomic(out / "bins.md", text)
        print("where each constraint acts, branches' rollouts:\n" + text)
        plot(out, trunks, branches)
