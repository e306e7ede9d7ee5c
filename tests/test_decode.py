"""The decoding loop of rollouts (lightning_troll.engines.decode) against ``generate``, the
model's own distribution and a teacher-forced pass."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lightning_troll.engines import choice as choice_module
from lightning_troll.engines import decode as decode_module
from lightning_troll.engines import sampling as sampling_module
from lightning_troll.engines.behaviour import BehaviourRecorder
from lightning_troll.engines.choice import top_k_mask, top_p_mask
from lightning_troll.engines.decode import cannot_decode
from lightning_troll.engines.sampling import SamplingConfig, left_pad, sample
from lightning_troll.models.loading import load_policy, load_tokenizer
from lightning_troll.rollouts.rollout import behaviour_outputs
from lightning_troll.trust_region.sparse import sparsify

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PROMPTS = [[1, 5, 9, 4, 7, 8], [1, 7], [3, 3, 8, 6, 2, 11, 12, 13, 14], [5]]  # left padded
VOCAB = 48


def tiny_llama(cls=LlamaForCausalLM, config=LlamaConfig, **options):
    """A 2-layer llama (grouped-query attention) whose weights are large enough for varied
    completions; the global random state is left as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        settings = dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            initializer_range=0.3,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
        return cls(config(**{**settings, **options})).eval()


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def sparse_rows(logits, tokens, reads=True):
    return sparsify(logits, max_tokens=6, mass_delta=1e-3, keep=tokens, reads=reads)


def generated(
    model, prompts, group, sampling, stops, do_sample, recorder=None, path="decode", **options
):
    """``sample`` on its decoding loop or (``path="generate"``) on ``generate``; ``options``
    are ``pad`` (0 unless given) and ``budgets``."""
    pad, budgets = options.get("pad", 0), options.get("budgets")
    args = (model, prompts, group, sampling, pad, stops, do_sample, recorder)
    if path == "generate":
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(sampling_module, "decode", lambda *args, **kwargs: None)
            return sample(*args, budgets=budgets)
    return sample(*args, budgets=budgets)


def stops_at_several_lengths(model, prompts, budget):
    """Stop ids that end the greedy completions of ``prompts`` at several different steps."""
    out = generated(model, prompts, 1, SamplingConfig(max_new_tokens=budget), [VOCAB - 1], False)
    tokens = out[0][:, -budget:]
    return sorted({int(tokens[0, 2]), int(tokens[2, 5])})


# ----------------------------------------------------------------------------------- greedy


def test_greedy_equals_generate_on_the_demo_policy():
    """The shipped TinyMath policy, prompts of three lengths: every output of ``sample``
    (ids, masks, truncation) is the same from the decoding loop and from ``generate``."""
    model, tokenizer = load_policy("tinymath"), load_tokenizer("tinymath")
    prompts = [tokenizer.encode(p) for p in ("12+34=", "7-9=", "50+50=", "3+4=")]
    sampling = SamplingConfig(max_new_tokens=6)
    stops = tokenizer.eos_token_id
    ours = generated(model, prompts, 2, sampling, stops, False)
    theirs = generated(model, prompts, 2, sampling, stops, False, path="generate")
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
    assert not ours[3].all()  # the policy answers within the budget


def test_greedy_equals_generate_with_left_padding_and_several_stops(llama):
    """Prompts of 1 to 9 tokens (left padded), two stop ids, completions of several lengths."""
    sampling = SamplingConfig(max_new_tokens=10)
    stops = stops_at_several_lengths(llama, PROMPTS, 10)
    ours = generated(llama, PROMPTS, 3, sampling, stops, False)
    theirs = generated(llama, PROMPTS, 3, sampling, stops, False, path="generate")
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
    lengths = ours[2].sum(-1)  # (B,)
    assert len(set(lengths.tolist())) >= 3, lengths


@pytest.mark.parametrize("kind", ["gpt2", "qwen2"])
def test_greedy_equals_generate_on_other_architectures(kind):
    """GPT-2 (learned positions) and Qwen 2 (grouped-query attention, biases) are served too."""
    if kind == "gpt2":
        model = tiny_llama(GPT2LMHeadModel, GPT2Config, n_embd=32, n_layer=2, n_head=2)
    else:
        model = tiny_llama(Qwen2ForCausalLM, Qwen2Config)
    assert cannot_decode(model) is None
    sampling = SamplingConfig(max_new_tokens=10)
    ours = generated(model, PROMPTS, 2, sampling, [VOCAB - 1], False)
    theirs = generated(model, PROMPTS, 2, sampling, [VOCAB - 1], False, path="generate")
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


