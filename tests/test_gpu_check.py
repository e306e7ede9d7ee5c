"""``examples/gpu_check.py``: the runner records every phase's end, and ``--tiny`` runs here.

The check itself is for a machine with a CUDA GPU; ``--tiny`` runs every phase at tiny shapes on
a CPU (the two CUDA-only phases are then skipped), so that the script cannot rot where CI has no
GPU. The runner's bookkeeping (failures, time limits, budget) is tested with small stand-in
commands.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))
import gpu_check  # noqa: E402 - examples/ is no package
import gpu_fits  # noqa: E402
import gpu_generation  # noqa: E402
import gpu_models  # noqa: E402
import gpu_overhead  # noqa: E402
import gpu_phases  # noqa: E402

EPS = 0.05  # the trust region of configs/tinymath.yaml


def python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def record(path: Path, status: str, **extra) -> str:
    """Python code that writes a phase's record to ``path``."""
    return f"import json; open({str(path)!r}, 'w').write(json.dumps({{'status': {status!r}, **{extra!r}}}))"


def numbers(figures: dict) -> list[float]:
    """Every number among a phase's figures and its rows."""
    values = [v for v in figures.values() if isinstance(v, int | float)]
    for row in figures.get("rows", []):
        values += [v for v in row.values() if isinstance(v, int | float)]
    return values


# -- the runner, with stand-in commands ---------------------------------------------------------
def test_a_phase_that_records_its_figures_is_ok(tmp_path):
    result = tmp_path / "r.json"
    code = record(result, "ok", figures={"tokens_per_s": 12.5, "rows": [{"shape": "a", "x": 1}]})
    entry = gpu_check.run_phase("p", python(code), 30, result, tmp_path / "p.log")
    assert entry["status"] == "ok" and entry["figures"]["tokens_per_s"] == 12.5
    assert "reason" not in entry and 0 <= entry["seconds"] < 30


def test_a_phase_that_skips_itself_says_why(tmp_path):
    result = tmp_path / "r.json"
    code = record(result, "skipped", reason="needs a CUDA device", figures={})
    entry = gpu_check.run_phase("p", python(code), 30, result, tmp_path / "p.log")
    assert entry["status"] == "skipped" and entry["reason"] == "needs a CUDA device"


def test_a_phase_that_raises_is_failed_and_keeps_its_figures(tmp_path):
    result = tmp_path / "r.json"
    code = record(result, "running", figures={"done": 1}) + "\nraise ValueError('bad shape')"
    entry = gpu_check.run_phase("p", python(code), 30, result, tmp_path / "p.log")
    assert entry["status"] == "failed" and entry["figures"] == {"done": 1}
    assert "exited with 1" in entry["reason"] and "ValueError: bad shape" in entry["reason"]
    assert "ValueError: bad shape" in entry["log_tail"]


def test_a_phase_that_exits_cleanly_without_a_record_is_failed(tmp_path):
    entry = gpu_check.run_phase("p", python("print('hi')"), 30, tmp_path / "r.json",
                                tmp_path / "p.log")  # fmt: skip
    assert entry["status"] == "failed" and "without recording how it ended" in entry["reason"]


@pytest.mark.slow  # waits for the time limit
def test_a_phase_past_its_limit_is_killed_with_its_children(tmp_path):
    """The phase and the process it started (one process group) are ended at the limit; what the
    phase had recorded before stays."""
    result, child = tmp_path / "r.json", tmp_path / "child.pid"
    result.write_text(json.dumps({"status": "running", "figures": {"first_shape_ms": 3.0}}))
    code = f"""
        import subprocess, sys, time
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        open({str(child)!r}, "w").write(str(sleeper.pid))
        time.sleep(300)
    """
    limit = 20  # seconds: room for two interpreters to start on a busy machine
    start = time.monotonic()
    entry = gpu_check.run_phase("p", python(code), limit, result, tmp_path / "p.log")
    assert limit <= time.monotonic() - start < limit + 60
    assert entry["status"] == "failed"
    assert entry["reason"] == f"timed out after {limit} s, the phase's limit"
    assert entry["figures"] == {"first_shape_ms": 3.0}
    pid = int(child.read_text())
    for _ in range(50):  # the child is gone (or a zombie) once the group is killed
        if not _alive(pid):
            break
        time.sleep(0.1)
    assert not _alive(pid), "the phase's child process outlived the time limit"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat")
    return not (state.exists() and state.read_text().split(")")[-1].split()[0] == "Z")


