"""Reward functions in TRL's form (``fn(completions, **kwargs) -> list[float]``) used as they are:
what they are given, by hand; what is refused before anything runs; failed calls scored by
``on_error``; and one trained from a task's own folder."""

from __future__ import annotations

import asyncio
import inspect
import textwrap
import warnings

import pytest

from lightning_troll.tasks.rewards.calls import RewardError, RewardWarning
from lightning_troll.tasks.rewards.registry import RewardScorer
from lightning_troll.tasks.rewards.trl_form import TrlFormReward, is_trl_form
from tests.test_own_task_example import fit_in_own_folder


def accuracy(completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def native(prompt, completion, row):
    return 0.5


def test_scores_by_hand_beside_a_native_reward():
    """Completions '4' and '5' against gold '4' and '6': accuracy 1 and 0. With weight 2 and the
    native reward's 0.5 at weight 1, the totals are 2 * 1 + 0.5 = 2.5 and 2 * 0 + 0.5 = 0.5."""
    scorer = RewardScorer({accuracy: 2.0, native: 1.0})
    assert isinstance(scorer.functions["accuracy"], TrlFormReward)
    assert scorer.functions["native"] is native
    out = scorer(["p1", "p2"], [" 4", "5"], [{"answer": "4"}, {"answer": "6"}])
    assert out.total.tolist() == [2.5, 0.5]
    assert out.per_function["accuracy"].tolist() == [1.0, 0.0]
    assert out.valid.tolist() == [True, True]


def _recorder(seen: list):
    def reward(prompts, completions, **kwargs):
        seen.append({"prompts": prompts, "completions": completions, **kwargs})
        return [0.0] * len(completions)

    return reward


def test_prompts_are_the_rows_prompt_field_else_the_formatted_prompts():
    seen: list = []
    scorer = RewardScorer([_recorder(seen)])
    scorer(["<s>q1", "<s>q2"], ["a", "b"], [{"prompt": "q1", "answer": "1"}, {"prompt": "q2"}])
    scorer(["<s>q1", "<s>q2"], ["a", "b"], [{"question": "q1"}, {"question": "q2"}])
    first, second = seen
    assert first == {"prompts": ["q1", "q2"], "completions": ["a", "b"], "answer": ["1", None]}
    assert second == {"prompts": ["<s>q1", "<s>q2"], "completions": ["a", "b"],
                      "question": ["q1", "q2"]}  # fmt: skip


def test_conversational_prompts_get_completions_as_one_assistant_message():
    seen: list = []
    scorer = RewardScorer([_recorder(seen)])
    talk = [{"role": "user", "content": "Hi"}]
    scorer(["t1", "t2"], ["a", "b"], [{"prompt": talk}, {"prompt": talk}])
    (call,) = seen
    assert call["prompts"] == [talk, talk]
    assert call["completions"] == [
        [{"role": "assistant", "content": "a"}],
        [{"role": "assistant", "content": "b"}],
    ]


def test_without_kwargs_only_the_fields_it_names_are_given_and_bound_arguments_win():
    seen: list = []

    def scaled(completions, answer, scale=1.0):
        seen.append((answer, scale))
        return [scale * (c == a) for c, a in zip(completions, answer, strict=True)]

    scorer = RewardScorer({scaled: 1.0}, kwargs={"scaled": {"scale": 3.0}})
    rows = [{"answer": "4", "prompt": "q", "level": 2, "scale": 100.0}]
    assert scorer(["p"], ["4"], rows).total.tolist() == [3.0]  # scale bound, not the row's 100
    assert seen == [(["4"], 3.0)]
    signature = inspect.signature(scorer.functions["scaled"])
    assert list(signature.parameters) == ["prompts", "completions", "rows", "answer", "scale"]


def test_bound_arguments_it_does_not_take_are_refused_naming_what_it_takes():
    def scaled(completions, answer, scale=1.0):
        return [0.0] * len(completions)

    message = r"reward_options.kwargs.scaled: \['bogus'\] .* it takes \['answer', 'scale'\]"
    with pytest.raises(ValueError, match=message):
        RewardScorer({scaled: 1.0}, kwargs={"scaled": {"bogus": 1}})


def test_what_trl_passes_and_the_library_does_not_is_refused_when_required():
    def needs_ids(completions, completion_ids, **kwargs):
        return [0.0] * len(completions)

    def ids_if_given(completions, completion_ids=None, **kwargs):
        return [float(completion_ids is None)] * len(completions)

    with pytest.raises(ValueError, match=r"'needs_ids' requires \['completion_ids'\], which TRL"):
        RewardScorer([needs_ids])
    assert RewardScorer([ids_if_given])(["p"], ["c"], [{}]).total.tolist() == [1.0]


def test_a_positional_only_parameter_is_refused():
    def positional(completions, answer, /, **kwargs):
        return [0.0] * len(completions)

    def completions_by_position(completions, /, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(
        ValueError, match=r"'positional' takes \['completions', 'answer'\] by position only"
    ):
        RewardScorer([positional])
    with pytest.raises(ValueError, match=r"takes \['completions'\] by position only"):
        RewardScorer([completions_by_position])


def test_which_functions_are_in_trls_form():
    def batched_native(prompts, completions, rows):
        return [0.0] * len(completions)

    batched_native.batched = True

    def both(completion, completions, **kwargs):
        return 0.0

    assert is_trl_form(accuracy)
    assert not is_trl_form(native)
    assert not is_trl_form(batched_native)  # the library's own batched form
    assert not is_trl_form(both)
    assert not is_trl_form(len)  # no readable signature


def _returns(values):
    def reward(completions, **kwargs):
        return list(values)

    return reward


def test_a_none_scores_zero_from_that_function_and_the_sample_stays():
    """TRL reads None as 'does not apply' and its weighted sum leaves it out: with weights 2 and
    1 and scores (None, 0.5) and (1.0, 0.5), the totals are 0.5 and 2.5, both samples valid and no
    error counted. A string is still a failed call."""
    scorer = RewardScorer({_returns([None, 1.0]): 2.0, native: 1.0})
    out = scorer(["p", "q"], ["a", "b"], [{}, {}])
    assert out.total.tolist() == [0.5, 2.5]
    assert out.valid.tolist() == [True, True]
    assert out.errors == {"reward": 0, "native": 0}
    with pytest.raises(RewardError, match=r"reward function 'reward' on sample 1 .*'high'"):
        RewardScorer([_returns([1.0, "high"])])(["p", "q"], ["a", "b"], [{}, {}])


def test_an_async_reward_is_awaited_in_either_form():
    """TRL's reward functions may be ``async def``; so may the library's own."""

    async def trl_async(completions, **kwargs):
        await asyncio.sleep(0.001)
        return [float(len(c)) for c in completions]

    async def native_async(prompt, completion, row):
        await asyncio.sleep(0.001)
        return 0.5

    scorer = RewardScorer({trl_async: 1.0, native_async: 1.0})
    assert scorer(["p", "q"], ["ab", "abcd"], [{}, {}]).total.tolist() == [2.5, 4.5]

    async def from_a_loop():  # a notebook's running loop: the coroutines get loops of their own
        return scorer(["p"], ["abc"], [{}]).total.tolist()

    assert asyncio.run(from_a_loop()) == [3.5]


def test_a_wrong_number_of_scores_or_a_missing_field_fails_every_completion():
    with pytest.raises(RewardError, match=r"returned \[1\.0\] \(1\) for 2 completions"):
        RewardScorer([_returns([1.0])])(["p", "q"], ["a", "b"], [{}, {}])
    scorer = RewardScorer([accuracy], on_error="drop")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RewardWarning)
        out = scorer(["p", "q"], ["a", "b"], [{"gold": "a"}, {"gold": "b"}])
    assert out.valid.tolist() == [False, False]
    with pytest.raises(
        RewardError,
        match=r"needs \['answer'\], which are neither fields of the rows \(\['gold'\]\)",
    ):
        RewardScorer([accuracy])(["p"], ["a"], [{"gold": "a"}])

    def named_only(completions, answer):  # without **kwargs: still told which fields there are
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match=r"fields of the rows \(\['gold', 'level'\]\)"):
        RewardScorer([named_only])(["p"], ["a"], [{"gold": "a", "level": 1}])


