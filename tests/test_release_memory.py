"""ReleaseFreedMemory: freed heap pages go back to the system, in a fit and from the command."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from lightning_troll.callbacks import ReleaseFreedMemory, RolloutGeneration
from lightning_troll.callbacks import memory as memory_module
from lightning_troll.callbacks.memory import release_freed_memory, resident_bytes
from lightning_troll.training.module import OptimizationConfig
from tests.test_cli import ROOT, one_step, run
from tests.test_training import fit, make_module

GLIBC = memory_module._TRIM is not None
needs_glibc = pytest.mark.skipif(not GLIBC, reason="the C library has no malloc_trim")

# In a fresh process: free one 24 MiB mapped block, so that glibc raises its mapping threshold
# above it; then 160 blocks of 1 MiB come from the heap. All but the last are freed (the last
# keeps the heap's top in use, so glibc's own trimming of the top cannot give the rest back).
HEAP = textwrap.dedent(
    """
    import json, sys
    import torch
    from lightning_troll.callbacks.memory import release_freed_memory, resident_bytes
    big = torch.ones(6 * 2**20)  # 24 MiB: mapped, then unmapped, and the threshold follows it
    del big
    start = resident_bytes()
    blocks = [torch.ones(2**18) for _ in range(160)]  # 1 MiB each, from the heap
    last = blocks.pop()
    del blocks
    before = resident_bytes()
    released = release_freed_memory() if sys.argv[1] == "release" else False
    after = resident_bytes()
    print(json.dumps({"start": start, "before": before, "after": after, "released": released, "last": float(last[0])}))
    """
)


def heap_after(action: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", HEAP, action], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_glibc
def test_release_gives_the_freed_heap_back_and_keeps_live_tensors():
    kept, released = heap_after("keep"), heap_after("release")
    mib = 2**20
    assert kept["after"] - kept["start"] > 120 * mib  # the freed ~159 MiB stay resident
    assert released["released"] is True
    assert released["before"] - released["start"] > 120 * mib
    assert released["after"] - released["start"] < 40 * mib  # given back
    assert released["last"] == 1.0  # the block still in use is untouched


def test_resident_bytes_reads_this_process():
    value = resident_bytes()
    if Path("/proc/self/statm").exists():
        assert value is not None and 10 * 2**20 < value < 64 * 2**30
    else:
        assert value is None


def test_without_malloc_trim_the_release_does_nothing(monkeypatch):
    monkeypatch.setattr(memory_module, "_TRIM", None)
    assert release_freed_memory() is False
    assert ReleaseFreedMemory().active is False


@needs_glibc
@pytest.mark.slow
def test_a_fit_logs_the_resident_memory_and_what_was_released(tmp_path, tiny_model_dir):
    trainer, _, _ = fit(
        tmp_path, tiny_model_dir, max_steps=2, extra=(ReleaseFreedMemory(enabled=True),)
    )
    metrics = trainer.callback_metrics
    resident = float(metrics["memory/resident_gib"])
    assert resident * 2**30 == pytest.approx(resident_bytes(), rel=0.5)
    assert float(metrics["memory/released_gib"]) >= 0.0


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [True, False])
def test_by_default_it_follows_gradient_checkpointing(checkpointing, tmp_path, tiny_model_dir):
    module = make_module(
        tiny_model_dir, optimization=OptimizationConfig(gradient_checkpointing=checkpointing)
    )
    release = ReleaseFreedMemory()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _, _ = fit(tmp_path, tiny_model_dir, max_steps=1, module=module, extra=(release,))
    # the flag is read by its current name: transformers' deprecated one warns in every run
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
    assert release.active is (checkpointing and GLIBC)
    assert ("memory/resident_gib" in trainer.callback_metrics) is (checkpointing and GLIBC)


@pytest.mark.slow
def test_switched_off_it_logs_nothing(tmp_path, tiny_model_dir):
    module = make_module(
        tiny_model_dir, optimization=OptimizationConfig(gradient_checkpointing=True)
    )
    trainer, _, _ = fit(
        tmp_path, tiny_model_dir, max_steps=1, module=module,
        extra=(ReleaseFreedMemory(enabled=False),),
    )  # fmt: skip
    assert "memory/resident_gib" not in trainer.callback_metrics
    assert "memory/released_gib" not in trainer.callback_metrics


@pytest.mark.slow
@pytest.mark.parametrize("enabled", [None, "true", "false"])
def test_the_command_releases_after_the_rollout_as_asked(
    enabled, tmp_path, monkeypatch, tiny_model_dir
):
    args = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml"), *one_step(tiny_model_dir)]
    if enabled is not None:
        args += ["--release_memory.enabled", enabled]
    cli = run(args, tmp_path, monkeypatch)
    callbacks = cli.trainer.callbacks
    kinds = [type(c) for c in callbacks]
    release = callbacks[kinds.index(ReleaseFreedMemory)]
    assert kinds.index(ReleaseFreedMemory) > kinds.index(RolloutGeneration)
    assert release.enabled is {None: None, "true": True, "false": False}[enabled]
    logged = "memory/resident_gib" in cli.trainer.callback_metrics
    assert logged is (enabled == "true" and GLIBC)  # tinymath.yaml: no gradient checkpointing
