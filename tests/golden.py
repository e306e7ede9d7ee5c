"""The golden runs: fixed-seed fits of a few rollouts on the shipped TinyMath policy, one per
objective, through the ``lightning-troll`` command, whose final weights and logged scalars must not
change when the library is reorganised (``tests/test_golden.py``).

    python -m tests.golden --record     # writes tests/fixtures/golden_runs.json

Record only when a change is meant to change the numbers, and say so in the commit. The runs use
one CPU thread, so that a reduction's order does not depend on the machine's core count. On the
machine kind they were recorded on (:func:`machine`: torch version, CPU kernels
``torch.backends.cpu.get_cpu_capability()`` and the processor) they are compared bit for bit; on
any other, within :data:`LOOSE`: over three rollouts, AVX2 kernels against AVX512 ones moved
continuous figures by up to 4e-5 relative, figures that are rounding noise around 0 (KL quantiles,
the largest violation) by up to 5e-7, and the mean support size, a count of tokens over a
probability threshold, by 1.2e-3 relative. The processor is part of the kind: with the same torch
and the same AVX512 kernels, an AMD EPYC gave final weights that differ from another processor's
in the last bits (their sum by 5e-8 relative), all within :data:`LOOSE`.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import platform
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "golden_runs.json"

RUNS: dict[str, list[str]] = {
    "troll": ["--model.objective", "troll"],
    "clip": ["--model.objective", "clip"],
}
"""Each golden run's options on top of :data:`BASE`."""

BASE = [
    "--trainer.max_steps", "6",  # 3 rollouts of 2 optimiser steps: the second is off-policy
    "--trainer.val_check_interval", "3",
    "--trainer.enable_progress_bar", "false",
    "--data.batch_size", "16",
    "--data.num_train", "64",
    "--data.num_val", "16",
    "--data.val_batch_size", "16",
    "--model.optimization.minibatch_size", "64",
    "--model.reward_options.workers", "0",
    "--model.optimizer.init_args.lr", "3e-3",  # steps large enough that both constraints act
    "--model.trust_region.eps", "0.002",
]  # fmt: skip

UNTIMED = ("time/", "memory/", "throughput/")
"""Logged figures that measure the machine, not the run."""

LOOSE = {"rel": 2e-4, "abs": 1e-6, "counts": ("sparsity/support_",), "counts_rel": 1e-2}
"""The comparison on a machine of another kind than the recording one: relative and absolute
tolerances, and the figures that count tokens (a rounding flips one in or out), with theirs."""


def fit(name: str, folder: Path) -> dict[str, Any]:
    """Runs golden run ``name`` in ``folder``: its weights' digest and norms, and its scalars."""
    from lightning_troll.cli.command import run

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        args = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml"), *BASE, *RUNS[name]]
        args += ["--trainer.default_root_dir", str(folder / name)]
        args += ["--trainer.logger", "lightning.pytorch.loggers.CSVLogger"]
        args += ["--trainer.logger.save_dir", str(folder / name)]
        cli = run(args)
    finally:
        torch.set_num_threads(threads)
    state = cli.model.policy.state_dict()
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(state[key].detach().cpu().contiguous().numpy().tobytes())
    weights = torch.cat([state[k].detach().double().flatten() for k in sorted(state)])
    return {
        "weights_sha256": digest.hexdigest(),
        "weights_sum": weights.sum().item(),
        "weights_norm": weights.norm().item(),
        "scalars": scalars(Path(cli.trainer.logger.log_dir) / "metrics.csv"),
    }


def scalars(path: Path) -> dict[str, list[float]]:
    """Every logged column but the untimed ones, in step order, empty cells left out."""
    with path.open() as handle:
        rows = list(csv.DictReader(handle))
    columns: dict[str, list[float]] = {}
    for row in rows:
        for key, value in row.items():
            if value not in ("", None) and not key.startswith(UNTIMED):
                columns.setdefault(key, []).append(float(value))
    return dict(sorted(columns.items()))


def machine() -> dict[str, str]:
    """The machine kind whose runs agree bit for bit: torch, its CPU kernels and the processor."""
    return {
        "torch": torch.__version__,
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "processor": processor(),
    }


def processor() -> str:
    """The processor's vendor and model (Linux's ``/proc/cpuinfo``), else what ``platform``
    says."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    fields = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    known = [fields[k] for k in ("vendor_id", "cpu family", "model", "model name") if k in fields]
    return " / ".join(known) or platform.processor() or platform.machine()


def differences(expected: dict[str, Any], got: dict[str, Any], exact: bool) -> list[str]:
    """What differs between two records of one run (empty when nothing does)."""
    found = []
    if exact and expected["weights_sha256"] != got["weights_sha256"]:
        found.append("the final weights differ (sha256)")
    for key in ("weights_sum", "weights_norm"):
        if not math.isclose(expected[key], got[key], rel_tol=0 if exact else LOOSE["rel"]):
            found.append(f"{key}: {expected[key]!r} -> {got[key]!r}")
    want, have = expected["scalars"], got["scalars"]
    if set(want) != set(have):
        found.append(f"logged figures: missing {sorted(set(want) - set(have))}, "
                     f"new {sorted(set(have) - set(want))}")  # fmt: skip
    for key in sorted(set(want) & set(have)):
        a, b = want[key], have[key]
        rel = LOOSE["counts_rel"] if key.startswith(LOOSE["counts"]) else LOOSE["rel"]
        same = len(a) == len(b) and all(
            (x == y or (math.isnan(x) and math.isnan(y))) if exact
            else math.isclose(x, y, rel_tol=rel, abs_tol=LOOSE["abs"]) or (math.isnan(x) and math.isnan(y))
            for x, y in zip(a, b, strict=False)
        )  # fmt: skip
        if not same:
            found.append(f"{key}: {a} -> {b}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help=f"write {FIXTURE.name}")
    parser.add_argument("--folder", type=Path, default=Path("runs/golden"))
    args = parser.parse_args()
    records = {name: fit(name, args.folder) for name in RUNS}
    if args.record:
        FIXTURE.write_text(json.dumps({"machine": machine(), "runs": records}, indent=1) + "\n")
        print(f"wrote {FIXTURE}")
        return
    stored = json.loads(FIXTURE.read_text())
    exact = stored["machine"] == machine()
    for name, record in records.items():
        found = differences(stored["runs"][name], record, exact)
        print(f"{name}: {'the same' if not found else '; '.join(found)}")


if __name__ == "__main__":
    main()
