"""Modules that moved: no import of an old path works, and what older runs wrote down (option
records pickled in a checkpoint, import paths in a config) is read at the places now, through the
one table of ``lightning_troll/training/moved.py``; ``CHANGELOG.md`` lists every move."""

from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path

import pytest
from jsonargparse import Namespace

import lightning_troll
from lightning_troll.training.moved import (
    MOVED_MODULES,
    fold_moved_options,
    load_checkpoint_file,
    moved_path,
)

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "pre_layout"


def changelog_moves() -> list[str]:
    """The old import paths in the first column of the 0.2.0 "Moved modules" tables."""
    text = (ROOT / "CHANGELOG.md").read_text().split("## 0.2.0", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in text.splitlines() if line.startswith("| `lightning_troll.")]
    return [re.match(r"\| `([a-zA-Z0-9_.]+)`", row).group(1) for row in rows]


@pytest.mark.parametrize("old", ["projection", "module", "rollout", "reward_functions", "data"])
def test_an_old_import_path_is_not_importable(old):
    assert not hasattr(lightning_troll, "MOVED_MODULES")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"lightning_troll.{old}")


@pytest.mark.parametrize("old", changelog_moves())
def test_every_move_of_the_changelog_folds_to_a_module_that_exists(old):
    new = moved_path(old)
    assert new is not None, f"{old} is in CHANGELOG.md but not in MOVED_MODULES"
    module, _, name = new.rpartition(".")
    try:
        importlib.import_module(new)
    except ModuleNotFoundError:  # a name moved alone: its module holds it
        assert hasattr(importlib.import_module(module), name), new


def test_every_move_of_the_table_is_in_the_changelog():
    listed = " ".join(changelog_moves())
    text = (ROOT / "CHANGELOG.md").read_text()
    for old in MOVED_MODULES:
        assert old in listed or f"`{old.rpartition('.')[2]}`" in text, old


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("lightning_troll.rollouts.engine:HFEngine", "lightning_troll.engines.hf:HFEngine"),
        ("lightning_troll.rollouts.engine.RolloutEngine", "lightning_troll.engines.base.RolloutEngine"),
        ("lightning_troll.rollouts.vllm_engine:VLLMEngine", "lightning_troll.engines.vllm:VLLMEngine"),
        ("lightning_troll.rollouts.rollout.SamplingConfig", "lightning_troll.engines.sampling.SamplingConfig"),
        ("lightning_troll.rewards.functions:gsm8k", "lightning_troll.tasks.rewards.functions:gsm8k"),
        ("lightning_troll.reward_functions.boxed", "lightning_troll.tasks.rewards.functions.boxed"),
        ("lightning_troll.environments", "lightning_troll.tasks.environments"),
        ("lightning_troll.projection", "lightning_troll.trust_region.projection"),
        ("lightning_troll.rollouts.rollout.Rollout", None),  # did not move
        ("lightning_troll.rollouts.engine_processes", None),  # no such module, not a prefix match
        ("my_package.rewards:score", None),
    ],
)  # fmt: skip
def test_an_old_path_folds_to_its_place_now(old, new):
    assert moved_path(old) == new


def test_a_config_naming_old_paths_is_read_at_the_new_ones_with_one_warning():
    model = Namespace(
        rewards={"lightning_troll.rewards.functions:tinymath": 1.0, "gsm8k": 0.5},
        engine=Namespace(name="lightning_troll.rollouts.engine:HFEngine"),
        episodes=Namespace(environment="lightning_troll.environments.tool_env:ToolEnvironment"),
    )
    message = fold_moved_options(model, Namespace(source="tinymath"))
    assert model.rewards == {"lightning_troll.tasks.rewards.functions:tinymath": 1.0, "gsm8k": 0.5}
    assert model.engine.name == "lightning_troll.engines.hf:HFEngine"
    assert model.episodes.environment == (
        "lightning_troll.tasks.environments.tool_env:ToolEnvironment"
    )
    assert "\n" not in message and "CHANGELOG.md" in message
    assert (
        "lightning_troll.rollouts.engine:HFEngine -> lightning_troll.engines.hf:HFEngine" in message
    )
    assert fold_moved_options(model) is None  # nothing old is left


