"""Sharded (FSDP2) and replicated (DDP) training with 2 CPU processes over gloo.

Each run is ``tests/distributed_worker.py`` in a subprocess: Lightning starts the second
process by running the script again. The worker's completions are a fixed function of the
prompt, so a 2-process run and a 1-process run see the same global batch and must take the same
optimiser steps.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
WEIGHT_ATOL = 2e-6  # float32 reductions in another order; the weights move by ~4e-3
WORKER = ROOT / "tests" / "distributed_worker.py"
# Per-rollout values that must agree; the monitors' ones only do if they reduce across ranks.
COMPARED = [
    "loss/total",
    "reward/mean",
    "reward/std",  # pooled over the processes, not their own stds averaged
    "trust_region/kl_before_mean",
    "trust_region/kl_before_max",
    "trust_region/kl_after_mean",
    "trust_region/eta_max",
    "trust_region/active_frac",
    "sparsity/coverage_min",
    "sparsity/support_mean",  # the whole vocabulary: the worker's support is fixed
]


def launch(out: Path, *args: str) -> Path:
    done = subprocess.run(
        [sys.executable, str(WORKER), str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def metrics(out: Path) -> dict[str, dict[str, float]]:
    return json.loads((out / "metrics.json").read_text())


def weights(out: Path) -> dict:
    return torch.load(out / "weights.pt")


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """The reference: one process, micro-batches of 3 sequences, 2 rollouts (4 steps)."""
    return launch(tmp_path_factory.mktemp("single"), "--micro-batch-size", "3")


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory) -> tuple[Path, Path]:
    """The same run sharded over 2 processes with FSDP2, saving a (sharded) checkpoint."""
    out = tmp_path_factory.mktemp("fsdp2")
    ckpt = out / "last.ckpt"
    launch(out, "--strategy", "fsdp2", "--micro-batch-size", "3", "--save", str(ckpt))
    return out, ckpt


def assert_same_metrics(reference: Path, other: Path, metric_atol: float = 1e-5) -> None:
    ref, got = metrics(reference), metrics(other)
    for name in COMPARED:
        assert set(ref[name]) == set(got[name]) == {"0", "1"}, name
        for step, value in ref[name].items():
            assert got[name][step] == pytest.approx(value, rel=1e-4, abs=metric_atol), (name, step)


def assert_same_run(
    reference: Path, other: Path, weight_atol: float = WEIGHT_ATOL, metric_atol: float = 1e-5
) -> None:
    assert_same_metrics(reference, other, metric_atol)
    ref_w, got_w = weights(reference), weights(other)
    for part in ("policy", "old_policy"):
        assert ref_w[part].keys() == got_w[part].keys()
        for name, value in ref_w[part].items():
            torch.testing.assert_close(got_w[part][name], value, rtol=0, atol=weight_atol)
    assert torch.equal(ref_w["greedy"], got_w["greedy"])


@pytest.mark.slow  # starts one or two Python processes
def test_the_reference_run_trains(single):
    """The comparison means something: the weights moved far more than the tolerance, and
    the second pass over each rollout was off-policy and projected."""
    from lightning_troll.models.loading import load_policy

    initial = load_policy("tinymath").state_dict()
    trained = weights(single)["policy"]
    moved = max((trained[k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1000 * WEIGHT_ATOL
    logged = metrics(single)
    assert min(logged["trust_region/kl_before_max"].values()) > 0.05  # beyond the bound
    assert max(logged["trust_region/active_frac"].values()) > 0
    assert set(logged["sparsity/support_mean"].values()) == {17.0}  # TinyMath's whole vocabulary


@pytest.mark.slow  # starts one or two Python processes
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_match_one(strategy, single, fsdp2, tmp_path):
    """Losses, rewards, KL and sparsity statistics at every logged step, the final policy and
    snapshot weights, and greedy completions equal the single-process run's."""
    if strategy == "fsdp2":
        out = fsdp2[0]
    else:
        out = launch(tmp_path, "--strategy", strategy, "--micro-batch-size", "3")
    assert_same_run(single, out)


