"""The studies' shared machinery (examples/study_kit.py) and the paper-regime study on it."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str):
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


kit = load("study_kit")
paper = load("paper_regime_study")


def test_read_history_merges_attempts_later_rows_winning(tmp_path):
    """Attempt 0 logged rollouts 1-3, attempt 1 (a resume) ran rollout 3 again and 4: rollout 3
    takes attempt 1's value; metrics outside the list are dropped; steps count from 0."""
    for version, rows in ((0, [(0, 0.1), (1, 0.2), (2, 0.3)]), (1, [(2, 0.35), (3, 0.4)])):
        folder = tmp_path / f"version_{version}"
        folder.mkdir()
        lines = ["step,reward/mean,other"] + [f"{s},{v},9" for s, v in rows]
        (folder / "metrics.csv").write_text("\n".join(lines) + "\n")
    history = kit.read_history(tmp_path, ["reward/mean"])
    assert history == [
        {"rollout": 1, "reward/mean": 0.1},
        {"rollout": 2, "reward/mean": 0.2},
        {"rollout": 3, "reward/mean": 0.35},
        {"rollout": 4, "reward/mean": 0.4},
    ]


def record(objective, lr, accuracies, active):
    history = [
        {"rollout": 5 * i, "val/accuracy": a, paper.ACTIVE[objective]: active}
        for i, a in enumerate(accuracies)
    ]
    return {
        "name": f"{objective}-{lr}",
        "fields": {"objective": objective, "lr": lr},
        "history": history,
    }


def test_choose_lrs_takes_the_best_pilot_whose_constraint_acts():
    """clip at 1e-6 scores best but clips nothing (plain policy gradient): 3e-6 is chosen; TROLL's
    best acting pilot is 1e-5. Scores are the mean of the last 2 validations."""
    pilots = [
        record("clip", 1e-6, [0.5, 0.9, 0.9], 0.0),
        record("clip", 3e-6, [0.5, 0.7, 0.8], 0.01),
        record("clip", 1e-5, [0.5, 0.8, 0.6], 0.05),
        record("troll", 1e-6, [0.5, 0.6, 0.6], 0.0),
        record("troll", 1e-5, [0.5, 0.7, 0.7], 0.02),
    ]
    assert paper.pilot_score(pilots[1]) == pytest.approx(0.75)
    assert paper.choose_lrs(pilots) == {"clip": 3e-6, "troll": 1e-5}
    # where no pilot's constraint acts, the best of all is taken (and the table shows 0%)
    assert paper.choose_lrs([pilots[0], pilots[3]]) == {"clip": 1e-6, "troll": 1e-6}


def test_grid_refuses_other_settings_in_the_same_folder(tmp_path):
    kit.Grid(tmp_path, {"prompts": 16}, []).check_settings()
    with pytest.raises(ValueError, match="holds runs made with"):
        kit.Grid(tmp_path, {"prompts": 8}, []).check_settings()


def test_write_atomic_leaves_no_partial_file(tmp_path):
    kit.write_atomic(tmp_path / "a.json", "[1]")
    assert (tmp_path / "a.json").read_text() == "[1]"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


DRY = [
    "--dry-run", "--prompts", "2", "--rollouts", "2", "--pilot-rollouts", "2",
    "--pilot-lrs", "1e-4", "1e-3", "--holdout", "16", "--seeds", "0", "--dense-seeds", "0",
]  # fmt: skip


@pytest.mark.slow
def test_paper_regime_study_runs_resumes_and_reports_from_a_copy(tmp_path, capsys):
    """The whole study on TinyMath in seconds: 4 pilots, then both objectives and the dense arm;
    the records say what ran; a copy without runs/ (as the repository keeps it) gives back the
    same records, reports, and trains nothing more."""
    out = tmp_path / "study"
    paper.main([*DRY, "--out", str(out)])
    pilots = json.loads((out / "pilot" / "results.json").read_text())
    assert sorted(r["name"] for r in pilots) == [
        "pilot-clip-lr0.0001", "pilot-clip-lr0.001", "pilot-troll-lr0.0001", "pilot-troll-lr0.001",
    ]  # fmt: skip
    main = {r["name"]: r for r in json.loads((out / "main" / "results.json").read_text())}
    assert len(main) == 3 and sum(r["fields"].get("support") == "dense" for r in main.values()) == 1
    header = (out / "main" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"name", "objective", "lr", "seed", "rollout", "val/accuracy"} <= set(header)
    held = (out / "pilot" / "holdout.jsonl").read_text().splitlines()
    train = (out / "pilot" / "train.jsonl").read_text().splitlines()
    assert len(held) == 16 and not set(held) & set(train), "the pilot validates on held-out rows"
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
    assert "started" not in printed and printed.count("done before, skipped") == 7
    with pytest.raises(ValueError, match="holds runs made with"):
        paper.main([*DRY[:2], "4", *DRY[3:], "--out", str(copy)])