def test_a_flat_layout_checkpoint_loads_without_weights_only_its_records_at_their_places():
    """api.ckpt pickles its option records under the flat layout's paths
    (``lightning_troll.rollout.SamplingConfig``, ...), which no longer import."""
    from lightning_troll.engines.sampling import SamplingConfig
    from lightning_troll.objectives import TrustRegionConfig
    from lightning_troll.training.optimization import OptimizationConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        checkpoint = load_checkpoint_file(FIXTURES / "api.ckpt", map_location="cpu")
    stored = checkpoint["hyper_parameters"]
    assert type(stored["sampling"]) is SamplingConfig and stored["sampling"].max_new_tokens == 4
    assert type(stored["trust_region"]) is TrustRegionConfig
    assert type(stored["optimization"]) is OptimizationConfig


def test_the_options_0_2_0_renamed_fold_into_their_records():
    """Every flat option of 0.1 lands in its record's field, over what the record holds; a
    switch ``dynamic_sampling`` becomes the record's ``enabled``; the old reward keys an earlier
    checkpoint stored as null beside their record are dropped; a record stays a record."""
    from lightning_troll.objectives.options import AdvantageConfig
    from lightning_troll.training.moved import RENAMED_OPTIONS, fold_renamed_options
    from lightning_troll.training.optimization import OptimizationConfig

    old = {
        "model": "m",
        "estimator": "dr_grpo",
        "scale_rewards": "batch",
        "dynamic_sampling": True,
        "dynamic_sampling_max_rounds": 2,
        "seed": 7,
        "gradient_checkpointing": True,
        "logits_chunk_size": None,  # null: not moved, the record's default stays
        "share_prompts": False,
        "rollout_engine": "vllm",
        "rollout_engine_options": {"kv_cache_gib": 1},
        "behaviour_logprobs": "forward",
        "reward_kwargs": {"overlong": {"buffer": 2}},
        "on_reward_error": "drop",
        "reward_workers": None,
        "reward_timeout": 5.0,
        "optimization": {"minibatch_size": 8},
        "loss": {"importance": "sequence", "mask_truncated": True, "anchor": "proximal"},
        "cache_old_distributions": True,
    }
    folded, moves = fold_renamed_options(old)
    assert folded == {
        "model": "m",
        "advantages": {"estimator": "dr_grpo", "scale_rewards": "batch"},
        "dynamic_sampling": {"enabled": True, "max_rounds": 2},
        "optimization": {
            "minibatch_size": 8, "seed": 7, "gradient_checkpointing": True, "share_prompts": False
        },
        "engine": {"name": "vllm", "options": {"kv_cache_gib": 1}, "behaviour_logprobs": "forward"},
        "reward_options": {"kwargs": {"overlong": {"buffer": 2}}, "on_error": "drop", "timeout": 5.0},
        "loss": {"importance": "sequence"},
        "corrections": {"mask_truncated": True, "anchor": "proximal"},
    }  # fmt: skip
    assert len(moves) == 16 and "model.estimator -> model.advantages.estimator" in moves
    assert "model.loss.anchor -> model.corrections.anchor" in moves
    assert any(m.startswith("model.cache_old_distributions (retired: ") for m in moves)
    flat = {k for k in RENAMED_OPTIONS if "." not in k}
    assert flat <= set(old)  # the test covers every flat rename (the dotted ones: below)
    again, none = fold_renamed_options(folded)
    assert again == folded and none == []  # a 0.2.0 section is left as it is
    records = {"optimization": OptimizationConfig(), "advantages": AdvantageConfig("rloo")}
    kept, _ = fold_renamed_options({**records, "seed": 3, "scale_rewards": "none"})
    assert kept["optimization"] == OptimizationConfig(seed=3)
    assert kept["advantages"] == AdvantageConfig("rloo", "none")