def test_without_cuda_full_shapes_are_skipped_with_the_reason(tmp_path, capsys):
    args = gpu_check.parse_args(["--json", str(tmp_path / "r.json")])
    entries = gpu_check.check(args, cuda=False, logs=tmp_path)
    assert [e["name"] for e in entries] == gpu_check.NAMES
    assert {e["status"] for e in entries} == {"skipped"}
    reasons = {e["name"]: e["reason"] for e in entries}
    assert "needs a CUDA device" in reasons["cuda-tests"]
    assert "--tiny runs it on a CPU" in reasons["overhead"]
    assert "[8/8] grpo-smollm2: skipped" in capsys.readouterr().out


def test_phases_past_the_budget_are_skipped(tmp_path):
    args = gpu_check.parse_args(["--tiny", "--budget", "1", "--phases", "overhead,generation"])
    entries = gpu_check.check(args, cuda=False, logs=tmp_path)
    assert [e["status"] for e in entries] == ["skipped", "skipped"]
    assert "the check's budget of 1 s (--budget) ran out" in entries[0]["reason"]


def test_a_phase_started_near_the_budgets_end_is_stopped_there_and_says_so(tmp_path, monkeypatch):
    """The budget bounds the whole check: a phase that starts with less of it left than its own
    limit runs under what is left, and a cut there names the budget, not the phase's limit."""
    calls = []

    def fake_run_phase(name, command, limit_s, result, log, env=None, limit_name="?"):
        calls.append((name, limit_s, limit_name))
        return {"name": name, "status": "failed", "seconds": limit_s, "figures": {},
                "reason": f"timed out after {limit_s:.0f} s, {limit_name}"}  # fmt: skip

    monkeypatch.setattr(gpu_check, "run_phase", fake_run_phase)
    phase = next(p for p in gpu_check.PHASES if p.name == "overhead")
    args = gpu_check.parse_args(["--tiny", "--budget", "30", "--phases", "overhead"])
    (entry,) = gpu_check.check(args, cuda=False, logs=tmp_path)
    ((name, limit, limit_name),) = calls
    assert name == "overhead" and 25 < limit <= 30 < phase.tiny_limit_s
    assert limit_name == "the end of the check's budget of 30 s (--budget)"
    assert entry["reason"].endswith("the end of the check's budget of 30 s (--budget)")
    calls.clear()
    args = gpu_check.parse_args(["--tiny", "--budget", "900", "--phases", "overhead"])
    gpu_check.check(args, cuda=False, logs=tmp_path)
    assert calls == [("overhead", phase.tiny_limit_s, None)]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--phases", "overhead,speed"], "--phases must name phases among"),
        (["--phases", ","], "--phases must name phases among"),
        (["--budget", "0"], "--budget must be a number of seconds > 0; got 0.0"),
        (["--budget", "nan"], "--budget must be a number of seconds > 0; got nan"),
        (["--fail-phase", "speed"], "--fail-phase must be one of ['cuda-tests'"),
    ],
)
def test_bad_options_name_the_option_the_value_and_what_is_allowed(argv, message, capsys):
    with pytest.raises(SystemExit):
        gpu_check.parse_args(argv)
    err = capsys.readouterr().err
    assert message in err
    if argv[0] == "--phases":
        assert repr(argv[1]) in err and "'tinymath-demo'" in err


