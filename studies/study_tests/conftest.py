"""The library's shared fixtures (``tests/conftest.py``), imported rather than copied."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `pytest studies/study_tests` alone, without `python -m`
    sys.path.insert(0, str(ROOT))

from tests.conftest import smollm2_dir, tiny_chat_model_dir, tiny_model_dir  # noqa: E402, F401
