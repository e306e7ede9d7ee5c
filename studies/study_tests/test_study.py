"""studies/tinymath_study.py and its tables and plots (tinymath_report.py): grid, arguments,
aggregation, table, plots, the committed outputs reported as they were, and a tiny end-to-end
run. The machinery shared with the other studies is tested in
studies/study_tests/test_study_kit.py."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from lightning_troll.models.tinymath import build_tokenizer

pytestmark = pytest.mark.slow  # imports Lightning and matplotlib; the end-to-end run trains

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("matplotlib")


def load_study():
    spec = importlib.util.spec_from_file_location(
        "tinymath_study", ROOT / "studies/tinymath_study.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


study = load_study()
report = sys.modules["tinymath_report"]
kit = sys.modules["study_kit"]
FAIR = ROOT / "studies/results/tinymath/fair"


def record(
    estimator, objective, seed, accuracies, max_tokens=64, eps=0.05, extra=None, lr=None, **more
):
    """A run record whose held-out accuracy is ``accuracies[i]`` at rollout 10 * i."""
    history = [{"rollout": 10 * i, "val/accuracy": a} for i, a in enumerate(accuracies)]
    for row in history:
        row.update(extra or {})
    spec = study.RunSpec(estimator, objective, seed, max_tokens, eps, lr, **more)
    return {"name": spec.name, "fields": asdict(spec), "seconds": 1.0, "history": history}


def test_rollouts_to_threshold_is_the_first_rollout_at_or_above_it():
    history = [
        {"rollout": 0, "val/accuracy": 0.4},
        {"rollout": 3, "entropy": 0.9},  # a rollout without validation is passed over
        {"rollout": 10, "val/accuracy": 0.5},
        {"rollout": 20, "val/accuracy": 0.7},
    ]
    assert report.rollouts_to_threshold(history, 0.5) == 10  # >=, not >
    assert report.rollouts_to_threshold(history, 0.6) == 20
    assert report.rollouts_to_threshold(history, 0.4) == 0
    assert report.rollouts_to_threshold(history, 0.71) is None
    assert report.final_accuracy(history) == 0.7
    assert report.final_accuracy(history, last=2) == pytest.approx(0.6, rel=1e-12)
    assert report.final_accuracy(history, last=9) == pytest.approx(1.6 / 3, rel=1e-12)  # all 3
    with pytest.raises(ValueError, match="val/accuracy"):
        report.final_accuracy([{"rollout": 0, "entropy": 1.0}])


def test_summary_and_table_of_synthetic_runs():
    records = [
        record("grpo", "troll", 0, [0.4, 0.6, 0.8]),  # reaches 0.6 at rollout 10
        record("grpo", "troll", 1, [0.4, 0.5, 0.6]),  # at rollout 20
        record("grpo", "clip", 0, [0.4, 0.5, 0.5]),  # never
        record("grpo", "clip", 0, [0.4, 0.7, 0.1], lr=1e-3),  # a cell of its own
        record("gspo", "clip", 0, [0.4, 0.6, 0.6], clip_low=3e-4, clip_high=4e-4),
        record("gspo", "clip", 1, [0.4, 0.5, 0.7], clip_low=3e-4, clip_high=4e-4),
        record("grpo", "clip", 0, [0.4, 0.3, 0.2], steps=8),  # not the 4-step clip cell
    ]
    rows = report.summarise(records, threshold=0.6)
    troll, clip, stress, narrow, steps = rows
    assert (narrow["clip_low"], narrow["clip_high"], narrow["seeds"]) == (3e-4, 4e-4, 2)
    assert math.isclose(narrow["accuracy_mean"], 0.65, rel_tol=1e-12)
    assert narrow["rollouts_to_threshold"] == 15  # (10 + 20) / 2
    assert (steps["steps"], steps["seeds"], steps["accuracy_mean"]) == (8, 1, 0.2)
    # troll: mean (0.8 + 0.6) / 2 = 0.7; sample std sqrt(((0.1)^2 + (0.1)^2) / 1) = 0.1414...
    assert (troll["objective"], troll["seeds"], troll["reached"]) == ("troll", 2, 2)
    assert math.isclose(troll["accuracy_mean"], 0.7, rel_tol=1e-12)
    assert math.isclose(troll["accuracy_std"], math.sqrt(0.02), rel_tol=1e-12)
    assert troll["rollouts_to_threshold"] == 15  # (10 + 20) / 2
    assert (clip["accuracy_mean"], clip["accuracy_std"], clip["reached"]) == (0.5, 0.0, 0)
    assert clip["rollouts_to_threshold"] is None
    assert (stress["lr"], stress["accuracy_mean"], stress["rollouts_to_threshold"]) == (
        1e-3,
        0.1,
        10,
    )
    # last 3 validations: troll (0.4 + 0.6 + 0.8) / 3 = 0.6 and (0.4 + 0.5 + 0.6) / 3 = 0.5,
    # mean 0.55, sample std sqrt((0.05^2 + 0.05^2) / 1) = 0.0707...
    assert math.isclose(troll["late_mean"], 0.55, rel_tol=1e-12)
    assert math.isclose(troll["late_std"], math.sqrt(0.005), rel_tol=1e-12)
    lines = report.format_table(rows, 0.6).splitlines()
    assert lines[0] == (
        "| estimator | objective | K | eps | clip range | lr | steps / rollout | seeds "
        "| final accuracy | last 3 validations | rollouts to 0.6 |"
    )
    # lr, clip range and steps: the config's and the budget's where the run kept them
    assert lines[2] == (
        "| grpo | troll | 64 | 0.05 | - | 0.0001 | 4 | 2 | 0.700 ± 0.141 | 0.550 ± 0.071 "
        "| 15 (2/2) |"
    )
    assert lines[3] == (
        "| grpo | clip | - | - | 0.2 | 0.0001 | 4 | 1 | 0.500 ± 0.000 | 0.467 ± 0.000 "
        "| not reached |"
    )
    assert lines[4] == (
        "| grpo | clip | - | - | 0.2 | 0.001 | 4 | 1 | 0.100 ± 0.000 | 0.400 ± 0.000 | 10 (1/1) |"
    )
    assert lines[5] == (
        "| gspo | clip | - | - | 0.0003/0.0004 | 0.0001 | 4 | 2 | 0.650 ± 0.071 "
        "| 0.533 ± 0.000 | 15 (2/2) |"
    )
    assert lines[6].startswith("| grpo | clip | - | - | 0.2 | 0.0001 | 8 | 1 | 0.200 ± 0.000 |")
    assert len(lines) == 7
    assert report.format_table(rows[:1], 0.6, steps=2).splitlines()[2].split(" | ")[6] == "2"


def test_grid_has_every_cell_and_deduplicated_ablation():
    specs = study.grid(["grpo", "gspo"], [0, 1], ablation=True)
    main = [s for s in specs if (s.max_tokens, s.eps, s.lr) == (64, 0.05, None)]
    assert len(main) == 2 * 2 * 2
    ablation = {(s.max_tokens, s.eps) for s in specs} - {(64, 0.05)}
    assert ablation == {(4, 0.05), (16, 0.05), (64, 0.01), (64, 0.25)}
    stress = [(s.estimator, s.objective, s.lr, s.seed) for s in specs if s.lr is not None]
    assert stress == [("grpo", o, lr, 0) for lr in (3e-4, 1e-3) for o in ("clip", "troll")]
    assert len({s.name for s in specs}) == len(specs) == 8 + 4 + 4
    assert study.RunSpec("grpo", "clip", 0, lr=1e-3).name == "grpo-clip-K64-eps0.05-lr0.001-s0"
    assert study.grid(["grpo"], [0], ablation=False) == [
        study.RunSpec("grpo", "clip", 0),
        study.RunSpec("grpo", "troll", 0),
    ]
    with pytest.raises(ValueError, match=r"--estimators: unknown \['ppo'\]"):
        study.grid(["ppo"], [0], ablation=False)


def test_the_fair_cells_run_over_the_seeds():
    """GSPO + clip at GSPO's own clip range and GRPO x {clip, TROLL} at 8 steps per rollout, per
    seed; without the main grid only those; names unique and telling the settings apart."""
    specs = study.grid(["grpo", "gspo"], [0, 1, 2], ablation=True, fair=True)
    fair = [s for s in specs if s.clip_low is not None or s.steps is not None]
    assert len({s.name for s in specs}) == len(specs) == 12 + 3 + 6 + 4 + 4
    narrow = [s for s in fair if s.clip_low is not None]
    assert [(s.estimator, s.objective, s.seed) for s in narrow] == [
        ("gspo", "clip", s) for s in range(3)
    ]
    assert {(s.clip_low, s.clip_high) for s in narrow} == {(3e-4, 4e-4)}
    stress = [(s.estimator, s.objective, s.seed, s.steps) for s in fair if s.steps is not None]
    assert stress == [("grpo", o, s, 8) for o in ("clip", "troll") for s in range(3)]
    assert narrow[0].name == "gspo-clip-K64-eps0.05-clip0.0003_0.0004-s0"
    assert study.RunSpec("grpo", "troll", 1, steps=8).name == "grpo-troll-K64-eps0.05-steps8-s1"
    only = study.grid(["grpo"], [0], ablation=False, fair=True, main=False)
    assert only == fair[:1] + [s for s in fair if s.steps is not None and s.seed == 0]
    assert study.grid(["grpo"], [0], ablation=False, fair=False, main=False) == []
    assert study.parse_args(["--quick"]).fair is False
    assert study.parse_args([]).fair is True


def options(args) -> dict[str, str]:
    """``["--a", "1", "--b", "2"]`` -> ``{"--a": "1", "--b": "2"}``."""
    return dict(zip(args[::2], args[1::2], strict=True))


def test_runs_take_the_preset_from_its_file():
    spec = study.RunSpec("gspo", "clip", 3, 16, 0.25)
    run = study.make_run(spec, study.Budget(), "tinymath")
    value = options(run.args)
    assert run.args.count("--config") == 2 and str(ROOT / "configs" / "gspo.yaml") in run.args
    assert value["--seed_everything"] == "3" and value["--model.objective"] == "clip"
    assert value["--model.trust_region.max_tokens"] == "16"
    assert run.fields == asdict(spec) and tuple(run.fields) == study.FIELDS
    # 128 prompts x group size 8 = 1024 sequences a rollout, in 4 minibatches of 256: 4 steps
    group = yaml.safe_load((ROOT / "configs/tinymath.yaml").read_text())["model"]["group_size"]
    assert (study.Budget().batch_size, group, study.Budget().minibatches) == (128, 8, 4)
    assert value["--model.optimization.minibatch_size"] == "256"
    assert run.max_steps == 400 and run.rollouts == 100  # 100 rollouts x 4
    budget = study.Budget(rollouts=10, batch_size=4, minibatches=2)  # 32 sequences a rollout
    run = study.make_run(spec, budget, "tinymath")
    assert options(run.args)["--model.optimization.minibatch_size"] == "16"
    assert run.max_steps == 20
    assert "--model.optimizer.init_args.lr" not in options(run.args)  # the config's
    stress = study.RunSpec("grpo", "troll", 0, lr=3e-4)
    value = options(study.make_run(stress, study.Budget(), "tinymath").args)
    assert float(value["--model.optimizer.init_args.lr"]) == 3e-4
    assert "--model.clip.eps_low" not in value and "--model.clip.eps_high" not in value
    narrow = study.RunSpec("gspo", "clip", 0, clip_low=3e-4, clip_high=4e-4, steps=8)
    run = study.make_run(narrow, study.Budget(), "tinymath")
    value = options(run.args)
    assert float(value["--model.clip.eps_low"]) == 3e-4
    assert float(value["--model.clip.eps_high"]) == 4e-4
    assert value["--model.optimization.minibatch_size"] == "128"  # 1024 sequences / 8 steps
    assert run.max_steps == 800
    odd = study.RunSpec("grpo", "clip", 0, steps=3)
    with pytest.raises(ValueError, match=r"3 steps per rollout do not divide the rollout's 16"):
        study.make_run(odd, study.Budget(batch_size=2, minibatches=2), "tinymath")


def fit(run, folder: Path):
    """``lightning-troll fit`` of ``run`` as the grid trains it, without its logs or checkpoints."""
    quiet = ["--trainer.logger", "false", "--trainer.enable_checkpointing", "false"]
    quiet += ["--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(folder)]
    return kit.cli(["fit", *run.args, "--trainer.max_steps", str(run.max_steps), *quiet])


def test_a_fair_run_trains_with_its_clip_range_and_steps(tmp_path):
    """The overrides reach the module the CLI builds and the number of optimiser steps."""
    budget = study.Budget(rollouts=1, batch_size=2, val_every=1, num_val=2, num_train=8)
    spec = study.RunSpec("gspo", "clip", 0, clip_low=3e-4, clip_high=4e-4, steps=4)
    done = fit(study.make_run(spec, budget, "tinymath"), tmp_path)
    assert done.trainer.global_step == 4  # 16 sequences in 4 minibatches, one rollout
    objective = done.model.objective
    assert (objective.eps_low, objective.eps_high) == pytest.approx((3e-4, 4e-4), rel=1e-12)
    assert done.model.objective.importance == "sequence"  # the GSPO preset


def test_a_stress_run_trains_at_its_learning_rate(tmp_path):
    """The override reaches the optimiser that the CLI builds; without it the config's 1e-4."""
    budget = study.Budget(rollouts=1, batch_size=2, val_every=1, num_val=2, num_train=8)
    for lr, expected in ((None, 1e-4), (3e-4, 3e-4)):
        spec = study.RunSpec("grpo", "clip", 0, lr=lr)
        done = fit(study.make_run(spec, budget, "tinymath"), tmp_path / spec.name)
        assert done.trainer.global_step == budget.minibatches
        (group,) = done.trainer.optimizers[0].param_groups
        assert group["initial_lr"] == pytest.approx(expected, rel=1e-12), spec.name


