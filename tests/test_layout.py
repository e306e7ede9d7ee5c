"""The layout of the package: layers whose imports run one way, rooms of readable size, what the
packages export, and checkpoints written before the move (old paths: ``tests/test_moved.py``).
"""

from __future__ import annotations

import ast
import importlib
import re
import shutil
from pathlib import Path

import pytest
import torch

import lightning_troll

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_troll"
FIXTURES = ROOT / "tests" / "fixtures" / "pre_layout"
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 250
LAYERS = (
    "trust_region",
    "objectives",
    "models",
    "tasks.data",
    "tasks.rewards",
    "tasks.environments",
    "engines",
    "rollouts",
    "training",
    "callbacks",
    "cli",
)
"""Bottom to top: a module imports only from its own layer and the layers below. ``tasks`` is one
room of three layers (the data, the rewards, the environments), ordered like the rooms."""
TORCH_ONLY = {"trust_region", "objectives"}
"""Layers that import neither Lightning nor transformers."""


def modules() -> dict[str, Path]:
    """Every module of the package (``lightning_troll.x.y``) and its file; callbacks/ included."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in sorted((ROOT / "callbacks").glob("*.py")):
        name = "lightning_troll.callbacks" + ("" if path.stem == "__init__" else f".{path.stem}")
        found[name] = path
    return found


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    for depth in (3, 2):  # a sub-layer (tasks.data) before its room
        if ".".join(parts[1:depth]) in LAYERS:
            return ".".join(parts[1:depth])
    return None


def imports_of(path: Path, module: str) -> set[str]:
    """The package modules ``path`` imports, at module level or inside functions."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    known = modules()
    return {m for m in found if m in known} | {m for m in found if not m.startswith("lightning")}


def test_at_most_eight_entries_at_the_top_one_per_room():
    entries = {
        p.name
        for p in PACKAGE.iterdir()
        if p.name not in ("__init__.py", "__main__.py", "py.typed")
    } - {"__pycache__"}
    assert len(entries) <= 8, sorted(entries)
    assert entries == {layer.split(".")[0] for layer in LAYERS} - {"callbacks"}


@pytest.mark.parametrize("module", sorted(modules()))
def test_every_module_is_small_and_every_class_too(module):
    path = modules()[module]
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path} has {lines} lines (limit {MAX_MODULE_LINES})"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            size = node.end_lineno - node.lineno + 1
            assert size <= MAX_CLASS_LINES, f"{module}.{node.name} has {size} lines"


def test_imports_run_down_the_layers_and_make_no_circle():
    known = modules()
    graph = {m: {i for i in imports_of(p, m) if i in known and i != m} for m, p in known.items()}
    upward = []
    for module, targets in graph.items():
        here = LAYERS.index(layer_of(module)) if layer_of(module) else len(LAYERS)
        for target in targets:
            there = layer_of(target)
            if there is not None and LAYERS.index(there) > here:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)

    # no circle among the modules (a package's __init__ re-exporting its own modules is not one)
    def edges(module: str) -> set[str]:
        return {t for t in graph[module] if not (module.endswith(t) or t.startswith(module + "."))}

    state: dict[str, int] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for target in edges(module):
            if state.get(target) == 1:
                raise AssertionError("import circle: " + " -> ".join([*trail, module, target]))
            if target not in state:
                visit(target, [*trail, module])
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [])


@pytest.mark.parametrize("layer", sorted(TORCH_ONLY))
def test_the_maths_imports_torch_only(layer):
    for module, path in modules().items():
        if layer_of(module) != layer:
            continue
        outside = {
            i.split(".")[0] for i in imports_of(path, module) if not i.startswith("lightning_troll")
        }
        assert not outside & {"lightning", "transformers", "peft", "datasets"}, (module, outside)


