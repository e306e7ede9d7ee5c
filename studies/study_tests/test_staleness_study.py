"""studies/staleness_study.py: each arm's options, the plan's endpoints computed by hand, the
headroom study's runs as the arm s0, and a dry run that trains stale arms on TinyMath."""

from __future__ import annotations

import pytest

from .helpers import load

study = load("staleness_study")
tables = load("staleness_tables")


def record(arm, objective, seed, accuracy=(0.5, 0.5), kl=0.0):
    """A run's record: held-out ``accuracy`` at rollouts 30 and 40, ``kl`` at the start of
    rollouts 20 and 30."""
    history = [
        {"rollout": 0, "val/accuracy": 0.1},
        {"rollout": 20, tables.KL_START: kl},
        {"rollout": 30, "val/accuracy": accuracy[0], tables.KL_START: kl},
        {"rollout": 40, "val/accuracy": accuracy[1]},
    ]
    fields = {"arm": arm, "objective": objective, "seed": seed}
    return {"name": f"{arm}-{objective}-s{seed}", "fields": fields, "history": history}


def test_each_arm_sets_its_staleness_anchor_and_steps():
    args = dict(zip(*[iter(study.arm_args("s4-proximal", 8))] * 2, strict=True))
    assert args["--old_policy.max_staleness"] == "4"
    assert args["--model.corrections.anchor"] == "proximal"
    assert args["--model.optimization.minibatch_size"] == "8"  # 64 sequences in 8 steps
    assert args["--trust_region_monitor.kl_start"] == "true"
    steps32 = dict(zip(*[iter(study.arm_args("steps32", 8))] * 2, strict=True))
    assert steps32["--model.optimization.minibatch_size"] == "2"  # in 32 steps
    assert steps32["--old_policy.max_staleness"] == "0"


def test_objectives_choose_a_half_of_each_seeds_runs(tmp_path):
    args = study.parse_args(["--out", str(tmp_path), "--arms", "s4", "--seeds", "2", "3",
                             "--objectives", "troll"])  # fmt: skip
    names = [run.name for run in study.runs(args, 1e-5)]
    assert names == ["s4-troll-s2", "s4-troll-s3"]
    both = study.parse_args(["--out", str(tmp_path), "--arms", "s4", "--seeds", "2"])
    assert [run.name for run in study.runs(both, 1e-5)] == ["s4-clip-s2", "s4-troll-s2"]
    with pytest.raises(SystemExit):
        study.parse_args(["--objectives", "ppo"])


def test_the_plans_endpoints_by_hand():
    """Two seeds. Gaps (TROLL - clipping, mean accuracy at rollouts 30 and 40): s0 +0.10 and
    +0.05; s4 +0.20 and +0.20. So d = gap(s4) - gap(s0) = +0.10 and +0.15: mean +0.125, sd
    0.0354, t = 0.125 / 0.025 = 5.0 on 1 degree of freedom, p = 1 - 2 atan(5) / pi = 0.13."""
    records = [
        record("s0", "troll", 0, (0.6, 0.6)), record("s0", "clip", 0, (0.5, 0.5)),
        record("s0", "troll", 1, (0.5, 0.6)), record("s0", "clip", 1, (0.5, 0.5)),
        record("s4", "troll", 0, (0.5, 0.5), kl=0.02), record("s4", "clip", 0, (0.3, 0.3), kl=0.04),
        record("s4", "troll", 1, (0.6, 0.6), kl=0.02), record("s4", "clip", 1, (0.4, 0.4)),
    ]  # fmt: skip
    gaps = tables.gaps(records)
    assert gaps["s0"] == pytest.approx({0: 0.10, 1: 0.05})
    assert gaps["s4"] == pytest.approx({0: 0.20, 1: 0.20})
    text = tables.report(records)
    assert "gap(s4) - gap(s0), seeds [0, 1]: +0.125 (+0.100, +0.150); t-test p 0.13" in text
    assert "| s4 | 0 | 0.500 | 0.300 | +0.200 | 2.00e-02 / 4.00e-02 |" in text
    assert "gap(s2)" not in text  # no run of it


def test_a_run_without_both_endpoint_validations_has_no_endpoint():
    partial = record("s2", "troll", 0)
    partial["history"] = [row for row in partial["history"] if row["rollout"] != 40]
    assert tables.endpoint(partial) is None
    assert "s2" not in tables.gaps([partial, record("s2", "clip", 0)])


