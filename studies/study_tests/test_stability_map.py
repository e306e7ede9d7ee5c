"""studies/stability_map.py: each cell's options, the plan's endpoints and regions computed by
hand, the verdict's sign test, the check that a pair shares its first rollout, and the report and
maps drawn from made-up records."""

from __future__ import annotations

import pytest

from .helpers import load

study = load("stability_map")
tables = load("stability_tables")
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
    run = study.make(tables.Cell("grpo-s4", 2e-4, steps), "clip", 3)
    args = args_of(run)
    assert args["--model.optimization.minibatch_size"] == minibatch  # 1,024 sequences / steps
    assert args["--model.optimizer.init_args.lr"] == "0.0002"
    assert args["--old_policy.max_staleness"] == "4"
    assert args["--model.objective"] == "clip" and args["--seed_everything"] == "3"
    assert args["--trust_region_monitor.kl_end"] == "true"
    assert run.max_steps == steps * 60 and run.rollouts == 60
    assert "gspo.yaml" in study.make(tables.Cell("gspo-s0", 1e-4, 4), "troll", 0).args[3]


def test_the_grid_runs_in_the_plans_order():
    runs = study.runs(list(study.PANELS), list(tables.SEEDS))
    assert len(runs) == 360 and len({r.name for r in runs}) == 360
    assert [r.fields["panel"] for r in runs[::120]] == ["grpo-s0", "gspo-s0", "grpo-s4"]
    first = runs[:24]  # the first panel's seed 0: every cell, its two objectives side by side
    assert {r.fields["seed"] for r in first} == {0}
    assert [r.fields["objective"] for r in first[:2]] == ["troll", "clip"]
    assert first[0].fields["lr"] == first[1].fields["lr"] == 3e-5


def test_outcome_follows_the_plans_margins():
    def out(final, entropy=0.3):
        return tables.outcome(record("grpo-s0", 1e-4, 4, "troll", 0, final, entropy), START)

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
    complete, stable, collapse = tables.regions(records, START)
    cell = tables.Cell("grpo-s0", 1e-4, 4)
    assert complete == [cell]
    assert stable == {"troll": {cell}, "clip": set()}  # clipping learned on 3 of 5
    assert collapse == {"troll": set(), "clip": set()}  # clipping collapsed on 2 of 5


def test_the_verdict_is_a_sign_test_over_the_discordant_cells():
    cells = tables.cells()
    six = {"troll": set(cells[:10]), "clip": set(cells[:4])}  # 6 cells TROLL's only
    text, p = tables.compare(six, "stable region")
    assert p == pytest.approx(2 / 2**6)  # all 6 one way: 2 * 0.5**6 = 0.03125
    assert text.startswith("TROLL's stable region is larger (TROLL 10 cells, clipping 4")
    five = {"troll": set(cells[:9]), "clip": set(cells[:4])}
    text, p = tables.compare(five, "stable region")
    assert p == pytest.approx(2 / 2**5) and text.startswith("no difference shown")
    mirrored = {"troll": set(cells[:4]), "clip": set(cells[:11])}
    assert tables.compare(mirrored, "stable region")[0].startswith("clipping's stable region")
    assert tables.verdict([record("grpo-s0", 1e-4, 4, "troll", 0)], START).startswith(
        "no verdict: 0 of 36 cells"
    )


def test_pairs_that_do_not_share_their_first_rollout_are_named():
    records = [record("grpo-s0", 1e-4, 4, o, 0) for o in ("troll", "clip")]
    records += [record("grpo-s0", 1e-4, 4, "troll", 1, reward=0.4)]
    records += [record("grpo-s0", 1e-4, 4, "clip", 1, reward=0.41)]
    assert tables.unshared_first_rollouts(records) == ["grpo-s0-lr0.0001-steps4-s1"]


