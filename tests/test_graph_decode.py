"""Decoding from a static KV cache in buckets (lightning_troll.engines.graph_decode) against the
dynamic loop, a teacher-forced pass and the option's checks.

On a CPU the static path runs without graph capture (``static_decode(..., capture=False)``):
the same cache, buckets, compaction and draws as under CUDA graphs, each step run eagerly. The
tests that take ``graph_device`` capture the graphs: on a CPU through a stand-in for them
(``tests/graph_stand_in.py``), and on the device, marked ``cuda`` (``make gpu-check`` runs
them)."""

from __future__ import annotations

import warnings
from dataclasses import replace
from functools import partial

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import LlamaForCausalLM, MistralConfig, MistralForCausalLM

from lightning_troll.engines import graph_decode as graph_module
from lightning_troll.engines import sampling as sampling_module
from lightning_troll.engines import static_batch as static_batch_module
from lightning_troll.engines.behaviour import BehaviourRecorder
from lightning_troll.engines.decode import decode
from lightning_troll.engines.graph_decode import cannot_capture, graph_decode, static_decode
from lightning_troll.engines.sampling import SamplingConfig, left_pad, sample
from lightning_troll.rollouts.rollout import behaviour_outputs
from tests.test_decode import PROMPTS, VOCAB, sparse_rows, stops_at_several_lengths, tiny_llama

SAMPLINGS = [
    SamplingConfig(temperature=1.0, max_new_tokens=12),
    SamplingConfig(temperature=0.7, top_k=5, max_new_tokens=12),
    SamplingConfig(temperature=1.3, top_p=0.8, top_k=9, max_new_tokens=12),
]


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.fixture(scope="module")
def llama64():
    """The tiny llama in float64: both paths' logits then agree to ~1e-15, so argmax and the
    inverse-CDF draws cannot split on rounding."""
    return tiny_llama().double()


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Every test starts with no fallback reason warned about yet."""
    monkeypatch.setattr(graph_module, "_WARNED", set())


def both_paths(model, prompts, group, sampling, stops, do_sample, seed=0, budgets=None,
               recorders=(None, None), capture=False):  # fmt: skip
    """The (B, T) tokens of the static path and of the dynamic loop, each from ``seed``."""
    ids, mask = left_pad(prompts, 0)
    args = (model, ids, mask, group, sampling, 0, stops, do_sample)
    own = None if budgets is None else torch.tensor(budgets).repeat_interleave(group)
    torch.manual_seed(seed)
    static = static_decode(*args, recorder=recorders[0], budgets=own, capture=capture)
    torch.manual_seed(seed)
    dynamic = decode(*args, recorder=recorders[1], budgets=own)
    return static, dynamic


def forward_rows(model):
    """A list that a forward hook fills with each forward's (rows, width) of ``input_ids``."""
    shapes = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
        with_kwargs=True,
    )
    return shapes, handle


# ------------------------------------------------------------------------------ the tokens


@pytest.mark.parametrize("group", [1, 3])
def test_greedy_tokens_equal_the_dynamic_loops(llama64, group):
    """Prompts of 1 to 9 tokens (left padded), two stop ids ending completions at several steps:
    the same (B, T) tokens, padding and length included."""
    sampling = SamplingConfig(max_new_tokens=10)
    stops = stops_at_several_lengths(llama64, PROMPTS, 10)
    static, dynamic = both_paths(llama64, PROMPTS, group, sampling, stops, False)
    assert torch.equal(static, dynamic)
    ended = (torch.isin(static, torch.tensor(stops))).any(-1)
    assert ended.any() and not ended.all()


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["plain", "top_k", "top_p"])
def test_a_seed_draws_the_dynamic_loops_tokens(llama64, sampling):
    """The static path draws from the running sequences' logits only, in the order of B, so
    it takes the dynamic loop's random numbers: the same seed gives the same completions,
    across temperature, top-k and top-p, and another seed other ones."""
    stops = [VOCAB - 1, 7]
    static, dynamic = both_paths(llama64, PROMPTS, 4, sampling, stops, True, seed=11)
    assert torch.equal(static, dynamic)
    other, _ = both_paths(llama64, PROMPTS, 4, sampling, stops, True, seed=12)
    assert not torch.equal(other, static)


