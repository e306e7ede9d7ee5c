"""Benchmark: drawing a decoding step's tokens, the two-level search against one scan.

Both decoding loops draw each step's tokens with ``lightning_troll.engines.choice.draw``: one
uniform number per row, inverted through the cumulative distribution. Inverting it with one
float64 cumulative sum over the whole vocabulary (``one_scan``, what ``draw`` did before) cost
280 us of a 7 ms decoding step at Qwen3's vocabulary on an H200 (the eighth GPU report's profile,
``examples/results/gpu/eighth/profile_65.txt``); ``draw`` now searches in two levels, the
blocks' masses first, then the tokens of one block. This times both, in turn, for ``--rows``
rows of random logits at each vocabulary (SmolLM2's 49,152 and Qwen3's 151,936 by default), on
``--device``, the median of ``--repeats`` draws each, and checks that from the same seed they
draw the same tokens.

    python examples/benchmark_draw.py --json examples/results/smollm2/draw.json

Prints one row per vocabulary: milliseconds a draw each way and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

VOCABULARIES = (49_152, 151_936)


def one_scan(scores):
    """Tokens drawn from ``softmax(scores)`` (n, V) by one float64 cumulative sum over the
    whole vocabulary: the same uniform numbers as ``draw`` takes, the same tokens."""
    import torch

    weights = (scores - scores.amax(dim=-1, keepdim=True)).exp()  # (n, V)
    cdf = weights.double().cumsum(dim=-1)  # (n, V)
    total = cdf[:, -1:]  # (n, 1)
    uniform = torch.rand(total.shape, dtype=torch.float64, device=scores.device)  # (n, 1)
    tokens = torch.searchsorted(cdf, uniform * total, right=True)  # (n, 1)
    return torch.minimum(tokens, cdf.argmax(dim=-1, keepdim=True)).squeeze(-1)  # (n,)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocabularies", type=int, nargs="+", default=list(VOCABULARIES))
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    for name in ("rows", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1; got {getattr(args, name)}")
    if any(v < 1 for v in args.vocabularies):
        parser.error(f"--vocabularies must all be >= 1; got {args.vocabularies}")

    import torch

    from lightning_troll.engines.choice import draw

    device = torch.device(args.device)

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    ways = {"two_level": draw, "one_scan": one_scan}
    rows = []
    for vocab in args.vocabularies:
        g = torch.Generator().manual_seed(0)
        scores = (3 * torch.randn(args.rows, vocab, generator=g)).to(device)
        drawn = {}
        for name, way in ways.items():
            torch.manual_seed(1)
            drawn[name] = way(scores)
        row = {"vocabulary": vocab, "rows": args.rows, "device": device.type,
               "same_tokens": bool(torch.equal(drawn["two_level"], drawn["one_scan"]))}  # fmt: skip
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.repeats):
            for name, way in ways.items():  # in turn
                start = clock()
                way(scores)
                times[name].append(clock() - start)
        medians = {name: statistics.median(times[name]) for name in ways}
        row |= {f"{name}_ms": round(1000 * medians[name], 4) for name in ways}
        row["two_level_over_one_scan"] = round(medians["two_level"] / medians["one_scan"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
