"""Benchmark: the cost of one GRPO iteration, ours (TROLL and clip) against TRL's GRPOTrainer.

One iteration: 8 prompts x 8 completions sampled at temperature 0.7 with at most 32 new tokens,
scored by the ``last_number`` reward, then ``--steps`` optimiser steps (AdamW, lr 1e-5), each on
all 64 sequences in one micro-batch, float32, ``--threads`` torch threads. With one step the
iteration is on-policy; with 4 the old policy's log-probs (and, for TROLL, its sparse
distributions) are needed for the three later steps. The 8 prompts are the same for every
iteration and every library (drawn once, seed 0, from ``examples/data/arithmetic/train.jsonl``
and put to the model in its chat template, as ``configs/smollm2.yaml`` does), so both sides do
the same work up to the lengths of the completions they sample; the mean completion length is
reported beside the times.

Each configuration runs in a fresh Python process, so the peak resident memory it reports
(``ru_maxrss``: model, optimiser, everything) is its own; on CUDA the peak of
``torch.cuda.max_memory_allocated`` is reported instead. The first iteration (allocations,
lazy initialisation) is left out; the figures are medians over the others. Per iteration:

- ``generation``: sampling (``generate``), for ours with the behaviour log-probs recorded;
- ``rest of rollout``: everything else before the first optimiser step (rewards, advantages,
  the behaviour policy's forward pass when it is not recorded, TRL's old-policy pass);
- ``training``: the optimiser steps;
- ``total``: the whole iteration, callbacks and logging included.

Ours runs through ``TrollModule`` and a Lightning ``Trainer`` with the callbacks the
``lightning-troll`` command adds (rollouts, old-policy refresh, KL and coverage monitors), with
``model.behaviour_logprobs`` as given (``--behaviour``; both by default) and a shared snapshot;
the split comes from the ``time/*`` metrics the module logs. TRL is timed when its Python can
import it (``--trl-python``, by default this one): ``GRPOTrainer`` with ``beta=0`` (no reference
model, TRL's default), its default loss, ``num_iterations=--steps``, ``per_device_train_batch_size
=64``, gradient checkpointing off and on (TRL's default is on), float32 on the CPU. TRL is not a
dependency of this project; to time it, install it into a separate environment::

    python -m venv /tmp/trl && /tmp/trl/bin/pip install torch==2.13.0 trl==1.16.0
    python examples/benchmark_iteration.py --trl-python /tmp/trl/bin/python

Run (from the repository root, after ``make smollm2``; on 2 quiet CPU cores each configuration
takes 3-15 minutes, so the whole run takes about an hour)::

    python examples/benchmark_iteration.py --json examples/results/smollm2/iteration.json
    python examples/benchmark_iteration.py --steps 1 --objectives troll --no-trl   # one config
    python examples/benchmark_iteration.py --tiny --iterations 2 --no-trl          # TinyMath smoke
    python examples/benchmark_iteration.py --behaviour-error   # recorded vs recomputed log-probs
    python examples/benchmark_iteration.py --generation        # generation alone, two ways

``--generation`` times one rollout's generation alone, two ways (``generate`` with its dynamic
KV cache, as the library samples, and with a static cache), in response tokens per second. ``--behaviour-error`` samples one rollout of the benchmark's prompts with the behaviour log-probs
and TROLL's sparse rows recorded, recomputes them with a teacher-forced pass of the same weights
(float32, then bfloat16), and prints how far apart they are.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data" / "arithmetic" / "train.jsonl"
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct"
INSTRUCTION = " Answer with only the number."
PROMPTS, GROUP, TEMPERATURE, LR = 8, 8, 0.7, 1e-5


def pick_rows(count: int = PROMPTS, seed: int = 0) -> list[dict]:
    """``count`` rows of the arithmetic training prompts, drawn with ``seed``."""
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    return random.Random(seed).sample(rows, count)


def peak_memory_gib() -> float:
    """The process's peak memory: CUDA's max allocated if CUDA was used, else ``ru_maxrss``."""
    import resource

    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


# ------------------------------------------------------------------------------------ ours


def run_ours(spec: dict) -> dict:
    import torch
    from lightning.pytorch import Callback, Trainer

    from lightning_troll.callbacks import (
        OldPolicyRefresh,
        RolloutGeneration,
        SparsityCoverageMonitor,
        TrustRegionMonitor,
    )
    from lightning_troll.data import PromptDataModule
    from lightning_troll.module import OptimizationConfig, TrollModule
    from lightning_troll.rollout import SamplingConfig
    from lightning_troll.snapshots import SnapshotConfig

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    tiny = spec["tiny"]

    class Timer(Callback):
        """Wall time of each whole iteration and the split the module logged."""

        def __init__(self) -> None:
            self.rows: list[dict] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            total = time.perf_counter() - self.start
            m = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
            self.rows.append(
                {
                    "total": total,
                    "generation": m["time/generation"],
                    "rest_of_rollout": m["time/rollout"] - m["time/generation"],
                    "training": m["time/training"],
                    "mean_length": m["completion/mean_length"],
                    "tokens_per_s": m["throughput/generated_tokens_per_s"],
                }
            )

    with tempfile.TemporaryDirectory() as tmp:
        if tiny:
            data = PromptDataModule(
                source="tinymath", batch_size=PROMPTS, num_train=PROMPTS, num_val=0
            )
            rewards, model = {"tinymath": 1.0}, "tinymath"
        else:
            path = Path(tmp) / "prompts.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in pick_rows()))
            data = PromptDataModule(
                source=str(path),
                val_file=str(path),
                num_train=None,
                num_val=None,
                prompt_field="question",
                template="{question}" + INSTRUCTION,
                chat_template=True,
                tokenizer=spec["model"],
                batch_size=PROMPTS,
            )
            rewards, model = {"last_number": 1.0}, spec["model"]
        module = TrollModule(
            model=model,
            objective=spec["objective"],
            group_size=GROUP,
            sampling=SamplingConfig(temperature=TEMPERATURE, max_new_tokens=spec["max_new_tokens"]),
            rewards=rewards,
            optimization=OptimizationConfig(epochs_per_rollout=spec["steps"]),
            optimizer=lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.0),
            snapshot=SnapshotConfig(mode="shared"),
            behaviour_logprobs=spec["behaviour"],
            share_prompts=spec["share_prompts"],
        )
        timer = Timer()
        trainer = Trainer(
            accelerator="auto",
            devices=1,
            max_steps=spec["iterations"] * spec["steps"],
            callbacks=[
                timer,
                RolloutGeneration(log_samples=0),
                OldPolicyRefresh(),
                TrustRegionMonitor(),
                SparsityCoverageMonitor(),
            ],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
        )
        trainer.fit(module, datamodule=data)
    return {"iterations": timer.rows, "peak_memory_gib": peak_memory_gib()}


# ------------------------------------------------------------------------------------- TRL


def run_trl(spec: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(ROOT))  # the same reward function as ours (it needs torch only)
    from lightning_troll.rewards import last_number

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    rows = pick_rows()
    dataset = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": r["question"] + INSTRUCTION}],
                "answer": r["answer"],
            }
            for r in rows
        ]
    )

    def reward(prompts, completions, answer, **_):
        return [
            last_number("", c[0]["content"] if isinstance(c, list) else c, {"answer": a})
            for c, a in zip(completions, answer, strict=True)
        ]

    seconds = {"generation": [], "rollout": []}

    def timed(fn, key):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[key].append(time.perf_counter() - start)

        return wrapper

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(time.perf_counter() - self.start)

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model.generate = timed(model.generate, "generation")
    steps = spec["steps"]
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp,
            use_cpu=not torch.cuda.is_available(),
            bf16=False,
            fp16=False,
            learning_rate=LR,
            weight_decay=0.0,
            lr_scheduler_type="constant",
            per_device_train_batch_size=PROMPTS * GROUP,
            gradient_accumulation_steps=1,
            num_generations=GROUP,
            max_completion_length=spec["max_new_tokens"],
            temperature=TEMPERATURE,
            num_iterations=steps,
            beta=0.0,
            gradient_checkpointing=spec["checkpointing"],
            max_steps=spec["iterations"] * steps,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            seed=0,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        trainer._generate_and_score_completions = timed(
            trainer._generate_and_score_completions, "rollout"
        )
        timer = StepTimer()
        trainer.add_callback(timer)
        trainer.train()
    lengths = [
        e["completions/mean_length"]
        for e in trainer.state.log_history
        if "completions/mean_length" in e
    ]
    iterations = []
    for i in range(spec["iterations"]):
        total = sum(timer.steps[i * steps : (i + 1) * steps])
        rollout, generation = seconds["rollout"][i], seconds["generation"][i]
        iterations.append(
            {
                "total": total,
                "generation": generation,
                "rest_of_rollout": rollout - generation,
                "training": total - rollout,
                "mean_length": length_of(lengths, i, steps),
                "tokens_per_s": length_of(lengths, i, steps) * PROMPTS * GROUP / generation,
            }
        )
    return {"iterations": iterations, "peak_memory_gib": peak_memory_gib()}


def chat_prompt_ids(tokenizer) -> list[list[int]]:
    """The benchmark's prompts in the chat template, as token ids (one per prompt)."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": r["question"] + INSTRUCTION}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for r in pick_rows()
    ]


