"""examples/staleness_study.py: each arm's options, the plan's endpoints computed by hand, the
headroom study's runs as the arm s0, and a dry run that trains stale arms on TinyMath."""

from __future__ import annotations

import pytest

from .helpers import load

study = load("staleness_study")


def record(arm, objective, seed, accuracy=(0.5, 0.5), kl=0.0):
    """A run's record: held-out ``accuracy`` at rollouts 30 and 40, ``kl`` at the start of
    rollouts 20 and 30."""
    history = [
        {"rollout": 0, "val/accuracy": 0.1},
        {"rollout": 20, study.KL_START: kl},
        {"rollout": 30, "val/accuracy": accuracy[0], study.KL_START: kl},
        {"rollout": 40, "val/accuracy": accuracy[1]},
    ]
    fields = {"arm": arm, "objective": objective, "seed": seed}
    return {"name": f"{arm}-{objective}-s{seed}", "fields": fields, "history": history}


def test_each_arm_sets_its_staleness_anchor_and_steps():
    args = dict(zip(*[iter(study.arm_args("s4-proximal", 8))] * 2, strict=True))
    assert args["--old_policy.max_staleness"] == "4"
    assert args["--model.loss.anchor"] == "proximal"
    assert args["--model.optimization.minibatch_size"] == "8"  # 64 sequences in 8 steps
    assert args["--trust_region_monitor.kl_start"] == "true"
    steps32 = dict(zip(*[iter(study.arm_args("steps32", 8))] * 2, strict=True))
    assert steps32["--model.optimization.minibatch_size"] == "2"  # in 32 steps
    assert steps32["--old_policy.max_staleness"] == "0"


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
    gaps = study.gaps(records)
    assert gaps["s0"] == pytest.approx({0: 0.10, 1: 0.05})
    assert gaps["s4"] == pytest.approx({0: 0.20, 1: 0.20})
    text = study.report(records)
    assert "gap(s4) - gap(s0), seeds [0, 1]: +0.125 (+0.100, +0.150); t-test p 0.13" in text
    assert "| s4 | 0 | 0.500 | 0.300 | +0.200 | 2.00e-02 / 4.00e-02 |" in text
    assert "gap(s2)" not in text  # no run of it


def test_a_run_without_both_endpoint_validations_has_no_endpoint():
    partial = record("s2", "troll", 0)
    partial["history"] = [row for row in partial["history"] if row["rollout"] != 40]
    assert study.endpoint(partial) is None
    assert "s2" not in study.gaps([partial, record("s2", "clip", 0)])


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
    """Both objectives at s0 and s2 on TinyMath for two rollouts: every run records the KL at
    each rollout's start (0 on-policy; that a stale sampler moves it is
    ``tests/test_training.py::test_kl_start_is_how_stale_the_data_is``), and each arm's run was
    configured as the arm says."""
    out = tmp_path / "stale"
    argv = ["--dry-run", "--out", str(out), "--s0-here", "--arms", "s0", "s2", "--seeds", "0"]
    study.main(argv)
    args = study.parse_args(argv)
    records = study.grid(args, study.DRY_LR).finished(study.runs(args, study.DRY_LR))
    assert sorted(r["name"] for r in records) == [
        "s0-clip-s0", "s0-troll-s0", "s2-clip-s0", "s2-troll-s0"
    ]  # fmt: skip
    for r in records:
        kl = [row[study.KL_START] for row in r["history"] if study.KL_START in row]
        assert len(kl) == 2 and kl[0] == pytest.approx(0.0, abs=1e-6)
        config = next((out / "runs" / r["name"] / "logs").glob("*/config.yaml")).read_text()
        staleness = 2 if r["fields"]["arm"] == "s2" else 0
        assert f"max_staleness: {staleness}" in config and "kl_start: true" in config
    assert "| s2 | 0 |" in capsys.readouterr().out
