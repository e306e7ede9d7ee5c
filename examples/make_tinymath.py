"""Warm-start the TinyMath demo policy: supervised training on two-digit arithmetic.

    python examples/make_tinymath.py                 # writes lightning_troll/assets/tinymath

Builds the character-level tokenizer and a tiny ``LlamaForCausalLM``, trains it with the
next-token loss on the answer and ``<eos>`` only (prompt tokens masked) on the ``train`` split,
and deliberately stops early: the policy should solve about half of the problems greedily, and
sampling at temperature 1.0 should find the answer often but not always, which leaves
reinforcement learning clear headroom (it turns pass@8 into pass@1). It then measures greedy
accuracy, sampled pass@1 (mean over 8 samples) and pass@8 on ``test`` problems, and saves model,
tokenizer, generation config and a model card into ``--out``. Deterministic for a given seed on
a given machine; about a minute on a 2-core laptop CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from lightning_troll.models.tinymath import (
    DEFAULT_MAX_NEW_TOKENS,
    TINYMATH_DIR,
    answer_of,
    build_tokenizer,
    generate_problems,
)

# The architecture of the shipped policy.
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 384
NUM_LAYERS = 3
NUM_HEADS = 4
MAX_POSITIONS = 32

EVAL_PROBLEMS = 1000  # test problems for the final numbers
NUM_SAMPLES = 8  # samples per problem for sampled pass@1 and pass@8
VALIDATION_PROBLEMS = 500  # validation problems for the progress lines
IGNORE = -100  # label of positions without loss


@dataclass
class Scores:
    """Accuracies on one set of problems (0-1)."""

    greedy: float
    """Greedy decoding gives the exact answer."""
    pass1: float
    """Sampled at temperature 1.0: share of correct samples (pass@1, mean over ``NUM_SAMPLES``)."""
    pass_k: float
    """Sampled at temperature 1.0: share of problems with a correct sample among ``NUM_SAMPLES``."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=TINYMATH_DIR, help="output directory")
    parser.add_argument("--steps", type=int, default=800, help="optimiser steps (early stop)")
    parser.add_argument("--seed", type=int, default=0, help="seed of data, init and sampling")
    parser.add_argument("--batch-size", type=int, default=128, help="problems per step")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
    parser.add_argument("--eval-every", type=int, default=100, help="steps between progress lines")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "eval_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if not args.lr > 0:
        parser.error(f"--lr must be > 0; got {args.lr}")
    return args


def build_model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        max_new_tokens=DEFAULT_MAX_NEW_TOKENS,
    )
    return model