def test_finished_sequences_are_not_decoded_further(llama):
    """The prefill runs each prompt once (P rows), and each later forward runs exactly the
    sequences that have not ended: a completion of L tokens takes part in L - 1 of them."""
    sampling = SamplingConfig(max_new_tokens=10)
    stops = stops_at_several_lengths(llama, PROMPTS, 10)
    shapes = []
    handle = llama.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
        with_kwargs=True,
    )
    try:
        _, _, response_mask, _ = generated(llama, PROMPTS, 3, sampling, stops, False)
    finally:
        handle.remove()
    lengths = response_mask.sum(-1)  # (B,)
    assert shapes[0] == (len(PROMPTS), max(map(len, PROMPTS)))
    steps = [rows for rows, width in shapes[1:] if width == 1]
    assert len(steps) == len(shapes) - 1 == int(lengths.max()) - 1
    assert steps == [int((lengths > t).sum()) for t in range(1, int(lengths.max()))]
    assert sum(steps) == int((lengths - 1).sum()) < len(lengths) * (int(lengths.max()) - 1)


@pytest.mark.parametrize("path", ["decode", "generate"])
def test_each_prompts_own_budget_ends_its_completions_there(llama, path):
    """Budgets of 3, 10, 1 and 6 tokens (an episode's turn gets the room its episode has left):
    each completion is the one without budgets, cut at its own (truncated there, unless it
    stopped first), on the decoding loop and on ``generate`` alike. The padding is a stop
    token, and what lies past a budget is still no response token. The decoding loop runs a
    sequence at its budget no further: it leaves the batch as a finished one does."""
    sampling = SamplingConfig(max_new_tokens=10)
    stops = stops_at_several_lengths(llama, PROMPTS, 10)
    budgets = [3, 10, 1, 6]
    _, _, free_mask, free_truncated = free = generated(llama, PROMPTS, 2, sampling, stops, False)
    own = torch.tensor(budgets).repeat_interleave(2)  # (B,)
    lengths = torch.minimum(free_mask.sum(-1), own)  # (B,)
    shapes = []
    handle = llama.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
        with_kwargs=True,
    )
    try:
        ids, attention, response, truncated = generated(
            llama, PROMPTS, 2, sampling, stops, False, path=path, budgets=budgets, pad=stops[0]
        )
    finally:
        handle.remove()
    assert torch.equal(response.sum(-1), lengths)
    assert torch.equal(truncated, free_truncated | (free_mask.sum(-1) > own))
    assert truncated.any() and not truncated.all()
    width = response.shape[1]
    assert torch.equal(
        ids[:, -width:].masked_fill(~response, -1),
        free[0][:, -free_mask.shape[1] :][:, :width].masked_fill(~response, -1),
    )
    assert torch.equal(attention[:, -width:].bool(), response)
    if path == "decode":
        steps = [rows for rows, w in shapes[1:] if w == 1]
        assert steps == [int((lengths > t).sum()) for t in range(1, int(lengths.max()))]


@pytest.mark.parametrize("budgets", [[3, 10, 1], [3, 10, 1, 0], [3, 11, 1, 6], [3, True, 1, 6]])
def test_budgets_that_do_not_fit_are_refused(llama, budgets):
    with pytest.raises(ValueError, match=r"budgets must be 4 integers \(one per prompt\) from 1 "
                       r"to max_new_tokens 10; got"):  # fmt: skip
        generated(llama, PROMPTS, 2, SamplingConfig(max_new_tokens=10), [VOCAB - 1], False,
                  budgets=budgets)  # fmt: skip