def test_markdown_has_a_line_per_phase_and_each_phase_table():
    report = {
        "tiny": False, "started": "2026-01-01T00:00:00+00:00", "seconds": 12.0, "commit": None,
        "device": {"kind": "cuda", "name": "GPU X", "count": 1, "memory_gib": 80.0,
                   "capability": "9.0", "cpu_cores": 16},
        "versions": {"python": "3.12", "torch": "2.11.0", "cuda": "13.0", "peft": None},
        "summary": {"ok": 1, "skipped": 0, "failed": 1},
        "phases": [
            {"name": "overhead", "title": "T", "status": "ok", "seconds": 5.0,
             "figures": {"summary": "x1.05", "rows": [{"shape": "qwen3-4b", "time_ratio": 1.05}],
                         "variants": [{"variant": "a", "ms": 2.5}], "paper": {"ratio": 1.09}}},
            {"name": "generation", "title": "G", "status": "failed", "seconds": 7.0,
             "figures": {}, "reason": "timed out after 150 s, the phase's limit"},
        ],
    }  # fmt: skip
    text = gpu_check.markdown(report)
    assert "1 x GPU X (80.0 GiB, compute capability 9.0)" in text
    assert "not installed: peft" in text
    assert "| overhead | ok | 5.0 | x1.05 |" in text
    assert "| generation | failed | 7.0 | timed out after 150 s, the phase's limit |" in text
    assert "| shape | time_ratio |" in text and "| qwen3-4b | 1.05 |" in text
    assert "variants:\n\n| variant | ms |\n| --- | --- |\n| a | 2.5 |" in text  # a table too
    assert "- paper: ratio: 1.09" in text and "- variants" not in text


def test_a_shape_out_of_gpu_memory_is_retried_smaller_and_a_failing_shape_is_recorded(tmp_path):
    """Sizes halve while a shape runs out of GPU memory; a shape that fails otherwise is a row
    with its error, the shapes after it still run, and the phase fails at the end."""
    import torch

    tried = []

    def measure(name, shape, size):
        tried.append((name, size))
        if name == "a" and size > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        if name == "b":
            raise ValueError("bad shape")
        return {"size": size}

    results = gpu_phases.Results(tmp_path / "r.json")
    shape = gpu_models.TINY_SMOLLM2
    with pytest.raises(RuntimeError, match=r"failed at shapes \['b'\]"):
        gpu_phases.each_shape(results, {"a": shape, "b": shape, "c": shape}, [4, 2, 1], measure)
    assert tried == [("a", 4), ("a", 2), ("a", 1), ("b", 4), ("c", 4)]
    rows = json.loads((tmp_path / "r.json").read_text())["figures"]["rows"]
    assert [r["shape"] for r in rows] == ["a", "b", "c"]
    assert rows[0]["size"] == 1 and rows[2]["size"] == 4
    assert rows[1]["error"] == "ValueError: bad shape"


def test_generation_hands_on_each_path_as_it_is_measured_graphs_first():
    """At the first tiny shape every path runs at the shorter length, all but the dynamic loop
    at the longer: the rows so far are handed on after each path (graphs first, the dynamic
    loop last) and once more when a row is done, the last hand-on being the rows returned."""
    import copy

    seen = []
    name = "qwen3-0.6b"
    rows = gpu_generation.generation_rows(
        name, gpu_models.TINY_QWEN3[name], gpu_generation.TINY_GENERATION, 4,
        lambda so_far: seen.append(copy.deepcopy(so_far)),
    )  # fmt: skip
    order = list(gpu_generation.PATHS)
    assert order[0] == "graphs" and order[-1] == "dynamic"
    measured = [[p for p in order if (r[-1].get(f"{p}_tokens_per_s") or 0) > 0] for r in seen]
    short = [order[: i + 1] for i in range(len(order))] + [order]
    long = [order[: i + 1] for i in range(len(order) - 1)] + [order[:-1]]
    assert measured == short + long
    assert [len(r) for r in seen] == [1] * 5 + [2] * 4
    assert "train_s" not in seen[3][-1] and seen[4][-1]["train_s"] > 0  # done: the iteration too
    assert "graphs_device_ms_per_step" in seen[4][-1]  # the first row's, before the second row
    assert seen[-1] == rows and len(rows) == 2 and rows[1]["dynamic_tokens_per_s"] is None