def test_a_loss_record_of_an_older_checkpoint_gives_its_corrections_their_record():
    """A ``LossConfig`` unpickled from a checkpoint written before the corrections had a record
    of their own carries their fields beside its own: each moves into ``corrections`` (a record
    stays a record), the loss keeps its fields, and a retired option stored false goes quietly."""
    from lightning_troll.objectives import CorrectionsConfig, LossConfig
    from lightning_troll.training.moved import CORRECTIONS, RENAMED_OPTIONS, fold_renamed_options

    stored = LossConfig(entropy_coef=0.1)
    values = {"mask_truncated": True, "engine_is_cap": 3.0, "engine_is_level": "sequence",
              "engine_is_mode": "mask", "engine_is_floor": 0.5, "anchor": "proximal",
              "anchor_is_cap": 4.0}  # fmt: skip
    assert set(values) == set(CORRECTIONS)
    assert {f"loss.{f}" for f in CORRECTIONS} <= set(RENAMED_OPTIONS)
    vars(stored).update(values)  # as the unpickler sets an older record's state
    model = {"loss": stored, "corrections": CorrectionsConfig(), "cache_old_distributions": False}
    folded, moves = fold_renamed_options(model)
    assert folded == {
        "loss": LossConfig(entropy_coef=0.1),
        "corrections": CorrectionsConfig(**values),
    }
    assert not set(CORRECTIONS) & set(vars(folded["loss"]))
    assert len(moves) == 7
    assert fold_renamed_options({"loss": LossConfig()}) == ({"loss": LossConfig()}, [])


def test_a_config_of_0_1_runs_warned_and_an_old_flag_is_refused_naming_the_new(tmp_path, capsys):
    """A config file with 0.1's flat options parses into the records with one warning naming
    the new places; the same option as a command-line flag is refused in a line that names its
    new flag."""
    from lightning_troll.cli import run

    old = tmp_path / "old.yaml"
    old.write_text(
        "model:\n  estimator: rloo\n  dynamic_sampling: false\n  logits_chunk_size: 64\n"
        "  rollout_engine: hf\n"
    )
    from lightning_troll.cli.loader import _load

    with pytest.warns(UserWarning, match="renamed in 0.2.0") as warned:
        loaded = _load(old.read_text())
    assert loaded["model"] == {
        "advantages": {"estimator": "rloo"},
        "dynamic_sampling": {"enabled": False},
        "optimization": {"logits_chunk_size": 64},
        "engine": {"name": "hf"},
    }
    assert len([w for w in warned if "renamed in 0.2.0" in str(w.message)]) == 1
    assert "read at their places now (write the new names): model.estimator" in str(
        [w for w in warned if "renamed in 0.2.0" in str(w.message)][0].message
    )
    from lightning_troll.training.moved import renamed_warning

    stored = renamed_warning(["model.seed -> model.optimization.seed"], "--ckpt_path x", False)
    assert "(nothing to change): model.seed -> model.optimization.seed" in stored
    with pytest.raises(SystemExit) as printed:
        run(["fit", "--config", str(old), "--print_config"])
    assert printed.value.code in (0, None)
    shown = capsys.readouterr().out
    assert re.search(r"advantages:\n    estimator: rloo", shown)
    assert re.search(r"logits_chunk_size: 64", shown)
    with pytest.raises(SystemExit) as refused:
        run(["fit", "--model.estimator", "rloo"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "--model.estimator is --model.advantages.estimator since 0.2.0" in err
    assert len(err.strip().splitlines()) <= 2


def test_the_changelog_lists_every_renamed_option():
    from lightning_troll.training.moved import RENAMED_OPTIONS

    text = (ROOT / "CHANGELOG.md").read_text().split("### Renamed options", 1)[1]
    rows = re.findall(r"^\| `model\.([\w.]+)` \| `model\.([\w.]+)` \|$", text, flags=re.M)
    assert dict(rows) == RENAMED_OPTIONS


def test_a_python_checkpoint_of_0_1_exports(tmp_path, monkeypatch, capsys):
    """``lightning-troll export`` of a module built in Python under 0.1, whose loss record still
    carries the corrections' fields: the fold moves them out and the export leaves them at their
    defaults (a policy is written without them)."""
    from lightning_troll.cli.export import main

    monkeypatch.chdir(ROOT)  # the checkpoint names its model folder relative to the repository
    out = tmp_path / "policy"
    main(["--ckpt_path", str(FIXTURES / "api.ckpt"), "--output_dir", str(out)])
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert f"to {out}" in capsys.readouterr().out
