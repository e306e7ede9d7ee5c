"""TinyMath: the task, its tokenizer, the shipped demo policy and the policy loaders."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from lightning_troll.models.loading import load_policy, load_tokenizer, tiny_causal_lm
from lightning_troll.models.tinymath import (
    CHARACTERS,
    DEFAULT_MAX_NEW_TOKENS,
    TINYMATH_DIR,
    answer_of,
    build_tokenizer,
    generate_problems,
)

SPLIT_SIZES = {"train": 16_000, "validation": 2_000, "test": 2_000}  # 80/10/10 of 20,000, roughly


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="module")
def shipped():
    """The shipped policy and tokenizer, loaded exactly like a hub model."""
    return AutoModelForCausalLM.from_pretrained(TINYMATH_DIR), AutoTokenizer.from_pretrained(
        TINYMATH_DIR
    )


# --- the task -------------------------------------------------------------------------------


def _all(split: str) -> list[dict[str, str]]:
    return generate_problems(SPLIT_SIZES[split] * 2, seed=0, split=split)


def test_splits_are_disjoint_and_cover_every_problem():
    prompts = {split: {r["prompt"] for r in _all(split)} for split in SPLIT_SIZES}
    assert not prompts["train"] & prompts["validation"]
    assert not prompts["train"] & prompts["test"]
    assert not prompts["validation"] & prompts["test"]
    assert sum(len(p) for p in prompts.values()) == 2 * 100 * 100  # two operators, 0..99 each
    for split, size in SPLIT_SIZES.items():
        assert abs(len(prompts[split]) - size) < 0.05 * size, (split, len(prompts[split]))


def test_problems_are_deterministic_distinct_and_prefix_stable():
    rows = generate_problems(1500, seed=3, split="test")
    assert rows == generate_problems(1500, seed=3, split="test")
    assert rows[:200] == generate_problems(200, seed=3, split="test")
    assert rows != generate_problems(1500, seed=4, split="test")
    assert len({r["prompt"] for r in rows}) == 1500  # no repeats within one pass
    assert generate_problems(0) == []


def test_answers_are_the_arithmetic_results():
    """``"17-58="`` -> -41: the answer is the exact integer result, negatives included."""
    for row in generate_problems(500, seed=0, split="train"):
        a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", row["prompt"]).groups()
        expected = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert row["answer"] == str(expected)
        assert len(row["answer"]) + 1 <= DEFAULT_MAX_NEW_TOKENS  # answer + eos fits the budget


@pytest.mark.parametrize(("kwargs", "words"), [({"split": "dev"}, "split"), ({"n": -1}, "n")])
def test_generate_problems_rejects_bad_arguments(kwargs, words):
    with pytest.raises(ValueError, match=words):
        generate_problems(**{"n": 3, **kwargs})


@pytest.mark.parametrize(
    ("completion", "answer"),
    [("81", "81"), ("-41", "-41"), (" 81\n9", "81"), ("81<eos><pad>", "81"), ("", None)],
)
def test_answer_of(completion, answer):
    assert answer_of(completion) == answer


# --- the tokenizer --------------------------------------------------------------------------


def test_tokenizer_round_trips_prompts_and_answers(tokenizer):
    for row in generate_problems(200, seed=0, split="validation"):
        for text in (row["prompt"], row["answer"], row["prompt"] + row["answer"]):
            ids = tokenizer(text).input_ids
            assert ids[0] == tokenizer.bos_token_id and tokenizer.eos_token_id not in ids
            assert len(ids) == len(text) + 1  # one token per character, plus <bos>
            assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_special_tokens_and_vocabulary(tokenizer):
    assert tokenizer.convert_ids_to_tokens([0, 1, 2, 3]) == ["<pad>", "<bos>", "<eos>", "<unk>"]
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert len(tokenizer) == 4 + len(CHARACTERS)
    assert tokenizer.padding_side == "left"
    assert tokenizer(" ", add_special_tokens=False).input_ids == [tokenizer.unk_token_id]


def test_tokenizer_pads_left_and_completions_concatenate(tokenizer):
    batch = tokenizer(["1+1=", "23+58="], padding=True)
    assert batch.input_ids[0] == [0, 0, *tokenizer("1+1=").input_ids]
    assert batch.attention_mask[0] == [0, 0, 1, 1, 1, 1, 1]
    # Generated ids appended to an encoded prompt decode to prompt + answer.
    ids = tokenizer("23+58=").input_ids + tokenizer("81", add_special_tokens=False).input_ids
    ids += [tokenizer.eos_token_id, tokenizer.pad_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "23+58=81"
    assert answer_of(tokenizer.decode(ids[7:], skip_special_tokens=True)) == "81"


# --- the shipped demo policy ----------------------------------------------------------------


def test_shipped_assets_are_small_and_load_like_a_hub_model(shipped, tokenizer):
    model, loaded = shipped
    assert (TINYMATH_DIR / "model.safetensors").stat().st_size <= 5 * 1024 * 1024
    assert type(model).__name__ == "LlamaForCausalLM"
    assert next(model.parameters()).dtype == torch.float32
    assert loaded.get_vocab() == tokenizer.get_vocab()
    assert loaded.padding_side == "left"
    assert loaded("23+58=").input_ids == tokenizer("23+58=").input_ids
    generation = model.generation_config
    assert generation.pad_token_id == loaded.pad_token_id
    assert generation.eos_token_id == loaded.eos_token_id
    assert generation.max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    assert model.config.vocab_size == len(loaded)


def _card_number(metric: str) -> float:
    card = (TINYMATH_DIR / "README.md").read_text()
    found = re.search(rf"^\| {re.escape(metric)}[^|]* \| ([0-9.]+) \|$", card, re.MULTILINE)
    assert found, f"the model card has no row {metric!r}"
    return float(found.group(1))


def test_shipped_model_greedy_accuracy_matches_the_card(shipped):
    """The card reports greedy accuracy on 1000 test problems; 200 of them must agree.

    The standard error of a 200-problem mean is at most 0.035, so 0.1 is about 3 of them.
    """
    model, tokenizer = shipped
    rows = generate_problems(200, seed=0, split="test")
    batch = tokenizer([r["prompt"] for r in rows], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=False, max_new_tokens=DEFAULT_MAX_NEW_TOKENS)
    texts = tokenizer.batch_decode(out[:, batch.input_ids.shape[1] :], skip_special_tokens=True)
    accuracy = sum(answer_of(t) == r["answer"] for t, r in zip(texts, rows, strict=True)) / 200
    assert abs(accuracy - _card_number("greedy accuracy")) <= 0.1
    # The demo leaves headroom for RL: neither hopeless nor solved.
    assert 0.3 <= accuracy <= 0.8
    assert _card_number("sampled accuracy") < _card_number("pass@8")


# --- the loaders ----------------------------------------------------------------------------


def test_load_policy_and_tokenizer_of_tinymath(shipped):
    policy = load_policy("tinymath")
    tokenizer = load_tokenizer("tinymath")
    assert not policy.training
    assert tokenizer.padding_side == "left" and tokenizer.pad_token_id == 0
    assert load_tokenizer("tinymath", padding_side="right").padding_side == "right"
    reference, _ = shipped
    for ours, theirs in zip(policy.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    half = load_policy(TINYMATH_DIR, dtype="bfloat16")
    assert next(half.parameters()).dtype == torch.bfloat16


def test_load_policy_rejects_an_unknown_dtype():
    with pytest.raises(ValueError, match=r"dtype.*float32.*bfloat16.*float16.*auto.*'int7'"):
        load_policy("tinymath", dtype="int7")


@pytest.mark.parametrize("missing", ["./no/such/dir", "/no/such/dir", "a/b/c"])
def test_loaders_reject_a_missing_directory(missing):
    with pytest.raises(FileNotFoundError, match="neither an existing local directory"):
        load_policy(missing)
    with pytest.raises(FileNotFoundError, match="neither an existing local directory"):
        load_tokenizer(missing)


def test_load_tokenizer_rejects_a_bad_padding_side():
    with pytest.raises(ValueError, match=r"padding_side.*'left', 'right'.*'center'"):
        load_tokenizer("tinymath", padding_side="center")


def _save_without_pad(path, eos: bool) -> None:
    backend = build_tokenizer().backend_tokenizer
    specials = {"bos_token": "<bos>", "unk_token": "<unk>"} | (
        {"eos_token": "<eos>"} if eos else {}
    )
    PreTrainedTokenizerFast(tokenizer_object=backend, **specials).save_pretrained(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    assert "pad_token" not in config and ("eos_token" in config) == eos


def test_load_tokenizer_without_pad_token_pads_with_eos_and_warns(tmp_path):
    _save_without_pad(tmp_path, eos=True)
    with pytest.warns(UserWarning, match="no pad token; using its eos token '<eos>'"):
        tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 2
    assert tokenizer.padding_side == "left"


def test_load_tokenizer_without_pad_or_eos_token_raises(tmp_path):
    _save_without_pad(tmp_path, eos=False)
    with pytest.raises(ValueError, match=re.escape(str(tmp_path)) + ".*neither a pad token"):
        load_tokenizer(tmp_path)


def test_tiny_causal_lm_is_seeded_and_carries_special_ids(tokenizer):
    before = torch.random.get_rng_state()
    kwargs = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    model = tiny_causal_lm(vocab_size=len(tokenizer), seed=5, **kwargs)
    assert torch.equal(torch.random.get_rng_state(), before)  # the global RNG is untouched
    again = tiny_causal_lm(vocab_size=len(tokenizer), seed=5, **kwargs)
    other = tiny_causal_lm(vocab_size=len(tokenizer), seed=6, **kwargs)
    first = next(model.parameters())
    assert torch.equal(first, next(again.parameters()))
    assert not torch.equal(first, next(other.parameters()))
    assert model.generation_config.pad_token_id == 0
    assert model.generation_config.bos_token_id == 1
    assert model.generation_config.eos_token_id == 2
    batch = tokenizer(["1+1=", "23+58="], return_tensors="pt", padding=True)
    assert model(**batch).logits.shape == (2, 7, len(tokenizer))  # (B, T, V)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pad/eos known: generate does not warn
        out = model.generate(**batch, do_sample=False, max_new_tokens=DEFAULT_MAX_NEW_TOKENS)
    assert out.shape[0] == 2 and out.shape[1] <= 7 + DEFAULT_MAX_NEW_TOKENS


def test_tiny_causal_lm_rejects_an_odd_head_size():
    with pytest.raises(ValueError, match="hidden_size=30, num_heads=2"):
        tiny_causal_lm(vocab_size=17, hidden_size=30, num_heads=2)
