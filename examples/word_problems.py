"""Two-step word problems: a task with headroom for SmolLM2-135M-Instruct, written procedurally.

    python examples/word_problems.py --make-task /tmp/words        # the task folder
    python examples/word_problems.py --probe --level 12 --count 64 # SmolLM2 greedy, training split
    python examples/word_problems.py --probe --held-out            # the start on the held-out set

Each problem takes two operations on small numbers, asked in words (``"Mia has 7 bags with 6
marbles in each bag. She gives away 9 marbles. How many marbles does Mia have now?"``), and the
prompt asks for a short worked answer that ends with the number, so completions are sentences,
not one number. The reward is exact: ``last_number`` (the reply's last number equals the answer).

- **Procedural, no repeats.** :func:`problems` draws questions from :data:`TEMPLATES`, names and
  operands (from 2 to ``level``) with a seeded generator and keeps each question once. A stable
  hash of the question (BLAKE2b) puts one problem in :data:`HELD_OUT_EVERY` into the held-out
  split and the rest into training, so the two never share a question. The task's training file
  holds :data:`TRAIN_ROWS` distinct problems, more than a study's rollouts draw (80 rollouts x
  8 prompts = 640), so a run sees every prompt at most once; it is kept small beside the space of
  questions, so that dropping repeats does not bend the mix of templates (one-step problems are
  0.43 of the training rows and of the held-out ones).
- **A fixed held-out set** of :data:`VAL_ROWS` problems (one validation's standard error is at
  most 0.5 / sqrt(512) = 0.022).
- **The level** is chosen by ``--probe`` on problems of the *training* split, never the held-out
  one: SmolLM2's greedy accuracy must lie between 0.15 and 0.45 before training.

``--make-task`` writes a folder laid out as ``examples/own_task/`` (``task.yaml``, ``data/``), which
``studies/unseen_task_check.py --task`` and ``lightning-troll fit --config task.yaml`` train on.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct"
LEVEL = 6
"""The largest operand of the task as written: of the levels 6, 9, 12 and 20 probed on 96
problems of the training split (``--probe``; 0.27, 0.15, 0.16, 0.11), the one closest to 0.30,
the middle of the range a task with headroom must start in."""
TRAIN_ROWS, VAL_ROWS = 1_200, 512
HELD_OUT_EVERY = 8
"""One question in this many (by its hash) belongs to the held-out split."""
INSTRUCTION = "Answer in one short sentence that ends with the number."
TOKENS = 64
"""The generation budget: room for a worked answer."""
NAMES = (
    "Mia", "Leo", "Ava", "Sam", "Zoe", "Max", "Ivy", "Ben", "Lily", "Omar", "Nina", "Tom", "Ana",
    "Raj", "Eva", "Jon", "Kim", "Luis", "Mei", "Noah", "Ola", "Paul", "Rosa", "Sara", "Theo",
    "Uma", "Vera", "Will", "Yara", "Zack", "Alma", "Bo", "Cleo", "Dan", "Elif", "Finn", "Gia",
    "Hugo", "Iris", "Jack",
)  # fmt: skip
TEMPLATES = (
    ("{n} has {a} bags with {b} marbles in each bag. {n} gives away {c} marbles. "
     "How many marbles does {n} have now?", "a*b-c"),
    ("{n} buys {a} packs of {b} pencils and already had {c} pencils. "
     "How many pencils does {n} have in total?", "a*b+c"),
    ("A shop has {a} shelves with {b} books on each shelf. It sells {c} books. "
     "How many books are left?", "a*b-c"),
    ("{n} reads {a} pages a day for {b} days, then {c} more pages. "
     "How many pages does {n} read in all?", "a*b+c"),
    ("{n} has {a} red and {b} blue balloons and gives {c} balloons to each friend until none are "
     "left. How many friends get balloons?", "(a+b)/c"),
    ("{n} saves {a} dollars a week for {b} weeks, then spends {c} dollars. "
     "How many dollars does {n} have left?", "a*b-c"),
    ("There are {a} boxes of {b} eggs. {c} eggs break. How many eggs are not broken?", "a*b-c"),
    ("{n} had {a} stickers and got {b} more, then shared them equally with {c} friends, keeping "
     "none. How many stickers does each friend get?", "(a+b)/c"),
    ("{n} has {a} apples and buys {b} more. How many apples does {n} have now?", "a+b"),
    ("{n} has {a} cookies and eats {b} of them. How many cookies are left?", "a-b"),
    ("{n} has {a} bags with {b} marbles in each bag. How many marbles does {n} have?", "a*b"),
    ("{n}'s class has {a} rows of {b} desks. How many desks are there?", "a*b"),
    ("{n} sees {a} people on a bus. {b} more get on. How many people are on the bus?", "a+b"),
    ("{n} has {a} dollars and spends {b} dollars. How many dollars are left?", "a-b"),
    ("{n}'s farm has {a} pens with {b} sheep in each pen. How many sheep are there?", "a*b"),
    ("{n} picks {a} flowers and then {b} more. How many flowers does {n} have?", "a+b"),
)  # fmt: skip
"""(question, its arithmetic): two steps (a product less or plus a number, a sum divided evenly)
in the first half, one step (a sum, a difference or a product) in the second."""


def _operands(rng: random.Random, arithmetic: str, level: int) -> tuple[int, int, int, int]:
    """(a, b, c, answer) for ``arithmetic``, operands a, b from 2 to ``level``; the answer is a
    whole number above 0 (a division divides evenly, into at least 2)."""
    while True:
        a, b = rng.randint(2, level), rng.randint(2, level)
        one_step = {"a+b": a + b, "a-b": a - b, "a*b": a * b}
        if arithmetic in one_step:
            if one_step[arithmetic] > 0:
                return a, b, 0, one_step[arithmetic]
            continue
        if arithmetic == "a*b-c":
            c = rng.randint(1, a * b - 1)
            return a, b, c, a * b - c
        if arithmetic == "a*b+c":
            c = rng.randint(1, 3 * level)
            return a, b, c, a * b + c
        divisors = [c for c in range(2, level + 1) if (a + b) % c == 0 and (a + b) // c >= 2]
        if divisors:
            c = rng.choice(divisors)
            return a, b, c, (a + b) // c


def _split_of(question: str) -> str:
    digest = hashlib.blake2b(question.encode(), digest_size=8).digest()
    return "validation" if int.from_bytes(digest, "big") % HELD_OUT_EVERY == 0 else "train"


def _draw(rng: random.Random, level: int) -> dict:
    template, arithmetic = TEMPLATES[rng.randrange(len(TEMPLATES))]
    a, b, c, answer = _operands(rng, arithmetic, level)
    question = template.format(n=rng.choice(NAMES), a=a, b=b, c=c)
    return {"question": question, "answer": str(answer)}


def problems(count: int, split: str, seed: int = 0, level: int = LEVEL) -> list[dict]:
    """``count`` distinct problems of ``split`` (``train`` or ``validation``), in a fixed order for
    ``seed``: no question twice, and none in both splits."""
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation'; got {split!r}")
    rng, seen, rows, misses = random.Random(f"{seed}-{level}"), set(), [], 0
    while misses < 20_000:  # this many draws in a row without a new problem: the space is spent
        row = _draw(rng, level)
        if row["question"] in seen or _split_of(row["question"]) != split:
            misses += 1
            continue
        misses = 0
        seen.add(row["question"])
        rows.append(row)
        if len(rows) == count:
            return rows
    raise ValueError(f"level {level} holds fewer than {count} distinct {split} problems")


TASK_CONFIG = """\
# Two-step word problems with a short worked answer, written by
# examples/word_problems.py --make-task (level {level}). From this folder:
#   lightning-troll fit --config task.yaml --model.model <a model folder>
seed_everything: 0
trainer:
  accelerator: cpu
  max_steps: 640             # optimiser steps: 8 per rollout, so 80 rollouts
  val_check_interval: 10
  check_val_every_n_epoch: null