@pytest.mark.slow  # starts one and two Python processes
def test_validation_over_two_processes_counts_every_row_once(tmp_path):
    """Five held-out rows over two processes: one answers rows 0, 2 and 4, the other rows 1 and
    3 and a copy of row 0 that it does not count. The figures equal one process's, and
    ``val/reward`` (each row's gold answer) is the mean over the five rows."""
    from lightning_troll.tasks.data.datamodule import PromptDataModule

    options = ["--validate", "5", "--reward", "tests.reward_helpers:gold_answer"]
    one = json.loads((launch(tmp_path / "one", *options) / "validated.json").read_text())
    two = json.loads(
        (launch(tmp_path / "two", *options, "--strategy", "ddp") / "validated.json").read_text()
    )
    data = PromptDataModule(source="tinymath", tokenizer="tinymath", num_train=64, num_val=5)
    data.setup("validate")
    answers = [float(item.row["answer"]) for item in data.val_items]
    assert one["val/reward"] == pytest.approx(sum(answers) / 5, rel=1e-6)
    assert two == pytest.approx(one, rel=1e-6)
    assert answers[0] != pytest.approx(sum(answers) / 5, rel=1e-3)  # a counted copy would show


@pytest.mark.slow  # starts one Python process
def test_fsdp2_in_one_process_matches_the_unsharded_run(single, tmp_path):
    """FSDP2 at world size 1 (ModelParallelStrategy with data_parallel_size 1, one gloo
    process), the set-up of a machine with one GPU: it trains exactly as the unsharded run."""
    out = launch(tmp_path, "--strategy", "fsdp2", "--devices", "1", "--micro-batch-size", "3")
    assert_same_run(single, out)


@pytest.mark.slow  # starts one or two Python processes
def test_fsdp2_with_bf16_and_gradient_checkpointing(single, tmp_path):
    """bf16 autocast and recomputed activations under FSDP2: the projection still runs in
    float32, so the bound holds to float32 precision on bf16 logits."""
    out = launch(tmp_path, "--strategy", "fsdp2", "--micro-batch-size", "3",
                 "--precision", "bf16-mixed", "--gradient-checkpointing")  # fmt: skip
    got, ref = metrics(out), metrics(single)
    assert max(got["trust_region/kl_after_max"].values()) <= 0.05 * (1 + 1e-5)
    assert min(got["trust_region/active_frac"].values()) > 0  # the projection was active
    assert all(math.isfinite(v) for v in got["loss/total"].values())
    assert got["reward/mean"] == ref["reward/mean"]  # same scripted completions
    assert got["loss/total"] != ref["loss/total"]  # bf16 did change the arithmetic
    trained, start = weights(out)["policy"], weights(single)["policy"]
    assert all(v.dtype == torch.float32 for v in trained.values())  # master weights in fp32
    assert trained.keys() == start.keys()


@pytest.mark.slow  # starts one or two Python processes
def test_fsdp2_gathers_weights_once_per_generation(fsdp2):
    """Sampling from the sharded snapshot: one all-gather per FSDP module for the whole
    generation, instead of one per decoder layer for every generated token (FSDP2 keeps the
    root's own weights gathered after its first forward either way)."""
    counts = json.loads((fsdp2[0] / "gathers.json").read_text())
    modules, steps = counts["modules"], counts["per_token_steps"]
    assert steps == counts["gathered_steps"] == 8
    assert modules == 1 + 3  # the root and TinyMath's 3 decoder layers
    assert counts["gathered"] == modules
    assert counts["per_token"] == 1 + (modules - 1) * steps


@pytest.mark.slow  # starts two pairs of Python processes
def test_fsdp2_resumes_exactly(tmp_path):
    """Real sampling on 2 processes, 3 rollouts, a sharded checkpoint after the second; a new
    pair of processes resumed from it samples, logs and ends exactly like the uninterrupted run
    (weights, snapshot, data position, optimiser and both processes' random states came back)."""
    options = ["--strategy", "fsdp2", "--real-sampling", "--rollouts", "3", "--estimator", "grpo"]
    whole = launch(tmp_path / "whole", *options, "--checkpoint-every", "2")
    ckpt = whole / "ckpts" / "epoch=0-step=4.ckpt"
    # a ModelCheckpoint's folder of one shard per process, written beside its name and swapped
    # in: nothing else is left
    assert ckpt.is_dir() and [p.name for p in ckpt.parent.iterdir()] == [ckpt.name]
    assert len(list(ckpt.glob("*.distcp"))) == 2
    resumed = launch(tmp_path / "resumed", *options, "--ckpt-path", str(ckpt))
    ref, got = metrics(whole), metrics(resumed)
    # each process sampled from random streams of its own (seed_per_rank), in both runs
    for run in (whole, resumed):
        first, second = json.loads((run / "rng.json").read_text())
        assert first != second, run.name
    assert torch.load(resumed / "loaded.pt")["global_step"] == 4
    assert set(got["loss/total"]) == {"2"}  # only the third rollout ran
    for name in COMPARED:
        assert got[name]["2"] == pytest.approx(ref[name]["2"], rel=1e-6, abs=1e-7), name
    for part in ("policy", "old_policy"):
        for name, value in weights(whole)[part].items():
            assert torch.equal(weights(resumed)[part][name], value), (part, name)


