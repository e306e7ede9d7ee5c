"""The ``generation`` phase of ``examples/gpu_check.py``: the decoding paths side by side.

At each Qwen3 shape (random initialisation, bf16 on a GPU) and at 256 and 1,024 new tokens, 8
prompts x 8 completions are sampled by the dynamic loop (``model.sampling.decode: dynamic``,
each step launched from the host), by the CUDA-graph path (``graphs``: a static KV cache,
each bucket's step replayed as one graph, the stop flags read at every step) and by that path
reading them every 8 steps (``graphs_every_8``: ``model.sampling.check_every: 8``, the graph
then holding the whole step, the draw and the records too); at the shapes
``long_shapes`` also by the graphs attending over all the static cache's positions at
every step, as they did before they attended over the positions a step can see
(``graphs_all_positions``). A row per shape and length gives, for each path:

- ``*_tokens_per_s``: generated tokens over the sampling's wall time; ``*_wall_ms_per_step``:
  that time over the decoding steps (prefill and, for graphs, capture included);
  ``*_captures`` and ``*_capture_s``: how many times the step was captured (a new bucket, a
  wider span) and the seconds those captures took, within that wall time (0 for the dynamic
  loop, and on a CPU, where nothing is captured);
- ``*_rollout_share``: the rollout (sampling plus the behaviour pass that caches the old
  log-probs and sparse rows) over one GRPO iteration (the rollout plus one TROLL step); the
  behaviour pass and the training step depend on the shapes only (a random model almost never
  draws EOS, so every completion runs to the budget) and are timed once, on the graphs path's
  sample (``behaviour_s``, ``train_s``);
- ``*_device_ms_per_step`` (first row of a shape; null on a CPU): the device's own work per
  decoding step, from the profiler's CUDA kernel times of a sample of ``profile_tokens`` tokens
  less those of a one-token sample, over the steps between them. A path bound by the host's
  launches shows a wall time per step far above it; one the device runs at its pace, close.

Each shape's paths are timed graphs first, the dynamic loop last, and the rows so far are handed
to a ``progress`` callback after every path: a phase stopped at its limit keeps them.

After the shapes, at ``variant_shape`` (:func:`variant_rows`, the phase's ``variants``), the
dynamic loop and the graphs sample ``variant_tokens`` new tokens with the decoding steps' attention
as the library runs it, with PyTorch's own attention backend order, and with transformers' own
handling of grouped heads, one after the other in one process.

The dynamic loop samples the shortest completions only: at 1,024 tokens it took 68 s at 0.6B's
shape on an H200 (965 tokens/s, the eighth report), most of the phase's time, and that report
keeps the figure. ``graphs_every_8`` samples the 1,024-token completions at the shapes
``long_shapes`` only; the rows that leave a path out leave its columns null.
On a CPU (``--tiny``) the graphs fall back to the dynamic loop (warned): the figures then say
nothing about graphs, only that the phase runs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from gpu_models import (
    EOS,
    PAD,
    Shape,
    clock,
    make_rollout,
    qwen3,
    snapshot_and_policy,
    train_step,
)

PATHS = {
    "graphs": {"decode": "graphs"},
    "graphs_every_8": {"decode": "graphs", "check_every": 8},
    "graphs_all_positions": {"decode": "graphs"},
    "dynamic": {"decode": "dynamic"},
}
"""Each path the phase times, in the order it times them (the slowest last): its
``model.sampling`` options."""

COMPILED_PATHS = {
    "graphs_every_8": PATHS["graphs_every_8"],
    "graphs_every_8_compiled": {**PATHS["graphs_every_8"], "compile_step": True},
}
"""The paths of the ``compiled-decoding`` phase (:func:`compiled_rows`): the whole step
captured, its forward compiled (``model.sampling.compile_step``) or not."""


@dataclass(frozen=True)
class GenerationSetting:
    prompts: int = 8
    group: int = 8
    prompt: int = 64
    new_tokens: tuple[int, ...] = (256, 1024)
    micro_batch: int = 8
    chunk: int = 1024
    warmup_tokens: int = 16
    """A first GRPO iteration this long (graphs) warms kernels, allocator and compiler caches."""
    profile_tokens: int = 17
    long_shapes: tuple[str, ...] = ("qwen3-0.6b",)
    """Shapes at which ``graphs_every_8`` samples the longest completions too, and
    ``graphs_all_positions`` samples at all."""
    variant_shape: str = "qwen3-0.6b"
    """The shape at which :func:`variant_rows` times the decoding steps' attention choices."""
    variant_tokens: int = 128


TINY_GENERATION = GenerationSetting(
    prompts=2, group=4, prompt=8, new_tokens=(8, 16), micro_batch=4, warmup_tokens=4,
    profile_tokens=5, variant_tokens=8,
)  # fmt: skip

VARIANTS = ("library", "torch_order", "transformers_heads")
"""The decoding steps' attention as the library runs it (``engines/step_attention.py``), with
PyTorch's own backend order instead of cuDNN last, and with transformers' own handling of
grouped heads (which, before transformers 5.24, repeats them: a copy of the cache a step)."""

