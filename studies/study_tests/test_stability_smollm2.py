"""studies/stability_smollm2.py: the plan's SmolLM2 endpoints and its item 1 rule computed by
hand, the corner's options and learning rate, and item 1's records as committed."""

from __future__ import annotations

import pytest

from .helpers import load

study = load("stability_smollm2")
tinymath = load("stability_tables")
START = 0.25


def record(objective, seed, final=(0.25, 0.25), entropy=0.5):
    history = [{"rollout": 0, "val/accuracy": START}]
    history += [{"rollout": r, "val/accuracy": 0.25} for r in (10, 20)]
    history += [{"rollout": 30, "val/accuracy": final[0]}]
    history += [{"rollout": r, "entropy": entropy} for r in range(35, 40)]
    history += [{"rollout": 40, "val/accuracy": final[1], "entropy": entropy}]
    fields = {"objective": objective, "seed": seed}
    return {"name": f"{objective}-s{seed}", "fields": fields, "history": history}


def test_the_endpoints_follow_the_plans_item_1_margins():
    def out(final, entropy=0.5):
        return study.outcome(record("troll", 0, final, entropy), START)

    assert out((0.288, 0.289)).learned  # 0.2885 >= 0.25 + 0.038
    assert not out((0.287, 0.288)).learned  # 0.2875: short of the margin
    assert out((0.19, 0.2)).collapsed  # 0.195 <= 0.25 - 0.05
    assert not out((0.21, 0.2)).collapsed  # 0.205: lower, but within the margin
    flat = out((0.4, 0.4), entropy=0.009)
    assert flat.collapsed and not flat.learned


def pairs(troll, clip):
    return [record("troll", s, (t, t)) for s, t in enumerate(troll)] + [
        record("clip", s, (c, c)) for s, c in enumerate(clip)
    ]


def test_ahead_here_needs_the_t_test_and_every_seed_that_differs_in_learning():
    seeds = range(5)
    # TROLL higher on every seed by about 0.1, and the two seeds that differ in learning are its
    records = pairs([0.38, 0.41, 0.39, 0.30, 0.42], [0.28, 0.30, 0.30, 0.20, 0.31])
    text, verdict = study.endpoints(records, START, seeds)
    assert verdict == "TROLL ahead here"
    assert text.startswith("TROLL learned on 5 of 5, collapsed on 0; clipping learned on 3 of 5")
    # the same differences, but one seed where only clipping learned: not ahead
    records = pairs([0.38, 0.41, 0.39, 0.28, 0.42], [0.28, 0.30, 0.30, 0.29, 0.31])
    assert study.endpoints(records, START, seeds)[0].endswith("t-test p 0.02, sign test p 0.38")
    assert study.endpoints(records, START, seeds)[1] == "no difference shown"
    # the mirror: clipping higher everywhere
    mirrored = pairs([0.30, 0.30, 0.30, 0.20, 0.31], [0.40, 0.41, 0.39, 0.30, 0.42])
    assert study.endpoints(mirrored, START, seeds)[1] == "clipping ahead here"
    # a spread that the t-test does not call
    spread = pairs([0.40, 0.20, 0.45, 0.22, 0.30], [0.30, 0.30, 0.30, 0.30, 0.30])
    assert study.endpoints(spread, START, seeds)[1] == "no difference shown"
    short = pairs([0.4, 0.4, 0.4], [0.3, 0.3, 0.3])
    assert study.endpoints(short, START, seeds)[1] == "no verdict: 3 of 5 seeds have both runs"


@pytest.mark.parametrize(("panel", "sequence", "staleness"),
                         [("grpo-s0", False, "0"), ("gspo-s0", True, "0"), ("grpo-s4", False, "4")])  # fmt: skip
def test_the_corner_runs_the_cells_steps_staleness_estimator_and_scaled_lr(
    panel, sequence, staleness
):
    cell = tinymath.Cell(panel, 3e-4, 32)
    runs = study.corner_runs(study.parse_args([]), cell, lr=1e-5)
    assert [r.name for r in runs] == [
        f"corner-{o}-s{s}" for s in (0, 1, 2) for o in ("troll", "clip")
    ]
    args = runs[0].args
    # the last value of each option is the one that holds
    last = {}
    for i, a in enumerate(args[:-1]):
        if a.startswith("--"):
            last[a] = args[i + 1]
    assert float(last["--model.optimizer.init_args.lr"]) == pytest.approx(3e-5)  # 1e-5 x 3
    assert last["--model.optimization.minibatch_size"] == "2"  # 8 prompts x 8 / 32 steps
    assert last["--old_policy.max_staleness"] == staleness
    assert last["--model.corrections.anchor"] == "behaviour"
    assert (last.get("--model.loss.importance") == "sequence") is sequence
    assert runs[0].max_steps == 40 * 32 and runs[0].rollouts == 40
    assert runs[0].fields["cell"] == cell.name


def test_a_process_trains_its_share_of_the_corner_and_the_report_reads_every_run():
    cell = tinymath.Cell("grpo-s0", 3e-5, 32)
    runs = study.corner_runs(study.parse_args([]), cell, lr=1e-5)
    args = study.parse_args(["--corner", "--seeds", "1", "2", "--objectives", "clip"])
    assert [r.name for r in study.own_share(runs, args)] == ["corner-clip-s1", "corner-clip-s2"]
    every = study.own_share(runs, study.parse_args(["--corner"]))
    assert every == runs
    with pytest.raises(SystemExit):
        study.parse_args(["--corner", "--seeds", "3"])  # not one of the plan's three


def test_item_1_reads_the_three_committed_seeds_of_the_stale_data_study():
    records = study.item1_records()
    table = study.by_seed(records)
    assert {o: sorted(t)[:3] for o, t in table.items()} == {"troll": [0, 1, 2], "clip": [0, 1, 2]}
    assert tinymath.start_accuracy(records) == pytest.approx(0.252, abs=5e-4)  # the plan's A0
    text = study.report(records, [], None)
    assert "| 1 | 0.425 up |" in text  # TROLL's seed 1 as the stale-data study recorded it
