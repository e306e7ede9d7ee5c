"""The layout of the package: small files, and the old import paths of everything that moved.

Names that moved to a file of their own stay importable from where they were, as the same
objects; checkpoints that name the option records by their old module path still load.
"""

from __future__ import annotations

import importlib
import re
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 430  # past ~400 lines a file is due for a split; this is the hard limit

# (where a name was importable from, the name, the file that defines it now)
MOVED = [
    ("module", "ClipConfig", "objectives"),
    ("module", "LossConfig", "objectives"),
    ("module", "TrustRegionConfig", "objectives"),
    ("module", "OptimizationConfig", "optimization"),
    ("module", "TrollModule", "module"),
    ("module", "check_strategy", "sharding"),
    ("module", "check_shardable", "sharding"),
    ("objectives", "AGGREGATIONS", "aggregation"),
    ("objectives", "AGGREGATION_SIZES", "aggregation"),
    ("objectives", "IMPORTANCE_LEVELS", "aggregation"),
    ("objectives", "REF_KL_ESTIMATORS", "aggregation"),
    ("objectives", "OBJECTIVES", "objectives"),
    ("objectives", "ClipObjective", "objectives"),
    ("objectives", "TrollObjective", "objectives"),
    ("objectives", "build_objective", "objectives"),
    ("objectives", "ObjectiveStats", "objective_stats"),
    ("objectives", "ClipStats", "objective_stats"),
    ("objectives", "TrollStats", "objective_stats"),
    ("objectives", "PolicyObjective", "policy_objective"),
    ("objectives", "token_entropy", "policy_objective"),
    ("rollout", "behaviour_outputs", "forward"),
    ("rollout", "linear_head", "forward"),
    ("rollout", "position_ids", "forward"),
    ("rollout", "response_hidden", "forward"),
    ("rollout", "response_logits", "forward"),
    ("data", "PromptDataModule", "data"),
    ("data", "EpochShuffleSampler", "prompts"),
    ("data", "PromptBatch", "prompts"),
    ("data", "PromptItem", "prompts"),
    ("data", "collate_prompts", "prompts"),
    ("data", "read_rows", "prompts"),
    ("data", "write_jsonl", "prompts"),
    ("rewards", "REWARD_FUNCTIONS", "rewards"),
    ("rewards", "RewardError", "rewards"),
    ("rewards", "RewardFunction", "rewards"),
    ("rewards", "RewardOutput", "rewards"),
    ("rewards", "RewardScorer", "rewards"),
    ("rewards", "RewardWarning", "rewards"),
    ("rewards", "register_reward", "rewards"),
    ("rewards", "resolve_reward", "rewards"),
    ("rewards", "boxed", "reward_functions"),
    ("rewards", "extract_boxed", "reward_functions"),
    ("rewards", "gsm8k", "reward_functions"),
    ("rewards", "last_number", "reward_functions"),
    ("rewards", "tinymath", "reward_functions"),
    ("rewards", "overlong", "reward_options"),
    ("rewards", "reward_tag", "reward_options"),
]
# names that were in the old files' __all__ (``from ... import *`` must still give them)
NOT_IN_ALL = {("module", "check_strategy"), ("module", "check_shardable")}


def sources() -> list[Path]:
    return sorted([*(ROOT / "lightning_troll").glob("*.py"), *(ROOT / "callbacks").glob("*.py")])