# ------------------------------------------------------------------------------ recording


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(temperature=0.7, max_new_tokens=8),
        SamplingConfig(temperature=1.3, top_p=0.8, top_k=5, max_new_tokens=8),
    ],
)
def test_recorded_rows_equal_a_teacher_forced_pass(llama, sampling):
    """Log-probs and sparse rows recorded on the running sequences only equal a teacher-forced
    pass (float32: the sampled tokens' log-probs and the kept tokens' probabilities to 1e-5,
    the same supports) at every response token of sequences that ended at several steps."""
    stops = stops_at_several_lengths(llama, PROMPTS, 8)
    torch.manual_seed(0)
    recorder = BehaviourRecorder(sampling.temperature, sparse_rows)
    ids, attention, response, _ = generated(llama, PROMPTS, 4, sampling, stops, True, recorder)
    assert len(set(response.sum(-1).tolist())) >= 3  # sequences ended at several steps
    logp, old = recorder.finish(ids[:, -response.shape[1] :]).outputs(response)
    logp_ref, old_ref = behaviour_outputs(llama, ids, attention, response, sampling.temperature,
                                          sparse_rows)  # fmt: skip
    torch.testing.assert_close(logp, logp_ref, rtol=0, atol=1e-5)
    assert old.num_rows == old_ref.num_rows == int(response.sum())
    assert torch.equal(old.indices, old_ref.indices)
    kept = old.indices >= 0  # the kept tokens' probabilities (a log-prob of -10 carries more
    # absolute rounding than the probability it stands for)
    torch.testing.assert_close(old.logprobs[kept].exp(), old_ref.logprobs[kept].exp(), rtol=0,
                               atol=1e-5)  # fmt: skip
    torch.testing.assert_close(old.tail_logmass.exp(), old_ref.tail_logmass.exp(), rtol=0,
                               atol=1e-6)  # fmt: skip


def test_a_plain_logits_processor_still_records_through_generate(llama):
    """A recorder without ``record_rows`` (any logits processor) makes ``sample`` use
    ``generate``, which calls it once per step with all sequences."""

    class Counting(LogitsProcessor):
        def __init__(self):
            self.batches = []

        def __call__(self, input_ids, scores):
            self.batches.append(scores.shape[0])
            return scores

    counting = Counting()
    ids, _, response, _ = generated(llama, PROMPTS, 2, SamplingConfig(max_new_tokens=5), [VOCAB - 1],
                                    True, counting)  # fmt: skip
    assert counting.batches == [len(PROMPTS) * 2] * response.shape[1]


# ------------------------------------------------------------------------------- sampling


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of ``counts`` against ``probs``: the p-value, with the bins
    whose expected count is below 5 pooled into one."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    statistic = ((observed - expected) ** 2 / expected).sum()
    df = torch.tensor(len(expected) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, statistic / 2))


def expected_probs(model, prompt: list[int], sampling: SamplingConfig) -> torch.Tensor:
    """(V,) the next-token distribution ``generate`` samples from after ``prompt``."""
    with torch.no_grad():
        scores = model(input_ids=torch.tensor([prompt])).logits[:, -1].float()  # (1, V)
    scores = scores / sampling.temperature
    if sampling.top_k:
        scores = TopKLogitsWarper(sampling.top_k)(None, scores)
    if sampling.top_p < 1:
        scores = TopPLogitsWarper(sampling.top_p)(None, scores)
    return scores.softmax(-1)[0]


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(temperature=0.7, max_new_tokens=2),
        SamplingConfig(temperature=1.2, top_k=12, top_p=0.9, max_new_tokens=2),
    ],
)
def test_sampled_tokens_follow_the_models_distribution(llama, sampling):
    """3,000 completions of each of two prompts (left padded against each other), fixed seed:
    the first token's frequencies, and the second's after the most frequent first token (so
    through the copied prompt cache), pass Pearson's chi-square test against the model's
    distribution (p > 0.001), and fail it against the distribution at another temperature."""
    prompts, group = [PROMPTS[0], PROMPTS[1]], 3000
    torch.manual_seed(1234)
    ids, _, response, _ = generated(llama, prompts, group, sampling, [VOCAB - 1], True)
    tokens = ids[:, -2:].view(len(prompts), group, 2)  # (P, G, 2)
    hotter = SamplingConfig(temperature=sampling.temperature * 1.5, top_k=sampling.top_k,
                            top_p=sampling.top_p)  # fmt: skip
    for prompt, drawn in zip(prompts, tokens, strict=True):
        first = torch.bincount(drawn[:, 0], minlength=VOCAB)
        assert chi_square_p(first, expected_probs(llama, prompt, sampling)) > 1e-3
        assert chi_square_p(first, expected_probs(llama, prompt, hotter)) < 1e-6
        top = int(first.argmax())
        second = torch.bincount(drawn[drawn[:, 0] == top, 1], minlength=VOCAB)
        assert second.sum() > 300
        assert chi_square_p(second, expected_probs(llama, [*prompt, top], sampling)) > 1e-3
        assert chi_square_p(second, expected_probs(llama, [*prompt, top], hotter)) < 1e-6


