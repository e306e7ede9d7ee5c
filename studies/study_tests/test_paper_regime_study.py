"""The paper-regime study and the late-gap branches, on the studies' shared machinery
(studies/study_kit.py), run end to end on TinyMath."""

from __future__ import annotations

import json
import shutil

import pytest

from .helpers import load

paper = load("paper_regime_study")

DRY = [
    "--dry-run", "--prompts", "1", "--rollouts", "1", "--pilot-rollouts", "2",
    "--pilot-lrs", "1e-3", "--holdout", "4", "--seeds", "0", "--dense-seeds", "0",
]  # fmt: skip
"""The smallest study that still runs every phase: 1 prompt x 8 completions per rollout (8
optimiser steps of 1 sequence), pilots and cause tests of 2 rollouts (so that the one-step cause
test ending at rollout 2, not 8, shows its steps), a main grid of 1 rollout, 4 held-out rows, and
one pilot lr (the grid of several lrs is checked on the run list, which is what the grid trains)."""


@pytest.mark.slow
def test_paper_regime_study_runs_resumes_and_reports_from_a_copy(tmp_path, capsys):
    """The whole study on TinyMath in seconds: 2 pilots (both objectives at one lr; the pilot
    grid of two lrs is 4 runs), 5 cause tests, then both objectives and the dense arm;
    the records say what ran; a copy without runs/ (as the repository keeps it) gives back the
    same records, reports, and trains nothing more."""
    lrs = DRY.index("--pilot-lrs") + 1
    two_lrs = paper.parse_args([*DRY[:lrs], "1e-4", *DRY[lrs:], "--out", str(tmp_path / "plan")])
    assert sorted(r.name for r in paper.pilot_runs(two_lrs)) == [
        "pilot-clip-lr0.0001", "pilot-clip-lr0.001", "pilot-troll-lr0.0001", "pilot-troll-lr0.001",
    ]  # fmt: skip
    out = tmp_path / "study"
    paper.main([*DRY, "--out", str(out)])
    pilots = json.loads((out / "pilot" / "results.json").read_text())
    assert sorted(r["name"] for r in pilots) == ["pilot-clip-lr0.001", "pilot-troll-lr0.001"]
    done = paper.parse_args([*DRY, "--out", str(out)])
    causes = {r["name"]: r for r in paper.grid(done, "causes").finished(paper.cause_runs(done))}
    assert sorted(causes) == [
        "cause-control-clip-lr1e-05", "cause-control-troll-lr1e-05", "cause-dense-troll-lr1e-05",
        "cause-steps1-clip-lr1e-05", "cause-steps1-troll-lr1e-05",
    ]  # fmt: skip
    control = causes["cause-control-troll-lr1e-05"]  # the pilot's settings: 8 steps, official
    assert control["fields"]["cause"] == "control" and "steps" not in control["fields"]
    one_step = causes["cause-steps1-troll-lr1e-05"]
    # 1 prompt x 8 completions in one minibatch: 1 step per rollout, as many rollouts as a pilot
    # (with 8 steps per rollout its 2 steps would end at rollout 1)
    assert one_step["history"][-1]["rollout"] == 2 and one_step["fields"]["cause"] == "steps1"
    table = (out / "causes" / "table.md").read_text()
    assert "| cause-steps1-clip-lr1e-05 | clip | 1 | - |" in table
    assert "| cause-dense-troll-lr1e-05 | troll | 8 | dense |" in table
    assert "| cause-control-troll-lr1e-05 | troll | 8 | official |" in table
    assert "| cause-control-clip-lr1e-05 | clip | 8 | - |" in table
    main = {r["name"]: r for r in json.loads((out / "main" / "results.json").read_text())}
    assert len(main) == 3 and sum(r["fields"].get("support") == "dense" for r in main.values()) == 1
    header = (out / "main" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"name", "objective", "lr", "seed", "rollout", "val/accuracy"} <= set(header)
    held = (out / "pilot" / "holdout.jsonl").read_text().splitlines()
    train = (out / "pilot" / "train.jsonl").read_text().splitlines()
    assert len(held) == 4 and not set(held) & set(train), "the pilot validates on held-out rows"
    assert (out / "main" / "accuracy.png").stat().st_size > 0
    capsys.readouterr()

    copy = tmp_path / "copy"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("runs"))
    copied, kept = (paper.parse_args([*DRY, "--out", str(o)]) for o in (copy, out))
    lrs = paper.choose_lrs(paper.grid(copied, "pilot").finished(paper.pilot_runs(copied)))
    restored = paper.grid(copied, "main").finished(paper.main_runs(copied, lrs))
    assert {r["name"] for r in restored} == set(main)
    original = {r["name"]: r for r in paper.grid(kept, "main").finished(paper.main_runs(kept, lrs))}
    for r in restored:
        assert r["history"] == original[r["name"]]["history"]
        assert r["fields"] == original[r["name"]]["fields"]
    paper.main([*DRY, "--out", str(copy)])  # everything is done: nothing trains
    printed = capsys.readouterr().out
    assert "started" not in printed and printed.count("done before, skipped") == 10
    with pytest.raises(ValueError, match="holds runs made with"):
        paper.main([*DRY[:2], "4", *DRY[3:], "--out", str(copy)])