@pytest.mark.parametrize("path", sources(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_file_is_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.name} has {lines} lines; split it (limit {MAX_LINES})"


@pytest.mark.parametrize(("old", "name", "home"), MOVED, ids=lambda v: str(v))
def test_old_import_paths_give_the_same_objects(old, name, home):
    old_module = importlib.import_module(f"lightning_troll.{old}")
    home_module = importlib.import_module(f"lightning_troll.{home}")
    assert getattr(old_module, name) is getattr(home_module, name)
    if (old, name) not in NOT_IN_ALL:
        assert name in old_module.__all__
        assert name in home_module.__all__
    defined_in = getattr(getattr(home_module, name), "__module__", home_module.__name__)
    if callable(getattr(home_module, name)):
        assert defined_in == home_module.__name__


def test_the_readme_names_every_file_once():
    """The README's "Where to find what" table names each file of the package, and no other."""
    text = (ROOT / "README.md").read_text()
    table = text.split("## Where to find what", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"`((?:callbacks/)?[a-z_0-9]+\.py)`", table)
    files = [
        ("callbacks/" if path.parent.name == "callbacks" else "") + path.name
        for path in sources()
        if path.name != "__init__.py"
    ]
    assert sorted(named) == sorted(files)


def test_the_reward_registry_holds_the_built_ins_by_name():
    from lightning_troll import reward_functions, reward_options
    from lightning_troll.rewards import REWARD_FUNCTIONS

    builtins = {name: getattr(reward_functions, name) for name in reward_functions.__all__}
    del builtins["extract_boxed"]  # a helper, not a reward
    builtins["overlong"] = reward_options.overlong
    assert list(REWARD_FUNCTIONS)[:5] == ["tinymath", "gsm8k", "boxed", "last_number", "overlong"]
    for name, function in builtins.items():  # tests may have registered more since
        assert REWARD_FUNCTIONS[name] is function


@pytest.mark.slow
def test_a_checkpoint_naming_the_old_module_paths_loads_and_resumes(tmp_path, tiny_model_dir):
    """A checkpoint written before the option records moved out of ``lightning_troll.module``
    names them by that path (a module built in Python keeps the records themselves in its
    hyper-parameters). One written so, by the real save path while the classes report their old
    module, loads with ``weights_only=True`` through ``TrollModule.load_from_checkpoint`` and
    resumes a fit; without the old paths on the allow-list it is refused."""
    from lightning_troll.module import (
        ClipConfig,
        OptimizationConfig,
        TrollModule,
        TrustRegionConfig,
    )
    from lightning_troll.resume import CHECKPOINT_CONFIGS, MOVED_CONFIGS
    from tests.test_training import make_data, make_module, make_trainer

    options = {
        "trust_region": TrustRegionConfig(eps=0.03),
        "clip": ClipConfig(eps_low=0.1),
        "optimization": OptimizationConfig(max_bad_steps=5),
    }
    trainer = make_trainer(tmp_path, 1, limit_val_batches=0)
    trainer.fit(make_module(tiny_model_dir, **options), datamodule=make_data(tiny_model_dir))
    old = tmp_path / "old.ckpt"
    with pytest.MonkeyPatch.context() as patch:
        for config, path in MOVED_CONFIGS.items():
            patch.setattr(config, "__module__", path.rpartition(".")[0])
        trainer.save_checkpoint(old)
    with zipfile.ZipFile(old) as archive:
        pickled = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    for config, path in MOVED_CONFIGS.items():
        module, _, name = path.rpartition(".")
        assert f"{module}\n{name}\n".encode() in pickled
        assert f"{config.__module__}\n{name}\n".encode() not in pickled

    allowed = torch.serialization.get_safe_globals()
    try:  # the control: with the present paths only, the old checkpoint is refused
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(list(CHECKPOINT_CONFIGS))
        with pytest.raises(Exception, match="lightning_troll.module"):
            torch.load(old, weights_only=True)
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(allowed)

    loaded = TrollModule.load_from_checkpoint(old, weights_only=True)
    for name, value in options.items():
        assert type(loaded.hparams[name]) is type(value)
        assert loaded.hparams[name] == value
    assert loaded.objective.projection.eps == 0.03
    assert loaded.minibatch_loop.config.max_bad_steps == 5

    resumed = make_trainer(tmp_path, 2, limit_val_batches=0)
    module = make_module(tiny_model_dir, **options)
    resumed.fit(module, datamodule=make_data(tiny_model_dir), ckpt_path=old, weights_only=True)
    assert resumed.global_step == 2
