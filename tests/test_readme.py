"""The README's first run and the API page's example are true as written."""

from __future__ import annotations

import math
import re
from pathlib import Path

import yaml

README = Path(__file__).resolve().parents[1] / "README.md"
API_PAGE = README.parent / "docs" / "api.md"


def test_api_page_python_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", API_PAGE.read_text(), flags=re.S)
    assert blocks, "docs/api.md has a python example"
    for block in blocks:
        exec(compile(block, str(API_PAGE), "exec"), {})
    # it prints the share of projected tokens and the largest KL after projection
    share, kl_max = (
        float(v) for v in re.findall(r"tensor\(([-0-9.e]+)\)", capsys.readouterr().out)
    )
    assert 0 < share <= 1
    assert kl_max <= 0.05 * (1 + 1e-4)


def test_readme_names_the_test_command():
    text = README.read_text()
    assert "make test" in text and "make setup" in text


def demo_config() -> dict:
    """configs/tinymath.yaml with configs/demo.yaml on top (sections merged, later keys win)."""
    merged: dict = {}
    for name in ("tinymath.yaml", "demo.yaml"):
        text = (README.parent / "configs" / name).read_text()
        for section, values in yaml.safe_load(text).items():
            if isinstance(values, dict):
                merged.setdefault(section, {}).update(values)
            else:
                merged[section] = values
    return merged


def test_readme_demo_paragraph_describes_the_demo_config():
    """The README's demo paragraph gives the demo config's numbers (rollouts: max_steps over the
    optimiser steps per rollout; prompts; completions; the validation cadence; held-out prompts;
    the bound), promises at most 3 minutes, and the figures it reports meet the demo's goal:
    the reward rising from quarter to quarter, held-out accuracy at least 0.65."""
    config = demo_config()
    model, data, trainer = config["model"], config["data"], config["trainer"]
    sequences = data["batch_size"] * model["group_size"]
    optimization = model["optimization"]
    steps = optimization["epochs_per_rollout"] * math.ceil(
        sequences / optimization["minibatch_size"]
    )
    assert trainer["max_steps"] % steps == 0, "the demo ends after a whole rollout"
    rollouts = trainer["max_steps"] // steps
    assert rollouts % trainer["val_check_interval"] == 0, "the last rollout is validated"
    text = README.read_text()
    start = text.index("`make demo` trains TinyMath")
    end = text.index("\n\n", start)  # the paragraph ends at the first blank line
    paragraph = " ".join(text[start:end].split())
    found = re.search(
        r"about ([\d.]+) minutes? for (\d+) rollouts of (\d+) prompts x (\d+) completions",
        paragraph,
    )
    assert found, paragraph
    minutes, *numbers = found.groups()
    assert float(minutes) <= 3
    assert [int(n) for n in numbers] == [rollouts, data["batch_size"], model["group_size"]]
    assert f"validated every {trainer['val_check_interval']} rollouts" in paragraph
    assert f"greedy accuracy on {data['num_val']} held-out" in paragraph
    assert f"never exceeds the bound {model['trust_region']['eps']}" in paragraph
    quarters = re.search(
        r"from ([\d.]+) over the first quarter of the rollouts through ([\d.]+) and ([\d.]+) "
        r"to ([\d.]+) over the last",
        paragraph,
    )
    assert quarters, paragraph
    rewards = [float(x) for x in quarters.groups()]
    assert rewards == sorted(rewards) and len(set(rewards)) == 4, "rising quarter by quarter"
    accuracy = float(re.search(r"held-out test problems reaches ([\d.]+)", paragraph).group(1))
    assert accuracy >= 0.65
