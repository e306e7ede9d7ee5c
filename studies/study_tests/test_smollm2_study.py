"""studies/smollm2_study.py and its tables and plots (smollm2_report.py): grid, arguments,
tables, the committed outputs reported as they were, and a dry run with an interrupted run resumed
from its checkpoint. The machinery they share with the other studies is tested in
studies/study_tests/test_study_kit.py."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # imports Lightning and matplotlib; the dry run trains
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "studies/results/smollm2/study"


def load_study():
    spec = importlib.util.spec_from_file_location(
        "smollm2_study", ROOT / "studies/smollm2_study.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


study = load_study()
report = sys.modules["smollm2_report"]
kit = sys.modules["study_kit"]
LR = 1e-5  # configs/smollm2.yaml's


def options(args) -> dict[str, str]:
    """``["--a", "1", "--b", "2"]`` -> ``{"--a": "1", "--b": "2"}``."""
    return dict(zip(args[::2], args[1::2], strict=True))


def test_grid_pairs_objectives_per_seed_and_adds_one_stress_cell():
    budget = study.Budget()  # 8 prompts x 8 completions = 64 sequences
    specs = study.grid([0, 1, 2], budget, "steps", 8)
    assert [(s.objective, s.seed, s.steps) for s in specs] == [
        ("clip", 0, 4), ("troll", 0, 4), ("clip", 1, 4), ("troll", 1, 4),
        ("clip", 2, 4), ("troll", 2, 4), ("clip", 0, 8), ("troll", 0, 8),
    ]  # fmt: skip
    assert len({s.name for s in specs}) == 8
    lr = study.grid([0], budget, "lr", 8)[2:]
    assert [(s.objective, s.steps, s.lr) for s in lr] == [("clip", 4, 3e-5), ("troll", 4, 3e-5)]
    assert lr[0].name == "clip-steps4-lr3e-05-s0"
    assert len(study.grid([0, 1], budget, "none", 8)) == 4
    looser = study.grid([0, 1], budget, "none", 8, troll_eps=[0.2, 0.1, 0.2])[4:]
    assert [(s.objective, s.seed, s.steps, s.eps) for s in looser] == [
        ("troll", 0, 4, 0.2), ("troll", 1, 4, 0.2), ("troll", 0, 4, 0.1), ("troll", 1, 4, 0.1),
    ]  # fmt: skip
    assert looser[0].name == "troll-steps4-eps0.2-s0"
    for bad in (0, -0.1, math.nan, True):
        with pytest.raises(ValueError, match=r"--troll-eps must be numbers > 0"):
            study.grid([0], budget, "none", 8, troll_eps=[bad])
    both = study.grid([0, 1], budget, "none", 8, troll_eps=[0.2], troll_alpha=[0.0])[4:]
    assert [(s.seed, s.eps, s.alpha) for s in both] == [
        (0, 0.2, None), (1, 0.2, None), (0, None, 0.0), (1, None, 0.0),
    ]  # fmt: skip
    assert both[2].name == "troll-steps4-alpha0-s0"
    for bad in (-1.0, math.nan, True):
        with pytest.raises(ValueError, match=r"--troll-alpha must be numbers >= 0"):
            study.grid([0], budget, "none", 8, troll_alpha=[bad])
    with pytest.raises(ValueError, match=r"--stress must be one of"):
        study.grid([0], budget, "more", 8)
    with pytest.raises(ValueError, match=r"must divide the 64 sequences .* got 7"):
        study.grid([0], budget, "steps", 7)
    with pytest.raises(ValueError, match=r"--rollouts must be an integer >= 1; got 0"):
        study.Budget(rollouts=0)


def test_runs_set_the_cell_and_record_their_fields():
    budget = study.Budget()
    run = study.make_run(study.RunSpec("clip", 2, 8), budget, None)
    value = options(run.args)
    assert run.name == "clip-steps8-s2" and run.rollouts == 30
    assert run.max_steps == 240  # 30 rollouts x 8
    assert run.fields == {
        "objective": "clip", "seed": 2, "steps": 8, "lr": None, "eps": None, "alpha": None,
    }  # fmt: skip
    assert value["--config"] == str(ROOT / "configs" / "smollm2.yaml")
    assert value["--seed_everything"] == "2" and value["--model.objective"] == "clip"
    assert value["--model.optimization.minibatch_size"] == "8"  # 64 sequences in 8 steps
    assert value["--trainer.val_check_interval"] == "5"
    assert value["--trust_region_monitor.kl_end"] == "true"
    assert "--model.model" not in value and "--model.optimizer.init_args.lr" not in value
    stress = study.make_run(study.RunSpec("troll", 0, 4, lr=3e-5), budget, "m")
    value = options(stress.args)
    assert float(value["--model.optimizer.init_args.lr"]) == 3e-5 and value["--model.model"] == "m"
    assert "--model.trust_region.eps" not in value
    looser = options(study.make_run(study.RunSpec("troll", 0, 4, eps=0.2), budget, None).args)
    assert float(looser["--model.trust_region.eps"]) == 0.2
    assert "--model.trust_region.alpha" not in looser
    no_pull = study.make_run(study.RunSpec("troll", 0, 4, alpha=0.0), budget, None)
    assert float(options(no_pull.args)["--model.trust_region.alpha"]) == 0.0
    assert tuple(run.fields) == study.FIELDS  # what records before study_kit kept by the name


def record(objective, seed, steps, accuracies, kl, seconds=60.0, eps=None):
    history = [{"rollout": 0, "val/accuracy": accuracies[0]}]
    for i, a in enumerate(accuracies[1:], start=1):
        history.append(
            {
                "rollout": i,
                "val/accuracy": a,
                "reward/mean": a,
                "trust_region/kl_end_mean": kl,
                "trust_region/kl_end_max": 10 * kl,
                "trust_region/kl_end_sampled": kl / 2,
                "time/iteration": 2.0,
                "entropy": 0.5,
                "completion/mean_length": 10.0 + i,
                "trust_region/bound": eps or 0.05,
            }
        )
    spec = study.RunSpec(objective, seed, steps, eps=eps)
    return {"name": spec.name, "fields": asdict(spec), "seconds": seconds, "history": history}


def test_summary_tables_and_plots(tmp_path):
    records = [
        record("clip", 0, 4, [0.4, 0.5, 0.6], 0.02),
        record("clip", 1, 4, [0.4, 0.7, 0.8], 0.04, seconds=120.0),
        record("troll", 0, 4, [0.4, 0.5, 0.5], 0.01),
        record("troll", 0, 8, [0.4, 0.6, 0.6], 0.03),
        record("troll", 0, 4, [0.4, 0.6, 0.7], 0.05, eps=0.2),
    ]
    rows = report.summarise(records)
    assert [(r["objective"], r["steps"], r["seeds"]) for r in rows] == [
        ("clip", 4, 2), ("troll", 4, 1), ("troll", 8, 1), ("troll eps 0.2", 4, 1),
    ]  # fmt: skip
    clip = rows[0]
    assert (clip["objective"], clip["steps"], clip["seeds"]) == ("clip", 4, 2)
    assert clip["accuracy"] == pytest.approx((0.7, 0.1414213562373095), rel=1e-12)
    # late: mean of (0.4, 0.5, 0.6) and (0.4, 0.7, 0.8) = 0.5 and 0.6333
    assert clip["late_accuracy"][0] == pytest.approx((0.5 + 1.9 / 3) / 2, rel=1e-12)
    assert clip["kl_end"][0] == pytest.approx(0.03, rel=1e-12) and clip["kl_end_max"] == 0.4
    lines = report.format_table(rows, LR).splitlines()
    assert len(lines) == 2 + 4
    assert lines[2].startswith("| clip | 4 | 1e-05 | 2 | 0.700 ± 0.141 |")
    assert "| troll | 8 | 1e-05 | 1 |" in lines[4]
    assert lines[5].startswith("| troll eps 0.2 | 4 | 1e-05 | 1 | 0.700 ± 0.000 |")
    # per run, then the two clip seeds' means (rewards equal the accuracies of rollouts 1 and 2)
    runs = report.format_runs(records).splitlines()
    assert len(runs) == 2 + 5 + 1
    assert runs[6].startswith("| troll-steps4-eps0.2-s0 | 0.400, 0.600, 0.700 | 0.567 |")
    assert runs[2] == (
        "| clip-steps4-s0 | 0.400, 0.500, 0.600 | 0.500 | 0.550 / 0.550 / 0.550 | 0.020 / 0.010 "
        "| 0.20 | 0.500 | 11.5 | 2 |"
    )
    assert runs[-1] == (
        "| clip-steps4, mean of 2 seeds | 0.400, 0.600, 0.700 | 0.567 | 0.650 / 0.650 / 0.650 "
        "| 0.030 / 0.015 | 0.40 | 0.500 | 11.5 | 2 |"
    )
    paused = record("troll", 1, 4, [0.4, 0.5, 0.6], 0.02, seconds=3600.0 + 2.0 + 56.0)
    paused["history"][1]["time/iteration"] = 3600.0
    # the grid's time: 3898 s of wall time, 300 s once the paused rollout counts at the median
    assert report.grid_time([*records[:3], paused]) == (
        "the runs took 1.08 h of training and validation, 0.08 h without the paused rollouts"
    )
    paths = report.write_plots([*records, paused], tmp_path, LR)  # paused: off the chart
    assert [p.name for p in paths] == [
        "reward.png", "accuracy.png", "kl_end.png", "kl_end_max.png", "entropy.png", "time.png",
    ]  # fmt: skip
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path.name


def test_the_committed_outputs_report_the_tables_they_hold(tmp_path, capsys):
    """``--report`` on a copy of the committed study (results.json and metrics.csv of the format
    before study_kit, no runs/) prints and writes the committed ``table.md`` and ``runs.md`` and
    leaves the records as they were."""
    for name in ("results.json", "metrics.csv", "settings.json", "start.json"):
        shutil.copy(COMMITTED / name, tmp_path / name)
    records = study.main(["--report", "--out", str(tmp_path)])
    assert len(records) == 14 and all(set(r["fields"]) == set(study.FIELDS) for r in records)
    for name in ("table.md", "runs.md"):
        assert (tmp_path / name).read_text() == (COMMITTED / name).read_text(), name
    printed = capsys.readouterr().out
    assert printed.startswith("14 of 14 runs finished\nthe runs took 6.92 h")
    assert (COMMITTED / "table.md").read_text() in printed
    for name in ("results.json", "metrics.csv"):
        assert (tmp_path / name).read_bytes() == (COMMITTED / name).read_bytes(), name
    assert not (tmp_path / "runs").exists()


KEPT = ("reward/mean", "val/accuracy", "trust_region/kl_end_mean", "trust_region/kl_end_sampled")


def test_dry_run_end_to_end_and_an_interrupted_run_resumes(tiny_model_dir, tmp_path, monkeypatch):
    """The four arms of a seed (clip, TROLL, TROLL at eps 0.2 and at alpha 0) on TinyMath, 2
    rollouts of 1 prompt x 8 completions (4 optimiser steps each), validated on 2 rows after
    each: their bounds, KL and time figures, headline and outputs; a copy without runs/ reports
    and resumes them exactly, training nothing; a narrower grid keeps the others' records; a TROLL
    run stopped after 1 of its 2 rollouts leaves a checkpoint and no result, and resumes from it
    to the same figures as the run done in one go. The plots are drawn for each set of records
    the study reports (all four runs, the narrow grid's two, clip alone); a call that reports a
    set already drawn skips them (plotting is most of a call's time)."""
    base = ["--dry-run", "--model", str(tiny_model_dir), "--seeds", "0", "--stress", "none",
            "--rollouts", "2", "--prompts", "1", "--num-val", "2"]  # fmt: skip
    records = study.main(
        [*base, "--troll-eps", "0.2", "--troll-alpha", "0", "--out", str(tmp_path / "a")]
    )
    out = tmp_path / "a"
    assert [(r["fields"]["objective"], r["fields"]["eps"], r["fields"]["alpha"]) for r in records] == [
        ("clip", None, None), ("troll", None, None), ("troll", 0.2, None), ("troll", None, 0.0),
    ]  # fmt: skip
    bounds = [{row.get("trust_region/bound") for row in r["history"][1:]} for r in records]
    assert bounds[0] == {None} and [len(b) for b in bounds] == [1, 1, 1, 1]
    # tinymath.yaml's eps, then the option's (logged in float32), then the config's again
    assert [b.pop() for b in bounds[1:]] == pytest.approx([0.05, 0.2, 0.05], rel=1e-6)
    table = (out / "table.md").read_text()
    assert "| troll eps 0.2 | 4 |" in table and "| troll alpha 0 | 4 |" in table
    for r in records:
        rows = r["history"]
        assert [row["rollout"] for row in rows] == [0, 1, 2]
        assert r["final_accuracy"] == rows[-1]["val/accuracy"]  # results.json's headline
        for row in rows[1:]:  # both objectives: the KL at the rollout's end, and wall time
            assert row["trust_region/kl_end_mean"] >= -1e-6 and row["time/iteration"] > 0
            assert row["trust_region/kl_end_max"] >= row["trust_region/kl_end_mean"]
        assert ("trust_region/kl_after_max" in rows[1]) == (r["fields"]["objective"] == "troll")
        assert not (out / "runs" / r["name"] / "checkpoints").exists()  # deleted when done
    for name in ("metrics.csv", "results.json", "table.md", "runs.md", "kl_end.png", "time.png"):
        assert (out / name).exists(), name
    assert set(json.loads((out / "start.json").read_text())) == {
        "rollout",
        "val/accuracy",
        "seconds",
    }

    # A copy of the outputs without runs/ (what version control keeps) holds the finished runs:
    # --report and a resumed study read them back exactly, and train nothing.
    c = tmp_path / "c"
    c.mkdir()
    for name in ("metrics.csv", "results.json", "settings.json", "start.json"):
        shutil.copy(out / name, c / name)
    full = [*base, "--troll-eps", "0.2", "--troll-alpha", "0", "--out", str(c)]
    plots = study.write_plots
    monkeypatch.setattr(study, "write_plots", lambda *args: [])  # these records' plots: above
    assert study.main([*full, "--report"]) == records
    monkeypatch.setattr(kit.Grid, "train", None)  # calling it would fail
    assert study.main(full) == records
    assert not (c / "runs").exists()
    monkeypatch.setattr(study, "write_plots", plots)  # plots of the narrower grid's two runs
    # A narrower grid reports its own runs and keeps the others' in the outputs.
    narrow = study.main([*base, "--troll-eps", "--troll-alpha", "--out", str(c), "--report"])
    assert [r["name"] for r in narrow] == ["clip-steps4-s0", "troll-steps4-s0"]
    kept = [r["name"] for r in json.loads((c / "results.json").read_text())]
    assert sorted(kept) == sorted(r["name"] for r in records)
    assert "| troll eps 0.2 |" not in (c / "table.md").read_text()
    monkeypatch.undo()

    # Stop the TROLL run after 1 of its 2 rollouts, as a signal would: last.ckpt, no result.json.
    real_cli = kit.cli

    def stopped_early(args):
        if args[0] == "fit" and "troll" in args and '"version": 0' in " ".join(args):
            args = list(args)
            args[args.index("--trainer.max_steps") + 1] = str(1 * 4)  # 1 rollout of 4 steps
        return real_cli(args)

    b = tmp_path / "b"  # the start's validation and the clip run taken over from a, the
    (b / "runs" / "clip-steps4-s0").mkdir(parents=True)  # settings where they used to be kept
    for name in ("settings.json", "start.json"):
        shutil.copy(out / name, b / "runs" / name)
    shutil.copy(out / "runs/clip-steps4-s0/result.json", b / "runs/clip-steps4-s0/result.json")
    monkeypatch.setattr(kit, "cli", stopped_early)
    base += ["--troll-eps", "--troll-alpha"]  # no value: no run at another bound or weight
    with pytest.raises(SystemExit):
        study.main([*base, "--out", str(b)])
    troll = b / "runs" / "troll-steps4-s0"
    assert (troll / "checkpoints" / "last.ckpt").exists() and not (troll / "result.json").exists()
    assert (b / "runs" / "clip-steps4-s0" / "result.json").exists()
    assert (b / "start.json").exists() and not (b / "runs" / "start.json").exists()  # moved
    assert json.loads((b / "settings.json").read_text()) == json.loads(
        (out / "settings.json").read_text()
    )
    # --report: the outputs of the finished runs (clip), training nothing
    reported = study.main([*base, "--out", str(b), "--report"])
    assert [r["fields"]["objective"] for r in reported] == ["clip"]
    assert (
        "| clip |" in (b / "table.md").read_text()
        and "| troll |" not in (b / "table.md").read_text()
    )
    assert not (troll / "result.json").exists() and len(list((troll / "logs").iterdir())) == 1
    with pytest.raises(SystemExit, match="--report: no finished run"):
        study.main([*base, "--out", str(tmp_path / "empty"), "--report"])
    monkeypatch.setattr(study, "write_plots", lambda *args: [])  # the narrow grid's: above
    again = study.main([*base, "--out", str(b)])  # clip skipped, TROLL resumed at rollout 2
    assert json.loads((troll / "attempts.json").read_text()).__len__() == 2
    assert sorted(p.name for p in (troll / "logs").iterdir()) == ["version_0", "version_1"]
    for resumed, whole in zip(again[1]["history"], records[1]["history"], strict=True):
        for key in KEPT:
            assert (key in resumed) == (key in whole), key
            if key in whole:
                assert resumed[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key
