"""The stability map's control column, read from its records: where a TROLL/clipping pair parts.

At 1 optimiser step per rollout without staleness every step is on-policy: TROLL's projection never
acts and clipping never clips, so the two objectives take the same gradient, computed by different
float32 operations (TROLL's through its sparse, lumped distributions, clipping's through the full
log-softmax). A pair shares its seed, its prompts and its first rollout's samples; this reading
finds, per pair, the first rollout at which the two runs' mean entropy differs at all (the first
update's rounding), the first at which their mean reward differs (a sample drawn differently), the
largest relative entropy difference before that, in units of float32's machine epsilon, and the
final accuracy's difference. ``stability_map.py --report`` appends it to ``map.md``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stability_tables import OBJECTIVES, PANELS, by_cell, outcome, start_accuracy  # noqa: E402
from study_figures import markdown_table  # noqa: E402

FLOAT32_EPS = 2.0**-23
"""float32's machine epsilon: the relative size of one rounding step near 1."""


def by_rollout(record: dict, metric: str) -> dict[int, float]:
    return {row["rollout"]: row[metric] for row in record["history"]
            if row.get(metric) is not None}  # fmt: skip


def parting(troll: dict, clip: dict) -> tuple[int | None, int | None, float]:
    """One pair: the first rollout whose mean entropy differs, the first whose mean reward
    differs (None where they never do) and the largest relative entropy difference over the
    rollouts before the rewards part, in float32 epsilons."""
    entropy = [by_rollout(r, "entropy") for r in (troll, clip)]
    reward = [by_rollout(r, "reward/mean") for r in (troll, clip)]
    shared = sorted(set(entropy[0]) & set(entropy[1]) & set(reward[0]) & set(reward[1]))
    first_entropy = next((k for k in shared if entropy[0][k] != entropy[1][k]), None)
    first_reward = next((k for k in shared if reward[0][k] != reward[1][k]), None)
    before = [k for k in shared if first_reward is None or k < first_reward]
    largest = max((abs(entropy[0][k] - entropy[1][k]) / abs(entropy[1][k])
                   for k in before if entropy[1][k]), default=0.0)  # fmt: skip
    return first_entropy, first_reward, largest / FLOAT32_EPS


def control_cells(records: Sequence[dict]):
    """The complete pairs of the control column: (cell, seed, troll record, clip record)."""
    table = by_cell(records)
    for cell in sorted(table, key=lambda c: (c.panel, c.lr)):
        objectives = table[cell]
        if cell.steps != 1 or PANELS[cell.panel][1] != 0:
            continue
        for seed in sorted(set.intersection(*(set(objectives.get(o, {})) for o in OBJECTIVES))):
            yield cell, seed, objectives["troll"][seed], objectives["clip"][seed]


def divergence(records: Sequence[dict]) -> str:
    """``map.md``'s section on the control column: a row per cell, its pairs seed by seed."""
    start = start_accuracy(records)
    rows: dict = {}
    for cell, seed, troll, clip in control_cells(records):
        first_entropy, first_reward, largest = parting(troll, clip)
        gap = outcome(troll, start).final - outcome(clip, start).final
        row = rows.setdefault(cell, [[], [], [], []])
        row[0].append(f"{seed}: {first_entropy if first_entropy is not None else '-'}")
        row[1].append(f"{seed}: {first_reward if first_reward is not None else 'never'}")
        row[2].append(largest)
        row[3].append(f"{gap:+.3f}")
    if not rows:
        return ""
    header = ["panel", "lr", "entropy first differs (seed: rollout)",
              "reward first differs (seed: rollout)",
              "largest entropy difference before, float32 eps", "F, TROLL - clipping"]  # fmt: skip
    table = [[c.panel, f"{c.lr:g}", ", ".join(r[0]), ", ".join(r[1]), f"{max(r[2]):.1f}",
              ", ".join(r[3])] for c, r in rows.items()]  # fmt: skip
    return ("\n## The control column: where a pair parts (a reading)\n\n"
            "1 step per rollout, no staleness: the same gradient by different float32 operations. "
            "Per pair, the first rollout at which the two runs' entropy differs, the first at "
            "which their mean reward differs (a sample drawn differently), the largest relative "
            "entropy difference before that, and the final accuracy's difference.\n\n"
            + markdown_table(header, table, "lr"))  # fmt: skip
