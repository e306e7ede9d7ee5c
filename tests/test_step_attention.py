"""A decoding step's attention (engines/step_attention.py): grouped queries from one query without a
copy of the cache, equal to the repeated heads' attention and used by the decoding loops; cuDNN's
attention last on a GPU; both given back after the loops."""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from lightning_troll.engines import graph_decode, static_batch
from lightning_troll.engines import step_attention as attention
from lightning_troll.engines.behaviour import BehaviourRecorder
from lightning_troll.engines.decode import decode, no_additive_mask
from lightning_troll.engines.graph_decode import static_decode
from lightning_troll.engines.sampling import SamplingConfig, left_pad, sample
from tests.test_decode import PROMPTS, VOCAB, stops_at_several_lengths, tiny_llama
from tests.test_graph_decode import DeviceReads


def grouped(n=3, heads=4, kv=2, length=7, size=8, query=1):
    """A float64 attention's inputs: query (n, heads, query, size), keys and values (n, kv,
    length, size), and an additive mask (n, 1, query, length) hiding a different prefix of each
    row (left padding)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, heads, query, size, generator=g, dtype=torch.float64)
    k, v = (torch.randn(n, kv, length, size, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.zeros(n, 1, query, length, dtype=torch.float64)
    for row in range(n):
        mask[row, ..., :row] = torch.finfo(torch.float64).min
    return SimpleNamespace(num_key_value_groups=heads // kv, is_causal=True), q, k, v, mask


@pytest.mark.parametrize("masked", [True, False])
def test_one_query_equals_the_repeated_heads(masked):
    module, q, k, v, mask = grouped()
    mask = mask if masked else None
    ours, _ = attention.one_query_attention(module, q, k, v, mask, scaling=0.3)
    groups = module.num_key_value_groups
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask, scale=0.3
    ).transpose(1, 2)  # (n, 1, heads, size)
    assert ours.shape == (3, 1, 4, 8)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-12)


def test_several_queries_go_to_sdpa_unchanged():
    module, q, k, v, _ = grouped(query=7)
    mask = torch.triu(torch.full((7, 7), -1e30, dtype=torch.float64), 1).expand(3, 1, 7, 7)
    ours, _ = attention.one_query_attention(module, q, k, v, mask)
    theirs, _ = sdpa_attention_forward(module, q, k, v, mask)
    assert torch.equal(ours, theirs)


class QueryShapes(TorchFunctionMode):
    """Records the shape of every query handed to ``scaled_dot_product_attention``."""

    def __init__(self) -> None:
        super().__init__()
        self.queries: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.queries.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("loop", [decode, partial(static_decode, capture=False)],
                         ids=["dynamic", "static"])  # fmt: skip
def test_the_decoding_loops_fold_groups_and_keep_their_tokens_and_log_probs(loop):
    """float64: each decoding loop (the dynamic one, the graphs' without capture) draws with the
    folded attention the tokens it draws with transformers' own and records the same log-probs,
    every decoding step's query folded (2 key/value heads of 2 queries, no repeated keys); the
    model's implementation comes back after the loop."""
    model = tiny_llama().double()
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=8)
    stops = stops_at_several_lengths(model, PROMPTS, 8)
    ids, mask = left_pad(PROMPTS, 0)
    runs = []
    for force in (False, True):
        recorder = BehaviourRecorder(sampling.temperature)
        shapes = QueryShapes()
        torch.manual_seed(3)
        with attention.grouped_query_steps(model, force=force), shapes:
            inside = model.config._attn_implementation
            tokens = loop(model, ids, mask, 2, sampling, 0, stops, True, recorder)
        logp, _ = recorder.finish(tokens).outputs(tokens != 0)
        runs.append((inside, tokens, logp, shapes.queries))
    (plain, tokens, logp, _), (folded, tokens_f, logp_f, queries) = runs
    assert plain == ("sdpa" if not attention.sdpa_copies_groups() else attention.NAME)
    assert folded == attention.NAME and model.config._attn_implementation == "sdpa"
    assert torch.equal(tokens, tokens_f)
    torch.testing.assert_close(logp_f, logp, rtol=0, atol=1e-12)
    steps = [shape for shape in queries if shape[2] != ids.shape[1]]  # not the prefill's
    assert steps and all(shape[1:3] == (2, 2) for shape in steps)


def test_the_implementation_comes_back_after_a_failure_and_others_are_left_alone():
    """Given back after a failure; a model with eager attention, or with as many key/value heads
    as query heads, keeps its own even where forced."""
    model = tiny_llama()
    with (
        pytest.raises(RuntimeError, match="planted"),
        attention.grouped_query_steps(model, force=True),
    ):
        assert model.config._attn_implementation == attention.NAME
        raise RuntimeError("planted")
    assert model.config._attn_implementation == "sdpa"
    eager = tiny_llama(attn_implementation="eager")
    with attention.grouped_query_steps(eager, force=True):
        assert eager.config._attn_implementation == "eager"
    ungrouped = tiny_llama(num_key_value_heads=4)
    with attention.grouped_query_steps(ungrouped, force=True):
        assert ungrouped.config._attn_implementation == "sdpa"


FLASH, EFFICIENT, MATH, CUDNN = (int(b) for b in (SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION))  # fmt: skip


def enabled_order() -> list[int]:
    """The attention backends in PyTorch's priority order, those enabled only."""
    cuda = torch.backends.cuda
    on = {FLASH: cuda.flash_sdp_enabled(), EFFICIENT: cuda.mem_efficient_sdp_enabled(),
          MATH: cuda.math_sdp_enabled(), CUDNN: cuda.cudnn_sdp_enabled()}  # fmt: skip
    return [b for b in torch._C._get_sdp_priority_order() if on.get(b, False)]


