"""Past one machine: two launches of the command on this machine join over loopback as two nodes
(``trainer.num_nodes 2``, one process each, gloo), as a SLURM or torchrun launch of two nodes
does (docs/gpu-and-fsdp.md), and train what one node with two processes trains."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_cli import ROOT, one_step

pytestmark = pytest.mark.slow  # starts two or three Python processes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def command(model_dir: Path, *extra: str) -> list[str]:
    script = Path(sys.executable).parent / "lightning-troll"
    args = [str(script), "fit", "--config", str(ROOT / "configs" / "tinymath.yaml")]
    args += one_step(model_dir) + ["--model.optimization.minibatch_size", "8"]
    args += ["--trainer.max_steps", "2", "--trainer.strategy", "ddp", "--trainer.logger", "false"]
    args += ["--trainer.limit_val_batches", "0"]
    return args + list(extra)


def policy_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("policy.")}


def test_two_nodes_over_loopback_train_as_one_node_with_two_processes(tmp_path, tiny_model_dir):
    one = tmp_path / "one"
    one.mkdir()
    done = subprocess.run(
        command(tiny_model_dir, "--trainer.devices", "2", "--checkpoint.dirpath", str(one)),
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    two = tmp_path / "two"
    two.mkdir()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    args = command(tiny_model_dir, "--trainer.devices", "1", "--trainer.num_nodes", "2",
                   "--checkpoint.dirpath", str(two))  # fmt: skip
    nodes = [
        subprocess.Popen(args, cwd=tmp_path, env={**env, "NODE_RANK": str(rank)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]  # fmt: skip
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (_, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err[-3000:]
    assert "lightning-troll: training finished" in outputs[0][0]
    reference, joined = policy_weights(one / "last.ckpt"), policy_weights(two / "last.ckpt")
    assert reference.keys() == joined.keys() and reference
    for name, value in reference.items():
        torch.testing.assert_close(joined[name], value, rtol=0, atol=0, msg=name)
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    moved = [k for k, v in start.items() if not torch.equal(reference[f"policy.{k}"], v)]
    assert moved, "the runs took no optimiser step"
