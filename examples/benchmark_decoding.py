"""Benchmark: the two decoding loops side by side on this machine's device, at several lengths.

The dynamic loop (``model.sampling.decode: dynamic``, what a CPU samples with) appends every
step's keys and values to transformers' ``DynamicCache``, which copies each layer's cache at every
step, and drops finished sequences from it. The static loop (what the CUDA-graph path runs,
here without graphs: :func:`~lightning_troll.engines.graph_decode.static_decode` with
``capture=False``) writes each step in place into a ``StaticCache`` allocated once and attends
over the positions a step can see, in spans of 256 (``static``), or over all its positions, the
unused ones masked, as it did before those spans (``static_all_positions``). This times the three
on the same prompts, in this process, in turn (``--repeats`` rounds, medians), on the iteration benchmark's 8 prompts x
``--group`` completions (8) and SmolLM2-135M-Instruct's architecture with
random weights (it almost never samples its end token, so every completion runs to the length
asked for), float32, with the behaviour recorder keeping TROLL's sparse rows as a float32 rollout
does (the library's defaults: 256 tokens, mass 1e-5, the sampled token kept).

    python examples/benchmark_decoding.py --lengths 128 512 \\
        --json examples/results/smollm2/decoding.json

Needs ``make smollm2`` (the architecture and tokenizer). Prints one row per length and loop:
seconds (median), tokens/s, and the loop's time over the dynamic one's (``over_dynamic``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_lengths import random_architecture  # noqa: E402
from iteration_workers import chat_prompt_ids  # noqa: E402

LOOPS = ("dynamic", "static", "static_all_positions")


def run(model_dir: Path, lengths: list[int], group: int, repeats: int) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightning_troll.engines import static_batch
    from lightning_troll.engines.behaviour import BehaviourRecorder
    from lightning_troll.engines.decode import decode
    from lightning_troll.engines.graph_decode import static_decode
    from lightning_troll.engines.sampling import SamplingConfig, left_pad, response_mask_of
    from lightning_troll.trust_region import defaults
    from lightning_troll.trust_region.sparse import sparsify

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = chat_prompt_ids(tokenizer)  # the iteration benchmark's 8, in the chat template
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    stops = [tokenizer.eos_token_id]

    def rows(logits, tokens, reads=True):
        return sparsify(logits, defaults.MAX_TOKENS, defaults.MASS_DELTA, keep=tokens,
                        reads=reads)  # fmt: skip

    def sample(loop: str, tokens: int) -> tuple[float, int]:
        sampling = SamplingConfig(max_new_tokens=tokens)
        recorder = BehaviourRecorder(sampling.temperature, rows)
        args = (model, ids, mask, group, sampling, tokenizer.pad_token_id, stops, True, recorder)
        span = static_batch.SPAN
        if loop == "static_all_positions":  # a span past the cache: every position, every step
            static_batch.SPAN = 1 << 40
        torch.manual_seed(0)
        try:
            start = time.perf_counter()
            out = decode(*args) if loop == "dynamic" else static_decode(*args, capture=False)
            recorder.finish(out)
            seconds = time.perf_counter() - start
        finally:
            static_batch.SPAN = span
        return seconds, int(response_mask_of(out, stops)[0].sum())

    sample("dynamic", 4), sample("static", 4)  # warm-up
    results = []
    for tokens in lengths:
        times: dict[str, list[float]] = {loop: [] for loop in LOOPS}
        sampled: dict[str, int] = {}
        for _ in range(repeats):
            for loop in LOOPS:
                seconds, sampled[loop] = sample(loop, tokens)
                times[loop].append(seconds)
        medians = {loop: statistics.median(times[loop]) for loop in LOOPS}
        for loop in LOOPS:
            results.append({
                "new_tokens": tokens, "loop": loop, "sequences": len(prompts) * group,
                "seconds": round(medians[loop], 2), "runs": [round(t, 2) for t in times[loop]],
                "tokens": sampled[loop],
                "tokens_per_s": round(sampled[loop] / medians[loop], 1),
                "over_dynamic": round(medians[loop] / medians["dynamic"], 3),
            })  # fmt: skip
            row = results[-1]
            print(f"{tokens:>6} new tokens  {loop:<20} {row['seconds']:>8.2f} s  "
                  f"{row['tokens_per_s']:>7.1f} tokens/s  over dynamic "
                  f"{row['over_dynamic']:.3f}", flush=True)  # fmt: skip
    return results


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the loops")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="a model folder (default: SmolLM2's architecture, random weights)")  # fmt: skip
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    for name in ("group", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1; got {getattr(args, name)}")
    if any(length < 1 for length in args.lengths):
        parser.error(f"--lengths must be >= 1; got {args.lengths}")
    model_dir = args.model_dir or random_architecture(
        Path(tempfile.gettempdir()) / "smollm2-random"
    )
    results = run(model_dir, args.lengths, args.group, args.repeats)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
