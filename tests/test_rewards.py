"""Reward functions: built-ins on hand-written cases, resolution by name and path, scoring."""

from __future__ import annotations

import math
import sys
import types
import warnings

import pytest
import torch

from lightning_troll.tasks.rewards.registry import (
    REWARD_FUNCTIONS,
    RewardError,
    RewardScorer,
    RewardWarning,
    boxed,
    extract_boxed,
    gsm8k,
    overlong,
    register_reward,
    resolve_reward,
    reward_tag,
    tinymath,
)
from tests import reward_helpers

GSM8K_GOLD = "Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips.\n#### 72"


# ----------------------------------------------------------------------------- built-ins


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("She sold 72 clips.\n#### 72", GSM8K_GOLD, 1.0),
        ("#### 71", GSM8K_GOLD, 0.0),  # wrong answer
        ("She sold 72 clips.", GSM8K_GOLD, 0.0),  # no ####
        ("#### 72", "72", 1.0),  # a plain gold number
        ("#### 72", 72, 1.0),  # a gold int
        ("#### 1,234", "Total: 1234\n#### 1,234", 1.0),  # commas on both sides
        ("#### 1234", "#### 1,234", 1.0),
        ("#### $1,200.50 in total.", "#### 1200.5", 1.0),  # dollars, trailing zero, full stop
        ("#### 72.0", "#### 72", 1.0),  # compared as numbers, not text
        ("#### -5", "#### -5", 1.0),
        ("#### 5", "#### -5", 0.0),  # the sign counts
        ("#### 7 then #### 72", GSM8K_GOLD, 1.0),  # the last #### counts
        ("#### 72 then #### 7", GSM8K_GOLD, 0.0),
        ("#### seventy-two", GSM8K_GOLD, 0.0),  # no number after ####
        ("####", GSM8K_GOLD, 0.0),
    ],
)
def test_gsm8k(completion, gold, expected):
    assert gsm8k("Q?", completion, {"answer": gold}) == expected


def test_gsm8k_gold_without_a_number_is_an_error():
    with pytest.raises(ValueError, match="holds no number"):
        gsm8k("Q?", "#### 3", {"answer": "#### three"})


@pytest.mark.parametrize(
    ("text", "content"),
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces
        (r"\boxed{1} then \boxed{{a}+{b}}", "{a}+{b}"),  # the last box
        (r"\boxed{12", None),  # cut off inside the box
        ("no box", None),
    ],
)
def test_extract_boxed(text, content):
    assert extract_boxed(text) == content


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        (r"The answer is $\boxed{42}$.", "42", 1.0),
        (r"\boxed{41}", "42", 0.0),  # wrong answer
        ("The answer is 42.", "42", 0.0),  # no box
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", 1.0),  # nested braces, as text
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),  # ... and as a number
        (r"\boxed{\dfrac{1}{3}}", "0.5", 0.0),
        (r"\boxed{1/2}", "0.50", 1.0),
        (r"\boxed{1,000}", "1000", 1.0),  # commas
        (r"\boxed{ 3.0 . }", "3", 1.0),  # spaces, trailing full stop, numeric
        (r"\boxed{$x + 1$}", "x+1", 1.0),  # text: spaces and $ stripped
        (r"\boxed{x+2}", "x+1", 0.0),
        (r"\boxed{1} and later \boxed{2}", "2", 1.0),  # the last box counts
        (r"\boxed{2", "2", 0.0),  # unclosed
    ],
)
def test_boxed(completion, gold, expected):
    assert boxed("Q?", completion, {"answer": gold}) == expected