def test_on_cuda_graphs_stood_in_for_the_graph_paths_capture_and_nothing_falls_back(monkeypatch):
    """On a CPU with CUDA graphs stood in for (``tests/graph_stand_in.py``), the phase at the first
    tiny shape runs as on a GPU: every path of the CUDA-graph decoding captures its step at each
    length, the dynamic loop never, and nothing is warned of falling back."""
    import torch

    from lightning_troll.engines import graph_decode
    from tests.graph_stand_in import stand_in

    stand_in(monkeypatch)
    monkeypatch.setattr(graph_decode, "_WARNED", set())
    name = "qwen3-0.6b"
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = gpu_generation.generation_rows(
            name, gpu_models.TINY_QWEN3[name], gpu_generation.TINY_GENERATION, 4
        )
    graphs = [path for path in gpu_generation.PATHS if path != "dynamic"]
    assert all(row[f"{path}_captures"] >= 1 for row in rows for path in graphs)
    assert rows[0]["dynamic_captures"] == 0
    assert not [w for w in caught if "model.sampling" in str(w.message)]


@pytest.mark.parametrize("name", ["episodes", "stop-flags-every-8"])
def test_loop_paths_train_from_cuda_graphs_stood_in_for(name, tmp_path, monkeypatch):
    """The ``loop-paths`` phase's episodes and reads every 8 steps, on a CPU with CUDA graphs
    stood in for: a fit of two rollouts samples from replayed graphs, keeps what the path
    promises, and warns of no fallback (which fails the phase on a GPU)."""
    from lightning_troll.cli import run
    from lightning_troll.engines import graph_decode
    from tests.graph_stand_in import stand_in

    replays = stand_in(monkeypatch)
    monkeypatch.setattr(graph_decode, "_WARNED", set())
    args = gpu_fits.tinymath_args("cpu", 2, str(tmp_path), True) + gpu_fits.LOOP_PATHS[name]
    args += ["--model.sampling.decode=graphs",
             "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
             f"--trainer.logger.save_dir={tmp_path}"]  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(args)
    assert gpu_fits.path_figures(name, gpu_fits.logged_series(tmp_path), 2)["rollouts"] == 2
    assert replays
    assert not [w for w in caught if "CUDA-graph" in str(w.message)]


def test_the_generation_phase_keeps_a_shapes_rows_while_it_runs_and_then_the_variants(
    tmp_path, monkeypatch
):
    """While a shape runs its rows so far are the record's ``unfinished`` (what a phase stopped
    at its limit keeps); a finished shape's rows are the phase's rows and ``unfinished`` goes;
    the attention variants are timed after the shapes, also where a shape failed."""
    path = tmp_path / "generation.json"
    during = []

    def rows_of(name, shape, setting, micro_batch, progress):
        if name == "qwen3-1.7b":
            raise ValueError("no such shape")
        progress([{"new_tokens": 8, "graphs_tokens_per_s": 1.0}])
        during.append(json.loads(path.read_text())["figures"]["unfinished"])
        return [{"new_tokens": 8, "graphs_tokens_per_s": 1.0, "dynamic_tokens_per_s": None,
                 "graphs_every_8_tokens_per_s": None}]  # fmt: skip

    monkeypatch.setattr(gpu_phases, "generation_rows", rows_of)
    monkeypatch.setattr(gpu_phases, "variant_rows", lambda name, shape, setting: [{"v": name}])
    results = gpu_phases.Results(path)
    with pytest.raises(RuntimeError, match=r"failed at shapes \['qwen3-1.7b'\]"):
        gpu_phases.generation(results, tiny=True)
    assert [[r["shape"] for r in u] for u in during] == [["qwen3-0.6b"], ["qwen3-4b"]]
    figures = json.loads(path.read_text())["figures"]
    assert "unfinished" not in figures and figures["variants"] == [{"v": "qwen3-0.6b"}]
    assert [r["shape"] for r in figures["rows"]] == ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b"]
    assert "error" in figures["rows"][1] and figures["rows"][2]["graphs_tokens_per_s"] == 1.0


