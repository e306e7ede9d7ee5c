"""Shared fixtures: a tiny causal LM with the TinyMath tokenizer, saved like a hub model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def pytest_configure(config) -> None:
    """Under pytest-xdist each worker takes an even share of the cores for torch's threads, and
    the processes its tests start inherit it (``OMP_NUM_THREADS``): two workers of two threads
    each on two cores took a quarter longer over the SmolLM2 tests than two of one thread each.
    An ``OMP_NUM_THREADS`` already set is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked ``cuda`` are skipped, with the reason, where torch sees no CUDA device; tests
    marked ``vllm`` where vLLM is not installed (``make test-vllm`` installs it and runs them)."""
    from importlib.util import find_spec

    if find_spec("vllm") is None:
        skip = pytest.mark.skip(reason="needs vLLM: `make test-vllm` installs it and runs these")
        for item in items:
            if item.get_closest_marker("vllm"):
                item.add_marker(skip)
    cuda_tests = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda_tests:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in cuda_tests:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_seed_left_behind():
    """Lightning's ``seed_everything`` records its seed in ``os.environ["PL_GLOBAL_SEED"]``, which
    the module's defaults read (the minibatch shuffle, the prompt order) and Lightning reseeds
    from; left there, it would reach every later test and every process a later test starts, and
    a run's result would depend on which tests ran before it."""
    os.environ.pop("PL_GLOBAL_SEED", None)
    yield
    os.environ.pop("PL_GLOBAL_SEED", None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A randomly initialised 2-layer model of the TinyMath vocabulary, in a local directory."""
    from lightning_troll.models.loading import tiny_causal_lm
    from lightning_troll.models.tinymath import build_tokenizer

    path = tmp_path_factory.mktemp("tiny_model")
    tokenizer = build_tokenizer()
    model = tiny_causal_lm(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        seed=0,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted into models/ (fetched once; reused when present)."""
    from lightning_troll.models import smollm2

    folder = Path(__file__).resolve().parents[1] / smollm2.DEFAULT_DIR
    if not (folder.parent / smollm2.GGUF_NAME).is_file():
        return smollm2.fetch_smollm2(folder, force=smollm2.is_converted(folder))
    return smollm2.fetch_smollm2(folder)


@pytest.fixture(scope="session")
def tiny_chat_model_dir(smollm2_dir, tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct's tokenizer and chat template on a randomly initialised 2-layer
    model of its vocabulary (about 3M weights): what a test of a command's plumbing needs of a
    chat model, at a fraction of the real one's time. tests/test_real_model.py trains the real one."""
    from transformers import AutoTokenizer

    from lightning_troll.models.loading import tiny_causal_lm

    path = tmp_path_factory.mktemp("tiny_chat_model")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = tiny_causal_lm(
        vocab_size=len(tokenizer),
        seed=0,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model.config.max_position_embeddings = 2048  # as long as the real one's prompts need
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def command_here(args: list[str], folder: Path, monkeypatch) -> None:
    """``lightning-troll <args>`` run in ``folder`` by the command's ``main`` in this process,
    which saves a process start-up: returning is exit status 0 (a stopped run raises
    ``SystemExit``, anything else its error). A reward module found in ``folder`` joins a copy of
    ``sys.path``; the seed the config's ``seed_everything`` records is removed again, so that a
    process the test starts next does not inherit it."""
    import os
    import sys

    from lightning_troll.cli.command import main as cli_main

    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", ["lightning-troll"])
    try:
        cli_main(args)
    finally:
        os.environ.pop("PL_GLOBAL_SEED", None)


def refused_here(args: list[str], folder: Path, monkeypatch, capsys, status: int = 2) -> str:
    """:func:`command_here` for a command that must stop: checks its exit status (2, bad input,
    by default) and returns what it wrote to stderr."""
    with pytest.raises(SystemExit) as stopped:
        command_here(args, folder, monkeypatch)
    assert stopped.value.code == status
    return capsys.readouterr().err


@pytest.fixture
def workers_die_at_start(monkeypatch) -> None:
    """Every reward or tool worker process is killed as soon as it is started, and whatever it
    sent before it died is read away: the pool sees a worker that never reported ready (a worker
    can send "ready" before the kill reaches it, which the pool would take for a crash in a call)."""
    from lightning_troll.tasks.rewards import workers

    start = workers._Worker.__init__

    def dies_at_once(self, context):
        start(self, context)
        self.process.kill()
        self.process.join()
        while self.conn.poll():
            try:
                self.conn.recv()
            except (EOFError, OSError):
                break

    monkeypatch.setattr(workers._Worker, "__init__", dies_at_once)


@pytest.fixture(
    params=[pytest.param("cpu", id="stand-in"), pytest.param("cuda", marks=pytest.mark.cuda)]
)
def graph_device(request, monkeypatch):
    """The device a test of captured CUDA graphs runs on: a CPU with the graphs stood in for
    (``tests/graph_stand_in.py``: a capture runs nothing, a replay runs what it kept, a host
    read inside it fails), and the CUDA device, where the test is marked ``cuda``."""
    import torch

    if request.param == "cpu":
        from tests.graph_stand_in import stand_in

        stand_in(monkeypatch)
    return torch.device(request.param)