@pytest.mark.parametrize(
    ("diffs", "expected"),
    [
        ((0.05, 0.06, 0.055), "better"),
        ((-0.05, -0.06, -0.055), "worse"),
        ((0.01, 0.30, 0.02), "no difference shown: mean +0.110"),  # all above 0, p 0.37
        ((0.05, -0.01, 0.06), "no difference shown"),
        ((0.05, 0.06), "no verdict: the rule is for 3 paired seeds, and 2 are in"),
        ((0.05,), "no verdict: the rule is for 3 paired seeds, and 1 is in"),
    ],
)
def test_the_verdict_needs_every_seed_and_the_t_test(diffs, expected):
    result = load("study_stats").paired(list(diffs), [0.0] * len(diffs))
    assert tables.verdict(result, "better", "worse").startswith(expected)


def test_a_level_is_stale_only_above_twice_s0s_kl_and_the_proximal_arm_follows_its_sampler():
    """s0 at KL 0.01 (run here), s2 at 0.015 (not above 0.02: not measurably stale), s4 at 0.03
    (stale); s4-proximal shares s4's sampler. Without s0's figure (the headroom study's runs do
    not log it) s0 counts as 0, so any KL above 0 is stale."""
    records = [record("s0", o, 0, kl=0.01) for o in ("troll", "clip")]
    records += [record("s2", o, 0, kl=0.015) for o in ("troll", "clip")]
    records += [record("s4", o, 0, kl=0.03) for o in ("troll", "clip")]
    text, flat = tables.stale_check(records)
    assert flat == {"s2"}
    assert "- s2: KL at a rollout's start 1.50e-02 against s0's 1.00e-02" in text
    assert "not measurably stale" in text.splitlines()[0] and text.splitlines()[1].endswith("stale")
    records[4:] = [record("s4", o, 0, kl=0.019) for o in ("troll", "clip")]
    assert tables.stale_check(records)[1] == {"s2", "s4", "s4-proximal"}
    headroom = [record("s0", o, 0) for o in ("troll", "clip")]
    for r in headroom:
        r["history"] = [row for row in r["history"] if tables.KL_START not in row]
    assert tables.kl_start(headroom, "s0") == 0.0
    assert tables.stale_check(headroom + records[2:])[1] == set()


def test_the_primary_comparison_carries_its_verdict_and_a_flat_level_is_named():
    """Three seeds where TROLL's gap grows by 0.10, 0.11 and 0.12 from s0 to s4: TROLL holds up
    better; with s4 not measurably stale the line says so."""
    records = []
    for seed, extra in enumerate((0.10, 0.11, 0.12)):
        records += [record("s0", "troll", seed, (0.5, 0.5), kl=0.0),
                    record("s0", "clip", seed, (0.5, 0.5), kl=0.0),
                    record("s4", "troll", seed, (0.5 + extra, 0.5 + extra), kl=0.02),
                    record("s4", "clip", seed, (0.5, 0.5), kl=0.02)]  # fmt: skip
    lines = tables.comparisons(records)
    assert lines[0].startswith("gap(s4) - gap(s0), seeds [0, 1, 2]: +0.110")
    assert lines[0].endswith("verdict: TROLL holds up better under staleness")
    assert "acc(troll, s4) - acc(troll, s0), seeds [0, 1, 2]: +0.110" in lines[1]
    assert "acc(clip, s4) - acc(clip, s0), seeds [0, 1, 2]: +0.000" in lines[2]
    for r in records:
        for row in r["history"]:
            if tables.KL_START in row and r["fields"]["arm"] == "s4":
                row[tables.KL_START] = 0.0
    assert "not a comparison under stale data" in tables.comparisons(records)[0]


def full(arm, objective, seed, kl_end, active, reward):
    """A run of 40 rollouts: ``kl_end`` and ``active`` before rollout 21 and twice them from it;
    the entropy 1 before rollout 21 and 3 from it, the share cut at the limit 0.5 on even rollouts
    from 21 and 0 elsewhere; the reward ``reward`` + rollout / 100; validations at 30 and 40."""
    history = []
    for r in range(1, 41):
        late = 2 if r >= 21 else 1
        row = {"rollout": r, "trust_region/kl_end_mean": kl_end * late,
               tables.ACTIVE[objective]: active * late, "reward/mean": reward + r / 100,
               "entropy": 2 * late - 1,
               "completion/truncated_frac": 0.5 if late == 2 and r % 2 == 0 else 0.0}  # fmt: skip
        if r in (30, 40):
            row["val/accuracy"] = 0.5
        history.append(row)
    fields = {"arm": arm, "objective": objective, "seed": seed}
    return {"name": f"{arm}-{objective}-s{seed}", "fields": fields, "history": history}