def test_ragged_completions_are_trained_each_way_beside_equal_ones():
    """The overhead phase's ``ragged`` table at the first tiny shape: the three ways to split the
    minibatch, each over the same real tokens; packed, the forwards hold exactly those, padded
    more (the lengths differ); each ratio is its own times'."""
    shape = gpu_models.TINY_QWEN3["qwen3-0.6b"]
    rows = gpu_overhead.ragged_at("qwen3-0.6b", shape, gpu_overhead.TINY_OVERHEAD)
    assert [r["split"] for r in rows] == [
        "2 sequences a part, padded", "token budget, padded", "token budget, packed"
    ]  # fmt: skip
    real = {r["real_tokens"] for r in rows}
    assert len(real) == 1 and {r["shape"] for r in rows} == {"qwen3-0.6b"}
    (tokens,) = real
    assert tokens > gpu_overhead.TINY_OVERHEAD.ragged_sequences * 48  # prompts and completions
    assert rows[2]["ragged_forward_tokens"] == tokens
    assert rows[0]["ragged_forward_tokens"] > tokens and rows[1]["ragged_forward_tokens"] > tokens
    for row in rows:
        assert row["ragged_s"] > 0 and row["equal_s"] > 0
        assert row["ragged_over_equal"] == pytest.approx(row["ragged_s"] / row["equal_s"], 5e-2)


def series(**extra: list[float]) -> dict[str, list[float]]:
    """What a loop path's CSV log holds over 3 rollouts, with ``extra`` figures."""
    return {"reward/mean": [0.3, 0.4, 0.5], "trust_region/kl_after_max": [0.01, 0.05, 0.02],
            "rollout/staleness": [0.0, 1.0, 1.0], **extra}  # fmt: skip


def test_each_loop_path_is_held_to_what_it_promises():
    """The engine apart samples every rollout after the first ahead; the sampler is as stale as
    the option allows; the proximal weight is logged; an episode plays one or two turns."""
    ahead = {"engine/process_prefetched": [0.0, 1.0, 1.0], "engine/process_wait_s": [2.0, 0.1, 0.3],
             "engine/weight_push_s": [0.5, 0.2, 0.4]}  # fmt: skip
    row = gpu_fits.path_figures("engine-process", series(**ahead), 3)
    assert row == {"path": "engine-process", "rollouts": 3, "final_reward": 0.5,
                   "kl_after_max": 0.05, "staleness_max": 1.0, "prefetched_share": 1.0,
                   "process_wait_s": 0.3, "weight_push_s": 0.4}  # fmt: skip
    late = {**ahead, "engine/process_prefetched": [0.0, 1.0, 0.0]}
    with pytest.raises(AssertionError, match=r"engine-process: engine/process_prefetched was "
                       r"\[0.0, 1.0, 0.0\]: sampled ahead after the first"):  # fmt: skip
        gpu_fits.path_figures("engine-process", series(**late), 3)
    with pytest.raises(AssertionError, match=r"^proximal: rollout/staleness reached 1.0, not 2$"):
        gpu_fits.path_figures(
            "proximal", series(**{"rollout/proximal_is_weight_mean": [1.0] * 3}), 3
        )
    stale = {"rollout/staleness": [0.0, 1.0, 2.0], "rollout/proximal_is_weight_mean": [1, 0.9, 0.8]}
    assert gpu_fits.path_figures("proximal", series(**stale), 3)["proximal_is_weight_mean"] == 0.9
    stale["rollout/proximal_is_weight_mean"] = [1.0, float("nan"), 0.8]
    with pytest.raises(AssertionError, match=r"rollout/proximal_is_weight_mean was \[1.0, nan"):
        gpu_fits.path_figures("proximal", series(**stale), 3)
    played = {"rollout/staleness": [0.0] * 3, "episodes/turns_mean": [2.0, 1.5, 3.0]}
    with pytest.raises(AssertionError, match=r"episodes/turns_mean was \[2.0, 1.5, 3.0\], not in"):
        gpu_fits.path_figures("episodes", series(**played), 3)
    with pytest.raises(AssertionError, match=r"^episodes: the run logged no episodes/turns_mean$"):
        gpu_fits.path_figures("episodes", series(), 3)
    unstale = {"reward/mean": [0.1], "trust_region/kl_after_max": [0.0]}
    with pytest.raises(AssertionError, match=r"^proximal: the run logged no rollout/staleness, ro"):
        gpu_fits.path_figures("proximal", unstale, 1)
    with pytest.raises(AssertionError, match=r"^episodes: 3 rollouts of 4; rollout/staleness"):
        gpu_fits.path_figures("episodes", series(**{"episodes/turns_mean": [2.0] * 3}), 4)


