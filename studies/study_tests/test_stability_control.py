"""studies/stability_control.py: where a pair of the control column parts, computed by hand on
made-up records."""

from __future__ import annotations

import pytest

from .helpers import load

control = load("stability_control")
START = 0.5


def record(panel, lr, steps, objective, seed, entropy, reward, final=0.5):
    """Rollouts 1-60: ``entropy`` and ``reward`` per rollout (lists of 60), validations at 0
    (``START``) and at 50 and 60 (``final``)."""
    history = [{"rollout": 0, "val/accuracy": START}]
    for k in range(1, 61):
        row = {"rollout": k, "entropy": entropy[k - 1], "reward/mean": reward[k - 1]}
        if k in (50, 60):
            row["val/accuracy"] = final
        history.append(row)
    fields = {"panel": panel, "lr": lr, "steps": steps, "objective": objective, "seed": seed}
    return {"name": f"{panel}-{lr}-{steps}-{objective}-s{seed}", "fields": fields,
            "history": history}  # fmt: skip


def test_a_pair_parts_where_its_entropy_and_then_its_reward_first_differ():
    entropy = [0.5] * 60
    reward = [0.4] * 60
    other_entropy = list(entropy)
    other_entropy[2] = 0.5 * (1 + 3 * control.FLOAT32_EPS)  # rollout 3: 3 eps apart
    other_entropy[9] = 0.5 * (1 + 40 * control.FLOAT32_EPS)  # rollout 10: 40 eps
    other_entropy[30] = 0.9  # after the rewards part: not counted
    other_reward = list(reward)
    other_reward[20] = 0.41  # rollout 21
    troll = record("grpo-s0", 2e-4, 1, "troll", 0, entropy, reward)
    clip = record("grpo-s0", 2e-4, 1, "clip", 0, other_entropy, other_reward)
    first_entropy, first_reward, largest = control.parting(troll, clip)
    assert (first_entropy, first_reward) == (3, 21)
    assert largest == pytest.approx(40, rel=1e-3)
    # a pair equal to the bit never parts
    assert control.parting(troll, troll) == (None, None, 0.0)


def test_the_section_reads_only_the_control_column_and_names_each_seed():
    flat, reward = [0.5] * 60, [0.4] * 60
    moved = [0.5] * 60
    moved[1] = 0.5 * (1 + control.FLOAT32_EPS)
    parted = list(reward)
    parted[39] = 0.3
    records = []
    for seed, (clip_entropy, clip_reward, final) in enumerate(
        [(moved, parted, 0.47), (flat, reward, 0.5)]
    ):
        records.append(record("grpo-s0", 2e-4, 1, "troll", seed, flat, reward, 0.5))
        records.append(record("grpo-s0", 2e-4, 1, "clip", seed, clip_entropy, clip_reward, final))
    # a cell with 4 steps and one with staleness: not the control
    for panel, steps in (("grpo-s0", 4), ("grpo-s4", 1)):
        records.append(record(panel, 2e-4, steps, "troll", 0, flat, reward))
        records.append(record(panel, 2e-4, steps, "clip", 0, moved, parted))
    # a seed with one objective only: left out
    records.append(record("grpo-s0", 2e-4, 1, "troll", 2, flat, reward))
    text = control.divergence(records)
    rows = [line for line in text.splitlines() if line.startswith("| grpo")]
    assert rows == ["| grpo-s0 | 0.0002 | 0: 2, 1: - | 0: 40, 1: never | 1.0 | +0.030, +0.000 |"]
    assert control.divergence([r for r in records if r["fields"]["steps"] == 4]) == ""