def test_the_secondary_table_reads_its_windows_by_hand():
    """KL end and the share acted on over rollouts 21-40 (twice the early values), the entropy
    (3) and the share cut at the limit (0.25) over the same rollouts; the reward in windows of 10
    (rollouts 1-10: reward + 0.055); means over the seeds."""
    records = [full("s2", "troll", s, 0.01, 0.02 * (s + 1), 0.1) for s in range(2)]
    table = tables.secondary_table(records).splitlines()
    assert table[0].startswith(
        "| arm | objective | seeds | KL end mean 21-40 | acts on 21-40 | entropy 21-40 "
        "| cut at the limit 21-40 |"
    )
    assert table[0].endswith("| reward 1-10 | reward 11-20 | reward 21-30 | reward 31-40 |")
    assert table[2] == "| s2 | troll | 2 | 0.02 | 0.06 | 3 | 0.25 | 0.155 | 0.255 | 0.355 | 0.455 |"


def test_the_plot_draws_a_panel_per_arm_and_the_kl_at_the_start(tmp_path):
    pytest.importorskip("matplotlib")
    records = [record(arm, o, 0, kl=0.01) for arm in ("s0", "s4", "s4-proximal")
               for o in ("troll", "clip")]  # fmt: skip
    path = tables.plot(records, tmp_path / "staleness.png")
    assert path.stat().st_size > 0


def test_the_figure_draws_the_whole_study_whatever_the_selection(tmp_path):
    """After one run of one arm, seed and objective, the figure still draws every finished run of
    the study's records (other arms, seeds and objectives), not that selection alone."""
    args = study.parse_args(["--dry-run", "--out", str(tmp_path), "--s0-here", "--arms",
                             "steps32", "--seeds", "0", "--objectives", "troll"])  # fmt: skip
    grid = study.grid(args, study.DRY_LR)
    held = [record(arm, o, seed) for arm in ("s4", "steps32") for o in ("troll", "clip")
            for seed in (0, 1)]  # fmt: skip
    grid.write(held)
    selected = grid.finished(study.runs(args, study.DRY_LR))
    assert [r["name"] for r in selected] == ["steps32-troll-s0"]
    drawn = study.whole_study(args, study.DRY_LR, grid)
    assert sorted(r["name"] for r in drawn) == sorted(r["name"] for r in held)
    assert args.arms == ["steps32"] and args.seeds == [0]  # the selection itself is unchanged


def test_the_headroom_runs_are_cut_at_the_studys_last_rollout():
    long = record("main", "troll", 0)
    long["history"].append({"rollout": 80, "val/accuracy": 0.9})
    cut = study.cut(long, 40)
    assert cut["fields"]["arm"] == "s0" and max(r["rollout"] for r in cut["history"]) == 40
    assert long["fields"]["arm"] == "main"  # the headroom record is left as it was


def test_short_runs_are_refused(capsys, tmp_path):
    with pytest.raises(SystemExit):
        study.parse_args(["--out", str(tmp_path), "--rollouts", "30"])
    assert "--rollouts must reach the endpoint's last validation, 40; got 30" in (
        capsys.readouterr().err
    )


@pytest.mark.slow
def test_a_dry_run_trains_a_stale_arm_and_logs_how_stale(tmp_path, capsys):
    """Both objectives at s2 on TinyMath for two rollouts of 1 prompt x 8 completions (8
    optimiser steps of 1 sequence): every run records the KL at each rollout's start (0
    on-policy; that a stale sampler moves it is
    ``tests/test_training.py::test_kl_start_is_how_stale_the_data_is``), and each arm's run was
    configured as the arm says: s2's in the config its run logged, s0's (run here with
    ``--s0-here``, the same machinery at staleness 0) in the arguments the grid trains it with."""
    out = tmp_path / "stale"
    common = ["--dry-run", "--out", str(out), "--s0-here", "--seeds", "0", "--prompts", "1"]
    argv = [*common, "--arms", "s2"]
    planned = study.runs(study.parse_args([*common, "--arms", "s0", "s2"]), study.DRY_LR)
    assert [r.name for r in planned] == ["s0-clip-s0", "s0-troll-s0", "s2-clip-s0", "s2-troll-s0"]
    for run in planned:
        given = dict(zip(run.args[::2], run.args[1::2], strict=True))
        staleness = "2" if run.fields["arm"] == "s2" else "0"
        assert given["--old_policy.max_staleness"] == staleness, run.name
        assert given["--trust_region_monitor.kl_start"] == "true", run.name
    study.main(argv)
    args = study.parse_args(argv)
    records = study.grid(args, study.DRY_LR).finished(study.runs(args, study.DRY_LR))
    assert sorted(r["name"] for r in records) == ["s2-clip-s0", "s2-troll-s0"]
    for r in records:
        kl = [row[tables.KL_START] for row in r["history"] if tables.KL_START in row]
        assert len(kl) == 2 and kl[0] == pytest.approx(0.0, abs=1e-6)
        config = next((out / "runs" / r["name"] / "logs").glob("*/config.yaml")).read_text()
        assert "max_staleness: 2" in config and "kl_start: true" in config
    assert "| s2 | 0 |" in capsys.readouterr().out