def test_a_seed_repeats_a_rollout(llama):
    sampling = SamplingConfig(temperature=1.0, top_p=0.95, max_new_tokens=8)
    runs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        runs.append(generated(llama, PROMPTS, 4, sampling, [VOCAB - 1], True)[0])
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


def test_draw_follows_a_distribution_with_tiny_and_masked_probabilities():
    """200,000 draws from one row whose probabilities span 1e-1 to 1e-9, with two tokens at
    -inf: the counts pass Pearson's test (p > 0.001), fail it against the same distribution
    with two probabilities swapped, and never hit a masked token."""
    scores = torch.tensor([[0.0, -1.0, -2.5, -20.7, float("-inf"), 1.3, -4.0, float("-inf")]])
    torch.manual_seed(7)
    drawn = choice_module.draw(scores.expand(200_000, -1))  # (200000,)
    counts = torch.bincount(drawn, minlength=scores.shape[1])
    probs = scores[0].softmax(-1)
    assert counts[4] == counts[7] == 0
    assert chi_square_p(counts, probs) > 1e-3
    assert chi_square_p(counts, probs[[1, 0, 2, 3, 4, 5, 6, 7]]) < 1e-6


@pytest.mark.parametrize("vocab", [1, 2, 7, 1000, 4096, 49_152])
def test_draw_searches_in_two_levels_for_the_tokens_one_scan_finds(monkeypatch, vocab):
    """Random rows with a seventh of their tokens at -inf, of vocabularies that fill their blocks
    and that do not: from the same seed ``draw`` gives the tokens of one float64 cumulative sum
    over the whole vocabulary (``examples/benchmark_draw.py``'s ``one_scan``), none masked."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "examples"))
    one_scan = importlib.import_module("benchmark_draw").one_scan

    g = torch.Generator().manual_seed(vocab)
    scores = 4 * torch.randn(512, vocab, generator=g)
    scores[:, 1::7] = float("-inf")
    torch.manual_seed(3)
    ours = choice_module.draw(scores)
    torch.manual_seed(3)
    assert torch.equal(ours, one_scan(scores))
    assert scores.gather(-1, ours.unsqueeze(-1)).isfinite().all()


@pytest.mark.parametrize("uniform", [0.0, 1 - 2**-53, 1.0])
def test_draw_at_the_ends_of_the_unit_interval_takes_the_first_and_last_token_of_weight(
    monkeypatch, uniform
):
    """Whole blocks at -inf before and after the tokens of weight, and within their block too:
    a uniform number of 0 draws the first token of positive weight, the largest below 1 the last;
    so does 1 itself (a target at the total, as rounding could make one), never a token at -inf
    or past the vocabulary."""
    vocab = 1000  # blocks of 32, the last one padded
    scores = torch.full((3, vocab), float("-inf"))
    scores[0, 70:75] = 0.0  # inside one block, its ends masked
    scores[1, 96:128] = torch.linspace(-30, 0, 32)  # a whole block, the tail tiny
    scores[2, [5, 990]] = torch.tensor([-1e-3, 40.0])  # the first and the last block
    at = lambda size, **options: torch.full(size, uniform, dtype=torch.float64)  # noqa: E731
    monkeypatch.setattr(choice_module.torch, "rand", at)
    tokens = choice_module.draw(scores).tolist()
    assert tokens == ([70, 96, 5] if uniform == 0 else [74, 127, 990])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_draw_refuses_rows_that_are_not_a_distribution(bad):
    scores = torch.zeros(3, 5)
    scores[1, 2] = bad
    with pytest.raises(RuntimeError, match="probability tensor"):
        choice_module.draw(scores)
    with pytest.raises(RuntimeError, match="probability tensor"):
        choice_module.draw(torch.full((2, 5), float("-inf")))


@pytest.mark.parametrize("recorded", [False, True])
def test_decoding_from_logits_that_are_not_finite_stops_with_the_check_that_caught_them(recorded):
    """A policy whose output layer holds NaN: with no recorder the draw's check, read in the
    same wait as the stop check, raises (and ``sample`` names the weight); with one, the
    recorder's check of the logits does, at the first step (it runs before that read)."""
    model = tiny_llama()
    with torch.no_grad():
        model.lm_head.weight[3, 0] = float("nan")
    recorder = BehaviourRecorder(1.0) if recorded else None
    error, message = (
        (FloatingPointError, "at generation step 0") if recorded
        else (FloatingPointError, r"sampling failed \(probability tensor contains either .*"
              r"weight '[\w.]+' holds NaN or inf at 1 entries")
    )  # fmt: skip
    with pytest.raises(error, match=message):
        generated(model, [[5, 6, 7]], 2, SamplingConfig(max_new_tokens=4), [VOCAB - 1], True,
                  recorder)  # fmt: skip


