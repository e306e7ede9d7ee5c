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
``model.engine.behaviour_logprobs`` as given (``--behaviour``; both by default) and a shared snapshot;
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
    python examples/benchmark_iteration.py --engines hf vllm --vllm-python .venv-vllm/bin/python

``--engines`` adds the rollout engine to the grid: ``hf`` (the snapshot samples, the default) and
``vllm`` (vLLM in the worker's own process, so its memory is in the peak; it needs a Python that
imports vllm, ``make setup-vllm``, given by ``--vllm-python`` unless this one does). The vLLM
engine's rows have the variant ``vllm``: it never records the behaviour log-probs while sampling,
so the snapshot recomputes them after it (in ``rest of rollout``), with shared prompts.

``--generation`` times one rollout's generation alone, two ways (``generate`` with its dynamic
KV cache, as the library samples, and with a static cache), in response tokens per second. ``--behaviour-error`` samples one rollout of the benchmark's prompts with the behaviour log-probs
and TROLL's sparse rows recorded, recomputes them with a teacher-forced pass of the same weights
(float32, then bfloat16), and prints how far apart they are.

This file runs the configurations and reports them; what each configuration runs is in
``iteration_workers.py``, the two side measurements in ``iteration_checks.py``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from iteration_checks import behaviour_error, generation_speed  # noqa: E402
from iteration_workers import SMOLLM2, run_ours, run_trl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


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


def importing(choice: str | None, package: str) -> str | None:
    """The Python that imports ``package``: ``choice``, else this one if it can; None if none
    can."""
    candidate = choice or sys.executable
    probe = subprocess.run([candidate, "-c", f"import {package}"], capture_output=True)
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
    return "\n".join(lines + memory_table(results))


def memory_table(results: list[dict]) -> list[str]:
    """Ours: resident memory by phase of the first and the last iteration, GiB: the level as it
    started, then each phase's peak. The allocator keeps what the first iteration freed, so
    later iterations start high; the process's peak is mostly set in the first."""
    rows = [r for r in results if "memory_mib" in (r.get("iterations") or [{}])[-1]]
    if not rows:
        return []
    phases = list(rows[0]["iterations"][-1]["memory_mib"])
    lines = ["", "Ours, resident memory by phase (GiB; the start, then the peak of each phase):"]
    lines += ["| configuration | steps | iteration | " + " | ".join(phases) + " |"]
    lines += ["| --- | ---: | --- |" + " ---: |" * len(phases)]
    for r in rows:
        for which, index in (("first", 0), ("last", -1)):
            memory = r["iterations"][index].get("memory_mib", {})
            cells = " | ".join(figure(memory.get(p, math.nan) / 1024, 2) for p in phases)
            lines.append(f"| {r['name']} | {r['spec']['steps']} | {which} | {cells} |")
    return lines


VARIANTS = {
    "default": {"behaviour": "sampling", "share_prompts": True},
    "recorded": {"behaviour": "sampling", "share_prompts": False},
    "baseline": {"behaviour": "forward", "share_prompts": False},
    "checkpointing": {"behaviour": "sampling", "share_prompts": True, "checkpointing": True},
}
"""Ours: the defaults; without shared prompts; without either (the library before both); the
defaults with gradient checkpointing (``model.optimization.gradient_checkpointing``, TRL's default)."""
RELEASE = {"auto": None, "on": True, "off": False}
"""``--release-memory``: ``ReleaseFreedMemory(enabled=...)`` (None: where checkpointing is on)."""
RELEASE_NAMES = {"auto": "", "on": ", memory released", "off": ", memory kept"}


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
        "shared prompts), baseline (a forward pass for the log-probs, no shared prompts), "
        "checkpointing (default with gradient checkpointing)",
    )
    parser.add_argument("--iterations", type=int, default=6, help="the first is left out")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--engines", nargs="+", choices=["hf", "vllm"], default=["hf"], help="ours: rollout engines"
    )
    parser.add_argument(
        "--vllm-python", default=None, help="a Python that imports vllm (make setup-vllm)"
    )
    parser.add_argument("--trl-python", default=None, help="a Python that imports trl")
    parser.add_argument("--no-trl", action="store_true")
    parser.add_argument(
        "--trl-checkpointing", nargs="+", choices=["off", "on"], default=["off", "on"]
    )
    parser.add_argument(
        "--release-memory",
        nargs="+",
        choices=list(RELEASE),
        default=["auto"],
        help="ours: ReleaseFreedMemory as the lightning-troll command has it (auto: where "
        "gradient checkpointing is on), on in every configuration, or off",
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
    python = None if args.no_trl or args.tiny else importing(args.trl_python, "trl")
    if not (args.no_trl or args.tiny) and python is None:
        print("TRL is not importable here: pass --trl-python (see the docstring); skipped")
    vllm = None
    if "vllm" in args.engines:
        vllm = importing(args.vllm_python, "vllm")
        if vllm is None:
            print("vLLM is not importable here: pass --vllm-python (make setup-vllm); skipped")
    configs = []
    for steps in args.steps:
        for gc in args.trl_checkpointing if python else []:
            spec = common | {"library": "trl", "steps": steps, "checkpointing": gc == "on"}
            configs.append((f"TRL GRPOTrainer, clip, checkpointing {gc}", python, spec))
        for objective in args.objectives:
            for engine in args.engines:
                # the vllm engine never records log-probs while sampling: one variant, its own
                variants = args.variants if engine == "hf" else ["vllm"]
                for variant, release in itertools.product(variants, args.release_memory):
                    spec = common | {"library": "ours", "steps": steps, "objective": objective}
                    spec |= {"variant": variant, "engine": engine, "release": RELEASE[release]}
                    spec |= VARIANTS.get(variant, {"behaviour": "forward", "share_prompts": True})
                    where = sys.executable if engine == "hf" else vllm
                    name = f"ours, {objective}, {variant}{RELEASE_NAMES[release]}"
                    if where is not None:
                        configs.append((name, where, spec))
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