def test_tinymath_with_a_stand_in_answer_of(monkeypatch):
    """The reward compares ``tinymath.answer_of(completion)`` with the gold answer as text."""
    fake = types.ModuleType("lightning_troll.models.tinymath")
    fake.answer_of = lambda completion: completion.split("<eos>")[0].strip() or None
    monkeypatch.setitem(sys.modules, "lightning_troll.models.tinymath", fake)
    assert tinymath("23+58=", "81<eos>", {"answer": "81"}) == 1.0
    assert tinymath("23+58=", "81<eos>", {"answer": 81}) == 1.0  # a numeric gold answer
    assert tinymath("23+58=", "18<eos>", {"answer": "81"}) == 0.0
    assert tinymath("23+58=", "<eos>", {"answer": "81"}) == 0.0  # no answer (None)


def test_tinymath_on_generated_problems():
    tm = pytest.importorskip("lightning_troll.models.tinymath")
    rows = tm.generate_problems(20, seed=3, split="test")
    for row in rows:
        assert tinymath(row["prompt"], row["answer"] + "<eos>", row) == 1.0
        wrong = str(int(row["answer"]) + 1)
        assert tinymath(row["prompt"], wrong + "<eos>", row) == 0.0


# ----------------------------------------------------------------------------- resolution


def test_builtins_are_registered():
    assert {"tinymath", "gsm8k", "boxed", "overlong"} <= set(REWARD_FUNCTIONS)
    assert resolve_reward("gsm8k") is gsm8k
    assert resolve_reward("overlong") is overlong
    assert resolve_reward(boxed) is boxed  # callables pass through


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("tests.reward_helpers:length_reward", reward_helpers.length_reward),
        ("tests.reward_helpers.length_reward", reward_helpers.length_reward),
        ("tests.reward_helpers:Rewards.contains_answer", reward_helpers.Rewards.contains_answer),
    ],
)
def test_resolve_import_path(spec, expected):
    assert resolve_reward(spec) is expected


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (
            "gsm8",
            r"unknown reward 'gsm8'; registered rewards are \[.*'boxed'.*'gsm8k'.*'module:function'",
        ),
        ("no_such_pkg.mod:fn", "no module 'no_such_pkg' in the working directory .* importable"),
        ("tests.reward_helpers:missing", "tests/reward_helpers.py has no function 'missing'"),
        ("tests.reward_helpers:NOT_CALLABLE", "is a int, not callable"),
        ("tests.reward_helpers:Rewards", "is a class"),
        ("", "registered name, an import path or a callable"),
    ],
)
def test_resolve_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        resolve_reward(spec)


def test_register_reward_rejects_a_duplicate_name():
    with pytest.raises(ValueError, match="'gsm8k' is already registered"):
        register_reward("gsm8k")(reward_helpers.length_reward)


def test_register_reward_makes_a_name_usable():
    @register_reward("test_constant_half")
    def half(prompt, completion, row):
        return 0.5

    try:
        assert RewardScorer(["test_constant_half"])(["p"], ["c"], [{}]).total.tolist() == [0.5]
    finally:
        del REWARD_FUNCTIONS["test_constant_half"]


# ----------------------------------------------------------------------------- scorer

PROMPTS = ["Q1", "Q2", "Q3"]
COMPLETIONS = ["#### 72", "#### 5", r"\boxed{5} #### 9"]
ROWS = [{"answer": "#### 72"}, {"answer": "5"}, {"answer": "5"}]


def test_scorer_weights_by_hand():
    """gsm8k = [1, 1, 0], boxed = [0, 0, 1], length = [7, 6, 16];
    total = 2 * gsm8k - 0.5 * boxed + 0.25 * length = [3.75, 3.5, 3.5]."""
    scorer = RewardScorer({"gsm8k": 2.0, "boxed": -0.5, "tests.reward_helpers:length_reward": 0.25})
    out = scorer(PROMPTS, COMPLETIONS, ROWS)
    assert out.total.dtype == torch.float32 and out.total.shape == (3,)
    torch.testing.assert_close(out.total, torch.tensor([3.75, 3.5, 3.5]))
    assert out.per_function["gsm8k"].tolist() == [1.0, 1.0, 0.0]
    assert out.per_function["boxed"].tolist() == [0.0, 0.0, 1.0]
    assert out.per_function["tests.reward_helpers:length_reward"].tolist() == [7.0, 6.0, 16.0]
    assert out.valid.tolist() == [True, True, True]