def test_a_model_without_decoder_layers_is_refused():
    from torch import nn

    from lightning_troll.models.sharding import decoder_layers

    class Flat(nn.Module):
        _no_split_modules = ["Block"]

    with pytest.raises(ValueError, match=r"cannot shard Flat: it names no decoder-layer class"):
        decoder_layers(Flat())


def test_decoder_layers_of_the_demo_policy():
    from lightning_troll.models.loading import load_policy
    from lightning_troll.models.sharding import decoder_layers

    policy = load_policy("tinymath")
    layers = decoder_layers(policy)
    assert layers == list(policy.model.layers) and len(layers) == policy.config.num_hidden_layers


def test_fsdp2_parameter_groups_of_either_torch_layout():
    """FSDP2's state holds a list of parameter groups in newer torch and one group (or None) in
    torch 2.11; gathering reads either (2.11's attribute name failed the first GPU check)."""
    from types import SimpleNamespace

    from lightning_troll.models.sharding import _param_groups

    one, two = SimpleNamespace(post_forward_mesh_info=None), SimpleNamespace()
    assert _param_groups(SimpleNamespace(_fsdp_param_groups=[one, two])) == [one, two]
    assert _param_groups(SimpleNamespace(_fsdp_param_group=one)) == [one]
    assert _param_groups(SimpleNamespace(_fsdp_param_group=None)) == []
    with pytest.raises(AttributeError):  # a layout neither names is not read as "no groups"
        _param_groups(SimpleNamespace())


def test_fsdp1_is_refused_with_the_way_out():
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    from lightning_troll.models.sharding import check_strategy

    check_strategy(DDPStrategy())  # accepted
    with pytest.raises(ValueError, match=r"FSDPStrategy \(FSDP1\) is not supported.*ModelParallel"):
        check_strategy(FSDPStrategy())


def test_memory_options_fsdp2_does_not_support_are_refused():
    from lightning_troll.models.lora import LoraConfig
    from lightning_troll.models.sharding import check_shardable
    from lightning_troll.models.snapshots import SnapshotConfig

    check_shardable(SnapshotConfig("shared"), None)  # accepted, and run below
    check_shardable(SnapshotConfig("copy", "bfloat16"), None)
    with pytest.raises(ValueError, match=r"model.lora is not supported with FSDP2.*ddp"):
        check_shardable(SnapshotConfig(), LoraConfig(r=4))
    with pytest.raises(ValueError, match=r"snapshot.dtype='int8' is not supported with FSDP2"):
        check_shardable(SnapshotConfig("copy", "int8"), None)


@pytest.mark.slow  # starts two Python processes
def test_fsdp2_with_a_shared_snapshot_matches_the_copy(single, tmp_path):
    """The snapshot that is the (sharded) policy itself samples and caches what the sharded
    copy would: the run equals the single-process run with a copy."""
    out = launch(tmp_path, "--strategy", "fsdp2", "--micro-batch-size", "3",
                 "--snapshot", "shared:same")  # fmt: skip
    assert_same_run(single, out)


@pytest.mark.slow  # uses the FSDP2 run's checkpoint
def test_a_sharded_checkpoint_exports_whole(fsdp2, tmp_path):
    """``lightning-troll export`` gathers the folder of shards into one model folder: the
    policy's full weights as the two processes ended with them."""
    from transformers import AutoModelForCausalLM

    from lightning_troll.cli.command import main as cli_main

    out, ckpt = fsdp2
    cli_main(["export", "--ckpt_path", str(ckpt), "--output_dir", str(tmp_path / "exported")])
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").state_dict()
    saved = weights(out)["policy"]
    assert exported.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(exported[name], value), name