REWARD_MODULE = '''\
def right(prompts, completions, answer, **kwargs):
    """TRL's form: every completion of a prompt whose gold answer and prompt came through
    scores 0.25; anything else -1."""
    return [0.25 if isinstance(p, str) and a is not None else -1.0
            for p, a in zip(prompts, answer)]
'''


def test_a_trl_form_reward_trains_from_a_folder_of_its_own(
    tmp_path, tiny_chat_model_dir, monkeypatch
):
    """The reward in TRL's form lies beside task.yaml; one rollout on a tiny model from that
    folder, no PYTHONPATH: every completion scores 0.25, so reward/mean is 0.25."""
    from lightning_troll.tasks.data.prompts import write_jsonl

    folder = tmp_path / "my_task"
    folder.mkdir()
    (folder / "trl_rewards.py").write_text(textwrap.dedent(REWARD_MODULE))
    write_jsonl(
        folder / "rows.jsonl", [{"prompt": f"{a} + 1 =", "answer": str(a + 1)} for a in range(8)]
    )
    (folder / "task.yaml").write_text(
        "model:\n  rewards: {trl_rewards:right: 1.0}\n"
        "data: {source: rows.jsonl, prompt_field: prompt, answer_field: answer}\n"
    )
    cli = fit_in_own_folder(folder, "trl_rewards", tiny_chat_model_dir, monkeypatch)
    logged = cli.trainer.logged_metrics
    assert cli.trainer.global_step == 2
    assert float(logged["reward/mean"]) == pytest.approx(0.25, abs=1e-7)
    assert float(logged["val/reward"]) == pytest.approx(0.25, abs=1e-7)
