"""The CUDA-graph path's reads every k steps (``model.sampling.check_every``), on a CPU through
its loop without capture: completions cut where the dynamic loop ends them, seeded draws equal
while no sequence stops, one read per k steps (the records against a teacher-forced pass are
``tests/test_graph_decode.py``'s, at k = 1 and 3)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lightning_troll.engines import sampling as sampling_module
from lightning_troll.engines.behaviour import BehaviourRecorder
from lightning_troll.engines.decode import decode
from lightning_troll.engines.graph_decode import static_decode
from lightning_troll.engines.sampling import SamplingConfig, left_pad
from tests.test_decode import PROMPTS, VOCAB, sparse_rows, stops_at_several_lengths, tiny_llama
from tests.test_graph_decode import SAMPLINGS, DeviceReads


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.fixture(scope="module")
def llama64():
    return tiny_llama().double()


def decoded(model, sampling, stops, do_sample, seed=0, budgets=None, group=2):
    """The (B, T) tokens of the static loop (its ``sampling.check_every``) and of the dynamic
    loop, each from ``seed``."""
    ids, mask = left_pad(PROMPTS, 0)
    args = (model, ids, mask, group, sampling, 0, stops, do_sample)
    own = None if budgets is None else torch.tensor(budgets).repeat_interleave(group)
    torch.manual_seed(seed)
    static = static_decode(*args, budgets=own, capture=False)
    torch.manual_seed(seed)
    dynamic = decode(*args, budgets=own)
    return static, dynamic, own


@pytest.mark.parametrize("every", [3, 8])
def test_greedy_completions_are_the_dynamic_loops_cut_where_they_stop(llama64, every):
    """float64, greedy, stops at several lengths and budgets of 3, 10, 1 and 6 tokens: the same
    response masks and the same tokens inside them; the static loop decodes at most
    ``every - 1`` steps past the dynamic loop's last."""
    sampling = SamplingConfig(max_new_tokens=10, check_every=every)
    stops = stops_at_several_lengths(llama64, PROMPTS, 10)
    static, dynamic, own = decoded(llama64, sampling, stops, False, budgets=[3, 10, 1, 6])
    ours, _ = sampling_module.response_mask_of(static, stops, own)
    theirs, _ = sampling_module.response_mask_of(dynamic, stops, own)
    width = dynamic.shape[1]
    assert width <= static.shape[1] <= min(10, width + every - 1)
    assert not ours[:, width:].any() and torch.equal(ours[:, :width], theirs)
    assert torch.equal(static[:, :width][theirs], dynamic[theirs])
    assert len(set(theirs.sum(-1).tolist())) >= 3  # completions of several lengths


@pytest.mark.parametrize("sampling", SAMPLINGS[:2], ids=["plain", "top_k"])
def test_a_seed_draws_the_dynamic_loops_tokens_while_no_sequence_stops(llama64, sampling):
    """No stop is ever drawn and no budget ends a completion early: every read finds every
    sequence running, and a seed draws the dynamic loop's tokens with reads every 5 steps."""
    static, dynamic, _ = decoded(llama64, replace(sampling, check_every=5), [VOCAB + 5], True, 1)
    assert static.shape == (8, sampling.max_new_tokens) and torch.equal(static, dynamic)


@pytest.mark.parametrize("every", [1, 4, 5])
def test_the_host_reads_once_every_k_steps(llama, every):
    """12 steps, no sequence stopping, a read-free recorder: one read at every ``every``-th step
    and at the last (12, 3 and 3 reads), none inside the steps' forwards."""
    sampling = SamplingConfig(max_new_tokens=12, check_every=every)
    recorder = BehaviourRecorder(1.0, sparse_rows, read_free=True)
    ids, mask = left_pad(PROMPTS, 0)
    with DeviceReads(llama) as counted:
        tokens = static_decode(llama, ids, mask, 2, sampling, 0, [VOCAB + 5], True, recorder,
                               capture=False)  # fmt: skip
    recorder.finish(tokens)
    assert tokens.shape[1] == 12 and counted.in_steps == 0
    assert counted.count == -(-12 // every)


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "4"])
def test_check_every_below_one_or_not_an_integer_is_refused(value):
    with pytest.raises(ValueError, match=r"model\.sampling\.check_every must be an integer >= 1"):
        SamplingConfig(check_every=value)


@pytest.mark.cuda
def test_captured_graphs_reading_every_4_steps_cut_the_dynamic_loops_completions():
    """On the device, with capture, float64, greedy, budgets and stops at several lengths: the
    response masks and the tokens inside them are the dynamic loop's."""
    model = tiny_llama().double().to("cuda")
    sampling = SamplingConfig(max_new_tokens=10, decode="graphs", check_every=4)
    stops = stops_at_several_lengths(model, PROMPTS, 10)
    ids, mask = (t.to("cuda") for t in left_pad(PROMPTS, 0))
    own = torch.tensor([3, 10, 1, 6], device="cuda").repeat_interleave(2)
    args = (model, ids, mask, 2, sampling, 0, stops, False)
    static = static_decode(*args, budgets=own, capture=True)
    dynamic = decode(*args, budgets=own)
    theirs, _ = sampling_module.response_mask_of(dynamic, stops, own)
    ours, _ = sampling_module.response_mask_of(static, stops, own)
    width = dynamic.shape[1]
    assert not ours[:, width:].any() and torch.equal(ours[:, :width], theirs)
    assert torch.equal(static[:, :width][theirs], dynamic[theirs])
