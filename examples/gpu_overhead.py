"""The measurements of the ``overhead`` phase of ``examples/gpu_check.py``
(:func:`gpu_phases.overhead`): one whole training step of TROLL and of clip at a Qwen3 shape
(:func:`overhead_at`), training steps at sequence lengths not seen before in both attention
backend orders (:func:`new_shape_rows`), and a ragged minibatch against an equal one
(:func:`ragged_at`)."""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_models import (  # noqa: E402
    Shape,
    clock,
    device,
    free_memory,
    make_rollout,
    out_of_memory,
    qwen3,
    snapshot_and_policy,
    train_step,
)
from peak_memory import PeakMemory  # noqa: E402
from profile_step import counts, profiled  # noqa: E402

PAPER = {"time_ratio": 1.091, "memory_ratio": 1.046}
"""TROLL / clip for one training step of Qwen3-4B in the paper (arXiv 2510.03817)."""


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