# -- the script itself --------------------------------------------------------------------------
def run_script(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1200)


def assert_generation_figures(figures: dict, cuda: bool) -> None:
    """The ``generation`` phase at tiny shapes: a row per shape and length, each path's figures
    where it ran (at the first shape every path at both lengths but the dynamic loop at the
    longer; at the others the graphs alone at the longer length, and the graphs over all
    positions not at all), and the device's time per step where there is a device."""
    assert figures["graphs_on_device"] is cuda
    rows = figures["rows"]
    assert [(r["shape"], r["new_tokens"]) for r in rows] == [
        (shape, tokens) for shape in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b") for tokens in (8, 16)
    ]
    for row in rows:
        assert row["generated_tokens"] > 0 and row["train_s"] > 0 and row["behaviour_s"] > 0
        first, short = row["shape"] == "qwen3-0.6b", row["new_tokens"] == 8
        every = ("graphs", "graphs_every_8") if short or first else ("graphs",)
        every += ("graphs_all_positions",) if first else ()
        every += ("dynamic",) if short else ()
        for path in gpu_generation.PATHS:
            if path in every:
                assert row[f"{path}_tokens_per_s"] > 0 and row[f"{path}_wall_ms_per_step"] > 0
                assert 0 < row[f"{path}_rollout_share"] < 1
                # captured on a device only, and not by the dynamic loop
                assert (row[f"{path}_captures"] > 0) is (cuda and path != "dynamic")
                assert (row[f"{path}_capture_s"] > 0) is (row[f"{path}_captures"] > 0)
            else:
                assert row[f"{path}_tokens_per_s"] is row[f"{path}_rollout_share"] is None
                assert row[f"{path}_captures"] is row[f"{path}_capture_s"] is None
        if short:
            ratio = row["graphs_tokens_per_s"] / row["dynamic_tokens_per_s"]
            assert row["speedup"] == pytest.approx(ratio, rel=2e-3)
    for row in rows[::2]:  # the device's time per step: in the first row of each shape
        for path in gpu_generation.PATHS:
            ran = path != "graphs_all_positions" or row["shape"] == "qwen3-0.6b"
            assert (row[f"{path}_device_ms_per_step"] is None) is not (cuda and ran)
    variants = figures["variants"]  # the steps' attention choices, both paths, first shape
    assert [(v["shape"], v["variant"], v["new_tokens"]) for v in variants] == [
        ("qwen3-0.6b", variant, 8) for variant in gpu_generation.VARIANTS
    ]
    for row in variants:
        for path in ("dynamic", "graphs"):
            assert row[f"{path}_tokens_per_s"] > 0 and row[f"{path}_wall_ms_per_step"] > 0


