"""Rollout generation phase by phase: transformers' ``generate`` against the library's own
decoding loop (:mod:`lightning_troll.engines.decode`), side by side in one run.

One rollout of SmolLM2-135M-Instruct (``make smollm2``): the 8 arithmetic prompts of
``examples/benchmark_iteration.py`` in the chat template, 8 completions each (64 sequences), at
most 32 new tokens, temperature 1.0, float32, 2 torch threads; the behaviour log-probs and
TROLL's sparse rows (its defaults: at most 256 tokens, ``mass_delta`` 1e-5) recorded while
sampling; the completions scored with ``last_number``. The ways, run in turn within every
repetition (interleaved, each seeded alike) after one warm-up round:

- ``generate``: one plain ``model.generate`` call on the 64 left-padded sequences, nothing else;
- ``old``: the rollout as it was: ``sample`` on its ``generate`` path, the
  ``BehaviourRecorder`` as logits processor, each prompt prefilled 8 times, every sequence
  decoded until the longest ends;
- ``new``: ``sample`` on its decoding loop: each prompt prefilled once, finished sequences
  dropped, the recorder's ``record_rows`` on the running ones;
- ``new, no recorder``: the same without recording (``--ways`` picks others, see ``WAYS``:
  ``old, no recorder``; ``generate, static cache``; ``new, multinomial``, drawing tokens with
  ``torch.multinomial`` as ``generate`` does; ``new, compiled``, the model under
  ``torch.compile(dynamic=True)``).

Phases, in seconds (medians over the repetitions): ``prefill`` is the model's first forward,
``decode forwards`` the others (``per step`` divides by their number, ``rows per step`` is
the mean batch), ``cache growth`` the part of the forwards spent growing the KV cache
(``DynamicLayer.update``: a concatenation per layer and step), ``recorder`` the recorder's
per-step calls, ``sampling`` choosing the tokens, ``drops`` removing finished sequences from
the batch and the cache, ``rest of the loop`` what remains of the sampling call (stop checks
and bookkeeping; on the ``generate`` path its own loop of logits processors, sampling, stop
checks and growing ids, all in one), ``post-processing`` the response mask, the padding and
the repeated prompts, ``recorder finish`` the assembly of the recorder's record, ``rewards``
decoding the completions to text and scoring them with ``last_number``, ``CPU seconds`` the
process's CPU time for the whole rollout (less sensitive than wall time to other work on the
machine).

Run (from the repository root; about 3 minutes on 2 quiet CPU cores)::

    .venv/bin/python examples/profile_rollout.py
    .venv/bin/python examples/profile_rollout.py --repeats 5 --json rollout_profile.json

It prints a markdown table, a row per phase and a column per way, then the ratio of each way's
total to the first way's.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import torch
from transformers.cache_utils import DynamicLayer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from iteration_workers import GROUP, SMOLLM2, chat_prompt_ids, pick_rows  # noqa: E402

from lightning_troll.engines import choice as choice_module
from lightning_troll.engines import decode as decode_module
from lightning_troll.engines import sampling as sampling_module
from lightning_troll.engines.behaviour import BehaviourRecorder
from lightning_troll.engines.sampling import SamplingConfig, left_pad, sample
from lightning_troll.models.loading import load_policy, load_tokenizer, stop_token_ids
from lightning_troll.tasks.rewards import last_number
from lightning_troll.trust_region.sparse import sparsify

WAYS = (
    "generate",
    "generate, static cache",
    "old",
    "old, no recorder",
    "new",
    "new, no recorder",
    "new, multinomial",
    "new, compiled",
)
DEFAULT_WAYS = ("generate", "old", "new", "new, no recorder")
PHASES = (
    "prefill",
    "decode forwards",
    "cache growth",
    "recorder",
    "sampling",
    "drops",
    "rest of the loop",
    "post-processing",
    "recorder finish",
    "rewards",
    "total",
    "CPU seconds",
)


class Clock:
    """Seconds and counts per phase of one run, filled by wrappers and forward hooks."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def timed(self, phase: str, fn: Callable) -> Callable:
        """``fn`` with its time added to ``phase``."""

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        return wrapper

    def hook(self, model: torch.nn.Module) -> list:
        """Forward hooks timing each forward: ``prefill`` (several tokens a row) or ``decode
        forwards`` (one), counting the decode forwards and their rows."""
        started: list[float] = []

        def before(module, args, kwargs):
            started.append(time.perf_counter())

        def after(module, args, kwargs, output):
            ids = kwargs.get("input_ids", args[0] if args else None)
            phase = "prefill" if ids.shape[1] > 1 else "decode forwards"
            self.seconds[phase] += time.perf_counter() - started.pop()
            if phase == "decode forwards":
                self.counts["steps"] += 1
                self.counts["row steps"] += ids.shape[0]

        return [
            model.register_forward_pre_hook(before, with_kwargs=True),
            model.register_forward_hook(after, with_kwargs=True),
        ]


