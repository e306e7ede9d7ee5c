"""Profile: where a long completion's time goes on SmolLM2-135M's architecture, by operator kind.

The length table (``examples/benchmark_lengths.py``) finds sampling growing faster than the tokens
and training's cost a token rising past 1,024 tokens. This measures both causes apart, in this
process, on SmolLM2-135M-Instruct's architecture with random weights, float32:

- **A decoding step against the cache's length**: one step of the dynamic loop (the running
  sequences' last tokens through the model, an additive 4-D mask) for ``--batch`` sequences (64:
  8 prompts x 8) whose cache already holds ``--contexts`` positions (random keys and values), on
  transformers' ``DynamicCache``, which appends by concatenation, and on the decoding loop's
  reserved cache (``lightning_troll.engines.reserved``), which writes in place: the two in turn,
  the same keys and values. Per context and cache: the step's seconds (median of ``--repeats``,
  without the profiler), and the share of the step's operator time (the profiler's self time,
  one more step) that goes to the cache's update (its append), to attention
  (``scaled_dot_product_attention`` and its kernels), to the matrix products of the weights,
  and to everything else; and the bytes the cache holds.
- **A training pass against the sequence length**: the loss's forward and backward (clipping's
  loss, the library's chunked logits, prompts shared) over one sequence of 48 prompt tokens and
  ``--train-lengths`` response tokens, as the token budget runs such a sequence: alone. Per
  length: milliseconds a token (median of ``--repeats``), the same split by operator kind, and
  the page faults and system time of a pass (memory the pass takes fresh from the system).

    python examples/profile_lengths.py --json examples/results/smollm2/length_profile.json

Needs ``make smollm2`` (the architecture and tokenizer are read from
``models/SmolLM2-135M-Instruct``). Operator times are the profiler's self times on the calling
thread, which include the intra-op threads' work; their sum is a little above the step's own
time (the profiler's cost), so the shares, not the profiled seconds, are reported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_lengths import random_architecture, random_rollout  # noqa: E402

KINDS = ("cache_append", "attention", "matmul", "other")
# transformers' DynamicCache, and the decoding loop's reserved one
CACHES = ("concatenated", "reserved")
CACHE_APPEND = "cache_append"  # the profiler's range around a cache layer's update
# attention's kernels, and any softmax: eager attention's, and in a training pass the loss's
ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "softmax")
MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")


def kind_of(event) -> str:
    """The kind of one profiled operator: anything within the cache's ``update`` is the cache's
    append (its concatenations); the names below otherwise (``attention`` counts every softmax
    too, so a training pass's includes the loss's log-softmax); the rest (rotary embedding, norms,
    activations, the loss's elementwise work, copies) is ``other``."""
    parent = event
    while parent is not None:
        if parent.name == CACHE_APPEND:
            return "cache_append"
        parent = parent.cpu_parent
    if any(a in event.name for a in ATTENTION):
        return "attention"
    return "matmul" if event.name in MATMUL else "other"


@contextlib.contextmanager
def cache_ranges():
    """Marks every cache layer's ``update`` (a step's append to the cache: transformers'
    ``DynamicLayer`` and the reserved cache's ``ReservedLayer``) as a profiler range."""
    from torch.profiler import record_function
    from transformers.cache_utils import DynamicLayer

    from lightning_troll.engines.reserved import ReservedLayer

    originals = {layer: layer.update for layer in (DynamicLayer, ReservedLayer)}

    def marked(update):
        def update_marked(self, *args, **kwargs):
            with record_function(CACHE_APPEND):
                return update(self, *args, **kwargs)

        return update_marked

    for layer, update in originals.items():
        layer.update = marked(update)
    try:
        yield
    finally:
        for layer, update in originals.items():
            layer.update = update


def shares(run) -> dict[str, float]:
    """The share of the operators' self time each kind takes in one profiled call of ``run``."""
    from torch.profiler import ProfilerActivity, profile

    with cache_ranges(), profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    totals = dict.fromkeys(KINDS, 0.0)
    for event in prof.events():
        totals[kind_of(event)] += event.self_cpu_time_total
    whole = sum(totals.values())
    return {kind: round(t / whole, 3) for kind, t in totals.items()}


def median_seconds(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_rows(model, contexts: list[int], batch: int, repeats: int) -> list[dict]:
    """One decoding step at each cache length, on transformers' concatenating cache and on the
    decoding loop's reserved one (the same keys and values), timed in turn and profiled."""
    import torch
    from transformers import DynamicCache

    from lightning_troll.engines.reserved import reserve

    config = model.config
    heads, dim = config.num_key_value_heads, config.head_dim
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(10, config.vocab_size, (batch, 1), generator=g)
    rows = []
    for context in contexts:
        caches = {name: DynamicCache(config=config) for name in CACHES}
        for layer in range(config.num_hidden_layers):
            keys, values = (torch.randn(batch, heads, context, dim, generator=g) for _ in "kv")
            for cache in caches.values():
                cache.update(keys, values, layer)
        reserve(caches["reserved"], 1, room=repeats + 4)  # warm-up, repeats, profile
        steps = {name: stepper(model, cache, tokens, context) for name, cache in caches.items()}
        times: dict[str, list[float]] = {name: [] for name in CACHES}
        for step in steps.values():
            step()  # warm-up
        for _ in range(repeats):
            for name, step in steps.items():
                times[name].append(median_seconds(step, 1))
        medians = {name: statistics.median(t) for name, t in times.items()}
        row = {"context": context, "sequences": batch,
               "cache_gib": round(cache_bytes(config, batch, context) / 2**30, 2),
               **{f"{name}_step_s": round(medians[name], 4) for name in CACHES},
               "reserved_over_concatenated": round(medians["reserved"] / medians["concatenated"],
                                                   3)}  # fmt: skip
        row.update({f"{name}_shares": shares(steps[name]) for name in CACHES})
        rows.append(row)
        print(json.dumps(row), flush=True)
        del caches, steps
    return rows


def stepper(model, cache, tokens, context: int):
    """A decoding step of ``tokens`` (n, 1) against ``cache`` of ``context`` positions, as the
    dynamic loop runs one (an additive 4-D mask, one column longer a step)."""
    import torch

    batch = tokens.shape[0]
    mask = torch.zeros(batch, 1, 1, context)  # additive: every position seen
    positions = torch.full((batch, 1), context)

    @torch.no_grad()
    def step() -> None:
        nonlocal mask, positions
        mask = torch.cat([mask, mask[..., :1]], dim=-1)
        model(input_ids=tokens, attention_mask=mask, position_ids=positions,
              past_key_values=cache, use_cache=True)  # fmt: skip
        positions = positions + 1

    return step


def cache_bytes(config, batch: int, context: int) -> int:
    """Bytes of float32 keys and values for ``batch`` sequences of ``context`` positions."""
    per_position = 2 * config.num_key_value_heads * config.head_dim * 4
    return batch * config.num_hidden_layers * context * per_position


def training_rows(model, lengths: list[int], repeats: int, prompt: int = 48) -> list[dict]:
    """The loss's forward and backward over one sequence of each length, timed and profiled."""
    from types import SimpleNamespace

    import torch

    from lightning_troll.objectives import build_objective
    from lightning_troll.training.optimization import OptimizationConfig
    from lightning_troll.training.policies import policy_loss

    config, objective = OptimizationConfig(), build_objective("clip")
    policies = SimpleNamespace(policy=model)
    g = torch.Generator().manual_seed(0)
    model.train()
    rows = []
    for length in lengths:
        rollout = random_rollout(torch.tensor([length]), prompt, g, model.config.vocab_size)

        def step(rollout=rollout) -> None:
            loss, _ = policy_loss(policies, objective, rollout, config.logits_chunk_size,
                                  config.share_prompts)  # fmt: skip
            loss.backward()
            model.zero_grad(set_to_none=True)

        step()  # warm-up
        before = resource.getrusage(resource.RUSAGE_SELF)
        seconds = median_seconds(step, repeats)
        after = resource.getrusage(resource.RUSAGE_SELF)
        row = {"response_tokens": length, "positions": prompt + length,
               "ms_per_token": round(1000 * seconds / (prompt + length), 2),
               "page_faults_per_pass": round((after.ru_minflt - before.ru_minflt) / repeats),
               "system_s_per_pass": round((after.ru_stime - before.ru_stime) / repeats, 2)}  # fmt: skip
        row["shares"] = shares(step)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="*", default=[128, 512, 1024, 2048])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--train-lengths", type=int, nargs="*", default=[512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "smollm2-random"
    )
    args = parser.parse_args(argv)
    for name in ("batch", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1; got {getattr(args, name)}")
    for name in ("contexts", "train_lengths"):
        if any(n < 1 for n in getattr(args, name)):
            parser.error(f"--{name.replace('_', '-')} must all be >= 1; got {getattr(args, name)}")

    import torch
    from transformers import AutoModelForCausalLM

    model_dir = random_architecture(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    result = {
        "threads": torch.get_num_threads(),
        "decode": decode_rows(model, args.contexts, args.batch, args.repeats),
        "training": training_rows(model, args.train_lengths, args.repeats),
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
