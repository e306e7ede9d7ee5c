"""Benchmark: a decoding step with grouped heads read as they are, against transformers' own.

A decoding step hands the model an additive 4-D mask, and with a mask transformers' ``sdpa``
attention before 5.24 repeats each key/value head for the query heads of its group: a copy of
the cache, twice a layer and step. The decoding loops lend such a model an attention that reads
one query's grouped heads as they are (``lightning_troll/engines/step_attention.py``). This times
one step of SmolLM2-135M's architecture (random weights, float32; 9 query heads on 3 key/value
heads, 30 layers) at several cache lengths, both ways in turn in one process (``--repeats``
steps each, medians): ``transformers``, the model's own ``sdpa``; ``folded``, the loops' attention
(forced, so that it runs on any transformers). With transformers 5.24 or later both fold, and the
ratio says what the loops' version costs against transformers' own; before 5.24 it says what the
copy costs.

    python examples/benchmark_grouped_heads.py --lengths 256 1024 2048 \\
        --json examples/results/smollm2/grouped_heads.json

Prints one row per length: milliseconds a step each way and folded over transformers'.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ARMS = ("transformers", "folded")


def smollm2_architecture(seed: int = 0):
    """SmolLM2-135M's architecture (``examples/gpu_models.py``'s ``SMOLLM2``) with random
    weights, float32, sdpa attention, in eval mode."""
    import torch
    from gpu_models import SMOLLM2 as shape
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.mlp,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        max_position_embeddings=8192, tie_word_embeddings=True, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def run(lengths: list[int], sequences: int, repeats: int) -> list[dict]:
    import torch

    model = smollm2_architecture()
    g = torch.Generator().manual_seed(0)
    rows = []
    for length in lengths:
        row = at_length(model, length, sequences, repeats, g)
        rows.append(row)
        print(f"{length:>6} cached: transformers {row['transformers_ms']:8.2f} ms, folded "
              f"{row['folded_ms']:8.2f} ms, x{row['ratio']:.3f} (logits within "
              f"{row['max_logit_gap']:.1e})", flush=True)  # fmt: skip
    return rows


def at_length(model, length: int, sequences: int, repeats: int, g) -> dict:
    """One step over ``length`` cached positions of ``sequences`` rows, each way in turn: a
    warm-up step each, then ``repeats`` timed steps each; medians in ms, their ratio, and the
    largest gap between the two ways' logits."""
    import torch

    from lightning_troll.engines import step_attention

    vocab = model.config.vocab_size
    ids = torch.randint(2, vocab, (sequences, length), generator=g)
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values  # (N, 3, L, 64) a layer
    token = torch.randint(2, vocab, (sequences, 1), generator=g)
    mask = torch.zeros(sequences, 1, 1, length + 1)  # additive: every position visible
    position = torch.full((sequences, 1), length)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    outputs = {}

    def step(arm: str) -> float:
        own = contextlib.nullcontext()  # transformers' sdpa as the model has it
        context = step_attention.grouped_query_steps(model, force=True) if arm == "folded" else own
        with torch.no_grad(), context:
            start = time.perf_counter()
            out = model(input_ids=token, attention_mask=mask, position_ids=position,
                        past_key_values=cache, use_cache=True)  # fmt: skip
            seconds = time.perf_counter() - start
        cache.crop(-1)  # the next step attends over the same positions
        outputs[arm] = out.logits[:, -1]
        return seconds

    for arm in ARMS:  # a warm-up step each
        step(arm)
    for _ in range(repeats):
        for arm in ARMS:
            times[arm].append(step(arm))
    row = {"cached": length, "sequences": sequences}
    row |= {f"{arm}_ms": round(1000 * statistics.median(times[arm]), 2) for arm in ARMS}
    row["ratio"] = round(row["folded_ms"] / row["transformers_ms"], 3)
    row["max_logit_gap"] = float((outputs["folded"] - outputs["transformers"]).abs().max())
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5, help="steps each way, in turn")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    import torch
    import transformers

    from lightning_troll.engines.step_attention import sdpa_copies_groups

    rows = run(args.lengths, args.sequences, args.repeats)
    record = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "sdpa_copies_groups": sdpa_copies_groups(),
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "rows": rows,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
