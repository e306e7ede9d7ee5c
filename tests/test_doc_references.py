"""Docs that cannot drift: every repository path, every ``lightning_troll.<module>.<symbol>`` and
every ``file.py`` (``Class.method``) pair named in README.md and docs/ exists as named."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "studies").glob("*.md")),
]
TOP = (
    "lightning_troll/", "docs/", "examples/", "studies/", "configs/", "tests/", "callbacks/",
    ".ci/",
)  # fmt: skip
"""A path starting here is the repository's."""
PACKAGES = tuple(
    f"{p.name}/" for p in (ROOT / "lightning_troll").iterdir() if (p / "__init__.py").exists()
)
"""A ``.py`` path starting here is the package's (``training/module.py``)."""
OUTPUTS = ("examples/results/gpu/",)
"""Folders that a documented command writes (``make gpu-check``), absent until it runs."""


def spans(path: Path) -> list[str]:
    return re.findall(r"`([^`\n]+)`", path.read_text())


def named_paths(text: str) -> list[str]:
    found = re.findall(r"(?<![\w./-])((?:[\w.-]+/)+[\w.-]*)", text)
    return [p for p in found if p.startswith(TOP) or (p.startswith(PACKAGES) and p.endswith(".py"))]


def exists(path: str) -> bool:
    name = path.rstrip("/")
    return any((base / name).exists() for base in (ROOT, ROOT / "lightning_troll"))


def resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                found = getattr(found, attr)
        except AttributeError:
            return False
        return True
    return False


def all_named(kind) -> list[tuple[str, str]]:
    return sorted({(doc.name, item) for doc in DOCS for span in spans(doc) for item in kind(span)})


def test_the_scanner_sees_what_it_checks():
    assert named_paths("see `lightning_troll/models/assets/tinymath` and training/module.py") == [
        "lightning_troll/models/assets/tinymath", "training/module.py"
    ]  # fmt: skip
    assert named_paths("trust_region/kl_after_max and runs/x") == []  # a metric, an output
    assert not exists("lightning_troll/assets/tinymath") and exists("training/module.py")
    assert resolves("lightning_troll.training.module.TrollModule")
    assert not resolves("lightning_troll.training.module.loss_of")
    assert len(all_named(named_paths)) > 100


@pytest.mark.parametrize(("doc", "path"), all_named(named_paths))
def test_a_named_path_exists(doc, path):
    assert path.startswith(OUTPUTS) or exists(path), f"{doc} names {path}, which does not exist"


@pytest.mark.parametrize(
    ("doc", "dotted"), all_named(lambda span: re.findall(r"\blightning_troll(?:\.\w+)+", span))
)
def test_a_named_symbol_resolves(doc, dotted):
    assert resolves(dotted), f"{doc} names {dotted}, which does not resolve"


def located() -> list[tuple[str, str, str]]:
    """(doc, file, method) for every ```file.py`` (``Class.method``)`` in the docs."""
    pattern = r"`([\w/]+\.py)` \(`\w+\.(\w+)`"
    return sorted({(d.name, f, m) for d in DOCS for f, m in re.findall(pattern, d.read_text())})


def test_located_methods_are_found():
    assert ("architecture.md", "training/module.py", "loss_of") in located()


@pytest.mark.parametrize(("doc", "path", "method"), located())
def test_a_method_is_defined_in_the_file_named_beside_it(doc, path, method):
    file = next(base / path for base in (ROOT, ROOT / "lightning_troll") if (base / path).exists())
    assert re.search(rf"def {method}\b|^\s*{method}\s*=", file.read_text(), re.M), (
        f"{doc} places {method} in {path}"
    )