def test_the_static_path_through_sample_gives_every_output_of_the_dynamic_loop(llama64,
                                                                               monkeypatch):  # fmt: skip
    """``sample`` with the static path in place of the graphs (ids, attention and response
    masks, truncation) equals ``sample`` on the dynamic loop, with budgets of its own."""
    sampling = SamplingConfig(max_new_tokens=10, decode="graphs")
    stops = stops_at_several_lengths(llama64, PROMPTS, 10)
    budgets = [3, 10, 1, 6]
    torch.manual_seed(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        theirs = sample(llama64, PROMPTS, 2, sampling, 0, stops, True, budgets=budgets)
    assert [str(w.message) for w in caught if "decode" in str(w.message)]  # no CUDA: warned
    monkeypatch.setattr(sampling_module, "graph_decode", partial(static_decode, capture=False))
    monkeypatch.setattr(
        sampling_module, "decode", lambda *a, **k: pytest.fail("the dynamic loop ran")
    )
    torch.manual_seed(3)
    ours = sample(llama64, PROMPTS, 2, sampling, 0, stops, True, budgets=budgets)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------- budgets and buckets


def test_each_prompts_budget_ends_its_completions_there(llama64):
    """Budgets of 3, 10, 1 and 6 tokens: each completion is the one without budgets cut at its
    own, as on the dynamic loop, greedy and sampled."""
    sampling = SamplingConfig(max_new_tokens=10)
    stops = stops_at_several_lengths(llama64, PROMPTS, 10)
    free, _ = both_paths(llama64, PROMPTS, 2, sampling, stops, False)
    budgets = [3, 10, 1, 6]
    static, dynamic = both_paths(llama64, PROMPTS, 2, sampling, stops, False, budgets=budgets)
    assert torch.equal(static, dynamic)
    own = torch.tensor(budgets).repeat_interleave(2)  # (B,)
    response, _ = sampling_module.response_mask_of(static, stops, own)  # (B, T)
    free_lengths = sampling_module.response_mask_of(free, stops)[0].sum(-1)  # (B,)
    assert torch.equal(response.sum(-1), torch.minimum(free_lengths, own))
    for seed in (1, 2):
        static, dynamic = both_paths(llama64, PROMPTS, 2, SAMPLINGS[1], stops, True, seed, budgets)
        assert torch.equal(static, dynamic)


def test_buckets_follow_the_running_sequences_and_keep_every_token(llama64):
    """8 prompts x 2 completions with budgets of 1, 2, 3, 4, 5, 8, 13 and 20 tokens (and no stop
    token that the model produces): after each step 14, 12, 10, 8, 6, 6, 6, 4, ..., 2 run, and
    the step runs on the bucket of 16 slots until 8 run, then on 8 until 4 run, on 4 until 2
    run, then on 2. Every sequence's tokens are the dynamic loop's, greedy and sampled."""
    prompts = [PROMPTS[i % 4] + [i + 3] for i in range(8)]
    budgets = [1, 2, 3, 4, 5, 8, 13, 20]
    sampling = SamplingConfig(max_new_tokens=20)
    stops = [VOCAB + 5]  # never drawn: only the budgets end completions
    static, dynamic = both_paths(llama64, prompts, 2, sampling, stops, False, budgets=budgets)
    assert torch.equal(static, dynamic)
    ids, mask = left_pad(prompts, 0)
    shapes, handle = forward_rows(llama64)
    try:
        static_decode(llama64, ids, mask, 2, sampling, 0, stops, False,
                      budgets=torch.tensor(budgets).repeat_interleave(2), capture=False)  # fmt: skip
    finally:
        handle.remove()
    running = [2 * sum(b > t for b in budgets) for t in range(1, 20)]  # before each step
    expected = []
    bucket = 16
    for count in running:
        while bucket > 1 and count <= bucket // 2:
            bucket //= 2
        expected.append(bucket)
    assert shapes[0] == (8, max(map(len, prompts)))
    assert [rows for rows, width in shapes[1:]] == expected
    assert expected[:3] == [16] * 3 and expected[3] == 8 and expected[-1] == 2
    for seed in (4, 5):
        static, dynamic = both_paths(llama64, prompts, 2, SAMPLINGS[2], stops, True, seed, budgets)
        assert torch.equal(static, dynamic)


# ---------------------------------------------------------------------------- the recorder


@pytest.mark.parametrize("sampling", SAMPLINGS[1:], ids=["top_k", "top_p"])
@pytest.mark.parametrize("every", [1, 3])
def test_recorded_rows_equal_a_teacher_forced_pass(llama, sampling, every):
    """float32, as the dynamic loop's test holds it: the sampled tokens' log-probs to 1e-5, the
    same sparse supports and the kept tokens' probabilities to 1e-5, at every response token of
    sequences that ended at several steps and were moved between buckets; with the stop flags
    read at every step, and every 3 (stopped sequences sampling on until a read)."""
    sampling = replace(sampling, check_every=every)
    stops = stops_at_several_lengths(llama, PROMPTS, 8)
    recorder = BehaviourRecorder(sampling.temperature, sparse_rows)
    ids, mask = left_pad(PROMPTS, 0)
    torch.manual_seed(0)
    tokens = static_decode(llama, ids, mask, 4, sampling, 0, stops, True, recorder, capture=False)
    response, _ = sampling_module.response_mask_of(tokens, stops)
    assert len(set(response.sum(-1).tolist())) >= 3
    full = torch.cat([ids.repeat_interleave(4, 0), tokens.masked_fill(~response, 0)], dim=-1)
    attention = torch.cat([mask.repeat_interleave(4, 0), response.long()], dim=-1)
    logp, old = recorder.finish(tokens).outputs(response)
    logp_ref, old_ref = behaviour_outputs(llama, full, attention, response, sampling.temperature,
                                          sparse_rows)  # fmt: skip
    torch.testing.assert_close(logp, logp_ref, rtol=0, atol=1e-5)
    assert torch.equal(old.indices, old_ref.indices)
    kept = old.indices >= 0
    torch.testing.assert_close(old.logprobs[kept].exp(), old_ref.logprobs[kept].exp(), rtol=0,
                               atol=1e-5)  # fmt: skip


class DeviceReads(TorchFunctionMode):
    """Counts the reads of tensor values by the host (each a wait on a GPU), outside the model's
    forward (``count``) and inside its forwards after the first, the prefill (``in_steps``):
    scalar and list reads, ``nonzero`` and boolean-mask indexing."""

    READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero"}

    def __init__(self, model):
        super().__init__()
        self.count, self.in_steps, self.forwards, self.inside = 0, 0, 0, False
        self.hooks = [
            model.register_forward_pre_hook(lambda *_: self._enter()),
            model.register_forward_hook(lambda *_: setattr(self, "inside", False)),
        ]

    def _enter(self):
        self.inside, self.forwards = True, self.forwards + 1

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        masked = name in ("__getitem__", "__setitem__") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if isinstance(args[1], tuple) else (args[1],))
        )
        if name in self.READS or masked:
            if not self.inside:
                self.count += 1
            elif self.forwards > 1:
                self.in_steps += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("loop", ["static", "dynamic"])
