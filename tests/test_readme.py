"""The README's example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has a python example"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})
    # it prints the share of projected tokens and the largest KL after projection
    share, kl_max = (
        float(v) for v in re.findall(r"tensor\(([-0-9.e]+)\)", capsys.readouterr().out)
    )
    assert 0 < share <= 1
    assert kl_max <= 0.05 * (1 + 1e-4)


def test_readme_names_the_test_command():
    text = README.read_text()
    assert "make test" in text and "make setup" in text