def test_budget_errors_name_the_option():
    with pytest.raises(ValueError, match="--batch-size must be an integer >= 1; got 0"):
        study.Budget(batch_size=0)
    with pytest.raises(ValueError, match="--minibatches must be an integer >= 1; got 0"):
        study.Budget(minibatches=0)
    with pytest.raises(ValueError, match=r"--minibatches must divide the 24 sequences .* got 5"):
        study.Budget(batch_size=3, minibatches=5)


def test_plots_are_written(tmp_path):
    kl = {"trust_region/kl_after_max": 0.04, "trust_region/bound": 0.05, "entropy": 0.5}
    records = [
        record(e, o, s, [0.4, 0.5 + 0.1 * s], extra=kl)
        for e in ("grpo", "gspo")
        for o in ("clip", "troll")
        for s in (0, 1)
    ]
    records.append(record("grpo", "troll", 0, [0.4, 0.45], max_tokens=4, extra=kl))
    records.append(record("grpo", "clip", 0, [0.4, 0.1], extra=kl, lr=1e-3))
    paths = report.write_plots(records, tmp_path)
    names = ["accuracy.png", "entropy.png", "kl_after.png", "active_frac.png", "ablation.png"]
    names.append("learning_rate.png")
    assert [p.name for p in paths] == names
    for path in paths:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000, path.name
    fair = [record("gspo", "clip", s, [0.4, 0.5], clip_low=3e-4, clip_high=4e-4) for s in (0, 1)]
    fair += [record("grpo", o, 0, [0.4, 0.5], extra=kl, steps=8) for o in ("clip", "troll")]
    (tmp_path / "fair").mkdir()
    paths = report.write_plots(fair, tmp_path / "fair")
    assert [p.name for p in paths] == ["fair.png"]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_committed_fair_outputs_report_the_table_they_hold(tmp_path, capsys):
    """``--report`` on a copy of the committed fair-baseline outputs (records of the format
    before study_kit, no runs/) writes and prints the committed ``table.md``, trains nothing and
    leaves the records as they were."""
    for name in ("results.json", "metrics.csv"):
        shutil.copy(FAIR / name, tmp_path / name)
    records = study.main(["--no-main", "--no-ablation", "--out", str(tmp_path), "--report"])
    assert [r["fields"]["seed"] for r in records] == [0, 1, 2] * 3
    assert (tmp_path / "table.md").read_text() == (FAIR / "table.md").read_text()
    assert (
        capsys.readouterr().out == "9 of 9 runs finished\n" + (FAIR / "table.md").read_text() + "\n"
    )
    for name in ("results.json", "metrics.csv"):
        assert (tmp_path / name).read_bytes() == (FAIR / name).read_bytes(), name
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "fair.png", "metrics.csv", "results.json", "table.md",
    ]  # fmt: skip
    with pytest.raises(SystemExit, match="--report: no finished run"):
        study.main(["--out", str(tmp_path / "empty"), "--report"])


