"""The phases of ``examples/gpu_check.py``: each runs in a process of its own and writes its figures.

A phase is a function ``fn(results, tiny)``: it records figures on ``results`` as it goes (a
phase that fails or runs out of time keeps what it had recorded) and raises :class:`Skip` when
it cannot run here. ``tiny`` shrinks every shape so that the phase runs on a CPU in seconds.
The models (Qwen3 and SmolLM2 shapes, randomly initialised), the rollouts and the training step
are :mod:`gpu_models`', the whole fits through Lightning :mod:`gpu_fits`' and the peak memory
:mod:`peak_memory`'s."""

from __future__ import annotations

import json
import statistics
import sys
import traceback
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from functools import partial
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
    clock,
    device,
    free_memory,
    make_rollout,
    out_of_memory,
    qwen3,
    shape_figures,
    shape_table,
    snapshot_and_policy,
    train_step,
)
from peak_memory import PeakMemory  # noqa: E402
from profile_step import counts, profiled  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAPER = {"time_ratio": 1.091, "memory_ratio": 1.046}
"""TROLL / clip for one training step of Qwen3-4B in the paper (arXiv 2510.03817)."""


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
@dataclass(frozen=True)
class OverheadSetting:
    sequences: int = 4
    prompt: int = 128
    response: int = 896  # prompt + response = 1024 tokens
    chunk: int = 1024
    warmup: int = 2
    repeats: int = 5
    perturb: float = 0.1
    compiled: bool = True
    """Also TROLL with ``trust_region.compile_solver`` (its warm-up compiles)."""
    new_shapes: int = 4
    """Sequence lengths of :func:`new_shape_rows`, for each attention backend order."""
    ragged_sequences: int = 32
    """The minibatch of :func:`ragged_at`: long-tailed completions against equal ones."""


# compiled=False: the compiled solver's own tests run it on a CPU; a compile would triple the phase
TINY_OVERHEAD = OverheadSetting(
    sequences=2, prompt=8, response=24, chunk=16, warmup=1, repeats=2, compiled=False,
    new_shapes=2, ragged_sequences=6,
)  # fmt: skip


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


def overhead_at(shape: Shape, setting: OverheadSetting, sequences: int) -> dict[str, Any]:
    import torch

    from lightning_troll.objectives import build_objective

    snapshot, policy = snapshot_and_policy(shape, setting.perturb)
    g = torch.Generator(device=device()).manual_seed(0)
    length = setting.prompt + setting.response
    ids = torch.randint(2, shape.vocab, (sequences, length), generator=g, device=device())
    attention = torch.ones_like(ids)
    response = torch.ones(sequences, setting.response, dtype=torch.bool, device=device())
    rewards = torch.randn(sequences, generator=g, device=device())
    meter, row = PeakMemory(), {"sequences": sequences, "tokens": length}
    # "troll" keeps the eager solver, as in every earlier report; the default ("auto") is the
    # compiled arm on a GPU and the eager one on a CPU
    arms = {"clip": {}, "troll": {"compile_solver": False}} | (
        {"troll_compiled": {"compile_solver": True}} if setting.compiled else {})  # fmt: skip
    for name, options in arms.items():
        objective = build_objective(name.removesuffix("_compiled"), **options)
        rollout = make_rollout(snapshot, objective, ids, attention, response, rewards,
                               sequences, setting.chunk)  # fmt: skip
        step = partial(train_step, policy, objective, rollout=rollout, micro_batch=None,
                       chunk=setting.chunk)  # fmt: skip
        try:
            figures, stats = arm_figures(policy, step, setting, meter)
        except Exception as error:  # the compiled arm's compiler is the GPU image's, untried
            if name != "troll_compiled" or out_of_memory(error):
                raise
            row["troll_compiled_error"] = f"{type(error).__name__}: {error}"[:400]
        else:
            row |= {f"{name}_{key}": value for key, value in figures.items()}
            if name == "troll":
                row["projected_frac"] = round(float(stats.active_frac), 4)
        del rollout, step
        policy.zero_grad(set_to_none=True)
        free_memory()
    row["time_ratio"] = round(row["troll_ms"] / row["clip_ms"], 4)
    if "troll_compiled_ms" in row:
        row["compiled_time_ratio"] = round(row["troll_compiled_ms"] / row["clip_ms"], 4)
    row["memory_ratio"] = round(row["troll_peak_mib"] / row["clip_peak_mib"], 4)
    return row