# (a package, a name it exports, the module the name lives in)
PACKAGE_EXPORTS = [
    ("objectives", "TrustRegionConfig", "objectives.options"),
    ("objectives", "ClipConfig", "objectives.options"),
    ("objectives", "LossConfig", "objectives.options"),
    ("objectives", "TrollObjective", "objectives.troll"),
    ("objectives", "ClipObjective", "objectives.clip"),
    ("objectives", "build_objective", "objectives.registry"),
    ("objectives", "AGGREGATIONS", "objectives.aggregation"),
    ("objectives", "ObjectiveStats", "objectives.stats"),
    ("objectives", "token_entropy", "objectives.base"),
    ("tasks.data", "PromptDataModule", "tasks.data.datamodule"),
    ("tasks.data", "read_rows", "tasks.data.prompts"),
    ("tasks.rewards", "RewardScorer", "tasks.rewards.registry"),
    ("tasks.rewards", "register_reward", "tasks.rewards.registry"),
    ("tasks.rewards", "last_number", "tasks.rewards.functions"),
    ("tasks.rewards", "overlong", "tasks.rewards.options"),
    ("models", "load_policy", "models.loading"),
    ("models", "tiny_causal_lm", "models.loading"),
    ("cli", "main", "cli.command"),
    ("cli", "TrollCLI", "cli.command"),
    ("engines", "HFEngine", "engines.hf"),
    ("engines", "SamplingConfig", "engines.sampling"),
    ("rollouts", "SamplingConfig", "engines.sampling"),
    ("rollouts", "RolloutCollector", "rollouts.collector"),
    ("training.module", "TrustRegionConfig", "objectives.options"),
    ("rollouts.rollout", "response_logits", "rollouts.forward"),
]


@pytest.mark.parametrize(("package", "name", "home"), PACKAGE_EXPORTS, ids=str)
def test_the_packages_export_their_modules_names(package, name, home):
    exporting = importlib.import_module(f"lightning_troll.{package}")
    home_module = importlib.import_module(f"lightning_troll.{home}")
    assert getattr(exporting, name) is getattr(home_module, name)
    assert name in exporting.__all__


def test_the_public_names_resolve():
    assert lightning_troll.__all__ == [
        "ADVANTAGE_ESTIMATORS",
        "ClipObjective",
        "LossInputs",
        "ProjectionResult",
        "SparseDistribution",
        "TrollObjective",
        "TrustRegionProjection",
        "build_objective",
        "compute_advantages",
        "kl_projection",
        "register_advantage_estimator",
        "sparsify",
    ]
    for name in lightning_troll.__all__:
        assert getattr(lightning_troll, name) is not None