# ------------------------------------------------------- recorded against recomputed log-probs


def behaviour_error(model_dir: str, dtype: str, threads: int, max_new_tokens: int) -> dict:
    """How far the behaviour log-probs and sparse rows recorded while sampling are from a
    teacher-forced forward pass of the same model, on one rollout of the benchmark's prompts.

    Returns the largest and mean absolute difference of the sampled tokens' log-probs (and so
    the largest on-policy ratio error ``exp(max) - 1``), and the largest total-variation distance
    between the two sparse distributions of a token (kept tokens and tail mass).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightning_troll.behaviour import BehaviourRecorder
    from lightning_troll.models import stop_token_ids
    from lightning_troll.rollout import SamplingConfig, behaviour_outputs, sample
    from lightning_troll.sparse import sparsify

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = chat_prompt_ids(tokenizer)

    def fn(logits, tokens):
        return sparsify(logits, max_tokens=64, mass_delta=1e-5, keep=tokens)

    sampling = SamplingConfig(temperature=TEMPERATURE, max_new_tokens=max_new_tokens)
    recorder = BehaviourRecorder(TEMPERATURE, fn)
    pad, stops = tokenizer.pad_token_id, stop_token_ids(tokenizer, model)
    ids, attention, response, _ = sample(
        model, prompts, GROUP, sampling, pad, stops, recorder=recorder
    )
    logp, old = recorder.finish(ids[:, -response.shape[1] :]).outputs(response)
    logp_ref, old_ref = behaviour_outputs(model, ids, attention, response, TEMPERATURE, fn, 256)
    diff = (logp - logp_ref)[response].abs()

    def dense(sparse):  # (N, V + 1): kept tokens' probabilities, then the tail mass
        out = torch.zeros(sparse.num_rows, sparse.vocab_size + 1)
        rows = torch.arange(sparse.num_rows).unsqueeze(-1).expand_as(sparse.indices)
        keep = sparse.mask
        out[rows[keep], sparse.indices[keep]] = sparse.logprobs[keep].float().exp()
        out[:, -1] = sparse.tail_logmass.float().exp()
        return out

    tv = 0.5 * (dense(old) - dense(old_ref)).abs().sum(-1)  # (N,)
    return {
        "dtype": dtype,
        "tokens": int(response.sum()),
        "max_abs_logprob_diff": float(diff.max()),
        "mean_abs_logprob_diff": float(diff.mean()),
        "max_ratio_error": float(diff.max().exp() - 1),
        "max_total_variation": float(tv.max()),
    }


# ------------------------------------------------------------------------------- generation


def generation_speed(model_dir: str, threads: int, max_new_tokens: int, repeats: int) -> list:
    """Response tokens per second of one rollout's generation (the benchmark's 64 sequences) by
    ``generate`` with its dynamic KV cache (what the library uses) and with a static cache, each
    ``repeats`` times interleaved after one warm-up; the median is reported."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from lightning_troll.models import stop_token_ids
    from lightning_troll.rollout import left_pad

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [ids for ids in chat_prompt_ids(tokenizer) for _ in range(GROUP)]
    stops = stop_token_ids(tokenizer, model)
    config = GenerationConfig(
        do_sample=True,
        temperature=TEMPERATURE,
        top_k=None,
        top_p=None,
        max_new_tokens=max_new_tokens,
        eos_token_id=stops,
        pad_token_id=tokenizer.pad_token_id,
    )

    def padded(cache: str | None) -> int:
        ids, mask = left_pad(prompts, tokenizer.pad_token_id)
        config.cache_implementation = cache
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        new = out[:, ids.shape[1] :]
        done = torch.isin(new, torch.tensor(stops)).long().cumsum(-1)
        return int(((done == 0) | ((done == 1) & torch.isin(new, torch.tensor(stops)))).sum())

    ways = {"generate, dynamic cache": lambda: padded(None)}
    ways["generate, static cache"] = lambda: padded("static")
    times: dict[str, list[float]] = {name: [] for name in ways}
    tokens: dict[str, list[int]] = {name: [] for name in ways}
    errors: dict[str, str] = {}
    for attempt in range(repeats + 1):
        for name, run in ways.items():
            if name in errors:
                continue
            torch.manual_seed(attempt)
            start = time.perf_counter()
            try:
                count = run()
            except Exception as error:  # a way this transformers or device does not support
                errors[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
                continue
            if attempt:  # the first round warms up
                times[name].append(time.perf_counter() - start)
                tokens[name].append(count)
    rows = []
    for name in ways:
        if name in errors:
            rows.append({"way": name, "error": errors[name]})
            continue
        speed = statistics.median(t / s for t, s in zip(tokens[name], times[name], strict=True))
        rows.append(
            {
                "way": name,
                "seconds": statistics.median(times[name]),
                "tokens": statistics.median(tokens[name]),
                "tokens_per_s": speed,
            }
        )
    return rows


def length_of(lengths: list[float], iteration: int, steps: int) -> float:
    """TRL's logged mean completion length of an iteration: logged once per iteration, or once
    per optimiser step (the iteration's first is taken); NaN if it was not logged."""
    index = iteration if len(lengths) <= iteration * steps else iteration * steps
    return lengths[index] if index < len(lengths) else float("nan")


# ----------------------------------------------------------------------------- orchestration


def run_config(python: str, spec: dict) -> dict:
    """Runs one configuration in a fresh process; returns its result (or its error)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(spec["threads"]))
    command = [python, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-15:]
        return {"error": "\n".join(tail), "wall_s": time.perf_counter() - start}
    return json.loads(lines[-1][len("RESULT ") :]) | {"wall_s": time.perf_counter() - start}


def summarise(result: dict) -> dict:
    """Medians over the iterations after the first."""
    rows = result["iterations"][1:] or result["iterations"]
    keys = ("total", "generation", "rest_of_rollout", "training", "mean_length", "tokens_per_s")
    return {k: statistics.median(r[k] for r in rows) for k in keys} | {
        "peak_memory_gib": result["peak_memory_gib"],
        "first_iteration_s": result["iterations"][0]["total"],
    }


def trl_python(choice: str | None) -> str | None:
    """The Python that imports trl: ``choice``, else this one if it can; None if none can."""
    candidate = choice or sys.executable
    probe = subprocess.run([candidate, "-c", "import trl"], capture_output=True)
    return candidate if probe.returncode == 0 else None


def figure(value: float, digits: int) -> str:
    """``value`` to ``digits`` decimals; "-" where it was not measured (NaN)."""
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def table(results: list[dict]) -> str:
    lines = [
        "| configuration | steps | s / iteration | generation | rest of rollout | training | "
        "mean length | tokens/s | peak memory GiB | vs TRL fastest |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for steps in sorted({r["spec"]["steps"] for r in results}):
        group = [r for r in results if r["spec"]["steps"] == steps and "summary" in r]
        trl = [r["summary"]["total"] for r in group if r["spec"]["library"] == "trl"]
        for r in group:
            s = r["summary"]
            ratio = f"{s['total'] / min(trl):.2f}x" if trl else "-"
            lines.append(
                f"| {r['name']} | {steps} | {s['total']:.1f} | {s['generation']:.1f} | "
                f"{s['rest_of_rollout']:.1f} | {s['training']:.1f} | {figure(s['mean_length'], 1)} | "
                f"{figure(s['tokens_per_s'], 0)} | {s['peak_memory_gib']:.2f} | {ratio} |"
            )
    for r in results:
        if "error" in r:
            lines.append(f"\n{r['name']} (steps {r['spec']['steps']}) failed:\n{r['error']}")
    return "\n".join(lines)


VARIANTS = {
    "default": {"behaviour": "sampling", "share_prompts": True},
    "recorded": {"behaviour": "sampling", "share_prompts": False},
    "baseline": {"behaviour": "forward", "share_prompts": False},
}
"""Ours: the defaults; without shared prompts; and without either (the library before both)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=SMOLLM2, help="a model folder")
    parser.add_argument("--tiny", action="store_true", help="TinyMath, no TRL (a smoke run)")
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 4], help="steps/iteration")
    parser.add_argument("--objectives", nargs="+", default=["clip", "troll"])
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=list(VARIANTS),
        help="ours: default (log-probs recorded while sampling, shared prompts), recorded (no "
        "shared prompts), baseline (a forward pass for the log-probs, no shared prompts)",
    )
    parser.add_argument("--iterations", type=int, default=6, help="the first is left out")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--trl-python", default=None, help="a Python that imports trl")
    parser.add_argument("--no-trl", action="store_true")
    parser.add_argument(
        "--trl-checkpointing", nargs="+", choices=["off", "on"], default=["off", "on"]
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="results file; configurations it holds are kept"
    )
    parser.add_argument(
        "--behaviour-error",
        action="store_true",
        help="only measure recorded against recomputed behaviour log-probs (float32, bfloat16)",
    )
    parser.add_argument(
        "--generation",
        action="store_true",
        help="only time generation: dynamic and static KV cache",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.iterations < 2:
        parser.error(f"--iterations must be >= 2 (the first is left out); got {args.iterations}")
    if any(s < 1 for s in args.steps):
        parser.error(f"--steps must be >= 1; got {args.steps}")
    if args.worker is None and not args.tiny and not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no model folder there; run `make smollm2` first")
    return args


def configurations(args: argparse.Namespace) -> list[tuple[str, str, dict]]:
    """(name, python, spec) of every configuration to time, in order."""
    common = {
        "model": str(args.model),
        "tiny": args.tiny,
        "iterations": args.iterations,
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
    }
    python = None if args.no_trl or args.tiny else trl_python(args.trl_python)
    if not (args.no_trl or args.tiny) and python is None:
        print("TRL is not importable here: pass --trl-python (see the docstring); skipped")
    configs = []
    for steps in args.steps:
        for gc in args.trl_checkpointing if python else []:
            spec = common | {"library": "trl", "steps": steps, "checkpointing": gc == "on"}
            configs.append((f"TRL GRPOTrainer, clip, checkpointing {gc}", python, spec))
        for objective in args.objectives:
            for variant in args.variants:
                spec = common | {"library": "ours", "steps": steps, "objective": objective}
                spec |= {"variant": variant} | VARIANTS[variant]
                configs.append((f"ours, {objective}, {variant}", sys.executable, spec))
    return configs


def print_behaviour_error(args: argparse.Namespace) -> None:
    errors = [
        behaviour_error(str(args.model), dtype, args.threads, args.max_new_tokens)
        for dtype in ("float32", "bfloat16")
    ]
    print("| weights | response tokens | max abs log-prob diff | mean | max ratio error | max TV |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for e in errors:
        print(
            f"| {e['dtype']} | {e['tokens']} | {e['max_abs_logprob_diff']:.2e} | "
            f"{e['mean_abs_logprob_diff']:.2e} | {e['max_ratio_error']:.2e} | "
            f"{e['max_total_variation']:.2e} |"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(errors, indent=1))


def run_all(configs: list[tuple[str, str, dict]], path: Path | None) -> list[dict]:
    """Times every configuration in turn, writing ``path`` after each; configurations ``path``
    already holds (a run stopped part-way) are kept, not timed again."""
    done = []
    if path and path.is_file():
        done = [r for r in json.loads(path.read_text()) if "summary" in r]
    results = []
    for i, (name, python, spec) in enumerate(configs, 1):
        print(f"[{i}/{len(configs)}] {name}, {spec['steps']} step(s) per iteration ...", flush=True)
        kept = [r for r in done if r["spec"] == spec]
        if kept:
            print("    measured before (in --json): kept", flush=True)
            results.append(kept[0])
            continue
        result = run_config(python, spec) | {"name": name, "spec": spec}
        if "error" not in result:
            result["summary"] = s = summarise(result)
            print(
                f"    {s['total']:.1f} s / iteration (generation {s['generation']:.1f}, rest of "
                f"rollout {s['rest_of_rollout']:.1f}, training {s['training']:.1f}), peak "
                f"{s['peak_memory_gib']:.2f} GiB; {result['wall_s']:.0f} s in all",
                flush=True,
            )
        else:
            print(f"    failed: {result['error'].splitlines()[-1]}", flush=True)
        results.append(result)
        if path:  # every configuration measured so far, this run's and earlier ones
            others = [r for r in done if all(r["spec"] != x["spec"] for x in results)]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(others + results, indent=1))
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        spec = json.loads(args.worker)
        result = run_trl(spec) if spec["library"] == "trl" else run_ours(spec)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if args.behaviour_error:
        print_behaviour_error(args)
        return 0
    if args.generation:
        rows = generation_speed(str(args.model), args.threads, args.max_new_tokens, 3)
        print("| generation | s / rollout | response tokens | tokens/s |")
        print("| --- | ---: | ---: | ---: |")
        for r in rows:
            if "error" in r:
                print(f"| {r['way']} | failed: {r['error']} | | |")
            else:
                print(
                    f"| {r['way']} | {r['seconds']:.1f} | {r['tokens']:.0f} | "
                    f"{r['tokens_per_s']:.0f} |"
                )
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(rows, indent=1))
        return 0
    results = run_all(configurations(args), args.json)
    print()
    print(table(json.loads(args.json.read_text()) if args.json else results))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
