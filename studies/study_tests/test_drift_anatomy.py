"""studies/drift_anatomy.py on a tiny model: the moments it measures and their invariants."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from lightning_troll.cli.command import run as cli_run

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # a short fit, then three variants of one rollout


def load_script():
    spec = importlib.util.spec_from_file_location(
        "drift_anatomy", ROOT / "studies/drift_anatomy.py"
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


def test_moved_kl_is_the_whole_distributions_kl():
    """A token of a 5-token distribution moves to ratio r, the rest scaled to keep the sum: the
    KL over all 5 tokens equals the two-point ``moved_kl``."""
    old = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64)
    for token, ratio in ((0, 1.2), (0, 0.8), (3, 2.5), (4, 0.0)):
        new = old * (1 - old[token] * ratio) / (1 - old[token])
        new[token] = old[token] * ratio
        whole = torch.where(new > 0, new * (new / old).log(), torch.zeros_like(new)).sum()
        assert script.moved_kl(old[token].item(), ratio) == pytest.approx(whole.item(), rel=1e-12)
    assert script.moved_kl(0.5, 1.2) == pytest.approx(
        0.6 * math.log(1.2) + 0.4 * math.log(0.8), rel=1e-12
    )
    assert script.moved_kl(0.9, 1.0) == 0.0
    assert script.moved_kl(0.9, 1.2) == pytest.approx(-math.log(0.9), rel=1e-12)  # all mass: p -> 1
    with pytest.raises(ValueError, match=r"need 0 < p < 1 and ratio >= 0; got p=1.0"):
        script.moved_kl(1.0, 1.2)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("eps", [0.05, 0.2])
def test_allowed_ratios_reach_the_bound(p, eps):
    low, high = script.allowed_ratios(p, eps)
    assert 0 <= low < 1 < high <= 1 / p
    for ratio in (low, high):
        at_edge = (ratio == 0 and script.moved_kl(p, 0) <= eps) or (ratio == 1 / p)
        if not at_edge:
            assert script.moved_kl(p, ratio) == pytest.approx(eps, rel=1e-9)
    assert script.moved_kl(p, low * 0.99) > eps or low == 0
    assert high == 1 / p or script.moved_kl(p, high * 1.01) > eps
    with pytest.raises(ValueError, match=r"eps must be > 0; got 0"):
        script.allowed_ratios(p, 0)


def test_boundary_table_printed_without_a_checkpoint(capsys):
    assert script.main(["--boundary", "--bounds", "0.05"]) == {}
    lines = capsys.readouterr().out.strip().splitlines()
    assert (
        lines[0]
        == "| p under pi_old | KL at ratio 0.8 | KL at ratio 1.2 | ratios eps 0.05 allows |"
    )
    assert len(lines) == 2 + len(script.BOUNDARY_PROBS)
    # p = 0.5: 0.6 ln 1.2 + 0.4 ln 0.8 = 0.0201 either way; p = 0.9 cannot reach 1.2
    assert lines[4].startswith("| 0.5 | 0.0201 | 0.0201 | 0.686 - 1.314 |")
    assert "| 0.9 | 0.1276 | 0.1054 (p -> 1) |" in lines[7]
    for args, message in (
        (
            ["--clip-range", "1.1", "1.2"],
            "--clip-range must satisfy 0 <= LOW < 1 < HIGH; got 1.1 1.2",
        ),
        (["--bounds", "0"], "--bounds must be > 0; got [0.0]"),
    ):
        with pytest.raises(SystemExit):
            script.parse_args(["--boundary", *args])
        assert message in capsys.readouterr().err