def test_report_and_maps_from_records(tmp_path):
    records = [record("grpo-s0", lr, 4, o, s, (0.6, 0.6) if o == "troll" else (0.5, 0.5))
               for lr in (1e-4, 3e-4) for o in ("troll", "clip") for s in range(5)]  # fmt: skip
    text = tables.report(records)
    assert "20 of 360 runs finished" in text and "no verdict: 2 of 36 cells" in text
    assert "| 0.0001 | 4 | troll 5/5 up, 0/5 down; clip 0/5 up, 0/5 down | +0.100" in text
    assert "gspo-s0" not in text  # a panel without runs is left out
    assert "- `grpo-s0`, 2 of 12 cells complete: stable TROLL 2, clipping 0" in text
    assert "Next: the SmolLM2 corner is chosen once every cell is complete." in text
    assert study.plot(records, tmp_path / "map.png").stat().st_size > 10_000


def test_entropy_at_the_end_per_cell_and_objective(tmp_path):
    records = [record("grpo-s0", 1e-4, 4, "troll", s, entropy=0.2 + 0.1 * s) for s in range(3)]
    records += [record("grpo-s0", 1e-4, 4, "clip", s, entropy=0.3) for s in range(2)]
    means = study.entropy_means(records)
    cell = tables.Cell("grpo-s0", 1e-4, 4)
    assert means == {(cell, "troll"): pytest.approx(0.3), (cell, "clip"): pytest.approx(0.3)}
    assert study.plot_entropy(records, tmp_path / "entropy.png").stat().st_size > 10_000
    unlogged = [{**r, "history": [row for row in r["history"] if "entropy" not in row]}
                for r in records]  # fmt: skip
    with pytest.raises(ValueError, match="entropy"):
        study.plot_entropy(unlogged, tmp_path / "none.png")


def test_seeds_outside_the_plan_are_refused():
    with pytest.raises(SystemExit):
        study.parse_args(["--seeds", "5"])


def full_grid(learned, entropy=lambda cell, objective, seed: 0.3):
    """Every cell's 5 seeds of both objectives; ``learned(cell, objective)`` is how many seeds
    learned (the rest stay at the start)."""
    records = []
    for cell in tables.cells():
        for o in tables.OBJECTIVES:
            for seed in tables.SEEDS:
                final = (0.6, 0.6) if seed < learned(cell, o) else (0.5, 0.5)
                records.append(record(cell.panel, cell.lr, cell.steps, o, seed, final,
                                      entropy(cell, o, seed)))  # fmt: skip
    return records


def test_the_corner_is_the_cell_where_the_learned_counts_differ_most_ties_by_the_plans_order():
    def learned(cell, objective):
        if cell.panel == "gspo-s0" and cell.lr == 3e-4 and cell.steps == 32:
            return 5 if objective == "troll" else 1  # differ by 4: the widest
        if cell.panel == "grpo-s0" and cell.lr in (3e-5, 1e-4):
            return 5 if objective == "clip" else 2  # differ by 3
        return 3

    found, why = tables.corner(full_grid(learned), START)
    assert found == tables.Cell("gspo-s0", 3e-4, 32) and "TROLL 5 of 5, clipping 1 of 5" in why

    def tied(cell, objective):  # differ by 3 in four grpo-s0 cells and one grpo-s4 cell
        if (cell.panel == "grpo-s0" and cell.lr in (3e-5, 1e-4) and cell.steps in (1, 4)) or (
            cell.panel == "grpo-s4" and cell.lr == 3e-4
        ):
            return 5 if objective == "clip" else 2
        return 3

    # grpo-s0 before grpo-s4, then the higher lr (1e-4), then more steps (4)
    assert tables.corner(full_grid(tied), START)[0] == tables.Cell("grpo-s0", 1e-4, 4)


