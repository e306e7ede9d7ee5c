"""Writes the small-number arithmetic prompts that ``configs/smollm2.yaml`` trains on.

    python examples/make_arithmetic_prompts.py        # -> examples/data/arithmetic/{train,val}.jsonl

Every problem ``a + b``, ``a - b`` (``a >= b``) and ``a * b`` with operands 0-12, phrased as a
question (``"What is 7 * 8?"``), with the exact answer: 429 problems. A stable hash of the
question (BLAKE2b, not Python's randomised ``hash``) holds out a quarter of them for validation,
so the split is the same on every machine. Rows are ``{"question": ..., "answer": ...}``; the
config adds the instruction (``Answer with only the number.``) through ``data.template`` and
scores completions with the ``last_number`` reward.

SmolLM2-135M-Instruct (dequantised from Q4_1) gets about two in five of these right when it
samples at temperature 0.7, and RL has room to raise that: see the README's section on
fine-tuning a real pretrained model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

OUT = Path(__file__).parent / "data" / "arithmetic"
MAX_OPERAND = 12
OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def problems() -> list[dict[str, object]]:
    """Every problem once, in a fixed order."""
    rows = []
    for symbol, apply in OPERATIONS.items():
        for a in range(MAX_OPERAND + 1):
            for b in range(MAX_OPERAND + 1):
                if symbol == "-" and a < b:
                    continue  # no negative answers
                rows.append({"question": f"What is {a} {symbol} {b}?", "answer": apply(a, b)})
    return rows


def is_validation(question: str) -> bool:
    """A quarter of the problems, chosen by a stable hash of the question."""
    return hashlib.blake2b(question.encode(), digest_size=8).digest()[0] % 4 == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=OUT, help="output folder (default: %(default)s)"
    )
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    rows = problems()
    splits = {
        "train": [r for r in rows if not is_validation(str(r["question"]))],
        "val": [r for r in rows if is_validation(str(r["question"]))],
    }
    for name, split in splits.items():
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in split), encoding="utf-8")
        print(f"{path}: {len(split)} problems")


if __name__ == "__main__":
    main()