def ragged_at(name: str, shape: Shape, setting: OverheadSetting) -> list[dict[str, Any]]:
    """Ragged completions against equal ones at ``shape``: one minibatch of
    ``setting.ragged_sequences`` long-tailed completions (median 200 tokens, a tail to 2,048)
    and as many of equal length with the same real tokens, trained (clip's forward and backward
    passes) in parts of two sequences, by the token budget padded, and by the token budget packed
    (``model.optimization.pack_sequences``), side by side (``examples/benchmark_lengths.py``'s
    ``ragged_rows``, which on a CPU chose the padded token budget as the default)."""
    from benchmark_lengths import ragged_rows

    policy = qwen3(shape).train()
    rows = ragged_rows(policy, setting.ragged_sequences, setting.repeats, clock=clock)
    return [{"shape": name, **row} for row in rows]


def new_shape_rows(name: str, shape: Shape, setting: OverheadSetting) -> list[dict[str, Any]]:
    """What a sequence length not seen before costs a training step: clip's behaviour pass and
    two training steps at each of ``setting.new_shapes`` lengths (the prompts shorter each time,
    the first row left-padded by 4 tokens so that attention gets a mask, as in a rollout), in
    PyTorch's attention backend order, then at as many other lengths with cuDNN's attention
    last (``engines/step_attention.py``). A backend that plans each shape on the host shows in
    the first step, not the second."""
    import contextlib

    import torch

    from lightning_troll.engines.step_attention import cudnn_attention_last
    from lightning_troll.objectives import build_objective

    snapshot, policy = snapshot_and_policy(shape, setting.perturb)
    objective = build_objective("clip")
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    g = torch.Generator(device=device()).manual_seed(0)
    n, rows = setting.sequences, []
    shorter = setting.prompt // (4 * setting.new_shapes)  # a prompt this much shorter each time
    response = torch.ones(n, setting.response, dtype=torch.bool, device=device())
    for index in range(2 * setting.new_shapes):
        order = "torch_order" if index < setting.new_shapes else "cudnn_last"
        length = setting.prompt + setting.response - shorter * index
        ids = torch.randint(2, shape.vocab, (n, length), generator=g, device=device())
        attention = torch.ones_like(ids)
        attention[0, :4] = 0  # left padding: a mask reaches the attention
        context = (
            cudnn_attention_last(device()) if order == "cudnn_last" else contextlib.nullcontext()
        )
        with context:
            start = clock()
            rollout = make_rollout(snapshot, objective, ids, attention, response,
                                   torch.randn(n, generator=g, device=device()), n, setting.chunk)  # fmt: skip
            times = [clock() - start]
            for _ in range(2):
                start = clock()
                train_step(policy, objective, optimizer, rollout, None, setting.chunk)
                times.append(clock() - start)
        rows.append({"shape": name, "order": order, "tokens": length,
                     "behaviour_ms": round(1000 * times[0], 1),
                     "first_step_ms": round(1000 * times[1], 1),
                     "second_step_ms": round(1000 * times[2], 1)})  # fmt: skip
        del rollout
    return rows


def arm_figures(
    policy, step, setting: OverheadSetting, meter: PeakMemory
) -> tuple[dict[str, Any], Any]:
    """One objective's figures and its last step's statistics: ``step(optimizer=...)`` takes one
    training step of ``policy``; warm-up steps, then the median of ``setting.repeats`` timed
    steps, one profiled step's counts and the peak memory."""
    import torch

    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    for _ in range(setting.warmup):
        step(optimizer=optimizer)
    baseline = meter.reset()
    times, stats = [], None
    for _ in range(setting.repeats):
        start = clock()
        stats = step(optimizer=optimizer)
        times.append(clock() - start)
    figures = {"ms": round(1000 * statistics.median(times), 2)}
    # kernel launches and host syncs (ATen calls on a CPU)
    figures |= counts(*profiled(partial(step, optimizer=optimizer)))
    figures |= {"peak_mib": round(meter.peak(), 1), "baseline_mib": round(baseline, 1)}
    return figures, stats


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