def test_a_recording_step_reads_the_device_once(llama, loop):
    """A read from the device is a wait on a GPU. With a read-free recorder (what a GPU gets)
    a step reads once outside the model's forward (its running flags with the draw's and the
    recorder's checks), and once more on a step where sequences ended; a reading recorder adds
    reads at every step (so the count sees them). Inside the forwards only the prefill reads
    (transformers' checks whether it may skip the sdpa mask): the steps hand it a 4-D mask."""
    sampling = SamplingConfig(temperature=0.9, top_k=9, max_new_tokens=8)
    stops = stops_at_several_lengths(llama, PROMPTS, 8)
    ids, mask = left_pad(PROMPTS, 0)

    def reads(read_free):
        recorder = BehaviourRecorder(sampling.temperature, sparse_rows, read_free=read_free)
        torch.manual_seed(0)
        with DeviceReads(llama) as counted:
            if loop == "static":
                tokens = static_decode(llama, ids, mask, 4, sampling, 0, stops, True, recorder,
                                       capture=False)  # fmt: skip
            else:
                tokens = decode(llama, ids, mask, 4, sampling, 0, stops, True, recorder)
        recorder.finish(tokens)
        assert counted.forwards == tokens.shape[1] and counted.in_steps == 0
        return counted.count, tokens

    free, tokens = reads(True)
    response, truncated = sampling_module.response_mask_of(tokens, stops)
    ended = set((response.sum(-1) - 1)[~truncated].tolist())  # steps where sequences ended
    assert len(ended) >= 2 and tokens.shape[1] > max(ended)
    assert free == tokens.shape[1] + len(ended)
    reading, _ = reads(False)
    assert reading >= free + 3 * tokens.shape[1]