def test_without_a_gap_of_two_seeds_the_corner_is_the_largest_lr_times_steps_that_learned():
    def learned(cell, objective):
        if cell.lr * cell.steps > 3e-4 * 4 + 1e-12:
            return 2 if objective == "troll" else 1  # learned, but on fewer than 3 of 5
        return 3 if objective == "clip" else 2

    found, why = tables.corner(full_grid(learned), START)
    assert found == tables.Cell("grpo-s0", 3e-4, 4)  # 1.2e-3: the largest with 3 of 5 (ties)
    assert why.startswith("no cell differs by 2 seeds")
    assert tables.corner(full_grid(lambda c, o: 2), START) is None  # nothing learned on 3
    assert tables.corner(full_grid(learned)[:-1], START) is None  # one run short: not yet
    line = tables.corner_line(full_grid(learned), START)
    assert "`grpo-s0-lr0.0003-steps4`" in line and "learning rate x 3" in line


def test_the_per_panel_regions_and_the_entropy_difference_per_seed():
    def learned(cell, objective):
        return 5 if cell.panel == "gspo-s0" and objective == "troll" and cell.steps == 1 else 0

    def entropy(cell, objective, seed):
        return 0.4 + 0.01 * seed if objective == "troll" else 0.3

    records = full_grid(learned, entropy)
    lines = tables.panel_regions(records, START)
    assert len(lines) == 3
    assert lines[1] == (
        "- `gspo-s0`, 12 of 12 cells complete: stable TROLL 4, clipping 0 (one only: 4 TROLL's "
        "[lr 3e-05 x 1 steps, lr 0.0001 x 1 steps, lr 0.0002 x 1 steps, lr 0.0003 x 1 steps], "
        "0 clipping's); collapse TROLL 0, clipping 0 (one only: 0 TROLL's, 0 clipping's)"
    )
    text = tables.entropy_difference(records, START)
    # per seed the mean over 36 cells: TROLL 0.40, ..., 0.44 against clipping 0.30
    assert text.startswith(
        "over 36 complete cells, mean entropy at the end TROLL / clipping 0.420 / 0.300"
    )
    assert "+0.120 (+0.100, +0.110, +0.120, +0.130, +0.140)" in text
    assert tables.entropy_difference(records[:5], START) == "no complete cell"


def test_the_constraint_readings_take_each_objectives_own_share(tmp_path):
    records = []
    for o, share in (("troll", 0.2), ("clip", 0.05)):
        for seed in range(2):
            r = record("grpo-s0", 1e-4, 32, o, seed)
            overall, name = tables.ACTS[o]
            for rollout in range(41, 61):
                r["history"].append({"rollout": rollout, overall: share + 0.1 * seed,
                                     f"trust_region/by_confidence/below_0.5/{name}": 2 * share,
                                     f"trust_region/by_advantage/zero/{name}": share / 2,
                                     "trust_region/kl_end_mean": 0.04})  # fmt: skip
            records.append(r)
    text = tables.constraint_report(records)
    row = [line for line in text.splitlines() if line.startswith("| 0.0001 | 32 |")]
    cells = [c.strip() for c in row[0].strip("|").split("|")]
    assert cells[2] == "0.250 / 0.100"  # the mean over seeds (0.2, 0.3) and (0.05, 0.15)
    assert cells[3] == "0.400 / 0.100"  # confidence below 0.5
    assert cells[4] == "- / -"  # a bin no run logged
    assert cells[8] == "0.100 / 0.025"  # advantage zero
    assert cells[10] == "0.0400 / 0.0400"
    assert "gspo-s0" not in text
    paths = study.plot_curves_by_cell(records, tmp_path)
    assert [p.name for p in paths] == ["curves-grpo-s0.png"] and paths[0].stat().st_size > 10_000


def test_a_process_can_take_one_objectives_share_of_the_grid(tmp_path, capsys):
    study.main(["--estimate", "--seeds", "4", "--out", str(tmp_path)])
    assert capsys.readouterr().out.startswith("72 runs:")  # 36 cells, both objectives
    study.main(["--estimate", "--seeds", "4", "--objectives", "clip", "--out", str(tmp_path)])
    assert capsys.readouterr().out.startswith("36 runs:")
    with pytest.raises(SystemExit):
        study.parse_args(["--objectives", "ppo"])