def test_scorer_list_means_weight_one():
    scorer = RewardScorer(["gsm8k", "boxed"])
    assert scorer.weights == {"gsm8k": 1.0, "boxed": 1.0}
    assert scorer(PROMPTS, COMPLETIONS, ROWS).total.tolist() == [1.0, 1.0, 1.0]
    assert RewardScorer("gsm8k").weights == {"gsm8k": 1.0}  # one name on its own


def test_scorer_counts_bools_as_zero_one():
    scorer = RewardScorer([lambda p, c, r: c == "yes"])
    assert scorer(["p", "p"], ["yes", "no"], [{}, {}]).total.tolist() == [1.0, 0.0]


@pytest.mark.parametrize(
    ("rewards", "match"),
    [
        ({}, "at least one reward function"),
        ([], "at least one reward function"),
        ({"gsm8k": math.nan}, "weight of reward 'gsm8k' must be finite; got nan"),
        ({"gsm8k": math.inf}, "must be finite; got inf"),
        ({"gsm8k": "1"}, "must be a number; got '1'"),
        (["gsm8k", "gsm8k"], "lists 'gsm8k' twice"),
        (["gsm8"], "unknown reward 'gsm8'"),
    ],
)
def test_scorer_validation(rewards, match):
    with pytest.raises(ValueError, match=match):
        RewardScorer(rewards)


def test_scorer_rejects_an_unknown_mode_and_mismatched_lengths():
    with pytest.raises(
        ValueError, match="reward_options.on_error must be 'raise', 'drop' or a number; got 'skip'"
    ):
        RewardScorer(["gsm8k"], on_error="skip")
    with pytest.raises(ValueError, match="same length; got 3, 2 and 3"):
        RewardScorer(["gsm8k"])(PROMPTS, COMPLETIONS[:2], ROWS)


def _raises(prompt, completion, row):
    raise KeyError("answer")


BAD_REWARDS = {
    "raises": (_raises, r"raised KeyError: 'answer'"),
    "none": (lambda p, c, r: None, r"returned None \(NoneType\)"),
    "nan": (lambda p, c, r: math.nan, r"returned nan \(float\)"),
    "inf": (lambda p, c, r: -math.inf, r"returned -inf \(float\)"),
    "text": (lambda p, c, r: "1.0", r"returned '1.0' \(str\)"),
    "list": (lambda p, c, r: [1.0, 2.0], r"returned \[1.0, 2.0\] \(list\)"),
}


def _bad_on_second(bad):
    """A reward that is 1.0 on every sample but the second, where ``bad`` takes over."""
    return lambda p, c, r: bad(p, c, r) if r.get("bad") else 1.0


@pytest.mark.parametrize("kind", sorted(BAD_REWARDS))
def test_scorer_raise_mode_names_function_sample_and_problem(kind):
    bad, problem = BAD_REWARDS[kind]
    fn = _bad_on_second(bad)
    fn.__name__ = f"bad_{kind}"
    long_completion = "x" * 200
    scorer = RewardScorer(["gsm8k", fn])
    with pytest.raises(RewardError, match=problem) as info:
        scorer(
            ["p0", "the second prompt"], ["#### 1", long_completion], [{"answer": "1"}, {"bad": 1}]
        )
    message = str(info.value)
    assert f"reward function 'bad_{kind}' on sample 1" in message
    assert "prompt 'the second prompt'" in message
    assert "completion '" + "x" * 77 + "...'" in message  # truncated to 80 characters
    assert "x" * 81 not in message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("kind", sorted(BAD_REWARDS))