model:
  model: HuggingFaceTB/SmolLM2-135M-Instruct
  group_size: 8
  sampling: {{max_new_tokens: {tokens}}}
  rewards: {{last_number: 1.0}}
  optimization: {{minibatch_size: 8}}
  optimizer:
    class_path: torch.optim.AdamW
    init_args: {{lr: 3.0e-6, weight_decay: 0.0}}
  lr_scheduler: null
data:
  source: data/train.jsonl
  val_file: data/val.jsonl
  num_val: null
  prompt_field: question
  template: "{{question}} {instruction}"
  chat_template: true
  batch_size: 8
  val_batch_size: 64
  max_prompt_tokens: 96
"""


def make_task(folder: Path, level: int = LEVEL, train: int = TRAIN_ROWS, val: int = VAL_ROWS):
    """Writes the task into ``folder`` (``data/``, ``task.yaml``); refuses one that is not empty."""
    if folder.exists() and any(folder.iterdir()):
        raise SystemExit(f"--make-task: {folder} exists and is not empty; name a new folder")
    (folder / "data").mkdir(parents=True)
    for name, split, count in (("train", "train", train), ("val", "validation", val)):
        text = "".join(json.dumps(r) + "\n" for r in problems(count, split, level=level))
        (folder / "data" / f"{name}.jsonl").write_text(text)
    config = TASK_CONFIG.format(level=level, tokens=TOKENS, instruction=INSTRUCTION)
    (folder / "task.yaml").write_text(config)
    return folder


def probe(rows: list[dict], model_dir: Path, batch: int = 32) -> dict:
    """SmolLM2's greedy replies to ``rows`` in the chat template: accuracy (``last_number``), its
    standard error, and the replies' mean length in tokens (EOS not counted)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightning_troll.tasks.rewards.functions import last_number

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    correct, lengths = [], []
    for start in range(0, len(rows), batch):
        part = rows[start : start + batch]
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"{r['question']} {INSTRUCTION}"}],
                tokenize=False,
                add_generation_prompt=True,
            )
            for r in part
        ]
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(
                **inputs,
                max_new_tokens=TOKENS,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        replies = out[:, inputs["input_ids"].shape[1] :]
        for row, reply in zip(part, replies, strict=True):
            ids = reply.tolist()
            ids = ids[: ids.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in ids else ids
            text = tokenizer.decode(ids, skip_special_tokens=True)
            correct.append(last_number("", text, row))
            lengths.append(len(ids))
        print(f"  {len(correct)}/{len(rows)}: accuracy so far {statistics.fmean(correct):.3f}",
              file=sys.stderr, flush=True)  # fmt: skip
    accuracy = statistics.fmean(correct)
    return {
        "problems": len(rows),
        "accuracy": accuracy,
        "standard_error": (accuracy * (1 - accuracy) / len(rows)) ** 0.5,
        "mean_tokens": statistics.fmean(lengths),
        "example": text,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--make-task", type=Path, metavar="FOLDER", help="write the task, then stop")
    p.add_argument("--probe", action="store_true", help="SmolLM2's greedy accuracy, then stop")
    p.add_argument("--held-out", action="store_true", help="probe the held-out set (the start)")
    p.add_argument("--level", type=int, default=LEVEL, help="the largest operand")
    p.add_argument("--count", type=int, default=64, help="problems to probe")
    p.add_argument("--model", type=Path, default=SMOLLM2, help="the model folder to probe")
    p.add_argument("--json", type=Path, help="write the probe's figures here too")
    args = p.parse_args(argv)
    if args.level < 3:
        p.error(f"--level must be >= 3 (operands from 2 to it); got {args.level}")
    if args.make_task:
        print(f"wrote {make_task(args.make_task, args.level)}")
    if args.probe:
        split = "validation" if args.held_out else "train"
        count = VAL_ROWS if args.held_out else args.count
        # the training split's probe draws with its own seed, apart from the task's own rows
        rows = problems(count, split, seed=0 if args.held_out else 1, level=args.level)
        figures = {"split": split, "level": args.level, **probe(rows, args.model)}
        print(json.dumps(figures, indent=1))
        if args.json:
            args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