# ------------------------------------------------------------------------------- fallback


def test_graphs_asked_for_without_cuda_warn_once_and_the_dynamic_loop_samples(llama):
    """``decode: graphs`` on a CPU: one warning naming the reason over two calls, and the
    completions the dynamic loop gives; ``auto`` and ``dynamic`` sample the same, silently."""
    stops = [VOCAB - 1]
    results = {}
    for mode in ("graphs", "auto", "dynamic"):
        sampling = SamplingConfig(max_new_tokens=6, decode=mode)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                torch.manual_seed(9)
                results[mode] = sample(llama, PROMPTS, 2, sampling, 0, stops, True)
        messages = [str(w.message) for w in caught]
        if mode == "graphs":
            assert messages == [
                "model.sampling.decode: CUDA-graph decoding cannot serve this model (no CUDA "
                "device); the dynamic decoding loop samples instead"
            ]
        else:
            assert messages == []
    for a, b, c in zip(results["graphs"], results["auto"], results["dynamic"], strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_what_capture_cannot_serve_is_named():
    """A CUDA device is asked for first; then the dynamic loop's refusals, a sliding window in
    the static cache, and an attention implementation that takes no 4-D mask."""
    cuda = torch.device("cuda")
    plain = tiny_llama()
    assert cannot_capture(plain, torch.device("cpu")) == "no CUDA device"
    assert cannot_capture(plain, cuda) is None
    windowed = tiny_llama(MistralForCausalLM, MistralConfig, sliding_window=4)
    assert "SlidingWindow" in cannot_capture(windowed, cuda)
    assert cannot_capture(tiny_llama(OwnMask), cuda) == "OwnMask builds its own attention mask"
    plain.config._attn_implementation = "flash_attention_2"
    assert cannot_capture(plain, cuda) == (
        "its attention implementation 'flash_attention_2' takes no 4-D mask"
    )


class OwnMask(LlamaForCausalLM):
    """A model whose module does not build masks with transformers' ``create_causal_mask``."""


@pytest.mark.parametrize("cls", [LlamaForCausalLM, OwnMask])
def test_the_dynamic_loop_hands_a_4d_mask_only_to_a_model_that_takes_it(cls):
    """Steps after the prefill get an additive (n, 1, 1, S + t) mask where transformers' masks
    pass it through, a 2-D one elsewhere; greedy tokens are the same either way."""
    model = tiny_llama(cls).double()
    masks = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: masks.append(kwargs["attention_mask"]), with_kwargs=True
    )
    ids, mask = left_pad(PROMPTS, 0)
    tokens = decode(model, ids, mask, 2, SamplingConfig(max_new_tokens=6), 0, [VOCAB - 1], False)
    handle.remove()
    steps = masks[1:]
    assert len(steps) == 5 and steps[0].shape[0] == 2 * len(PROMPTS)
    if cls is OwnMask:
        assert all(m.dim() == 2 for m in steps)
    else:
        assert all(m.dim() == 4 and m.dtype == torch.float64 for m in steps)
        lowest = torch.finfo(torch.float64).min
        first = mask.repeat_interleave(2, 0)  # (B, S), left padding at 0
        seen = torch.cat([first, torch.ones(first.shape[0], 1, dtype=first.dtype)], -1)
        expected = torch.zeros(seen.shape, dtype=torch.float64).masked_fill(seen == 0, lowest)
        assert torch.equal(steps[0][:, 0, 0], expected) and (seen == 0).any()
    plain = decode(tiny_llama().double(), ids, mask, 2, SamplingConfig(max_new_tokens=6), 0,
                   [VOCAB - 1], False)  # fmt: skip
    assert torch.equal(tokens, plain)