def test_scorer_drop_mode_marks_the_sample_invalid(kind):
    bad, problem = BAD_REWARDS[kind]
    scorer = RewardScorer(
        {"gsm8k": 1.0, "tests.reward_helpers:length_reward": 0.5}, on_error="drop"
    )
    scorer.functions["tests.reward_helpers:length_reward"] = _bad_on_second(bad)
    rows = [{"answer": "1"}, {"answer": "1", "bad": 1}, {"answer": "2"}]
    with pytest.warns(RewardWarning, match=f"dropped 1 of 3 samples.*{problem}") as record:
        out = scorer(["p"] * 3, ["#### 1", "#### 1", "#### 3"], rows)
    assert len(record) == 1  # once per call
    assert out.valid.tolist() == [True, False, True]
    assert out.total.tolist() == [1.5, 0.0, 0.5]  # gsm8k 1 + 0.5 * 1; dropped; 0 + 0.5 * 1
    assert out.per_function["gsm8k"].tolist() == [1.0, 0.0, 0.0]
    assert torch.isfinite(out.total).all()


def test_scorer_drop_mode_warns_once_with_the_count():
    scorer = RewardScorer([lambda p, c, r: None if c == "bad" else 1.0], on_error="drop")
    with pytest.warns(RewardWarning, match="dropped 2 of 4 samples") as record:
        out = scorer(["p"] * 4, ["bad", "ok", "bad", "ok"], [{}] * 4)
    assert len(record) == 1
    assert out.valid.tolist() == [False, True, False, True]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing dropped: no warning
        assert scorer(["p"], ["ok"], [{}]).valid.tolist() == [True]


def test_scorer_accepts_tensor_scalars_and_names_callables_apart():
    scorer = RewardScorer([lambda p, c, r: torch.tensor(0.25), lambda p, c, r: 2])
    torch.testing.assert_close(scorer(["p"], ["c"], [{}]).total, torch.tensor([2.25]))
    assert list(scorer.weights) == ["<lambda>", "<lambda>_2"]  # two callables, two names


# ----------------------------------------------------------------------------- overlong, kwargs


@pytest.mark.parametrize(
    ("tokens", "buffer", "expected"),
    [
        (10, 4, 0.0),  # max_new_tokens 16, buffer 4: no penalty up to 12 tokens
        (12, 4, 0.0),
        (13, 4, -0.25),  # (12 - 13) / 4
        (15, 4, -0.75),
        (16, 4, -1.0),  # cut off at the budget
        (14, None, -1 / 3),  # default buffer: a fifth of 16, floored, is 3; start 13
    ],
)
def test_overlong_by_hand(tokens, buffer, expected):
    """max_new_tokens = 16: the penalty is (16 - buffer - tokens) / buffer past 16 - buffer."""
    value = overlong("p", "c", {}, completion_tokens=tokens, max_new_tokens=16, buffer=buffer)
    assert value == pytest.approx(expected, abs=1e-12)