def test_paper_regime_main_grid_splits_by_objective_into_disjoint_runs(tmp_path):
    """Two studies side by side (--objectives clip, --objectives troll) share no run, and
    together make the whole grid; the dense arm goes with TROLL only."""
    lrs = {"clip": 3e-6, "troll": 3e-6}

    def names(*extra: str) -> set[str]:
        args = paper.parse_args(["--out", str(tmp_path), "--seeds", "0", "1", *extra])
        return {r.name for r in paper.main_runs(args, lrs)}

    clip, troll, both = names("--objectives", "clip"), names("--objectives", "troll"), names()
    assert clip == {"clip-lr3e-06-s0", "clip-lr3e-06-s1"}
    assert troll == {"troll-lr3e-06-s0", "troll-lr3e-06-s1", "troll-dense-lr3e-06-s0"}
    assert not clip & troll and clip | troll == both
    with pytest.raises(SystemExit):
        paper.parse_args(["--objectives", "kl"])


@pytest.mark.slow
def test_late_gap_branches_start_from_the_trunk_with_their_change(tmp_path):
    """The branch test on TinyMath, 1 prompt x 8 completions per rollout: a trunk of 1 rollout,
    four branches of 2 more. Every arm samples the same rollout 2 from the trunk's weights; the
    clipping arm logs clipping's figures, the eps 0.2 arm a bound of 0.2, the alpha 0 arm no
    regression loss, on every rollout; every arm logs the confidence bins; the trunk's checkpoint
    is kept for later branches."""
    branches = load("late_gap_branches")
    out = tmp_path / "late"
    argv = ["--dry-run", "--out", str(out), "--seeds", "0", "--trunk", "1", "--branch", "2",
            "--prompts", "1"]  # fmt: skip
    branches.main(argv)
    trunk = out / "trunks" / "runs" / "trunk-troll-lr3e-06-s0" / "checkpoints" / "last.ckpt"
    assert trunk.exists()
    args = branches.parse_args(argv)
    runs = branches.branch_runs(args, 0)
    records = {r["name"]: r for r in branches.branch_grid(args).finished(runs)}
    assert set(records) == {"control-s0", "clip-s0", "eps0.2-s0", "alpha0-s0"}
    first = {n: r["history"][0] for n, r in records.items()}
    assert {row["rollout"] for row in first.values()} == {2}
    assert len({row["reward/mean"] for row in first.values()}) == 1  # the same rollout 2
    assert all(len(r["history"]) == 2 for r in records.values())  # rollouts 2 and 3
    clip, eps = records["clip-s0"]["history"], records["eps0.2-s0"]["history"]
    assert all("clip/active_frac" in row and "trust_region/bound" not in row for row in clip)
    assert all(row["trust_region/bound"] == pytest.approx(0.2) for row in eps)
    for row in records["control-s0"]["history"]:
        assert row["trust_region/bound"] == pytest.approx(0.05)
    assert all(row["loss/regression"] == 0 for row in records["alpha0-s0"]["history"])
    for r in records.values():
        assert any(k.startswith("trust_region/by_confidence/") for k in r["history"][0])
    header = (out / "branches" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "trust_region/by_advantage/zero/tokens" in header and "clip/outside_frac" not in header