VARIANT_PATHS = ("dynamic", "graphs")
"""The paths :func:`variant_rows` times."""


def variant_rows(name: str, shape: Shape, setting: GenerationSetting) -> list[dict[str, Any]]:
    """The tokens/s and wall time a step of :data:`VARIANT_PATHS` at ``shape``,
    ``variant_tokens`` new tokens, for each of :data:`VARIANTS` in turn, in one process after
    one warm-up sample of each path."""
    from unittest import mock

    from lightning_troll.engines import step_attention

    snapshot = qwen3(shape).requires_grad_(False)  # sampling only: no trainable copy
    prompts = random_prompts(shape, setting)
    for path in VARIANT_PATHS:
        sample_with(snapshot, prompts, setting.group, setting.warmup_tokens, path)
    patches = {
        "library": {},
        "torch_order": {"cudnn_attention_last": lambda device: contextlib.nullcontext()},
        "transformers_heads": {"grouped_query_steps": lambda model: contextlib.nullcontext()},
    }
    rows = []
    for variant in VARIANTS:
        row: dict[str, Any] = {"shape": name, "variant": variant,
                               "new_tokens": setting.variant_tokens}  # fmt: skip
        with contextlib.ExitStack() as stack:
            for attribute, stand_in in patches[variant].items():
                stack.enter_context(mock.patch.object(step_attention, attribute, stand_in))
            for path in VARIANT_PATHS:
                start = clock()
                response = sample_with(snapshot, prompts, setting.group, setting.variant_tokens,
                                       path)[2]  # fmt: skip
                seconds = clock() - start
                row[f"{path}_tokens_per_s"] = round(int(response.sum()) / seconds, 1)
                row[f"{path}_wall_ms_per_step"] = round(1000 * seconds / response.shape[1], 3)
        rows.append(row)
    return rows


def generation_rows(
    name: str, shape: Shape, setting: GenerationSetting, micro_batch: int, progress=None
) -> list[dict[str, Any]]:
    """The rows of one shape: one per length in ``setting.new_tokens``. ``progress``, if given,
    is called with the rows so far (the last one possibly unfinished) after every path, so that
    a phase stopped at its limit keeps what it measured."""
    import torch

    from lightning_troll.objectives import build_objective

    snapshot, policy = snapshot_and_policy(shape)
    objective = build_objective("troll")
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    prompts = random_prompts(shape, setting)
    report = progress or (lambda rows: None)

    def iteration_parts(sampled) -> tuple[float, float]:
        """Seconds of the behaviour pass and of one training step on a sample."""
        ids, attention, response = sampled
        tokens = ids[:, -response.shape[1] :].masked_fill(~response, 0)
        rewards = (tokens.sum(-1) % 2).float()  # a stand-in: the parity of the token ids' sum
        start = clock()
        rollout = make_rollout(snapshot, objective, ids, attention, response, rewards,
                               setting.group, setting.chunk)  # fmt: skip
        collected = clock()
        train_step(policy, objective, optimizer, rollout, micro_batch, setting.chunk)
        return collected - start, clock() - collected

    iteration_parts(sample_with(snapshot, prompts, setting.group, setting.warmup_tokens, "graphs"))
    rows: list[dict[str, Any]] = []
    for tokens in setting.new_tokens:
        row: dict[str, Any] = {"new_tokens": tokens, "sequences": setting.prompts * setting.group,
                               "micro_batch": micro_batch}  # fmt: skip
        rows.append(row)
        paths = paths_at(name, tokens, setting)
        times = {}
        for path in PATHS:
            if path not in paths:
                row |= {f"{path}_{k}": None for k in ("tokens_per_s", "wall_ms_per_step",
                                                      "rollout_share", "captures", "capture_s")}  # fmt: skip
                continue
            sampled, times[path], figures = timed_sample(snapshot, prompts, setting.group,
                                                         tokens, path)  # fmt: skip
            row["generated_tokens"] = int(sampled[2].sum())
            row |= figures
            if path == "graphs":
                on_graphs = sampled  # what the rest of the iteration is timed on
            report(rows)
        behaviour_s, train_s = iteration_parts(on_graphs)
        row |= {"behaviour_s": round(behaviour_s, 3), "train_s": round(train_s, 3)}
        for path, seconds in times.items():
            rollout_s = seconds + behaviour_s
            row[f"{path}_rollout_share"] = round(rollout_s / (rollout_s + train_s), 4)
        if "dynamic" in times:  # tokens/s of graphs over the dynamic loop's
            row["speedup"] = round(row["graphs_tokens_per_s"] / row["dynamic_tokens_per_s"], 3)
        if len(rows) == 1:  # the device's time per step, before the longer completions
            for path in PATHS:
                row[f"{path}_device_ms_per_step"] = (
                    device_ms_per_step(
                        snapshot, prompts, setting.group, setting.profile_tokens, path
                    )
                    if path in paths
                    else None
                )
        report(rows)
    return rows