def test_scorer_passes_completion_tokens_and_binds_keyword_arguments():
    """overlong (buffer 2, budget 4) at 2, 3 and 4 tokens: 0, -0.5, -1; weighted by 0.5 next to
    an exact-answer reward; full marks count overlong's best score, 0."""
    scorer = RewardScorer({"tinymath": 1.0, "overlong": 0.5}, kwargs={"overlong": {"buffer": 2}})
    out = scorer(["p"] * 3, ["1", "1", "2"], [{"answer": "1"}] * 3, [2, 3, 4], max_new_tokens=4)
    torch.testing.assert_close(out.per_function["overlong"], torch.tensor([0.0, -0.5, -1.0]))
    torch.testing.assert_close(out.total, torch.tensor([1.0, 0.75, -0.5]))
    assert scorer.full_marks == 1.0
    assert scorer.sample_keywords == {
        "tinymath": (), "overlong": ("completion_tokens", "max_new_tokens")
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"'overlong' needs \['completion_tokens', 'max_new"):
        scorer(["p"], ["1"], [{"answer": "1"}])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"gsm8k": {"x": 1}}, r"reward_options.kwargs names 'gsm8k', which is not one of the "
         r"rewards"),
        ({"overlong": {"width": 2}}, r"reward_options.kwargs.overlong: \['width'\] is not a "
         r"keyword argument the reward 'overlong' takes; it takes \['buffer'\]"),
        ({"overlong": {"max_new_tokens": 2}}, r"\['max_new_tokens'\] is not a keyword argument"),
        ({"overlong": {"buffer": 0}}, r"reward_options.kwargs.overlong: buffer must be null or "
         r"an integer >= 1; got 0"),
        ({"overlong": 3}, r"reward_options.kwargs.overlong must map argument names to "
         r"values; got 3"),
    ],
)  # fmt: skip
def test_reward_options_kwargs_are_checked_when_the_scorer_is_built(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RewardScorer({"tinymath": 1.0, "overlong": 1.0}, kwargs=kwargs)


def test_reward_tag_keeps_names_readable():
    assert reward_tag("tinymath") == "tinymath"
    assert reward_tag("tests.reward_helpers:length_reward") == "tests.reward_helpers_length_reward"
    assert reward_tag("a/b c") == "a_b_c"


def _two_arguments(prompt, completion):
    return 1.0


def _needs_a_keyword(prompt, completion, row, *, scale):
    return scale


def _takes_the_budget(prompt, completion, row, max_new_tokens, completion_tokens=0):
    return 1.0


@pytest.mark.parametrize(
    "fn, kwargs, allowed",
    [
        (_two_arguments, None, False),  # no row
        (_needs_a_keyword, None, False),  # a required keyword nobody gives
        (_needs_a_keyword, {"_needs_a_keyword": {"scale": 2.0}}, True),  # given as kwargs
        (_takes_the_budget, None, True),  # the scorer passes the budget by keyword
        (lambda *args, **kwargs: 1.0, None, True),
    ],
)
def test_a_reward_whose_signature_cannot_take_the_call_is_refused_at_once(fn, kwargs, allowed):
    """The scorer calls fn(prompt, completion, row, **kwargs, **the per-completion
    keywords it names); a signature that cannot take that call is refused when the scorer is
    built, before any model loads, with the signature in the message."""
    if allowed:
        RewardScorer([fn], kwargs=kwargs)
        return
    name = fn.__name__
    expected = rf"model.rewards: '{name}' cannot be called as fn\(prompt, completion, row\) "
    with pytest.raises(ValueError, match=expected + rf".*its signature is {name}\("):
        RewardScorer([fn], kwargs=kwargs)


# ----------------------------------------------------------------------------- options


def test_val_accuracy_leaves_out_a_reward_without_a_best_score():
    """An exact-answer reward beside one without a best score (``max_reward = None``, as a reward
    model's logit): the right answer with a logit of -2 is correct, the wrong one with a logit of
    3 is not (before, the logit counted in the total: the other way round). Alone, such a reward
    counts a positive total."""
    from types import SimpleNamespace

    from lightning_troll.training.validation import _correct

    def logit(prompt, completion, row):
        return {"1": -2.0, "2": 3.0}[completion]

    logit.max_reward = None
    scorer = RewardScorer({"tinymath": 1.0, logit: 1.0})
    scored = scorer(["p", "p"], ["1", "2"], [{"answer": "1"}] * 2)
    assert scored.total.tolist() == [-1.0, 3.0] and scorer.full_marks == 1.0
    assert _correct(SimpleNamespace(scorer=scorer), scored).tolist() == [True, False]
    alone = RewardScorer({logit: 1.0})
    scored = alone(["p", "p"], ["1", "2"], [{}] * 2)
    assert _correct(SimpleNamespace(scorer=alone), scored).tolist() == [False, True]
