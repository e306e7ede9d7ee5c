"""examples/benchmark_turn_rooms.py: both ways run the game's episodes; a turn given its own room
never samples past it, one asked for the largest room may; bad arguments are refused by name."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "benchmark_turn_rooms.py"


def load(monkeypatch):
    monkeypatch.setattr(sys, "path", [str(SCRIPT.parent), *sys.path])
    for name in ("benchmark_turn_rooms", "retry"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module("benchmark_turn_rooms")


@pytest.mark.slow
def test_own_rooms_sample_only_what_the_episodes_keep(tiny_chat_model_dir, tmp_path, monkeypatch):
    """A random 2-layer model with SmolLM2's chat template, 3 problems x 2 episodes, a budget of
    24 tokens: with its own room, every token a turn samples stays in its episode; asked for the
    largest, a turn samples at least what its episode keeps. The JSON holds the medians' ratios."""
    benchmark = load(monkeypatch)
    out = tmp_path / "rooms.json"
    try:
        medians = benchmark.main(["--model", str(tiny_chat_model_dir), "--prompts", "3",
                                  "--group", "2", "--budget", "24", "--repeats", "1",
                                  "--json", str(out)])  # fmt: skip
    finally:
        sys.modules.pop("retry", None)
    own, largest = medians["own rooms"], medians["largest"]
    assert own["sampled"] == own["kept"] > 0
    assert largest["sampled"] >= largest["kept"] > 0
    assert 0 < own["kept"] <= 6 * 24 and 0 < largest["kept"] <= 6 * 24  # 6 episodes' budgets
    turns = benchmark.TASK["episodes"]["max_turns"]  # the game's: 3
    for way in (own, largest):  # a call decodes at most the budget, once a turn
        assert 1 <= way["steps"] <= turns * 24
    written = json.loads(out.read_text())
    assert written["medians"] == medians
    for name, value in written["ratios"].items():
        assert math.isfinite(value) and value > 0, (name, value)
    assert written["ratios"]["sampled"] == pytest.approx(own["sampled"] / largest["sampled"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--repeats", "0"], "--repeats must be at least 1; got 0"),
        (["--budget", "-3"], "--budget must be at least 1; got -3"),
        (["--model", "/nonexistent/model"], "--model /nonexistent/model is not a model folder"),
    ],
)
def test_bad_arguments_are_refused_by_name(args, message, capsys, monkeypatch):
    benchmark = load(monkeypatch)
    with pytest.raises(SystemExit):
        benchmark.parse_args(args)
    assert message in capsys.readouterr().err
