"""The CUDA-graph path's reads every k steps (``model.sampling.check_every``), on a CPU through
its loop without capture: completions cut where the dynamic loop ends them, seeded draws equal
while no sequence stops, one read per k steps, slots that hold no sequence writing nowhere, and
the checks of bad logits raised at the next read, naming the step (the records against a
teacher-forced pass are ``tests/test_graph_decode.py``'s, at k = 1 and 3). At k > 1 the whole
step, the choice of its tokens and their records too, is what the graph holds; the test marked
``cuda`` captures it."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

from lightning_troll.engines import decode as decode_module
from lightning_troll.engines import graph_decode as graph_module
from lightning_troll.engines import sampling as sampling_module
from lightning_troll.engines import static_batch
from lightning_troll.engines.behaviour import BehaviourRecorder
from lightning_troll.engines.decode import decode
from lightning_troll.engines.graph_decode import static_decode
from lightning_troll.engines.sampling import SamplingConfig, left_pad
from lightning_troll.rollouts.rollout import behaviour_outputs
from tests.test_decode import PROMPTS, VOCAB, sparse_rows, stops_at_several_lengths, tiny_llama
from tests.test_graph_decode import SAMPLINGS, DeviceReads

BUDGETS = [1, 2, 3, 4, 5, 8, 13, 20]
"""Per prompt, for 8 prompts x 2: read every 3 steps, 10 sequences run after the first read, 6
after the second (a bucket of 8 with 2 slots holding none), 4, 4, 2."""


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
    width = dynamic.shape[1]
    assert width <= static.shape[1] <= min(10, width + every - 1)
    assert_cut_where_the_dynamic_loop_stops(static, dynamic, stops, own)
    theirs, _ = sampling_module.response_mask_of(dynamic, stops, own)
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


def records_match_a_teacher_forced_pass(model, ids, mask, group, tokens, response, record,
                                        temperature, atol):  # fmt: skip
    """Asserts that ``record``'s log-probs and sparse rows at the ``response`` tokens equal a
    teacher-forced pass's, to ``atol`` (the records are float32, a float64 model's pass is
    not)."""
    full = torch.cat([ids.repeat_interleave(group, 0), tokens.masked_fill(~response, 0)], dim=-1)
    attention = torch.cat([mask.repeat_interleave(group, 0), response.long()], dim=-1)
    logp, old = record.outputs(response)
    logp_ref, old_ref = behaviour_outputs(model, full, attention, response, temperature,
                                          sparse_rows)  # fmt: skip
    torch.testing.assert_close(logp, logp_ref, rtol=0, atol=atol)
    assert torch.equal(old.indices, old_ref.indices)
    kept = old.indices >= 0
    torch.testing.assert_close(old.logprobs[kept].exp(), old_ref.logprobs[kept].exp(), rtol=0,
                               atol=atol, check_dtype=False)  # fmt: skip


@pytest.mark.parametrize(("seed", "span"), [(3, 256), (4, 256), (3, 4)])
def test_slots_that_hold_no_sequence_write_nowhere(llama, monkeypatch, seed, span):
    """Budgets that leave 6 sequences running at a read: the bucket of 8 fills its last 2 slots
    with copies of the first running one, which draw tokens of their own. Those land in no
    sequence's row: the steps run in buckets of 16, 8, 4 and 2, each step feeds every slot that
    holds a sequence the token its row holds (a copy's token written into the first running
    sequence's row would not be the one its slot was fed), every completion runs to its budget,
    and its records equal a teacher-forced pass over its tokens; also where the positions a
    step attends over widen every 4 (``span``)."""
    monkeypatch.setattr(static_batch, "SPAN", span)
    prompts = [PROMPTS[i % 4] + [i + 3] for i in range(8)]
    sampling = replace(SAMPLINGS[1], max_new_tokens=20, check_every=3)
    recorder = BehaviourRecorder(sampling.temperature, sparse_rows)
    ids, mask = left_pad(prompts, 0)
    own = torch.tensor(BUDGETS).repeat_interleave(2)
    fed = []  # each forward's (b,) input ids
    handle = llama.register_forward_pre_hook(
        lambda module, args, kwargs: fed.append(kwargs["input_ids"][:, -1].clone()),
        with_kwargs=True,
    )
    torch.manual_seed(seed)
    try:
        tokens = static_decode(llama, ids, mask, 2, sampling, 0, [VOCAB + 5], True, recorder,
                               budgets=own, capture=False)  # fmt: skip
    finally:
        handle.remove()
    assert [len(step) for step in fed[1:]] == [16] * 5 + [8] * 3 + [4] * 6 + [2] * 5
    held = {16: range(16), 8: range(10, 16), 4: range(12, 16), 2: range(14, 16)}  # their rows
    for token, slots in enumerate(fed[1:]):  # the step that feeds each slot's token `token`
        rows = list(held[len(slots)])
        assert torch.equal(slots[: len(rows)], tokens[rows, token])
    response, truncated = sampling_module.response_mask_of(tokens, [VOCAB + 5], own)
    assert torch.equal(response.sum(-1), own) and truncated.all()
    records_match_a_teacher_forced_pass(
        llama, ids, mask, 2, tokens, response, recorder.finish(tokens), sampling.temperature, 1e-5
    )


@pytest.mark.slow  # compiles two tiny models' steps: about 20 s on 2 cores
def test_each_model_compiles_a_step_of_its_own_under_the_compilers_limit():
    """The compiler keeps a function's compilations up to ``recompile_limit`` and then runs it
    uncompiled, silently. With the limit at 1, a model of another width than the first still
    compiles its step (the graphs compiled grow with it), as it would not through one function
    shared by both; each gives the uncompiled step's greedy tokens."""
    from torch._dynamo import config
    from torch._dynamo.utils import counters

    ids, mask = left_pad(PROMPTS, 0)
    graphs = [counters["stats"]["unique_graphs"]]
    for width in (32, 48):
        model = tiny_llama(hidden_size=width)
        runs = []
        for compiled in (False, True):
            sampling = SamplingConfig(max_new_tokens=4, check_every=2, compile_step=compiled)
            with config.patch(recompile_limit=1):
                runs.append(static_decode(model, ids, mask, 1, sampling, 0, [VOCAB + 5], False,
                                          capture=False))  # fmt: skip
        graphs.append(counters["stats"]["unique_graphs"])
        assert torch.equal(*runs) and static_batch.compiled_step(model).failure is None
    assert graphs[0] < graphs[1] < graphs[2]


@pytest.mark.parametrize("recorded", [True, False])
def test_bad_logits_between_reads_raise_at_the_next_naming_their_step(recorded):
    """NaN in one sequence's logits at step 4, reads every 3 steps: the read at step 6 raises
    the recorder's error naming step 4 and sequence 1, or without a recorder the draw's."""
    model = tiny_llama()
    forwards = []

    def spoil(module, args, output):
        forwards.append(1)
        if len(forwards) == 5:  # the prefill, then the steps that choose tokens 1 to 4
            output.logits[1, -1, 0] = float("nan")

    handle = model.register_forward_hook(spoil)
    recorder = BehaviourRecorder(1.0, sparse_rows) if recorded else None
    error, message = (
        (FloatingPointError, r"at generation step 4 for 1 sequences \(first: 1\)") if recorded
        else (RuntimeError, "probability tensor contains either")
    )  # fmt: skip
    ids, mask = left_pad(PROMPTS, 0)
    sampling = SamplingConfig(max_new_tokens=12, check_every=3)
    try:
        with pytest.raises(error, match=message):
            static_decode(model, ids, mask, 2, sampling, 0, [VOCAB + 5], True, recorder,
                          capture=False)  # fmt: skip
    finally:
        handle.remove()
    assert len(forwards) == 6  # the prefill and tokens 1 to 5: the read after token 5 raised


def test_a_recorder_without_record_slots_reads_at_every_step(llama64, monkeypatch):
    """A recorder that records running rows only cannot be written from a captured step: the
    path warns once and reads at every step, so a seed draws the dynamic loop's tokens."""

    class RowsOnly:
        def __init__(self):
            self.steps = 0

        def record_rows(self, scores, tokens, rows, checks=None):
            self.steps += 1

    monkeypatch.setattr(graph_module, "_WARNED", set())
    sampling = replace(SAMPLINGS[1], check_every=4)
    stops = stops_at_several_lengths(llama64, PROMPTS, 12)
    ids, mask = left_pad(PROMPTS, 0)
    ours, theirs = RowsOnly(), RowsOnly()
    args = (llama64, ids, mask, 2, sampling, 0, stops, True)
    torch.manual_seed(2)
    with pytest.warns(UserWarning, match=r"RowsOnly\) has no record_slots; it reads at every"):
        static = static_decode(*args, ours, capture=False)
    torch.manual_seed(2)
    dynamic = decode(*args, theirs)
    assert torch.equal(static, dynamic) and ours.steps == theirs.steps == static.shape[1]


def captures_recorded(monkeypatch, failure=None):
    """``StaticBatch.capture`` replaced by one that records (slots, visible positions, whether
    the choice is set, the position the next step writes) and captures nothing, returning
    ``failure``: the steps then run eagerly, on a CPU too."""
    calls = []

    def capture(self):
        self.stale = False
        calls.append((self.rows.numel(), self.visible, self.slots is not None, self.slot))
        return failure

    monkeypatch.setattr(static_batch.StaticBatch, "capture", capture)
    monkeypatch.setattr(graph_module, "_WARNED", set())
    return calls


@pytest.mark.parametrize("every", [1, 3])
def test_each_step_is_captured_once_at_k_above_1_with_its_choice_after_the_first_draw(
    llama, monkeypatch, every
):
    """No sequence stops, spans of 4 visible positions: the step is captured once for each span
    the 11 steps after the first token see. At k = 1 the first capture comes before any draw and
    holds the forward alone; at k > 1 every capture holds the choice too (the first bucket is not
    captured alone first), the first at the same position, after the first token is drawn."""
    calls = captures_recorded(monkeypatch)
    monkeypatch.setattr(static_batch, "SPAN", 4)
    sampling = SamplingConfig(max_new_tokens=12, check_every=every)
    recorder = BehaviourRecorder(1.0, sparse_rows, read_free=True)
    ids, mask = left_pad(PROMPTS, 0)
    tokens = static_decode(llama, ids, mask, 2, sampling, 0, [VOCAB + 5], True, recorder,
                           capture=True)  # fmt: skip
    start = ids.shape[1]  # S
    cache = -(-(start + 12) // 16) * 16  # L
    spans = sorted({min(cache, -(-(slot + 1) // 4) * 4) for slot in range(start, start + 11)})
    assert tokens.shape == (8, 12) and len(spans) >= 3
    assert [visible for _, visible, _, _ in calls] == spans
    assert {(size, chosen) for size, _, chosen, _ in calls} == {(8, every > 1)}
    assert calls[0][3] == start  # the first step's position, before its forward either way


def test_a_failed_first_capture_at_k_above_1_runs_the_steps_eagerly_warned(llama, monkeypatch):
    """At k > 1 a token is drawn before the first capture, so where it fails the static loop
    goes on eagerly (warned once for the bucket), and a seed gives the tokens of the loop
    without capture."""
    calls = captures_recorded(monkeypatch, failure="RuntimeError: not capturable")
    sampling = SamplingConfig(max_new_tokens=7, check_every=4)
    ids, mask = left_pad(PROMPTS, 0)
    args = (llama, ids, mask, 2, sampling, 0, [VOCAB + 5], True)
    torch.manual_seed(5)
    with pytest.warns(UserWarning, match=r"for 8 slots failed \(RuntimeError: not capturable\); "
                      "those steps run eagerly"):  # fmt: skip
        ours = static_decode(*args, capture=True)
    torch.manual_seed(5)
    assert torch.equal(ours, static_decode(*args, capture=False)) and len(calls) == 1


@pytest.mark.parametrize(
    ("failing", "tries", "results", "warmed"),
    [
        (set(), [True, False, False], [None, None, None], True),
        ({(2, False)}, [True, False, True, False], [None, None, None], True),
        ({(2, False), (2, True)}, [True, False, True, False], [None, "E", None], True),
        ({(1, True)}, [True, True, False], ["E", None, None], True),
        ({(1, True), (2, True), (3, True)}, [True, True, True], ["E", "E", "E"], False),
    ],
    ids=["ok", "retried", "retry-failed", "first-failed", "never"],
)
def test_captures_warm_up_until_one_succeeds_and_a_later_failure_is_retried_warm(
    llama, monkeypatch, failing, tries, results, warmed
):
    """Three captures of one batch, a try failing where (capture number, warm-up) is in
    ``failing``: captures warm up until one succeeds; after that they record at once, and one
    that fails is tried once more after a warm-up, whose result is the capture's."""
    ids, mask = left_pad(PROMPTS, 0)
    first = decode_module.prefill(llama, ids, mask, 2)
    batch = static_batch.StaticBatch.prefilled(llama, first, mask, 2, 6)
    calls, number = [], [0]

    def record(self, warm_up):
        calls.append(warm_up)
        return "E" if (number[0], warm_up) in failing else None

    monkeypatch.setattr(static_batch.StaticBatch, "_record", record)
    got = []
    for number[0] in (1, 2, 3):
        batch.stale = True
        got.append(batch.capture())
        assert not batch.stale
    assert calls == tries and got == results and batch.warmed is warmed


@pytest.mark.slow  # compiles a tiny model's step: about 30 s on 2 cores
def test_a_compiled_step_gives_the_same_tokens_and_records_and_compiles_once_or_twice(
    monkeypatch,
):
    """float64, greedy, stops at several lengths (buckets of 8, 4, 2), spans of 4 positions,
    reads every 3 steps, on a CPU without capture: with ``compile_step`` the static loop's
    tokens and records are the uncompiled loop's, at two prompt lengths and budgets; the step
    compiles at most twice over both rollouts (its dimensions dynamic), and a third rollout of
    the first's shapes compiles nothing. The records are float32 from float64 logits that the
    compiled kernels sum in another order: equal to 1e-5, the bound the loops hold against a
    teacher-forced pass."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(static_batch, "SPAN", 4)
    model = tiny_llama().double()
    graphs = [counters["stats"]["unique_graphs"]]  # compiled graphs so far, then after each
    for extra, budget in ((0, 10), (2, 14), (0, 10)):
        prompts = [p + [3] * extra for p in PROMPTS]
        stops = stops_at_several_lengths(model, prompts, budget)
        ids, mask = left_pad(prompts, 0)
        runs = []
        for compiled in (False, True):
            sampling = SamplingConfig(max_new_tokens=budget, check_every=3, compile_step=compiled)
            recorder = BehaviourRecorder(1.0, sparse_rows, read_free=True)
            tokens = static_decode(model, ids, mask, 2, sampling, 0, stops, False, recorder,
                                   capture=False)  # fmt: skip
            runs.append((tokens, recorder.finish(tokens)))
        graphs.append(counters["stats"]["unique_graphs"])
        (plain, plain_record), (ours, our_record) = runs
        assert torch.equal(ours, plain)
        assert torch.allclose(our_record.logprobs, plain_record.logprobs, atol=1e-5, rtol=0)
        assert torch.equal(our_record.indices, plain_record.indices)
        lengths = sampling_module.response_mask_of(plain, stops)[0].sum(-1)
        assert len(set(lengths.tolist())) >= 3  # completions of several lengths: buckets
    step = static_batch.compiled_step(model)
    assert step.failure is None and 1 <= graphs[2] - graphs[0] <= 2 and graphs[3] == graphs[2]


@pytest.mark.parametrize("when", ["compiling", "wrapping"])
def test_a_step_that_fails_to_compile_warns_once_and_runs_uncompiled(monkeypatch, when):
    """A compiler that fails at the first step (or ``torch.compile`` itself, on a platform it
    does not serve): one warning naming the model and the error, and the static loop's tokens
    are the uncompiled loop's, in this rollout and the next (no second warning)."""

    def failing(function, **options):
        def call(*args, **kwargs):
            raise RuntimeError("no compiler here")

        if when == "wrapping":
            call()
        return call

    monkeypatch.setattr(static_batch.torch, "compile", failing)
    model = tiny_llama()
    ids, mask = left_pad(PROMPTS, 0)
    args = (model, ids, mask, 2)
    stops = [VOCAB + 5]
    plain = static_decode(*args, SamplingConfig(max_new_tokens=6), 0, stops, False, capture=False)
    sampling = SamplingConfig(max_new_tokens=6, compile_step=True)
    with pytest.warns(UserWarning) as caught:
        first = static_decode(*args, sampling, 0, stops, False, capture=False)
    messages = [str(w.message) for w in caught if "compile_step" in str(w.message)]
    assert messages == [
        "model.sampling.compile_step: compiling the decoding step of LlamaForCausalLM failed "
        "(RuntimeError: no compiler here); its steps run uncompiled"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = static_decode(*args, sampling, 0, stops, False, capture=False)
    assert torch.equal(first, plain) and torch.equal(second, plain)


@pytest.mark.parametrize("value", [1, 0, "true", None])
def test_compile_step_other_than_a_bool_is_refused(value):
    with pytest.raises(ValueError, match=r"model\.sampling\.compile_step must be true or false"):
        SamplingConfig(compile_step=value)


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "4"])
def test_check_every_below_one_or_not_an_integer_is_refused(value):
    with pytest.raises(ValueError, match=r"model\.sampling\.check_every must be an integer >= 1"):
        SamplingConfig(check_every=value)


def assert_cut_where_the_dynamic_loop_stops(static, dynamic, stops, own) -> None:
    """The static loop's tokens (B, T') hold the dynamic loop's (B, T) completions: the same
    response masks, nothing past them, the same tokens inside them."""
    theirs, _ = sampling_module.response_mask_of(dynamic, stops, own)
    ours, _ = sampling_module.response_mask_of(static, stops, own)
    width = dynamic.shape[1]
    assert not ours[:, width:].any() and torch.equal(ours[:, :width], theirs)
    assert torch.equal(static[:, :width][theirs], dynamic[theirs])


def test_captured_graphs_reading_every_4_steps_cut_the_dynamic_loops_completions(graph_device):
    """Captured, float64, greedy, budgets and stops at several lengths: the
    response masks and the tokens inside them are the dynamic loop's."""
    model = tiny_llama().double().to(graph_device)
    sampling = SamplingConfig(max_new_tokens=10, decode="graphs", check_every=4)
    stops = stops_at_several_lengths(model, PROMPTS, 10)
    ids, mask = (t.to(graph_device) for t in left_pad(PROMPTS, 0))
    own = torch.tensor([3, 10, 1, 6], device=graph_device).repeat_interleave(2)
    args = (model, ids, mask, 2, sampling, 0, stops, False)
    static = static_decode(*args, budgets=own, capture=True)
    dynamic = decode(*args, budgets=own)
    assert_cut_where_the_dynamic_loop_stops(static, dynamic, stops, own)


@pytest.mark.parametrize("span", [256, 8])
def test_captured_whole_steps_run_no_step_eagerly_and_record_a_teacher_forced_pass(
    graph_device, monkeypatch, span
):
    """Captured, float64, top-k draws, the budgets above, reads every 3 steps: the forward
    runs only to prefill and in captures (a recording each, the first after a warm-up: the first
    bucket's step with its choice, once; again at each new bucket of 16, 8, 4 and 2 slots and
    each wider span of visible positions), never per step, and no capture is warned about; every
    completion runs to its budget and its records equal a teacher-forced pass to 2e-6: they are
    float32, as the step's logits are, whose rounding at log-probs near -5 is about 5e-7."""
    monkeypatch.setattr(graph_module, "_WARNED", set())
    monkeypatch.setattr(static_batch, "SPAN", span)
    model = tiny_llama().double().to(graph_device)
    prompts = [PROMPTS[i % 4] + [i + 3] for i in range(8)]
    sampling = replace(SAMPLINGS[1], max_new_tokens=20, check_every=3, decode="graphs")
    recorder = BehaviourRecorder(sampling.temperature, sparse_rows)
    ids, mask = (t.to(graph_device) for t in left_pad(prompts, 0))
    own = torch.tensor(BUDGETS, device=graph_device).repeat_interleave(2)
    forwards = []
    handle = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            tokens = static_decode(model, ids, mask, 2, sampling, 0, [VOCAB + 5], True, recorder,
                                   budgets=own, capture=True)  # fmt: skip
        finally:
            handle.remove()
    assert not [w for w in caught if "model.sampling" in str(w.message)]
    start, cache = ids.shape[1], 32  # S, and L: S + 20 rounded up to 16
    buckets = [16] * 5 + [8] * 3 + [4] * 6 + [2] * 5  # the steps that choose tokens 1 to 19
    seen = [min(cache, -(-(start + t) // span) * span) for t in range(1, 20)]
    steps = list(zip(buckets, seen, strict=True))
    captures = 1 + sum(1 for t in range(1, 19) if steps[t] != steps[t - 1])
    assert len(forwards) == 1 + 1 + captures
    response, truncated = sampling_module.response_mask_of(tokens, [VOCAB + 5], own)
    assert torch.equal(response.sum(-1), own) and truncated.all()
    records_match_a_teacher_forced_pass(
        model, ids, mask, 2, tokens, response, recorder.finish(tokens), sampling.temperature, 2e-6
    )


def test_a_compiled_step_is_captured_and_cuts_the_dynamic_loops_completions(
    graph_device, monkeypatch
):
    """Captured, float64, greedy, budgets and stops at several lengths, reads every 3 steps,
    spans of 8: with ``compile_step`` the captured steps run what the compiler made
    (graphs compiled, no failure) and the completions are the dynamic loop's, cut where they
    stop; nothing is warned (no capture nor compilation fell back)."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(graph_module, "_WARNED", set())
    monkeypatch.setattr(static_batch, "SPAN", 8)
    model = tiny_llama().double().to(graph_device)
    sampling = SamplingConfig(max_new_tokens=20, decode="graphs", check_every=3,
                              compile_step=True)  # fmt: skip
    stops = stops_at_several_lengths(model, PROMPTS, 20)
    ids, mask = (t.to(graph_device) for t in left_pad(PROMPTS, 0))
    own = torch.tensor([3, 20, 1, 12], device=graph_device).repeat_interleave(2)
    args = (model, ids, mask, 2, sampling, 0, stops, False)
    before = counters["stats"]["unique_graphs"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        static = static_decode(*args, budgets=own, capture=True)
    assert not [w for w in caught if "model.sampling" in str(w.message)]
    assert counters["stats"]["unique_graphs"] > before
    assert static_batch.compiled_step(model).failure is None
    dynamic = decode(*args, budgets=own)
    assert_cut_where_the_dynamic_loop_stops(static, dynamic, stops, own)
