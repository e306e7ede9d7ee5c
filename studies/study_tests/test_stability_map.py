"""studies/stability_map.py: each cell's options, the plan's endpoints and regions computed by
hand, the verdict's sign test, the check that a pair shares its first rollout, and the report and
maps drawn from made-up records."""

from __future__ import annotations

import pytest

from .helpers import load

study = load("stability_map")
START = 0.5


def record(panel, lr, steps, objective, seed, final=(0.5, 0.5), entropy=0.3, reward=0.4):
    """A run's record: held-out ``final`` accuracy at rollouts 50 and 60, ``entropy`` at rollouts
    56-60, ``reward`` at rollout 1."""
    history = [{"rollout": 0, "val/accuracy": START}, {"rollout": 1, "reward/mean": reward}]
    history += [{"rollout": r, "val/accuracy": 0.5} for r in (10, 20, 30, 40)]
    history += [{"rollout": 50, "val/accuracy": final[0]}]
    history += [{"rollout": r, "entropy": entropy} for r in range(55, 60)]
    history += [{"rollout": 60, "val/accuracy": final[1], "entropy": entropy}]
    fields = {"panel": panel, "lr": lr, "steps": steps, "objective": objective, "seed": seed}
    name = f"{panel}-lr{lr:g}-steps{steps}-{objective}-s{seed}"
    return {"name": name, "fields": fields, "history": history}


def args_of(run) -> dict:
    return dict(zip(*[iter(run.args[4:])] * 2, strict=True))  # past the two --config pairs


@pytest.mark.parametrize(("steps", "minibatch"), [(1, "1024"), (4, "256"), (32, "32")])
def test_each_cell_sets_its_steps_learning_rate_and_staleness(steps, minibatch):
    run = study.make(study.Cell("grpo-s4", 2e-4, steps), "clip", 3)
    args = args_of(run)
    assert args["--model.optimization.minibatch_size"] == minibatch  # 1,024 sequences / steps
    assert args["--model.optimizer.init_args.lr"] == "0.0002"
    assert args["--old_policy.max_staleness"] == "4"
    assert args["--model.objective"] == "clip" and args["--seed_everything"] == "3"
    assert args["--trust_region_monitor.kl_end"] == "true"
    assert run.max_steps == steps * 60 and run.rollouts == 60
    assert "gspo.yaml" in study.make(study.Cell("gspo-s0", 1e-4, 4), "troll", 0).args[3]


def test_the_grid_runs_in_the_plans_order():
    runs = study.runs(list(study.PANELS), list(study.SEEDS))
    assert len(runs) == 360 and len({r.name for r in runs}) == 360
    assert [r.fields["panel"] for r in runs[::120]] == ["grpo-s0", "gspo-s0", "grpo-s4"]
    first = runs[:24]  # the first panel's seed 0: every cell, its two objectives side by side
    assert {r.fields["seed"] for r in first} == {0}
    assert [r.fields["objective"] for r in first[:2]] == ["troll", "clip"]
    assert first[0].fields["lr"] == first[1].fields["lr"] == 3e-5


def test_outcome_follows_the_plans_margins():
    def out(final, entropy=0.3):
        return study.outcome(record("grpo-s0", 1e-4, 4, "troll", 0, final, entropy), START)

    assert out((0.531, 0.533)).learned  # mean 0.532 > start + 0.031
    assert not out((0.53, 0.531)).learned  # 0.5305: short of the margin
    assert out((0.44, 0.45)).collapsed and not out((0.44, 0.45)).learned  # 0.445 < 0.45
    assert not out((0.47, 0.46)).collapsed  # 0.465: lower, but within the margin
    flat = out((0.6, 0.6), entropy=0.005)  # accurate, but the entropy fell under the floor
    assert flat.collapsed and not flat.learned
    assert out((0.6, 0.6)).final == pytest.approx(0.6)


def test_regions_need_four_of_five_seeds_and_complete_cells():
    up, down = (0.6, 0.6), (0.3, 0.3)
    records = []
    for seed in range(5):
        records.append(record("grpo-s0", 1e-4, 4, "troll", seed, up))
        records.append(record("grpo-s0", 1e-4, 4, "clip", seed, up if seed < 3 else down))
    records.append(record("grpo-s0", 2e-4, 4, "troll", 0, up))  # an incomplete cell
    complete, stable, collapse = study.regions(records, START)
    cell = study.Cell("grpo-s0", 1e-4, 4)
    assert complete == [cell]
    assert stable == {"troll": {cell}, "clip": set()}  # clipping learned on 3 of 5
    assert collapse == {"troll": set(), "clip": set()}  # clipping collapsed on 2 of 5


def test_the_verdict_is_a_sign_test_over_the_discordant_cells():
    cells = study.cells()
    six = {"troll": set(cells[:10]), "clip": set(cells[:4])}  # 6 cells TROLL's only
    text, p = study.compare(six, "stable region")
    assert p == pytest.approx(2 / 2**6)  # all 6 one way: 2 * 0.5**6 = 0.03125
    assert text.startswith("TROLL's stable region is larger (TROLL 10 cells, clipping 4")
    five = {"troll": set(cells[:9]), "clip": set(cells[:4])}
    text, p = study.compare(five, "stable region")
    assert p == pytest.approx(2 / 2**5) and text.startswith("no difference shown")
    mirrored = {"troll": set(cells[:4]), "clip": set(cells[:11])}
    assert study.compare(mirrored, "stable region")[0].startswith("clipping's stable region")
    assert study.verdict([record("grpo-s0", 1e-4, 4, "troll", 0)], START).startswith(
        "no verdict: 0 of 36 cells"
    )


def test_pairs_that_do_not_share_their_first_rollout_are_named():
    records = [record("grpo-s0", 1e-4, 4, o, 0) for o in ("troll", "clip")]
    records += [record("grpo-s0", 1e-4, 4, "troll", 1, reward=0.4)]
    records += [record("grpo-s0", 1e-4, 4, "clip", 1, reward=0.41)]
    assert study.unshared_first_rollouts(records) == ["grpo-s0-lr0.0001-steps4-s1"]


def test_report_and_maps_from_records(tmp_path):
    records = [record("grpo-s0", lr, 4, o, s, (0.6, 0.6) if o == "troll" else (0.5, 0.5))
               for lr in (1e-4, 3e-4) for o in ("troll", "clip") for s in range(5)]  # fmt: skip
    text = study.report(records)
    assert "20 of 360 runs finished" in text and "no verdict: 2 of 36 cells" in text
    assert "| 0.0001 | 4 | troll 5/5 up, 0/5 down; clip 0/5 up, 0/5 down | +0.100" in text
    assert "gspo-s0" not in text  # a panel without runs is left out
    assert study.plot(records, tmp_path / "map.png").stat().st_size > 10_000


def test_seeds_outside_the_plan_are_refused():
    with pytest.raises(SystemExit):
        study.parse_args(["--seeds", "5"])