def assert_compiled_figures(figures: dict, cuda: bool) -> None:
    """The ``compiled-decoding`` phase at tiny shapes: one row at the first shape, both paths'
    warm-up and figures, captures on a device only, and the speed-up their ratio."""
    (row,) = figures["rows"]
    assert row["shape"] == "qwen3-0.6b" and row["new_tokens"] == 8 and row["sequences"] == 8
    assert figures["graphs_on_device"] is cuda
    for path in gpu_generation.COMPILED_PATHS:
        assert row[f"{path}_warmup_s"] > 0 and row[f"{path}_tokens_per_s"] > 0
        assert row[f"{path}_wall_ms_per_step"] > 0
        assert (row[f"{path}_captures"] > 0) is cuda
        assert (row[f"{path}_device_ms_per_step"] is None) is not cuda
    ratio = row["graphs_every_8_compiled_tokens_per_s"] / row["graphs_every_8_tokens_per_s"]
    assert row["speedup"] == pytest.approx(ratio, rel=2e-3)


def test_the_compiled_decoding_phase_times_both_paths_at_the_first_shape(tmp_path):
    """The phase in this process at tiny shapes (on a CPU both paths fall back to the dynamic
    loop, warned: the figures only show that it runs)."""
    import torch

    results = gpu_phases.Results(tmp_path / "compiled.json")
    gpu_phases.compiled_decoding(results, tiny=True)
    figures = json.loads((tmp_path / "compiled.json").read_text())["figures"]
    assert_compiled_figures(figures, torch.cuda.is_available())
    assert figures["summary"].startswith("qwen3-0.6b 8: compiled ")


@pytest.mark.slow  # eight phases, six of them in processes of their own: about 3 minutes
def test_tiny_check_runs_every_phase_and_reports_it(tmp_path):
    out = tmp_path / "report.json"
    done = run_script("--tiny", "--json", str(out), "--logs", str(tmp_path / "logs"))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert {"device", "versions", "phases", "summary", "seconds", "tiny"} <= set(report)
    assert report["tiny"] is True
    assert {"python", "torch", "lightning", "transformers"} <= set(report["versions"])
    assert report["versions"]["torch"] and report["versions"]["lightning-troll"]
    phases = {p["name"]: p for p in report["phases"]}
    assert list(phases) == gpu_check.NAMES
    for phase in report["phases"]:
        assert phase["status"] in gpu_check.STATUSES
        assert {"name", "title", "status", "seconds", "figures"} <= set(phase)
        assert math.isfinite(phase["seconds"]) and phase["seconds"] >= 0
    cuda = report["device"]["kind"] == "cuda"
    for name in ("cuda-tests", "fsdp2-nccl"):
        if not cuda:
            assert phases[name]["status"] == "skipped"
            assert "needs a CUDA device" in phases[name]["reason"]
    ran = [p for p in report["phases"] if p["name"] not in ("cuda-tests", "fsdp2-nccl") or cuda]
    for phase in ran:
        assert phase["status"] == "ok", (phase["name"], phase.get("reason"))
        values = numbers(phase["figures"])
        assert values and all(math.isfinite(v) for v in values), phase["name"]
        assert phase["figures"]["summary"]
    assert report["summary"] == {
        "ok": len(ran), "skipped": len(report["phases"]) - len(ran), "failed": 0
    }  # fmt: skip

    overhead = phases["overhead"]["figures"]
    assert [r["shape"] for r in overhead["rows"]] == ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b"]
    assert overhead["paper"] == {"time_ratio": 1.091, "memory_ratio": 1.046}
    for row in overhead["rows"]:
        assert row["clip_ms"] > 0 and row["troll_ms"] > 0 and row["clip_peak_mib"] > 0
        calls = "launches" if cuda else "aten_calls"  # kernel launches on CUDA
        assert row[f"troll_{calls}"] > row[f"clip_{calls}"] > 100
        assert row["troll_syncs"] >= 0 and row["clip_syncs"] >= 0
        assert row["time_ratio"] == pytest.approx(row["troll_ms"] / row["clip_ms"], rel=1e-3)
        assert row["memory_ratio"] == pytest.approx(
            row["troll_peak_mib"] / row["clip_peak_mib"], rel=1e-3
        )
    shapes = overhead["unseen_lengths"]  # a training step at lengths not seen before
    assert [r["order"] for r in shapes] == ["torch_order"] * 2 + ["cudnn_last"] * 2
    assert [r["tokens"] for r in shapes] == [32, 31, 30, 29] and len(
        {r["shape"] for r in shapes}
    ) == 1
    assert all(
        r[k] > 0 for r in shapes for k in ("behaviour_ms", "first_step_ms", "second_step_ms")
    )
    assert [r["split"] for r in overhead["ragged"]][2] == "token budget, packed"
    assert_generation_figures(phases["generation"]["figures"], cuda)
    assert_compiled_figures(phases["compiled-decoding"]["figures"], cuda)
    demo = phases["tinymath-demo"]["figures"]
    assert demo["rollouts"] == 2 and 0 <= demo["final_reward"] <= 1
    assert 0 <= demo["val_accuracy"] <= 1 and demo["kl_after_max"] <= EPS * (1 + 1e-5)
    paths = {row["path"]: row for row in phases["loop-paths"]["figures"]["rows"]}
    assert list(paths) == list(gpu_fits.LOOP_PATHS)
    for row in paths.values():
        assert row["rollouts"] == 3 and 0 <= row["final_reward"] <= 1
        assert row["kl_after_max"] <= EPS * (1 + 1e-5)
    assert paths["engine-process"]["staleness_max"] == 1
    assert paths["engine-process"]["prefetched_share"] == 1
    assert paths["proximal"]["staleness_max"] == 2
    assert 0 < paths["proximal"]["proximal_is_weight_mean"] < 2  # truncated at anchor_is_cap 2
    assert paths["episodes"]["staleness_max"] == 0 and 1 <= paths["episodes"]["turns_mean"] <= 2
    smol = phases["grpo-smollm2"]["figures"]
    assert 0 <= smol["final_reward"] <= 1 and smol["sequences"] == 16
    assert smol["kl_after_max"] <= EPS * (1 + 1e-5) and smol["rollout_s"] > 0

    text = out.with_suffix(".md").read_text()
    for name in gpu_check.NAMES:
        assert f"| {name} | {phases[name]['status']} |" in text
    assert "| shape | parameters_m | sequences |" in text


