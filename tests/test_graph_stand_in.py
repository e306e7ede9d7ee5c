"""The CPU stand-in for CUDA graphs (``tests/graph_stand_in.py``) keeps a device's rules: a
capture runs nothing that outlives it, a replay runs what it kept on the tensors it kept, random
ops draw anew at each replay, and a read by the host inside a capture fails. The tests that take
``graph_device`` rely on it."""

from __future__ import annotations

import pytest
import torch

from tests.graph_stand_in import _CAPTURING, stand_in


@pytest.fixture
def graphs(monkeypatch):
    stand_in(monkeypatch)


def test_a_capture_runs_nothing_and_a_replay_runs_it(graphs):
    """``x += 1; y = 2 x`` captured: x keeps its values and y holds NaN until a replay; each
    replay adds 1 to x and writes 2 x into y, the tensor the capture made."""
    x = torch.tensor([1.0, 2.0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x += 1
        y = x * 2
    assert torch.equal(x, torch.tensor([1.0, 2.0])) and y.isnan().all()
    graph.replay()
    assert torch.equal(x, torch.tensor([2.0, 3.0])) and torch.equal(y, torch.tensor([4.0, 6.0]))
    graph.replay()
    assert torch.equal(x, torch.tensor([3.0, 4.0])) and torch.equal(y, torch.tensor([6.0, 8.0]))


def test_a_replay_reads_the_tensors_the_capture_saw(graphs):
    """A tensor the code replaces by a new one after the capture is not the one the replay
    reads: the replay adds the old x's values, whatever the new x holds."""
    x, total = torch.tensor([1.0]), torch.zeros(1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        total += x
    x = torch.tensor([100.0])  # what a step must not do to a tensor its graph reads
    graph.replay()
    graph.replay()
    assert torch.equal(total, torch.tensor([2.0]))


def test_captured_draws_are_the_eager_draws_in_turn_and_a_capture_draws_none(graphs):
    """Seeded, a capture of ``torch.rand`` leaves the generator where it was, and three
    replays give the three draws three eager calls give."""
    torch.manual_seed(3)
    eager = [torch.rand(4) for _ in range(3)]
    torch.manual_seed(3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        drawn = torch.rand(4)
    replayed = []
    for _ in range(3):
        graph.replay()
        replayed.append(drawn.clone())
    assert all(torch.equal(a, b) for a, b in zip(eager, replayed, strict=True))


@pytest.mark.parametrize(
    "read",
    [
        lambda x: x.sum().item(),
        lambda x: x.tolist(),
        lambda x: bool(x[0]),
        lambda x: torch.nonzero(x),
        lambda x: x[x > 1],
        lambda x: x.repeat_interleave(x.long()),
    ],
    ids=["item", "tolist", "bool", "nonzero", "mask", "repeat_interleave"],
)
def test_a_read_by_the_host_fails_the_capture_and_leaves_nothing_written(graphs, read):
    """Each read of values by the host raises inside a capture, as on a device; what the capture
    wrote before it is put back and no capture is left under way."""
    x = torch.tensor([1.0, 2.0])
    refused = pytest.raises(RuntimeError, match="operation not permitted when stream is capturing")
    with refused, torch.cuda.graph(torch.cuda.CUDAGraph()):
        x.mul_(3)
        read(x)
    assert torch.equal(x, torch.tensor([1.0, 2.0])) and not _CAPTURING
    read(x)  # outside a capture, the same read is allowed