def sparse_rows(logits: torch.Tensor, tokens: torch.Tensor):
    """TROLL's sparse rows with the default ``model.trust_region`` (256 tokens, 1e-5)."""
    return sparsify(logits, max_tokens=256, mass_delta=1e-5, keep=tokens)


def multinomial(scores: torch.Tensor) -> torch.Tensor:
    """A token per row of ``scores`` (n, V) drawn as ``generate`` draws it."""
    return torch.multinomial(scores.softmax(dim=-1), num_samples=1).squeeze(1)


def run_way(way: str, setup: dict, clock: Clock) -> dict:
    """One rollout the way ``way`` says, timed into ``clock``; returns its counts."""
    model, tokenizer, prompts = setup["model"], setup["tokenizer"], setup["prompts"]
    sampling, pad, stops = setup["sampling"], tokenizer.pad_token_id, setup["stops"]
    if way.startswith("generate"):
        ids, mask = left_pad([p for p in prompts for _ in range(GROUP)], pad)  # (B, S)
        options = {"cache_implementation": "static"} if "static" in way else {}
        start = time.perf_counter()
        with sampling_module._plain_generation_config(model):
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=sampling.temperature,
                max_new_tokens=sampling.max_new_tokens,
                pad_token_id=pad,
                eos_token_id=list(stops),
                **options,
            )
        clock.seconds["total"] = clock.seconds["loop"] = time.perf_counter() - start
        responses = out[:, ids.shape[1] :]
        mask, _ = sampling_module.response_mask_of(responses, stops)
        return {"tokens": int(mask.sum()), "length": responses.shape[1]}
    recorder = None if "no recorder" in way else BehaviourRecorder(1.0, sparse_rows)
    sampler = setup["compiled"] if "compiled" in way else model
    with ExitStack() as patches:
        enter = patches.enter_context
        if way.startswith("old"):
            enter(mock.patch.object(sampling_module, "decode", lambda *args, **kwargs: None))
        enter(
            mock.patch.object(
                sampling_module, "decode", clock.timed("loop", sampling_module.decode)
            )
        )
        enter(
            mock.patch.object(
                sampling_module, "_generate", clock.timed("loop", sampling_module._generate)
            )
        )
        if "multinomial" in way:
            enter(mock.patch.object(choice_module, "draw", multinomial))
        choose = clock.timed("sampling", decode_module.choose_tokens)
        enter(mock.patch.object(decode_module, "choose_tokens", choose))
        keep = decode_module._Batch.keep
        enter(mock.patch.object(decode_module._Batch, "keep", clock.timed("drops", keep)))
        for name in ("__call__", "record_rows"):
            fn = getattr(BehaviourRecorder, name)
            enter(mock.patch.object(BehaviourRecorder, name, clock.timed("recorder", fn)))
        start = time.perf_counter()
        ids, attention, response_mask, truncated = sample(
            sampler, prompts, GROUP, sampling, pad, stops, recorder=recorder
        )
        clock.seconds["post-processing"] = time.perf_counter() - start - clock.seconds["loop"]
        responses = ids[:, -response_mask.shape[1] :]  # (B, T)
        begin = time.perf_counter()
        if recorder is not None:
            recorder.finish(responses)
        clock.seconds["recorder finish"] = time.perf_counter() - begin
    begin = time.perf_counter()
    kept = response_mask & ~torch.isin(responses, torch.tensor(stops))  # (B, T)
    texts = [
        tokenizer.decode(r[k].tolist(), skip_special_tokens=True)
        for r, k in zip(responses, kept, strict=True)
    ]
    rows = [r for r in setup["rows"] for _ in range(GROUP)]
    for text, row in zip(texts, rows, strict=True):
        last_number(row["question"], text, row)
    clock.seconds["rewards"] = time.perf_counter() - begin
    clock.seconds["total"] = time.perf_counter() - start
    return {"tokens": int(response_mask.sum()), "length": response_mask.shape[1]}