@pytest.mark.slow  # two phases in processes of their own
def test_a_phase_that_raises_is_recorded_and_the_next_one_runs(tmp_path):
    out = tmp_path / "report.json"
    done = run_script("--tiny", "--phases", "overhead,generation", "--fail-phase", "overhead",
                      "--json", str(out))  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(out.read_text())
    first, second = report["phases"]
    assert first["name"] == "overhead" and first["status"] == "failed"
    assert "RuntimeError: --fail-phase overhead: a failure planted" in first["reason"]
    assert second["name"] == "generation" and second["status"] == "ok"
    assert report["summary"] == {"ok": 1, "skipped": 0, "failed": 1}
    assert "[1/2] overhead: failed" in done.stdout and "[2/2] generation: ok" in done.stdout


@pytest.mark.slow  # builds and steps two tiny models
def test_the_step_profile_counts_calls_and_host_syncs(capsys):
    """``examples/profile_step.py --tiny``: both objectives timed and profiled; TROLL's step makes
    more operator calls than clipping's (the projection), and every count is a real one."""
    import profile_step

    report = profile_step.main(["--tiny", "--tables", "0", "--repeats", "1"])
    assert set(report) == {"clip", "troll"}
    for row in report.values():
        assert set(row) == {"median_ms", "aten_calls", "syncs"}
        assert row["median_ms"] > 0 and row["aten_calls"] > 100
    assert report["troll"]["aten_calls"] > report["clip"]["aten_calls"]
    assert "troll / clip step time: x" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        profile_step.main(["--repeats", "0"])