def test_the_architecture_page_names_every_module_once():
    """docs/architecture.md's table of modules names each module of the package, and no other."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## Every module", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"`((?:[a-z_]+/)*[a-z_0-9]+\.py)`", table)
    files = [
        str(path.relative_to(PACKAGE if PACKAGE in path.parents else ROOT))
        for path in modules().values()
        if path.name != "__init__.py"
    ]
    assert sorted(named) == sorted(files)


def test_the_reward_registry_holds_the_built_ins_by_name():
    from lightning_troll.tasks.rewards import functions, options
    from lightning_troll.tasks.rewards.registry import REWARD_FUNCTIONS

    builtins = {name: getattr(functions, name) for name in functions.__all__}
    del builtins["extract_boxed"]  # a helper, not a reward
    builtins["overlong"] = options.overlong
    assert list(REWARD_FUNCTIONS)[:6] == [
        "tinymath", "gsm8k", "boxed", "last_number", "overlong", "math_verify"
    ]  # fmt: skip
    for name, function in builtins.items():  # tests may have registered more since
        assert REWARD_FUNCTIONS[name] is function


# -- checkpoints written by the flat layout ------------------------------------------------------


def test_the_python_checkpoint_names_the_old_paths_and_loads_only_through_the_allow_list():
    """api.ckpt pickles its option records by their flat paths; ``weights_only=True`` loads it
    because those paths are allow-listed, and refuses it with the present paths alone."""
    from lightning_troll.training.resume import CHECKPOINT_CONFIGS

    allowed = torch.serialization.get_safe_globals()
    try:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(list(CHECKPOINT_CONFIGS))
        with pytest.raises(Exception, match=r"lightning_troll\.(objectives|optimization|rollout)"):
            torch.load(FIXTURES / "api.ckpt", weights_only=True)
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(allowed)
    checkpoint = torch.load(FIXTURES / "api.ckpt", weights_only=True)
    region = checkpoint["hyper_parameters"]["trust_region"]
    assert type(region) is lightning_troll.objectives.TrustRegionConfig
    assert (region.support, region.max_tokens) == ("union", 8)


@pytest.mark.slow
def test_a_python_checkpoint_of_the_flat_layout_loads_and_resumes(tmp_path, monkeypatch):
    from lightning.pytorch import Trainer

    from lightning_troll.callbacks import OldPolicyRefresh, RolloutGeneration
    from lightning_troll.tasks.data import PromptDataModule
    from lightning_troll.training.module import TrollModule

    monkeypatch.chdir(ROOT)  # the checkpoint names its model folder relative to the repository
    loaded = TrollModule.load_from_checkpoint(FIXTURES / "api.ckpt", weights_only=True)
    assert loaded.objective.projection.support == "union"
    assert loaded.hparams["optimization"].minibatch_size == 8
    module = TrollModule(**{k: v for k, v in loaded.hparams.items() if not k.startswith("_")})
    data = PromptDataModule(
        source="tinymath", tokenizer=loaded.hparams["model"], batch_size=4, num_train=64,
        num_val=8, val_batch_size=8, seed=0,
    )  # fmt: skip
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[RolloutGeneration(log_samples=0), OldPolicyRefresh()],
    )  # fmt: skip
    trainer.fit(module, datamodule=data, ckpt_path=FIXTURES / "api.ckpt", weights_only=True)
    assert trainer.global_step == 6


@pytest.mark.slow
def test_a_command_line_checkpoint_of_the_flat_layout_resumes(tmp_path, monkeypatch):
    from lightning_troll.cli.command import run

    monkeypatch.chdir(ROOT)
    checkpoint = tmp_path / "cli.ckpt"
    shutil.copy(FIXTURES / "cli.ckpt", checkpoint)
    done = run(
        [
            "fit", "--config", str(FIXTURES / "config.yaml"), "--trainer.max_steps", "6",
            "--checkpoint.dirpath", str(tmp_path), "--ckpt_path", str(checkpoint),
        ]
    )  # fmt: skip
    assert done.trainer.global_step == 6
    assert done.model.objective.projection.support == "union"


def test_the_library_tests_load_no_study_script():
    """The studies live in ``studies/`` with their tests in ``studies/study_tests/``, and every
    script of ``examples/`` that imports a study script is a study script too (it belongs there);
    no file under ``tests/`` imports or loads one: no ``import``, no string naming one
    (``load("study_kit")``, ``sys.modules["study_kit"]``, ``"studies/study_kit.py"``) outside
    docstrings, and no import from ``studies`` or ``examples``."""

    def imports(path: Path) -> set[str]:
        """The top-level modules ``path`` imports, at module level or inside functions."""
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
        return found

    def loads(path: Path) -> set[str]:
        """What ``path`` imports, and the script names its strings give (docstrings aside)."""
        tree = ast.parse(path.read_text())
        documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, documented) and node.body and isinstance(node.body[0], ast.Expr)
        }
        strings = {
            node.value.rpartition("/")[2].removesuffix(".py")
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        }
        return imports(path) | strings

    studies = {path.stem for path in (ROOT / "studies").glob("*.py")}
    assert len(studies) > 10, f"studies/ holds {len(studies)} scripts"
    examples = {path.stem: path for path in (ROOT / "examples").glob("*.py")}
    misplaced = sorted(name for name, path in examples.items() if imports(path) & studies)
    assert not misplaced, f"examples/ holds scripts that import a study script: {misplaced}"
    offending = [
        f"{path.relative_to(ROOT)}: {sorted(named)}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if (named := (loads(path) & studies) | (imports(path) & {"examples", "studies"}))
    ]
    assert not offending, (
        "tests/ loads study scripts (their tests go in studies/study_tests/):\n"
        + "\n".join(offending)
    )