def phases(clock: Clock) -> dict[str, float]:
    """The phases of one run from its clock; ``rest of the loop`` is what the others leave."""
    s = clock.seconds
    inner = ("prefill", "decode forwards", "recorder", "sampling", "drops")
    out = {name: s.get(name, 0.0) for name in PHASES}
    out["rest of the loop"] = s["loop"] - sum(s.get(name, 0.0) for name in inner)
    steps = clock.counts["steps"]
    out["decode steps"] = steps
    out["per step (ms)"] = 1000 * s["decode forwards"] / max(steps, 1)
    out["rows per step"] = clock.counts["row steps"] / max(steps, 1)
    return out


def profile(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    model = load_policy(args.model)
    tokenizer = load_tokenizer(args.model)
    setup = {
        "model": model,
        "tokenizer": tokenizer,
        "prompts": prompt_ids(tokenizer),
        "rows": pick_rows(),
        "stops": stop_token_ids(tokenizer, model),
        "sampling": SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens),
    }
    if "new, compiled" in args.ways:
        setup["compiled"] = torch.compile(model, dynamic=True)
    runs: dict[str, list[dict]] = {way: [] for way in args.ways}
    for repeat in range(args.repeats + 1):  # round 0 warms up
        for way in args.ways:
            clock = Clock()
            handles = [] if "compiled" in way else clock.hook(model)  # hooks break the graph
            torch.manual_seed(repeat)
            cpu = time.process_time()
            try:
                with ExitStack() as patches:
                    if "compiled" not in way:  # timers break the graph
                        grow = clock.timed("cache growth", DynamicLayer.update)
                        patches.enter_context(mock.patch.object(DynamicLayer, "update", grow))
                    counts = run_way(way, setup, clock)
            finally:
                for handle in handles:
                    handle.remove()
            clock.seconds["CPU seconds"] = time.process_time() - cpu
            if repeat:
                runs[way].append({**phases(clock), **counts})
            print(f"round {repeat} {way}: {clock.seconds['total']:.2f} s", file=sys.stderr)
    medians = {
        way: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        for way, rs in runs.items()
    }
    return {"settings": {**vars(args), "ways": list(args.ways)}, "runs": runs, "medians": medians}


def prompt_ids(tokenizer) -> list[list[int]]:
    """The benchmark's prompts in the chat template; the question text alone for a tokenizer
    without one (the tiny models of the tests)."""
    if tokenizer.chat_template:
        return chat_prompt_ids(tokenizer)
    return [tokenizer.encode(r["question"])[-16:] for r in pick_rows()]


def table(result: dict) -> str:
    """The medians as a markdown table, a column per way, and the totals' ratios."""
    medians = result["medians"]
    ways = list(medians)
    rows = [
        "| phase | " + " | ".join(ways) + " |",
        "| --- |" + " ---: |" * len(ways),
    ]
    quiet = ("recorder", "sampling", "drops", "post-processing", "recorder finish")
    for name in PHASES + ("decode steps", "per step (ms)", "rows per step", "tokens"):
        cells = []
        for way in ways:
            value = medians[way].get(name)
            blank = way.startswith("generate") and name in quiet + ("rewards",)
            if value is None or blank:
                cells.append("-")
            elif name in ("decode steps", "tokens"):
                cells.append(f"{value:.0f}")
            elif name in ("per step (ms)", "rows per step"):
                cells.append(f"{value:.1f}")
            else:
                cells.append(f"{value:.3f}")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    first = medians[ways[0]]["total"]
    ratios = ", ".join(f"{way}: {medians[way]['total'] / first:.2f}x" for way in ways)
    return "\n".join(rows) + f"\n\ntotal against {ways[0]}: {ratios}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(SMOLLM2), help="a model folder")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds after a warm-up")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--ways", nargs="+", default=list(DEFAULT_WAYS), choices=WAYS)
    parser.add_argument("--json", type=Path, default=None, help="write the runs here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1; got {args.repeats}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = profile(args)
    print(table(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