def test_a_failed_capture_falls_back_before_any_draw(llama, monkeypatch):
    """Where the first capture fails, ``graph_decode`` warns once and returns None having drawn
    no random number, so ``sample`` gives what the dynamic loop gives with the same seed."""
    monkeypatch.setattr(graph_module, "cannot_capture", lambda model, device: None)
    monkeypatch.setattr(static_batch_module.StaticBatch, "capture",
                        lambda self: "RuntimeError: operation not permitted when stream is capturing")  # fmt: skip
    sampling = SamplingConfig(max_new_tokens=6, decode="graphs")
    ids, mask = left_pad(PROMPTS, 0)
    torch.manual_seed(2)
    state = torch.get_rng_state()
    with pytest.warns(UserWarning, match=r"capturing its decode step failed \(RuntimeError: "):
        assert graph_decode(llama, ids, mask, 2, sampling, 0, [VOCAB - 1], True) is None
    assert torch.equal(torch.get_rng_state(), state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(2)
        ours = sample(llama, PROMPTS, 2, sampling, 0, [VOCAB - 1], True)
    assert caught == []  # warned once already
    torch.manual_seed(2)
    theirs = sample(llama, PROMPTS, 2, SamplingConfig(max_new_tokens=6, decode="dynamic"), 0,
                    [VOCAB - 1], True)  # fmt: skip
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------- the option


@pytest.mark.parametrize("value", ["fast", "Graphs", "", None])
def test_unknown_decode_values_are_refused(value):
    with pytest.raises(ValueError, match=r"model.sampling.decode must be one of auto, dynamic, "
                       r"graphs; got "):  # fmt: skip
        SamplingConfig(decode=value)


def test_the_option_reaches_the_command_line_with_its_default(tmp_path, monkeypatch, capsys):
    import yaml

    from lightning_troll.cli.command import run

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        run(["fit", "--print_config"])
    assert yaml.safe_load(capsys.readouterr().out)["model"]["sampling"]["decode"] == "auto"
    with pytest.raises(SystemExit):
        run(["fit", "--model.sampling.decode", "fast", "--print_config"])
    error = capsys.readouterr().err
    assert "decode" in error and "graphs" in error


# ----------------------------------------------------------------------------- captured


def test_captured_graphs_equal_the_dynamic_loop(graph_device):
    """Captured graphs: greedy tokens equal the dynamic loop's in float64, with the
    model's forward called only to prefill and to capture (1 + 1 per bucket, the recording, and
    one warm-up before the first), never per step; a seed draws the same completions; no
    fallback warned."""
    model = tiny_llama().double().to(graph_device)
    prompts = [PROMPTS[i % 4] + [i + 3] for i in range(8)]
    budgets = [1, 2, 3, 4, 5, 8, 13, 20]
    sampling = SamplingConfig(max_new_tokens=20, decode="graphs")
    ids, mask = (t.to(graph_device) for t in left_pad(prompts, 0))
    own = torch.tensor(budgets, device=graph_device).repeat_interleave(2)
    stops = [VOCAB + 5]  # never drawn: only the budgets end completions
    shapes, handle = forward_rows(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ours = graph_decode(model, ids, mask, 2, sampling, 0, stops, False, budgets=own)
        finally:
            handle.remove()
        theirs = decode(model, ids, mask, 2, sampling, 0, stops, False, budgets=own)
        assert torch.equal(ours, theirs)
        assert len(shapes) == 1 + 1 + 4  # buckets of 16, 8, 4 and 2 slots
        graphs = replace(SAMPLINGS[2], decode="graphs")
        for seed in (1, 2):
            torch.manual_seed(seed)
            ours = graph_decode(model, ids, mask, 2, graphs, 0, stops, True, budgets=own)
            torch.manual_seed(seed)
            theirs = decode(model, ids, mask, 2, graphs, 0, stops, True, budgets=own)
            assert torch.equal(ours, theirs)
    assert not [w for w in caught if "model.sampling.decode" in str(w.message)]


def test_captured_graphs_record_a_teacher_forced_passs_log_probs(graph_device):
    """float32, TF32 off on the device: the recorded log-probs equal a teacher-forced pass's to
    1e-5 plus 1e-5 of their size, and the sparse rows keep the same tokens. On a CPU the bound is
    1e-5 alone; on the device the step and the pass run different kernels (a one-row product and
    attention from one query, against a whole sequence's), whose float32 sums are ordered
    differently: on one H200 the largest difference was 1.45e-5 at a log-prob of -2.36 (6.1e-6 of
    it), one value in 128."""
    model = tiny_llama().to(graph_device)
    sampling = SamplingConfig(temperature=0.7, top_k=5, max_new_tokens=8, decode="graphs")
    stops = stops_at_several_lengths(model, PROMPTS, 8)
    ids, mask = (t.to(graph_device) for t in left_pad(PROMPTS, 0))
    recorder = BehaviourRecorder(sampling.temperature, sparse_rows)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        torch.manual_seed(0)
        tokens = graph_decode(model, ids, mask, 4, sampling, 0, stops, True, recorder)
        response, _ = sampling_module.response_mask_of(tokens, stops)
        full = torch.cat([ids.repeat_interleave(4, 0), tokens.masked_fill(~response, 0)], -1)
        attention = torch.cat([mask.repeat_interleave(4, 0), response.long()], dim=-1)
        logp, old = recorder.finish(tokens).outputs(response)
        logp_ref, old_ref = behaviour_outputs(model, full, attention, response, 0.7, sparse_rows)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    torch.testing.assert_close(logp, logp_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(old.indices, old_ref.indices)


def test_a_forward_that_cannot_be_captured_falls_back(graph_device, monkeypatch):
    """A forward that reads a value to the host (illegal while a stream is captured): the
    capture fails, ``graph_decode`` warns and returns None before any draw, and the device is
    still usable: ``sample`` gives the dynamic loop's completions for the same seed."""
    monkeypatch.setattr(graph_module, "_WARNED", set())
    model = tiny_llama().to(graph_device)

    def read(module, args, kwargs) -> None:  # a pre-hook returns None to leave the inputs be
        kwargs["input_ids"].sum().item()

    handle = model.register_forward_pre_hook(read, with_kwargs=True)
    sampling = SamplingConfig(max_new_tokens=6, decode="graphs")
    try:
        ids, mask = (t.to(graph_device) for t in left_pad(PROMPTS, 0))
        with pytest.warns(UserWarning, match="capturing its decode step failed"):
            assert graph_decode(model, ids, mask, 2, sampling, 0, [VOCAB - 1], True) is None
        torch.manual_seed(4)
        ours = sample(model, PROMPTS, 2, sampling, 0, [VOCAB - 1], True)
        torch.manual_seed(4)
        theirs = sample(model, PROMPTS, 2, SamplingConfig(max_new_tokens=6, decode="dynamic"),
                        0, [VOCAB - 1], True)  # fmt: skip
    finally:
        handle.remove()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
