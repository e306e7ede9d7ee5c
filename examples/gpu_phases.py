"""The phases of ``examples/gpu_check.py``: each runs in a process of its own and writes its figures.

A phase is a function ``fn(results, tiny)``: it records figures on ``results`` as it goes (a
phase that fails or runs out of time keeps what it had recorded) and raises :class:`Skip` when
it cannot run here. ``tiny`` shrinks every shape so that the phase runs on a CPU in seconds.
The models (Qwen3 and SmolLM2 shapes, randomly initialised), the rollouts and the training step
are :mod:`gpu_models`', the whole fits through Lightning :mod:`gpu_fits`', the training step's
overhead :mod:`gpu_overhead`'s, the decoding paths :mod:`gpu_generation`'s and the peak memory
:mod:`peak_memory`'s."""

from __future__ import annotations

import json
import sys
import traceback
import xml.etree.ElementTree as ET
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_fits import grpo_smollm2, loop_paths, tinymath_demo  # noqa: E402
from gpu_generation import (  # noqa: E402
    TINY_GENERATION,
    GenerationSetting,
    compiled_rows,
    generation_rows,
    variant_rows,
)
from gpu_models import (  # noqa: E402
    QWEN3,
    TINY_QWEN3,
    Shape,
    free_memory,
    out_of_memory,
    shape_figures,
    shape_table,
)
from gpu_overhead import (  # noqa: E402
    PAPER,
    TINY_OVERHEAD,
    OverheadSetting,
    new_shape_rows,
    overhead_at,
    ragged_at,
)
from peak_memory import PeakMemory  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class Skip(Exception):
    """The phase cannot run on this machine; the message says why."""


class Results:
    """A phase's figures, written to ``path`` (JSON) every time they change."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.figures: dict[str, Any] = {}
        self.rows: list[dict[str, Any]] = []

    def update(self, **figures: Any) -> None:
        self.figures.update(figures)
        self.write()

    def add_row(self, row: dict[str, Any]) -> None:
        """One line of the phase's table (a shape, a test)."""
        self.rows.append(row)
        self.write()

    def write(self, status: str = "running", **extra: Any) -> None:
        figures = {**self.figures, **({"rows": self.rows} if self.rows else {})}
        record = {"status": status, "figures": figures, **extra}
        partial = self.path.with_suffix(".part")
        partial.write_text(json.dumps(record, indent=1, default=float))
        partial.replace(self.path)


def halving(first: int):
    """first, first // 2, ..., 1: the sizes to try while a shape runs out of GPU memory."""
    size = first
    while size >= 1:
        yield size
        size //= 2


def each_shape(results: Results, shapes: dict[str, Shape], sizes: list[int], measure) -> None:
    """``measure(name, shape, size)`` (a row, or a list of rows) for every shape, halving ``size``
    on running out of GPU memory; a shape that fails is recorded as a row with its error, and the
    others still run.
    Raises at the end if any shape failed."""
    failed = []
    for name, shape in shapes.items():
        rows: list[dict[str, Any]] = []
        for size in sizes:
            retry = False
            try:
                measured = measure(name, shape, size)
                rows = [{**shape_figures(name, shape), **r}
                        for r in (measured if isinstance(measured, list) else [measured])]  # fmt: skip
            except Exception as error:  # noqa: BLE001 - recorded, and the next shape runs
                rows = [{**shape_figures(name, shape), "error": f"{type(error).__name__}: {error}"}]
                retry = out_of_memory(error) and size > 1
                traceback.print_exc()
            free_memory()  # outside the handler: the error's frames no longer hold the tensors
            if not retry:
                break
        for row in rows:
            results.add_row(row)
        failed += [name] if "error" in rows[0] else []
    if failed:
        raise RuntimeError(f"failed at shapes {failed}; see their rows")


# -- phases 1 and 2: the CUDA-only tests ------------------------------------------------------
def pytest_phase(results: Results, keyword: str) -> None:
    """``pytest -m cuda -k keyword`` on ``tests/test_cuda.py`` and the decoding tests
    (``tests/test_graph_decode.py``, ``tests/test_graph_checks.py``,
    ``tests/test_step_attention.py``), its outcome per test."""
    import pytest
    import torch

    if not torch.cuda.is_available():
        raise Skip("needs a CUDA device")
    junit = results.path.with_suffix(".junit.xml")
    options = ["-q", "-p", "no:cacheprovider", f"--junitxml={junit}", f"--rootdir={ROOT}"]
    names = (
        "test_cuda.py",
        "test_graph_decode.py",
        "test_graph_checks.py",
        "test_step_attention.py",
    )
    files = [str(ROOT / "tests" / name) for name in names]
    code = pytest.main([*files, "-m", "cuda", "-k", keyword, *options])
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for case in ET.parse(junit).getroot().iter("testcase") if junit.exists() else []:
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                message = ((found.get("message") or "").splitlines() or [""])[0][:300]
        counts[outcome] += 1
        seconds = round(float(case.get("time", "nan")), 2)
        results.add_row(
            {"test": case.get("name"), "outcome": outcome, "seconds": seconds, "message": message}
        )
    results.update(**counts, summary=", ".join(f"{n} {k}" for k, n in counts.items() if n))
    if code not in (0, 5) or counts["failed"]:
        failed = [r["test"] for r in results.rows if r["outcome"] == "failed"]
        raise RuntimeError(f"pytest exited with {int(code)}; failed: {failed}")
    if not counts["passed"]:
        reasons = sorted({r["message"] for r in results.rows}) or ["no test selected"]
        raise Skip("every test was skipped: " + "; ".join(reasons))


def cuda_tests(results: Results, tiny: bool) -> None:
    pytest_phase(results, "not nccl")


