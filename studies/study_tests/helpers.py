"""Loading a study script of ``studies/`` (no package) as a module of its own name; the task
generators of ``examples/`` (``word_problems``) importable beside them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

STUDIES = Path(__file__).resolve().parents[1]
EXAMPLES = STUDIES.parent / "examples"


def load(name: str):
    for folder in (EXAMPLES, STUDIES):  # the studies' folder first
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, STUDIES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
