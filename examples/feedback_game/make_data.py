"""Writes the game's problems: ``python examples/feedback_game/make_data.py``.

Two-step word problems of :mod:`word_problems` (level 6), drawn from its *training* generator on
seed 11, leaving out the headroom study's pilot problems: 640 training rows (``data/train.jsonl``)
and the next 64 for validation (``data/val.jsonl``). The headroom study's held-out set comes from
the generator's other split, so no problem here is one of them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import word_problems  # noqa: E402

TRAIN, VAL, SEED = 640, 64, 11
PILOT = HERE.parent / "results" / "smollm2" / "headroom" / "pilot" / "holdout.jsonl"


def main() -> None:
    pilot = {json.loads(line)["question"] for line in PILOT.read_text().splitlines()}
    rows = [r for r in word_problems.problems(2 * (TRAIN + VAL), "train", seed=SEED)
            if r["question"] not in pilot][: TRAIN + VAL]  # fmt: skip
    (HERE / "data").mkdir(exist_ok=True)
    for name, part in (("train", rows[:TRAIN]), ("val", rows[TRAIN:])):
        (HERE / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    print(f"wrote {TRAIN} training and {VAL} validation problems to {HERE / 'data'}")


if __name__ == "__main__":
    main()