@pytest.mark.parametrize("top_k", [1, 3, 17, 100, 250])
def test_top_k_mask_equals_transformers_warper(top_k):
    generator = torch.Generator().manual_seed(top_k)
    scores = (torch.randn(16, 200, generator=generator) * 3).round(decimals=1)  # ties
    expected = TopKLogitsWarper(top_k)(None, scores)
    assert torch.equal(top_k_mask(scores, top_k), expected)


@pytest.mark.parametrize("top_p", [0.01, 0.3, 0.75, 0.95, 0.999])
def test_top_p_mask_equals_transformers_warper(top_p):
    generator = torch.Generator().manual_seed(int(top_p * 1000))
    scores = (torch.randn(16, 200, generator=generator) * 3).round(decimals=1)  # ties
    expected = TopPLogitsWarper(top_p)(None, scores)
    assert torch.equal(top_p_mask(scores, top_p), expected)


# ------------------------------------------------------------------------------- fallback


def test_a_sliding_window_model_falls_back_to_generate(monkeypatch):
    """Mistral with a sliding window: the loop declines it, ``generate`` samples, and the
    results are what ``generate`` gives."""
    model = tiny_llama(MistralForCausalLM, MistralConfig, sliding_window=4)
    assert "DynamicSlidingWindowLayer" in cannot_decode(model)
    calls = []
    original = model.generate
    monkeypatch.setattr(model, "generate", lambda **kw: calls.append(1) or original(**kw))
    sampling = SamplingConfig(max_new_tokens=6)
    ours = generated(model, PROMPTS, 2, sampling, [VOCAB - 1], False)
    assert calls == [1]
    theirs = generated(model, PROMPTS, 2, sampling, [VOCAB - 1], False, path="generate")
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


def test_a_checkpointed_model_in_training_mode_is_declined(llama):
    """Training mode with gradient checkpointing switches the cache off; in eval mode, or
    without checkpointing, the loop serves the model."""
    assert cannot_decode(llama) is None
    getattr(llama, "activation_checkpointing_enable", llama.gradient_checkpointing_enable)()
    try:
        assert cannot_decode(llama) is None  # in eval mode the cache stays on
        llama.train()
        assert "gradient checkpointing" in cannot_decode(llama)
        prompts, mask = left_pad(PROMPTS, 0)
        assert decode_module.decode(llama, prompts, mask, 1, SamplingConfig(), 0, [2]) is None
    finally:
        getattr(llama, "activation_checkpointing_disable", llama.gradient_checkpointing_disable)()
        llama.eval()


# ---------------------------------------------------------------------------- the profile


@pytest.mark.slow
def test_the_rollout_profile_times_every_way(tmp_path, monkeypatch, capsys):
    """examples/profile_rollout.py on the demo policy: one round of the default ways, a table
    and a JSON file with their phases."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    profile = importlib.import_module("profile_rollout")
    out = tmp_path / "profile.json"
    args = ["--model", "tinymath", "--repeats", "1", "--max-new-tokens", "4", "--json", str(out)]
    assert profile.main(args) == 0
    printed = capsys.readouterr().out
    assert "| prefill |" in printed and "total against generate" in printed
    medians = json.loads(out.read_text())["medians"]
    assert list(medians) == list(profile.DEFAULT_WAYS)
    assert all(m["total"] > 0 for m in medians.values())