def test_cudnn_comes_last_on_cuda_and_the_order_comes_back():
    """With cuDNN first and flash disabled before (set here, as a GPU's torch may order them),
    a CUDA device gets memory-efficient, math, then cuDNN, flash still disabled, and the order
    and flags come back after the block; a CPU device changes nothing. Flags only: no CUDA
    device is needed."""
    before = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(before, set_priority=True):
        assert enabled_order() == [CUDNN, EFFICIENT, MATH]
        with attention.cudnn_attention_last(torch.device("cpu")):
            assert enabled_order() == [CUDNN, EFFICIENT, MATH]
        with attention.cudnn_attention_last(torch.device("cuda")):
            assert enabled_order() == [EFFICIENT, MATH, CUDNN]
            assert not torch.backends.cuda.flash_sdp_enabled()
        assert enabled_order() == [CUDNN, EFFICIENT, MATH]


@pytest.mark.cuda
def test_sampling_on_cuda_runs_with_cudnn_last_and_gives_the_order_back(monkeypatch):
    """Every forward of ``sample`` on the device (prefill, steps, captures) sees cuDNN last,
    with cuDNN first before and after it; the CUDA-graph path serves the model, whatever
    attention the loops lend it (no fallback warned)."""
    monkeypatch.setattr(graph_decode, "_WARNED", set())
    model = tiny_llama().to("cuda")
    seen = []
    handle = model.register_forward_pre_hook(lambda *_: seen.append(enabled_order()))
    first = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # fmt: skip
    try:
        with sdpa_kernel(first, set_priority=True), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sample(model, PROMPTS, 2, SamplingConfig(max_new_tokens=6), 0, [2], True)
            assert enabled_order()[0] == CUDNN
    finally:
        handle.remove()
    assert seen and all(order[-1] == CUDNN and order[0] == FLASH for order in seen)
    assert not [w for w in caught if "model.sampling.decode" in str(w.message)]


class KeyLengths(TorchFunctionMode):
    """Records the query and key lengths of every ``scaled_dot_product_attention`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.calls.append((args[0].shape[2], args[1].shape[2]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fold", [False, True], ids=["sdpa", "folded"])
def test_a_static_step_attends_over_the_positions_it_can_see(monkeypatch, fold):
    """float64, greedy, the visible positions widened in steps of 4: every decoding step of the
    static loop hands the attention kernel the keys up to the next multiple of 4 past the
    position it writes (at most the cache's L), not all L, with transformers' ``sdpa`` lent the
    cut and with the fold lent; the tokens are the dynamic loop's."""
    monkeypatch.setattr(static_batch, "SPAN", 4)
    model = tiny_llama().double()
    sampling = SamplingConfig(max_new_tokens=10)
    ids, mask = left_pad(PROMPTS, 0)
    stops = [VOCAB + 5]  # never drawn: every completion runs to 10 tokens
    start, layers = ids.shape[1], model.config.num_hidden_layers  # S: the first step's position
    cache = -(-(start + 10) // 16) * 16  # L
    lengths = KeyLengths()
    lent = attention.grouped_query_steps(model, force=True) if fold else nullcontext()
    with lent, lengths:
        static = static_decode(model, ids, mask, 2, sampling, 0, stops, False, capture=False)
    assert torch.equal(static, decode(model, ids, mask, 2, sampling, 0, stops, False))
    steps = [keys for _, keys in lengths.calls[layers:]]  # after the prefill's
    expected = [min(cache, -(-(slot + 1) // 4) * 4) for slot in range(start, start + 9)]
    assert steps == [keys for keys in expected for _ in range(layers)]
    assert len(set(expected)) >= 3 and max(expected) < cache
    assert model.config._attn_implementation == "sdpa"


def test_a_static_step_of_eager_attention_gets_the_whole_mask(monkeypatch):
    """Eager attention is lent nothing that cuts the keys: its steps get the mask of all L
    positions (a mask of the visible ones would not match its keys), and with spans of 4 the
    static loop's greedy tokens are the dynamic loop's."""
    monkeypatch.setattr(static_batch, "SPAN", 4)
    model = tiny_llama(attn_implementation="eager").double()
    widths = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["attention_mask"].shape[-1]),
        with_kwargs=True,
    )
    sampling = SamplingConfig(max_new_tokens=10)
    ids, mask = left_pad(PROMPTS, 0)
    try:
        static = static_decode(model, ids, mask, 2, sampling, 0, [VOCAB + 5], False,
                               capture=False)  # fmt: skip
    finally:
        handle.remove()
    cache = -(-(ids.shape[1] + 10) // 16) * 16  # L
    assert widths[1:] == [cache] * 9  # after the prefill's
    assert torch.equal(static, decode(model, ids, mask, 2, sampling, 0, [VOCAB + 5], False))


def test_the_lent_attention_takes_a_4d_mask_and_the_dynamic_loop_reads_nothing_in_its_steps():
    """Lent the fold (as ``sample`` lends it where transformers copies grouped heads) or the cut
    to visible positions, the model still takes the loops' additive 4-D mask as it is: the
    CUDA-graph path serves it, and the dynamic loop's steps read nothing from the device."""
    model = tiny_llama()
    for lent in (attention.grouped_query_steps(model, force=True), attention.prefix_steps(model)):
        with lent:
            assert model.config._attn_implementation in attention.LENT
            assert no_additive_mask(model) is None
    sampling = SamplingConfig(temperature=0.9, max_new_tokens=6)
    ids, mask = left_pad(PROMPTS, 0)
    with attention.grouped_query_steps(model, force=True), DeviceReads(model) as counted:
        tokens = decode(model, ids, mask, 2, sampling, 0, [VOCAB + 5], True)
    assert tokens.shape[1] == 6 and counted.forwards == 6 and counted.in_steps == 0