def test_tiny_end_to_end_run(tiny_model_dir, tmp_path):
    args = [
        "--model", str(tiny_model_dir),
        "--estimators", "grpo",
        "--seeds", "0",
        "--rollouts", "2",
        "--val-every", "1",
        "--batch-size", "2",
        "--num-val", "4",
        "--num-train", "16",
        "--support-prompts", "2",
        "--no-ablation",
        "--no-fair",
    ]  # fmt: skip
    records = study.main([*args, "--out", str(tmp_path / "a")])
    out = tmp_path / "a"
    fields = [r["fields"] for r in records]
    assert [(f["objective"], f["seed"]) for f in fields] == [("clip", 0), ("troll", 0)]
    with (out / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["name", *sorted(study.FIELDS), "rollout", *study.METRICS]
    results = json.loads((out / "results.json").read_text())
    for result in results:
        mine = [r for r in rows if r["name"] == result["name"] and r["val/accuracy"]]
        # rollout 0 (the warm start), then after rollouts 1 and 2
        assert [int(r["rollout"]) for r in mine] == [0, 1, 2]
        assert result["final_accuracy"] == float(mine[-1]["val/accuracy"])
        assert result["rollouts_to_threshold"] == report.rollouts_to_threshold(
            [
                {"rollout": int(r["rollout"]), "val/accuracy": float(r["val/accuracy"])}
                for r in mine
            ],
            0.55,
        )
        logged = {k for r in rows if r["name"] == result["name"] for k, v in r.items() if v}
        troll = result["fields"]["objective"] == "troll"
        assert ("trust_region/kl_after_max" in logged) == troll
        assert ("clip/active_frac" in logged) == (not troll)
        assert not (out / "runs" / result["name"] / "checkpoints").exists()  # deleted when done
    support = json.loads((out / "support.json").read_text())
    vocab = len(build_tokenizer())
    assert support["vocab_size"] == vocab and 1 <= support["median"] <= support["max"] <= vocab
    assert (out / "table.md").read_text().count("| grpo |") == 2
    # the same seed gives the same run
    budget = study.Budget(rollouts=2, batch_size=2, val_every=1, num_val=4, num_train=16)
    troll = study.make_run(study.RunSpec("grpo", "troll", 0), budget, str(tiny_model_dir))
    start = json.loads((out / "start.json").read_text())
    start = [{"rollout": 0, "val/accuracy": start["val/accuracy"]}]
    grid = study.study_grid(budget, str(tiny_model_dir), tmp_path / "b", 0.55)
    again = grid.train(troll, tmp_path / "b" / "runs" / troll.name, start)
    assert again["history"] == records[1]["history"]