def encode_examples(
    tokenizer: PreTrainedTokenizerFast, rows: list[dict[str, str]]
) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded ``<bos> prompt answer <eos>``: ids, attention mask, labels (answer + eos)."""
    prompts = tokenizer([r["prompt"] for r in rows]).input_ids  # with <bos>
    answers = tokenizer([r["answer"] for r in rows], add_special_tokens=False).input_ids
    length = max(len(p) + len(a) + 1 for p, a in zip(prompts, answers, strict=True))
    ids = torch.full((len(rows), length), tokenizer.pad_token_id)  # (N, L)
    labels = torch.full((len(rows), length), IGNORE)  # (N, L)
    mask = torch.zeros((len(rows), length), dtype=torch.long)  # (N, L)
    for i, (p, a) in enumerate(zip(prompts, answers, strict=True)):
        seq = p + a + [tokenizer.eos_token_id]
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p) : len(seq)] = torch.tensor(a + [tokenizer.eos_token_id])
        mask[i, : len(seq)] = 1
    return ids, mask, labels


@torch.no_grad()
def evaluate(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    rows: list[dict[str, str]],
    num_samples: int,
    seed: int,
) -> Scores:
    """Greedy accuracy, and sampled (temperature 1.0) pass@1 and pass@``num_samples``."""
    was_training = model.training
    model.eval()
    batch = tokenizer([r["prompt"] for r in rows], return_tensors="pt", padding=True)  # left pad
    prompt_len = batch.input_ids.shape[1]

    def correct(out: Tensor, repeats: int) -> Tensor:  # (N * repeats,) bool
        texts = tokenizer.batch_decode(out[:, prompt_len:], skip_special_tokens=True)
        answers = [r["answer"] for r in rows for _ in range(repeats)]
        return torch.tensor([answer_of(t) == a for t, a in zip(texts, answers, strict=True)])

    greedy = correct(model.generate(**batch, do_sample=False), 1)  # (N,)
    with torch.random.fork_rng(devices=[]):  # sampling leaves the caller's RNG alone
        torch.manual_seed(seed)
        sampled = model.generate(
            **batch,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            num_return_sequences=num_samples,
        )  # (N * S, prompt_len + new), problem-major
    hits = correct(sampled, num_samples).view(len(rows), num_samples).float()  # (N, S)
    model.train(was_training)
    return Scores(
        greedy=greedy.float().mean().item(),
        pass1=hits.mean().item(),
        pass_k=hits.amax(dim=1).mean().item(),
    )


def train(args: argparse.Namespace, model: LlamaForCausalLM, tok: PreTrainedTokenizerFast) -> None:
    rows = generate_problems(args.steps * args.batch_size, seed=args.seed, split="train")
    ids, mask, labels = encode_examples(tok, rows)  # (steps * B, L)
    validation = generate_problems(VALIDATION_PROBLEMS, seed=args.seed, split="validation")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:  # linear warm-up, cosine decay to 10 %
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    model.train()
    start = time.perf_counter()
    for step in range(args.steps):
        span = slice(step * args.batch_size, (step + 1) * args.batch_size)
        loss = model(input_ids=ids[span], attention_mask=mask[span], labels=labels[span]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            scores = evaluate(model, tok, validation, num_samples=2, seed=args.seed)
            print(
                f"step {step + 1:5d}/{args.steps}  loss {loss.item():.4f}  "
                f"validation greedy {scores.greedy:.3f}  sampled pass@1 {scores.pass1:.3f}  "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )


def model_card(
    args: argparse.Namespace, num_params: int, train_s: float, scores: Scores, total_s: float
) -> str:
    command = shlex.join(["python", "examples/make_tinymath.py", *sys.argv[1:]])
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags: [demo, arithmetic, lightning_troll]
---

# TinyMath (demo policy)

A **demo model**: a tiny `LlamaForCausalLM` that does two-digit addition and subtraction
*sometimes*. It ships with `lightning_troll` so that reinforcement-learning fine-tuning can be
watched working within minutes on a laptop CPU. It is deliberately undertrained: it is not
meant to be good at arithmetic, it is meant to have headroom that RL can take.

## Task

Prompts `"{{a}}{{op}}{{b}}="` with `0 <= a, b <= 99` and `op` in `+`, `-`; the answer is the
decimal result (negative when `a < b`), then `<eos>`: `"23+58="` -> `"81"`, `"17-58="` ->
`"-41"`. The 20,000 problems are split by a stable hash of the prompt into train (80 %),
validation (10 %) and test (10 %); see `lightning_troll.models.tinymath.generate_problems`.
Reward for RL: 1 for the exact answer (`lightning_troll.models.tinymath.answer_of`), else 0.

## Model

| | |
| --- | --- |
| architecture | `LlamaForCausalLM`, {NUM_LAYERS} layers, hidden {HIDDEN_SIZE}, {NUM_HEADS} heads, MLP {INTERMEDIATE_SIZE}, tied embeddings, {MAX_POSITIONS} positions |
| parameters | {num_params:,} |
| weights | float32 safetensors |
| tokenizer | character-level over `0123456789+-=` and `<pad> <bos> <eos> <unk>`; prepends `<bos>`; left padding |
| answer budget | `max_new_tokens={DEFAULT_MAX_NEW_TOKENS}` (3 characters + `<eos>`) |

## Training

Supervised next-token loss on the answer and `<eos>` only (prompt masked), AdamW (lr
{args.lr:g}, weight decay 0.01, linear warm-up, cosine decay to 10 %), batch {args.batch_size},
{args.steps} steps, seed {args.seed}; stopped early on purpose. Training (progress evaluations included) took {train_s:.0f} s,
the whole script {total_s:.0f} s, on a {os.cpu_count()}-core {platform.machine()} CPU
(torch {torch.__version__}, {torch.get_num_threads()} threads). Reproduce with:

```bash
{command}
```

## Results

On the first {EVAL_PROBLEMS} problems of `generate_problems({EVAL_PROBLEMS}, seed={args.seed}, split="test")`:

| metric | value |
| --- | --- |
| greedy accuracy | {scores.greedy:.3f} |
| sampled accuracy (pass@1, temperature 1.0, mean of {NUM_SAMPLES} samples) | {scores.pass1:.3f} |
| pass@{NUM_SAMPLES} (temperature 1.0) | {scores.pass_k:.3f} |

## Use

```python
from lightning_troll.models import load_policy, load_tokenizer

policy = load_policy("tinymath")         # = AutoModelForCausalLM.from_pretrained(TINYMATH_DIR)
tokenizer = load_tokenizer("tinymath")   # = AutoTokenizer.from_pretrained(TINYMATH_DIR)
batch = tokenizer(["23+58=", "7-30="], return_tensors="pt", padding=True)
out = policy.generate(**batch, do_sample=False)
print(tokenizer.batch_decode(out[:, batch.input_ids.shape[1]:], skip_special_tokens=True))
```
"""


def portable_tokenizer_class(out: Path) -> None:
    """Record the class as ``PreTrainedTokenizerFast``, a name transformers 4.x also knows.

    transformers 5 writes ``TokenizersBackend``, of which ``PreTrainedTokenizerFast`` is an alias.
    """
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"LlamaForCausalLM with {num_params:,} parameters; {args.steps} steps", flush=True)

    train(args, model, tokenizer)
    train_s = time.perf_counter() - start
    model.eval()
    test = generate_problems(EVAL_PROBLEMS, seed=args.seed, split="test")
    scores = evaluate(model, tokenizer, test, num_samples=NUM_SAMPLES, seed=args.seed)
    total_s = time.perf_counter() - start
    print(
        f"test ({EVAL_PROBLEMS} problems): greedy {scores.greedy:.3f}  sampled pass@1 "
        f"{scores.pass1:.3f}  pass@{NUM_SAMPLES} {scores.pass_k:.3f}",
        flush=True,
    )

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    portable_tokenizer_class(args.out)
    for path in args.out.iterdir():  # package data must be world-readable; safetensors writes 0600
        if path.is_file() and (
            path.suffix in {".json", ".safetensors"} or path.name == "README.md"
        ):
            path.chmod(0o644)
    (args.out / "README.md").write_text(model_card(args, num_params, train_s, scores, total_s))
    print(f"saved to {args.out}; wall time {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