def compiled_rows(name: str, shape: Shape, setting: GenerationSetting) -> list[dict[str, Any]]:
    """The ``compiled-decoding`` phase at ``shape``: for each of :data:`COMPILED_PATHS`, one
    sample of the shortest length in ``setting.new_tokens`` to warm up (for the compiled path
    its compilations: the step's spans before and at the cache's end; its seconds are
    ``warmup_s``), then the same sample timed: tokens/s, wall time a step, captures and their
    seconds, the device's time a step (profiled, as in the ``generation`` phase), and the
    compiled path's tokens/s over the other's."""
    snapshot = qwen3(shape).requires_grad_(False)  # sampling only: no trainable copy
    prompts = random_prompts(shape, setting)
    tokens = min(setting.new_tokens)
    row: dict[str, Any] = {"shape": name, "new_tokens": tokens,
                           "sequences": setting.prompts * setting.group}  # fmt: skip
    for path in COMPILED_PATHS:
        start = clock()
        sample_with(snapshot, prompts, setting.group, tokens, path)
        row[f"{path}_warmup_s"] = round(clock() - start, 2)
        row |= timed_sample(snapshot, prompts, setting.group, tokens, path)[2]
        row[f"{path}_device_ms_per_step"] = device_ms_per_step(
            snapshot, prompts, setting.group, setting.profile_tokens, path
        )
    row["speedup"] = round(
        row["graphs_every_8_compiled_tokens_per_s"] / row["graphs_every_8_tokens_per_s"], 3
    )
    return [row]


def timed_sample(snapshot, prompts, group: int, tokens: int, path: str):
    """:func:`sample_with`'s sample, its seconds, and its figures as a row holds them, under the
    ``path``'s name: tokens/s, wall time a decoding step, captures and their seconds."""
    captures: list[float] = []
    start = clock()
    sampled = sample_with(snapshot, prompts, group, tokens, path, captures)
    seconds = clock() - start
    response = sampled[2]
    figures = {
        f"{path}_tokens_per_s": round(int(response.sum()) / seconds, 1),
        f"{path}_wall_ms_per_step": round(1000 * seconds / response.shape[1], 3),
        f"{path}_captures": len(captures),
        f"{path}_capture_s": round(sum(captures), 4),
    }
    return sampled, seconds, figures


def paths_at(name: str, tokens: int, setting: GenerationSetting) -> tuple[str, ...]:
    """The paths the phase times at shape ``name`` and ``tokens`` new tokens."""
    longest = tokens > min(setting.new_tokens)
    if name in setting.long_shapes:
        return tuple(path for path in PATHS if not (longest and path == "dynamic"))
    return ("graphs",) if longest else ("graphs", "graphs_every_8", "dynamic")


def random_prompts(shape: Shape, setting: GenerationSetting) -> list[list[int]]:
    """``setting.prompts`` prompts of ``setting.prompt`` random token ids (seed 0)."""
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(2, shape.vocab, (setting.prompts, setting.prompt), generator=g).tolist()


def sample_with(snapshot, prompts, group: int, tokens: int, path: str, captures=None):
    """(ids, attention mask, response mask) of ``group`` completions of ``tokens`` per prompt,
    sampled by the decoding ``path`` (a key of :data:`PATHS`). ``captures``, a list, gets the
    seconds of each capture of the CUDA-graph path's step (its warm-up and recording, the
    device's queued work finished before and after)."""
    from unittest import mock

    from lightning_troll.engines import static_batch
    from lightning_troll.engines.sampling import SamplingConfig, sample

    sampling = SamplingConfig(max_new_tokens=tokens, **(PATHS | COMPILED_PATHS)[path])
    span = 1 << 40 if path == "graphs_all_positions" else static_batch.SPAN  # past any cache
    own = static_batch.StaticBatch.capture

    def timed(batch):
        start = clock()
        failure = own(batch)
        captures.append(clock() - start)
        return failure

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(static_batch, "SPAN", span))
        if captures is not None:
            stack.enter_context(mock.patch.object(static_batch.StaticBatch, "capture", timed))
        ids, attention, response, _ = sample(snapshot, prompts, group, sampling, PAD, EOS)
    return ids, attention, response


def device_ms_per_step(snapshot, prompts, group: int, tokens: int, path: str) -> float | None:
    """The device's kernel time per decoding step of ``path`` (None without CUDA): the CUDA
    activities of a ``tokens``-token sample less those of a one-token one (the prefill and, for
    graphs, a capture), over the ``tokens - 1`` steps between them."""
    import torch

    if not torch.cuda.is_available():
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def kernel_us(length: int) -> float:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            sample_with(snapshot, prompts, group, length, path)
            torch.cuda.synchronize()
        return sum(
            e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA
        )

    return round((kernel_us(tokens) - kernel_us(1)) / (tokens - 1) / 1000, 4)
