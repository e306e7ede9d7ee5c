"""The iteration benchmark: a TinyMath run end to end, its summary and table, resuming from its
JSON, and clear refusals of bad arguments."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "benchmark_iteration.py"


def load():
    spec = importlib.util.spec_from_file_location("benchmark_iteration", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(total, generation, rest, training, length=10.0, speed=50.0):
    return {
        "total": total,
        "generation": generation,
        "rest_of_rollout": rest,
        "training": training,
        "mean_length": length,
        "tokens_per_s": speed,
    }


def test_summary_leaves_out_the_first_iteration_and_takes_medians():
    bench = load()
    result = {
        "iterations": [row(99, 50, 9, 40), row(10, 4, 1, 5), row(12, 6, 1, 5), row(30, 9, 3, 18)],
        "peak_memory_gib": 3.5,
    }
    summary = bench.summarise(result)
    assert summary["total"] == 12 and summary["generation"] == 6 and summary["training"] == 5
    assert summary["first_iteration_s"] == 99 and summary["peak_memory_gib"] == 3.5


def test_table_gives_ratios_to_the_fastest_trl_configuration_per_step_count():
    bench = load()

    def result(name, library, steps, total):
        summary = bench.summarise({"iterations": [row(1, 1, 0, 0), row(total, 1, 0, 1)],
                                   "peak_memory_gib": 1.0})  # fmt: skip
        return {"name": name, "spec": {"library": library, "steps": steps}, "summary": summary}

    text = bench.table(
        [
            result("TRL off", "trl", 1, 70.0),
            result("TRL on", "trl", 1, 80.0),
            result("ours", "ours", 1, 35.0),
            result("ours 4", "ours", 4, 50.0),
            {"name": "broken", "spec": {"library": "ours", "steps": 1}, "error": "boom"},
        ]
    )
    lines = {
        line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")
    }
    assert lines["ours"].rstrip(" |").endswith("0.50x")
    assert lines["TRL on"].rstrip(" |").endswith("1.14x")
    assert lines["ours 4"].rstrip(" |").endswith("-")  # no TRL run at 4 steps
    assert "broken (steps 1) failed:\nboom" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--iterations", "1"], "--iterations must be >= 2 (the first is left out); got 1"),
        (["--steps", "0"], "--steps must be >= 1; got [0]"),
        (["--model", "/nowhere"], "--model /nowhere: no model folder there; run `make smollm2`"),
        (["--variants", "fast"], "argument --variants: invalid choice: 'fast'"),
    ],
)
def test_bad_arguments_are_refused(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load().main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_a_tiny_run_times_both_variants_and_resumes_from_its_json(tmp_path, capsys):
    """The benchmark's main, here; each configuration it times is the script run as a command
    in a fresh process, as always (three in all). A first run times both variants, in order,
    each with its iterations split into parts that add up to no more than the total, and prints
    the table; a second run keeps the configuration the JSON holds, times only the one it lacks,
    and keeps the first run's other configuration, all exactly as they were. At most 8 new
    tokens a completion: the plumbing, not the lengths, is under test."""
    out = tmp_path / "iteration.json"
    args = ["--tiny", "--iterations", "2", "--steps", "2", "--objectives", "troll", "--no-trl"]
    args += ["--max-new-tokens", "8", "--json", str(out)]
    code = load().main([*args, "--variants", "default", "baseline"])
    printed = capsys.readouterr().out
    assert code == 0, printed[-3000:]  # a failed configuration prints its error's last lines
    results = json.loads(out.read_text())
    assert [r["spec"]["variant"] for r in results] == ["default", "baseline"]
    for r in results:
        assert len(r["iterations"]) == 2 and r["peak_memory_gib"] > 0
        for it in r["iterations"]:
            parts = it["generation"] + it["rest_of_rollout"] + it["training"]
            assert it["generation"] > 0 and it["training"] > 0 and parts <= it["total"]
            assert it["mean_length"] >= 1
    assert "| ours, troll, default | 2 |" in printed
    # a second run keeps what the JSON holds, times only what it lacks, and loses nothing
    code = load().main([*args, "--variants", "default", "recorded"])
    printed = capsys.readouterr().out
    assert code == 0, printed[-3000:]
    assert printed.count("measured before (in --json): kept") == 1
    final = json.loads(out.read_text())
    assert sorted(r["spec"]["variant"] for r in final) == ["baseline", "default", "recorded"]
    by_variant = {r["spec"]["variant"]: r for r in final}
    assert [by_variant[r["spec"]["variant"]] for r in results] == results  # kept as they were


def test_memory_table_gives_each_phase_of_the_last_iteration_in_gib():
    bench = load()
    phases = {"start": 1024.0, "rollout": 2048.0, "backward": 3584.0}
    ours = {"name": "ours", "spec": {"library": "ours", "steps": 1},
            "iterations": [{"memory_mib": {}}, {"memory_mib": phases}]}  # fmt: skip
    trl = {"name": "TRL", "spec": {"library": "trl", "steps": 1}, "iterations": [{}]}
    lines = bench.memory_table([trl, ours])
    assert lines[2] == "| configuration | steps | iteration | start | rollout | backward |"
    assert lines[4] == "| ours | 1 | first | - | - | - |"
    assert lines[5] == "| ours | 1 | last | 1.00 | 2.00 | 3.50 |"
    assert len(lines) == 6  # TRL records no phases
    assert bench.memory_table([trl]) == []
