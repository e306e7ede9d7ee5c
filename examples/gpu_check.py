"""One command proves the GPU path: ``make gpu-check`` (``python examples/gpu_check.py``).

On a machine with a CUDA GPU it runs eight phases, each in a process of its own under its own time
limit, so that a phase that fails or runs out of time is recorded and the next one still runs:

1. ``cuda-tests``: the CUDA-only tests (``pytest -m cuda``, ``tests/test_cuda.py``,
   ``tests/test_graph_decode.py``, ``tests/test_graph_checks.py`` and
   ``tests/test_step_attention.py``): QLoRA on a 4-bit base, the paged 8-bit AdamW, a bf16-true
   training step, chunked == full log-probs, the projection against the float64 reference, CUDA
   graphs decoding as the dynamic loop does (reading stop flags every step or every 4),
   sampling with cuDNN's attention last;
2. ``fsdp2-nccl``: FSDP2 (``ModelParallelStrategy``) over NCCL on every visible GPU, against the
   same run in one CPU process;
3. ``loop-paths``: ``configs/tinymath.yaml`` for 20 rollouts on the GPU along each path of the
   loop that the demo does not take: the engine in a process of its own at
   ``old_policy.max_staleness: 1``, the proximal anchor at ``max_staleness: 2``, and two-turn
   episodes; each checked for what it promises (every rollout after the first sampled ahead, the
   staleness reached, the proximal weight logged, one or two turns an episode);
4. ``overhead``: TROLL against clip, one whole training step (forward, objective, backward,
   gradient clipping, AdamW) at Qwen3-0.6B, 1.7B and 4B shapes (random initialisation, bf16,
   V = 151,936, 4 sequences of 1,024 tokens, fewer where they do not fit): the ratio of the median
   step times and of ``torch.cuda.max_memory_allocated``, beside the paper's x1.091 and x1.046,
   and TROLL's step with its root finder compiled (``trust_region.compile_solver``);
5. ``generation``: the dynamic decoding loop against the CUDA-graph path at the same shapes,
   64 completions of 256 and of 1,024 tokens: tokens per second, wall and device time per
   decoding step, and the rollout's share of one GRPO iteration (``examples/gpu_generation.py``);
6. ``compiled-decoding``: at the 0.6B shape, the whole decoding step captured with the model's
   forward compiled (``sampling.compile_step``) and without: the warm-up's seconds, tokens per
   second and the device's time per step;
7. ``tinymath-demo``: ``configs/tinymath.yaml`` for 100 rollouts on the GPU: wall time, reward,
   held-out accuracy;
8. ``grpo-smollm2``: one GRPO iteration at SmolLM2-135M's shape (random initialisation) through
   ``TrollModule`` and a Lightning ``Trainer`` in bf16-true: wall time and reward.

It writes a JSON report (``--json``: the device, the versions, and a ``phases`` list with each
phase's name, status ``ok``/``skipped``/``failed``, seconds and figures) and a Markdown one
(``--markdown``, by default beside the JSON), and exits with 1 if a phase failed. The whole check
ends within ``--budget`` seconds (540, 9 minutes, by default): no phase starts later, and a phase
still running then is stopped as if at its own time limit, the reason naming the budget.

``--tiny`` runs every phase at tiny shapes: on a CPU in about 2 minutes, where the two CUDA-only
phases are recorded as skipped; ``tests/test_gpu_check.py`` runs it, so the script cannot rot.

    python examples/gpu_check.py                         # on a machine with a CUDA GPU
    python examples/gpu_check.py --tiny --json /tmp/gpu_check.json
    python examples/gpu_check.py --phases overhead,generation
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
STATUSES = ("ok", "skipped", "failed")
PACKAGES = (
    "lightning", "transformers", "tokenizers", "torchmetrics", "peft", "bitsandbytes",
    "jsonargparse", "datasets", "tensorboard", "lightning-troll",
)  # fmt: skip


@dataclass(frozen=True)
class Phase:
    """One phase: its name, what it does, and its time limits at full and at tiny shapes."""

    name: str
    title: str
    limit_s: float
    tiny_limit_s: float
    cuda_only: bool = False
    """Needs CUDA at tiny shapes too (the CUDA-only tests)."""


PHASES = (
    Phase("cuda-tests", "CUDA-only tests (pytest -m cuda)", 150, 120, cuda_only=True),
    Phase("fsdp2-nccl", "FSDP2 over NCCL against one CPU process", 150, 120, cuda_only=True),
    Phase("loop-paths", "the engine apart, stale data, episodes: TinyMath fits", 150, 240),
    Phase("overhead", "TROLL vs clip, one training step, Qwen3 shapes", 240, 120),
    Phase("generation", "dynamic decoding against CUDA graphs, Qwen3 shapes", 480, 120),
    Phase("compiled-decoding", "the captured step, its forward compiled or not", 300, 120),
    Phase("tinymath-demo", "the TinyMath demo, shortened", 120, 120),
    Phase("grpo-smollm2", "one GRPO iteration at SmolLM2-135M's shape", 120, 120),
)
NAMES = [p.name for p in PHASES]


# -- running phases -------------------------------------------------------------------------
def run_phase(
    name: str, command: list[str], limit_s: float, result: Path, log: Path, env=None,
    limit_name: str | None = None,
) -> dict:  # fmt: skip
    """Runs ``command`` (a phase's process, which writes its record to ``result``) under a time
    limit; returns the phase's entry of the report. A phase that exits with an error or outlives
    ``limit_s`` (its whole process group is then killed) is ``failed``, with the figures it had
    recorded and the reason, which names the limit: ``limit_name``, or the phase's own."""
    entry: dict[str, Any] = {"name": name, "status": "failed", "seconds": 0.0, "limit_s": limit_s}
    start = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with log.open("w") as output:
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip
        try:
            code = process.wait(timeout=limit_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            code, timed_out = None, True
        _kill_group(process)  # at the limit, and whatever a finished phase left running
    entry["seconds"] = round(time.monotonic() - start, 2)
    record = _read(result)
    entry["figures"] = record.get("figures", {})
    if timed_out:
        named = limit_name or "the phase's limit"
        entry["reason"] = f"timed out after {limit_s:.0f} s, {named}"
    elif code != 0:
        entry["reason"] = record.get("error") or f"exited with {code}: {_tail(log)}"
    elif record.get("status") in ("ok", "skipped"):
        entry["status"] = record["status"]
        if record.get("reason"):
            entry["reason"] = record["reason"]
    else:
        entry["reason"] = f"exited without recording how it ended: {_tail(log)}"
    if entry["status"] == "failed" and code != 0 and not timed_out:
        entry["log_tail"] = _tail(log, 2000)
    return entry


def _kill_group(process: subprocess.Popen) -> None:
    """Ends the phase's process and every process it started (its own process group)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:
            time.sleep(0.5)  # then SIGKILL whatever of the group ignored SIGTERM


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _tail(log: Path, chars: int = 600) -> str:
    try:
        text = log.read_text(errors="replace").strip()
    except OSError:
        return ""
    return text[-chars:]


def skipped(phase: Phase, reason: str) -> dict:
    return {"name": phase.name, "status": "skipped", "seconds": 0.0, "figures": {},
            "reason": reason}  # fmt: skip


def check(args: argparse.Namespace, cuda: bool, logs: Path) -> list[dict]:
    """Every selected phase in turn, each in its own process; returns their report entries."""
    entries, deadline = [], time.monotonic() + args.budget
    budget = f"the check's budget of {args.budget:.0f} s (--budget)"
    selected = [p for p in PHASES if p.name in args.phases]
    for i, phase in enumerate(selected, 1):
        left = deadline - time.monotonic()
        if phase.cuda_only and not cuda:
            entry = skipped(phase, "needs a CUDA device; torch.cuda.is_available() is False")
        elif not (cuda or args.tiny):
            entry = skipped(phase, "full shapes need a CUDA device; --tiny runs it on a CPU")
        elif left < 5:
            entry = skipped(phase, f"{budget} ran out")
        else:
            own_limit = phase.tiny_limit_s if args.tiny else phase.limit_s
            limit = min(own_limit, left)
            # The budget bounds the whole check: a phase that starts near its end is stopped there.
            limit_name = None if limit == own_limit else f"the end of {budget}"
            command = [sys.executable, str(SCRIPT), "--worker", phase.name,
                       "--result", str(logs / f"{phase.name}.json")]  # fmt: skip
            command += ["--tiny"] if args.tiny else []
            command += ["--fail-phase", args.fail_phase] if args.fail_phase else []
            # Tiny shapes gain nothing from several threads; on a busy CPU, threads that wait
            # for one another turn milliseconds into seconds.
            env = {"OMP_NUM_THREADS": "1"} if args.tiny and not cuda else None
            entry = run_phase(phase.name, command, limit, logs / f"{phase.name}.json",
                              logs / f"{phase.name}.log", env, limit_name)  # fmt: skip
        entry["title"] = phase.title
        entries.append(entry)
        summary = entry["figures"].get("summary") or entry.get("reason", "")
        print(f"[{i}/{len(selected)}] {phase.name}: {entry['status']} ({entry['seconds']:.1f} s) "
              f"{summary}", flush=True)  # fmt: skip
    return entries


# -- the report -----------------------------------------------------------------------------
def device_info() -> dict[str, Any]:
    import torch

    host = {"cpu": platform.processor() or platform.machine(), "cpu_cores": os.cpu_count()}
    if not torch.cuda.is_available():
        return {"kind": "cpu", "name": host["cpu"], "count": 0, **host}
    props = torch.cuda.get_device_properties(0)
    return {
        "kind": "cuda",
        "name": props.name,
        "count": torch.cuda.device_count(),
        "memory_gib": round(props.total_memory / 2**30, 1),
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        **host,
    }


def versions() -> dict[str, str | None]:
    import torch

    found: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    found["cuda"] = torch.version.cuda  # None for a CPU build
    if torch.cuda.is_available():
        found["cudnn"] = str(torch.backends.cudnn.version())
        found["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def markdown(report: dict) -> str:
    """The report as Markdown: device, versions, one line per phase, then each phase's figures."""
    device, counts = report["device"], report["summary"]
    lines = ["# GPU check", ""]
    name = device["name"] if device["kind"] == "cpu" else (
        f"{device['count']} x {device['name']} ({device['memory_gib']} GiB, compute "
        f"capability {device['capability']})"
    )  # fmt: skip
    lines.append(f"- device: {device['kind']}, {name}; host {device['cpu_cores']} CPU cores")
    found = ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v is not None)
    missing = [k for k in PACKAGES if k in report["versions"] and report["versions"][k] is None]
    lines.append(
        f"- versions: {found}" + (f"; not installed: {', '.join(missing)}" if missing else "")
    )
    lines.append(f"- shapes: {'tiny (--tiny)' if report['tiny'] else 'full'}; commit "
                 f"{report['commit'] or 'unknown'}; started {report['started']}")  # fmt: skip
    lines.append(f"- {report['seconds']:.1f} s in all: " +
                 ", ".join(f"{counts[s]} {s}" for s in STATUSES))  # fmt: skip
    lines += ["", "| phase | status | seconds | summary |", "| --- | --- | --- | --- |"]
    for phase in report["phases"]:
        summary = phase["figures"].get("summary") or phase.get("reason", "")
        lines.append(f"| {phase['name']} | {phase['status']} | {phase['seconds']:.1f} | "
                     f"{_cell(summary)} |")  # fmt: skip
    for phase in report["phases"]:
        lines += ["", f"## {phase['name']}: {phase['title']}", ""]
        if phase.get("reason"):
            lines += [f"{phase['status']}: {_cell(phase['reason'])}", ""]
        figures = {k: v for k, v in phase["figures"].items() if k != "summary"}
        tables = {k: v for k, v in figures.items() if _is_table(v)}  # rows, and any like them
        lines += [f"- {k}: {_cell(v)}" for k, v in figures.items() if k not in tables]
        for name, rows in sorted(tables.items(), key=lambda item: item[0] != "rows"):
            columns = list(dict.fromkeys(k for row in rows for k in row))
            lines += [""] + ([] if name == "rows" else [f"{name}:", ""])
            lines += ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
            lines += [
                "| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows
            ]
    return "\n".join(lines) + "\n"


def _is_table(value: Any) -> bool:
    """A non-empty list of dicts: a figure the Markdown report shows as a table."""
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _cell(value: Any) -> str:
    if isinstance(value, dict):
        value = "; ".join(f"{k}: {v}" for k, v in value.items())
    return str(value).replace("|", "\\|").replace("\n", " ")


# -- the command line -----------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU, in minutes)")
    parser.add_argument("--json", type=Path, help="the JSON report (default: "
                        "examples/results/gpu/gpu_check.json; with --tiny, runs/gpu_check_tiny.json)")  # fmt: skip
    parser.add_argument(
        "--markdown", type=Path, help="the Markdown report (default: beside --json)"
    )
    parser.add_argument("--phases", default=",".join(NAMES),
                        help=f"comma-separated phases to run, of {', '.join(NAMES)} (default: all)")  # fmt: skip
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds the whole check may take: no phase starts later and a running "
                             "one is stopped then (default: 540; --tiny: 900)")  # fmt: skip
    parser.add_argument(
        "--logs", type=Path, help="folder for each phase's log (default: a temporary one)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # runs one phase in this process
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--fail-phase", help=argparse.SUPPRESS)  # a test hook: that phase raises
    args = parser.parse_args(argv)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = [p for p in phases if p not in NAMES]
    if unknown or not phases:
        parser.error(f"--phases must name phases among {NAMES}; got {args.phases!r}")
    args.phases = phases
    for option, value in (("--fail-phase", args.fail_phase), ("--worker", args.worker)):
        if value is not None and value not in NAMES:
            parser.error(f"{option} must be one of {NAMES}; got {value!r}")
    if args.budget is None:
        args.budget = 900.0 if args.tiny else 540.0
    if not (math.isfinite(args.budget) and args.budget > 0):
        parser.error(f"--budget must be a number of seconds > 0; got {args.budget}")
    if args.json is None:
        tiny = ROOT / "runs" / "gpu_check_tiny.json"
        args.json = tiny if args.tiny else ROOT / "examples" / "results" / "gpu" / "gpu_check.json"
    if args.markdown is None:
        args.markdown = args.json.with_suffix(".md")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:  # one phase, in the process the runner started for it
        from gpu_phases import work

        return work(args.worker, args.result, args.tiny, args.fail_phase == args.worker)
    import torch

    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    cuda = torch.cuda.is_available()
    logs = args.logs or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"gpu-check: {'tiny' if args.tiny else 'full'} shapes on "
          f"{'CUDA' if cuda else 'a CPU'}; logs in {logs}", flush=True)  # fmt: skip
    start = time.monotonic()
    entries = check(args, cuda, logs)
    report = {
        "check": "lightning_troll gpu-check",
        "tiny": args.tiny,
        "started": started,
        "seconds": round(time.monotonic() - start, 1),
        "commit": git_commit(),
        "device": device_info(),
        "versions": versions(),
        "summary": {s: sum(e["status"] == s for e in entries) for s in STATUSES},
        "phases": entries,
    }
    for path, text in (
        (args.json, json.dumps(report, indent=2) + "\n"),
        (args.markdown, markdown(report)),
    ):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    print(f"gpu-check: {report['seconds']:.1f} s; "
          + ", ".join(f"{n} {s}" for s, n in report["summary"].items())
          + f"; reports {args.json} and {args.markdown}")  # fmt: skip
    return 1 if report["summary"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