def fsdp2_nccl(results: Results, tiny: bool) -> None:
    pytest_phase(results, "nccl")


# -- phase 3: TROLL against clip, one training step -------------------------------------------
def overhead(results: Results, tiny: bool) -> None:
    """Median step time and peak memory of TROLL and clip at each Qwen3 shape, and TROLL's step
    time with its root finder compiled (``troll_compiled``)."""
    setting, shapes = (TINY_OVERHEAD, TINY_QWEN3) if tiny else (OverheadSetting(), QWEN3)
    results.update(paper=PAPER, memory=PeakMemory().source, shapes=shape_table(shapes),
                   **asdict(setting))  # fmt: skip

    def measure(name: str, shape: Shape, sequences: int) -> dict[str, Any]:
        return overhead_at(shape, setting, sequences)

    each_shape(results, shapes, list(halving(setting.sequences)), measure)
    first = next(iter(shapes))
    results.update(unseen_lengths=new_shape_rows(first, shapes[first], setting))
    results.update(ragged=ragged_at(first, shapes[first], setting))
    rows = [r for r in results.rows if "time_ratio" in r]
    if rows:
        last = rows[-1]
        compiled = (f" (compiled solver x{last['compiled_time_ratio']:.3f})"
                    if "compiled_time_ratio" in last else "")  # fmt: skip
        results.update(
            summary=f"{last['shape']}: time x{last['time_ratio']:.3f}{compiled}, memory "
            f"x{last['memory_ratio']:.3f} (paper x{PAPER['time_ratio']}, x{PAPER['memory_ratio']})"
        )


# -- phase 4: generation, the dynamic loop against CUDA graphs -------------------------------
def generation(results: Results, tiny: bool) -> None:
    """Both decoding paths at each shape and length: tokens/s, wall and device time per step, and
    the rollout's share of a GRPO iteration (:mod:`gpu_generation`)."""
    import torch

    setting, shapes = (TINY_GENERATION, TINY_QWEN3) if tiny else (GenerationSetting(), QWEN3)
    results.update(shapes=shape_table(shapes), graphs_on_device=torch.cuda.is_available(),
                   **asdict(setting))  # fmt: skip

    def measure(name: str, shape: Shape, micro_batch: int) -> list[dict[str, Any]]:
        def progress(rows: list[dict[str, Any]]) -> None:  # kept if the phase is stopped
            results.update(unfinished=[{**shape_figures(name, shape), **r} for r in rows])

        try:
            return generation_rows(name, shape, setting, micro_batch, progress)
        finally:  # the rows are the phase's now (or the shape failed)
            results.figures.pop("unfinished", None)
            results.write()

    try:  # the shapes first, the measurements; the attention variants after them
        each_shape(results, shapes, list(halving(setting.micro_batch)), measure)
    finally:
        variant = setting.variant_shape
        results.update(variants=variant_rows(variant, shapes[variant], setting))
    rates = [
        f"{r['shape']} {r['new_tokens']}: {r['graphs_tokens_per_s']:.0f}"
        + (f" (dynamic {r['dynamic_tokens_per_s']:.0f})" if r["dynamic_tokens_per_s"] else "")
        + (
            f" (every 8: {r['graphs_every_8_tokens_per_s']:.0f})"
            if r["graphs_every_8_tokens_per_s"]
            else ""
        )
        for r in results.rows
        if r.get("graphs_tokens_per_s")
    ]
    results.update(summary="graphs tokens/s: " + ", ".join(rates))


# -- phase 5: the captured step, its forward compiled or not ----------------------------------
def compiled_decoding(results: Results, tiny: bool) -> None:
    """At the first shape, the whole decoding step captured (``check_every: 8``) with the
    model's forward compiled (``model.sampling.compile_step``) and without: the warm-up's
    seconds (the compilations), tokens/s and the device's time a step
    (:func:`gpu_generation.compiled_rows`)."""
    import torch

    setting, shapes = (TINY_GENERATION, TINY_QWEN3) if tiny else (GenerationSetting(), QWEN3)
    first = next(iter(shapes))
    results.update(shapes=shape_table({first: shapes[first]}),
                   graphs_on_device=torch.cuda.is_available())  # fmt: skip
    for row in compiled_rows(first, shapes[first], setting):
        results.add_row({**shape_figures(first, shapes[first]), **row})
    row = results.rows[-1]
    results.update(
        summary=f"{first} {row['new_tokens']}: compiled "
        f"{row['graphs_every_8_compiled_tokens_per_s']:.0f} tokens/s, not compiled "
        f"{row['graphs_every_8_tokens_per_s']:.0f} (x{row['speedup']:.3f}); its warm-up "
        f"{row['graphs_every_8_compiled_warmup_s']:.1f} s"
    )


WORKERS = {
    "cuda-tests": cuda_tests,
    "fsdp2-nccl": fsdp2_nccl,
    "loop-paths": loop_paths,
    "overhead": overhead,
    "generation": generation,
    "compiled-decoding": compiled_decoding,
    "tinymath-demo": tinymath_demo,
    "grpo-smollm2": grpo_smollm2,
}


def work(name: str, path: Path, tiny: bool, fail: bool) -> int:
    """Runs phase ``name`` in this process and records how it ended in ``path``; the exit code."""
    results = Results(path)
    results.write()
    try:
        if fail:
            raise RuntimeError(f"--fail-phase {name}: a failure planted to test the runner")
        WORKERS[name](results, tiny)
    except Skip as reason:
        results.write("skipped", reason=str(reason))
        return 0
    except BaseException as error:  # noqa: BLE001 - recorded, then the exit code says it
        traceback.print_exc()
        results.write("failed", error=f"{type(error).__name__}: {error}")
        return 1
    results.write("ok")
    return 0
