"""examples/drift_anatomy.py on a tiny model: the moments it measures and their invariants."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from lightning_troll.cli import run as cli_run

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # a short fit, then three variants of one rollout


def load_script():
    spec = importlib.util.spec_from_file_location(
        "drift_anatomy", ROOT / "examples/drift_anatomy.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


script = load_script()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A TinyMath run of 2 rollouts of 4 prompts x 8 completions, 2 steps each, with the shipped
    policy (it earns rewards, so the steps move it): its last.ckpt (weights, AdamW state)."""
    folder = tmp_path_factory.mktemp("anatomy_run")
    cli_run(
        [
            "fit", "--config", str(ROOT / "configs" / "tinymath.yaml"),
            "--trainer.max_steps", "4",
            "--trainer.limit_val_batches", "0",
            "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", str(folder),
            "--trainer.logger", "false",
            "--data.batch_size", "4",
            "--data.num_train", "32",
            "--data.num_val", "4",
            "--model.optimization.minibatch_size", "16",
            "--checkpoint.dirpath", str(folder),
        ]
    )  # fmt: skip
    return folder / "last.ckpt"


@pytest.fixture(scope="module")
def results(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("anatomy") / "anatomy.json"
    before = checkpoint.read_bytes()
    found = script.main(
        ["--checkpoint", str(checkpoint), "--repeats", "1", "--alphas", "10", "--json", str(out)]
    )
    assert checkpoint.read_bytes() == before  # only read
    assert json.loads(out.read_text()) == json.loads(json.dumps(found))
    return found


def test_every_variant_takes_the_rollout_in_four_minibatches(results):
    assert list(results["variants"]) == ["clip", "troll", "troll alpha 10"]
    assert results["variants"]["troll alpha 10"] == {"objective": "troll", "alpha": 10.0}
    (repeat,) = results["repeats"]
    assert repeat["sequences"] == 32
    for rows in repeat["objectives"].values():
        assert [r["position"] for r in rows] == [1, 2, 3, 4]
        assert sum(r["tokens"] for r in rows) > 0


def test_the_moments_agree_where_they_must(results):
    eps = results["eps"]
    assert eps == 0.05  # tinymath.yaml's
    objectives = results["repeats"][0]["objectives"]
    clip = objectives["clip"]
    for rows in objectives.values():
        first, last = rows[0], rows[-1]
        # the first minibatch arrives on-policy: the policy is the behaviour policy
        assert abs(first["arrive"]["mean"]) < 1e-5 and first["arrive"]["max"] < 1e-4
        assert first["arrive"]["over_frac"] == 0.0 and first["arrive"]["arrived_over"] == 0
        assert first["arrive"]["ratio_max"] == pytest.approx(1.0, abs=1e-3)
        assert first["arrive"]["ratio_min"] == pytest.approx(1.0, abs=1e-3)
        assert first["arrive"]["ratio_outside_clip"] == 0.0
        # the last minibatch's own step is the rollout's last: "own" and "end" coincide
        assert last["own"] == last["end"]
        # the first step is on-policy, where TROLL projects nothing: every variant takes clip's
        # step, so the second minibatch arrives at the same KL
        assert rows[1]["arrive"]["mean"] == pytest.approx(clip[1]["arrive"]["mean"], rel=1e-4)
        for row in rows:
            for moment in script.MOMENTS:
                figures = row[moment]
                assert 0.0 <= figures["over_frac"] <= 1.0
                assert figures["max"] >= figures["mean"] - 1e-7
                if figures["arrived_over"]:
                    assert figures["arrived_over_before"] > eps
                assert 0.0 < figures["ratio_min"] <= figures["ratio_max"]
                assert 0.0 <= figures["ratio_outside_clip"] <= 1.0
                assert figures["sampled_mean"] >= -1e-6  # r log r - r + 1 >= 0 per token
    # the rollout moved the policy: by its end, the first minibatch is no longer on-policy
    assert all(rows[0]["end"]["mean"] > 1e-4 for rows in objectives.values())


def test_the_table_has_a_row_per_variant_and_minibatch(results, tmp_path, capsys):
    lines = script.table(results).splitlines()
    assert len(lines) == 2 + 3 * 4
    assert lines[2].startswith("| clip | 1 | 0.0000 / 0.000 / 0.0% |")
    assert lines[-1].startswith("| troll alpha 10 | 4 |")
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(results))
    capsys.readouterr()
    assert script.main(["--report", str(saved)]) == json.loads(json.dumps(results))
    assert capsys.readouterr().out.strip() == script.table(results).strip()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--checkpoint", "gone.ckpt"], "--checkpoint: no file at gone.ckpt"),
        (["--steps", "0"], "--steps must be >= 1; got 0"),
        (["--alphas", "-1"], "--alphas must be >= 0; got [-1.0]"),
        (["--report", "gone.json"], "--report: no file at gone.json"),
    ],
)
def test_bad_arguments_are_refused(args, message, checkpoint, capsys):
    given = ["--checkpoint", str(checkpoint), *args]
    with pytest.raises(SystemExit) as stop:
        script.parse_args(given)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_a_checkpoint_or_a_report_is_required(capsys):
    with pytest.raises(SystemExit):
        script.parse_args([])
    assert "--checkpoint is required (or --report" in capsys.readouterr().err


def test_steps_that_do_not_divide_the_rollout_are_refused(checkpoint):
    with pytest.raises(SystemExit, match="--steps: 5 does not divide the rollout's 32 sequences"):
        script.main(["--checkpoint", str(checkpoint), "--repeats", "1", "--steps", "5"])
