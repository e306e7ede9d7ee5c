"""The CUDA-graph path's captured steps against the same steps run eagerly, on a CPU through the
stand-in for CUDA graphs (``tests/graph_stand_in.py``): what a capture holds is what a replay
runs, so a step that leaves a value of the host in its graph (a Python count, a tensor replaced
rather than written in place), reads from the host inside it, or reads a tensor the loop no
longer writes, draws or records something else than the eager step, or fails its capture. The
device runs the same tests that take ``graph_device``."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

from lightning_troll.engines import graph_decode as graph_module
from lightning_troll.engines import static_batch
from lightning_troll.engines.behaviour import BehaviourRecorder
from lightning_troll.engines.graph_decode import static_decode
from lightning_troll.engines.sampling import left_pad, response_mask_of
from tests.graph_stand_in import stand_in
from tests.test_decode import PROMPTS, sparse_rows, stops_at_several_lengths, tiny_llama
from tests.test_graph_checks import BUDGETS
from tests.test_graph_decode import SAMPLINGS

PROMPTS8 = [PROMPTS[i % 4] + [i + 3] for i in range(8)]
"""8 prompts of 2 to 6 tokens, each its own."""


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.fixture(scope="module")
def stops(llama):
    return stops_at_several_lengths(llama, PROMPTS8, 20)


def decoded(model, sampling, stops, capture, seed=0):
    """The (B, T) tokens, their response mask and records (log-probs, sparse rows) of the
    static loop from ``seed``, 8 prompts x 2 with :data:`BUDGETS`."""
    ids, mask = left_pad(PROMPTS8, 0)
    own = torch.tensor(BUDGETS).repeat_interleave(2)
    recorder = BehaviourRecorder(sampling.temperature, sparse_rows)
    torch.manual_seed(seed)
    tokens = static_decode(model, ids, mask, 2, sampling, 0, stops, True, recorder,
                           budgets=own, capture=capture)  # fmt: skip
    response, _ = response_mask_of(tokens, stops, own)
    return tokens, response, recorder.finish(tokens).outputs(response)


@pytest.mark.parametrize("every", [1, 3, 8])
@pytest.mark.parametrize("span", [256, 4])
@pytest.mark.parametrize("index", range(len(SAMPLINGS)), ids=["plain", "top-k", "top-p"])
def test_captured_steps_draw_and_record_what_eager_steps_do(llama, stops, monkeypatch, every,
                                                             span, index):  # fmt: skip
    """Stops at several lengths, budgets of 1 to 20 tokens (buckets of 16, 8, 4 and 2 slots),
    spans of 256 and of 4 positions (a capture every 4 steps), reads every 1, 3 and 8 steps,
    three samplings, from one seed: the captured loop's tokens, log-probs and sparse rows are
    the eager loop's, bit for bit; its steps replay graphs (more replays than forwards), and no
    capture fell back."""
    replays = stand_in(monkeypatch)
    monkeypatch.setattr(graph_module, "_WARNED", set())
    monkeypatch.setattr(static_batch, "SPAN", span)
    sampling = replace(SAMPLINGS[index], max_new_tokens=20, check_every=every, decode="graphs")
    forwards = []
    handle = llama.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            captured = decoded(llama, sampling, stops, capture=True)
    finally:
        handle.remove()
    assert not [w for w in caught if "model.sampling" in str(w.message)]
    eager = decoded(llama, sampling, stops, capture=False)
    tokens, response, (logp, old) = captured
    assert torch.equal(tokens, eager[0]) and torch.equal(response, eager[1])
    assert torch.equal(logp, eager[2][0]) and torch.equal(old.indices, eager[2][1].indices)
    assert torch.equal(old.logprobs, eager[2][1].logprobs)
    assert len(replays) > len(forwards) > 1


def test_a_step_that_keeps_a_host_count_in_its_graph_is_found(llama, stops, monkeypatch):
    """The check above can fail: a step that sets the position it writes (``slot_at``, on the
    device) from ``slot``, the host's count, is right eagerly and wrong under replay (every
    replay writes and opens the position of the capture), and its records say so."""
    stand_in(monkeypatch)
    step = static_batch.StaticBatch._step

    def host_count(batch):
        batch.slot_at.fill_(batch.slot)  # kept in the graph as the capture's count
        return step(batch)

    monkeypatch.setattr(static_batch.StaticBatch, "_step", host_count)
    sampling = replace(SAMPLINGS[1], max_new_tokens=20, check_every=3, decode="graphs")
    captured, eager = (decoded(llama, sampling, stops, capture) for capture in (True, False))
    assert not torch.equal(captured[2][0], eager[2][0])
