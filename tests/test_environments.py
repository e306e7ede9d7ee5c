"""The environment protocol, the built-in ToolEnvironment, and how a conversation and an
environment's replies are rendered through the chat template."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lightning_troll.tasks.environments import (
    Conversation,
    EnvironmentFactory,
    Step,
    ToolEnvironment,
    ToolRunner,
    load_environment,
    step_all,
    template_support,
    tool_section,
)
from lightning_troll.tasks.environments.rendering import Reply, TemplateSupport
from tests import tool_helpers
from tests.chat_helpers import CHATML, CHATML_TOOLS, FORGETFUL, chat_tokenizer

H = "tests.tool_helpers:"
SMOLLM2 = Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct"
USER = [{"role": "user", "content": "6*7?"}]
CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>'


# -- templates -------------------------------------------------------------------------------------


def test_what_a_template_renders_of_tools():
    assert template_support(chat_tokenizer(CHATML)) == TemplateSupport(tools=False, tool_role=False)
    assert template_support(chat_tokenizer(CHATML_TOOLS)) == TemplateSupport(True, True)
    assert template_support(chat_tokenizer(None)) == TemplateSupport(False, False)


@pytest.mark.skipif(not SMOLLM2.is_dir(), reason="needs models/SmolLM2-135M-Instruct")
def test_smollm2s_template_renders_no_tools():
    from lightning_troll.models.loading import load_tokenizer

    assert template_support(load_tokenizer(SMOLLM2)) == TemplateSupport(False, False)


def test_without_template_support_the_tools_go_into_a_system_message():
    schema = ToolRunner([H + "multiply"]).schemas
    section = tool_section(schema)
    assert json.dumps(schema[0]) in section and '{"name": <function name>' in section
    conversation = Conversation(chat_tokenizer(CHATML), USER, schema)
    assert conversation.prompt_text == (
        f"<|im_start|>system\n{section}<|im_end|>\n<|im_start|>user\n6*7?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    system = [{"role": "system", "content": "Be brief."}, *USER]
    conversation = Conversation(chat_tokenizer(CHATML), system, schema)
    assert conversation.messages[0] == {"role": "system", "content": f"Be brief.\n\n{section}"}


def test_with_template_support_the_template_gets_the_schemas():
    schema = ToolRunner([H + "multiply"]).schemas
    conversation = Conversation(chat_tokenizer(CHATML_TOOLS), USER, schema)
    assert conversation.prompt_text == (
        f"<|im_start|>system\n# Tools\n<tools>\n{json.dumps(schema[0])}\n</tools><|im_end|>\n"
        "<|im_start|>user\n6*7?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert conversation.messages == USER  # no section of ours


# -- an environment's reply as the difference of two renderings ------------------------------------


def replied(conversation: Conversation, *args) -> Reply:
    """The reply to the model's turn, taken into the conversation."""
    reply = conversation.reply(*args)
    conversation.add(reply)
    return reply


def test_a_reply_is_what_the_template_writes_between_two_turns():
    """The model wrote ``hi<|im_end|>``; the template closes a turn with ``<|im_end|>\\n``, so
    the reply starts with the ``\\n`` the model did not write, then the user turn, then the next
    generation prompt."""
    tokenizer = chat_tokenizer(CHATML)
    conversation = Conversation(tokenizer, USER)
    text = replied(conversation, "hi", "<|im_end|>", "Say more.").text
    assert text == "\n<|im_start|>user\nSay more.<|im_end|>\n<|im_start|>assistant\n"
    assert conversation.messages == [*USER, {"role": "assistant", "content": "hi"},
                                      {"role": "user", "content": "Say more."}]  # fmt: skip
    # the whole conversation rendered is the prompt, the model's text and the reply
    rendered = conversation.render(conversation.messages, generation_prompt=True)
    assert rendered == conversation.prompt_text + "hi<|im_end|>" + text


def test_a_turn_ended_by_a_stop_string_gets_the_templates_close_as_environment_text():
    conversation = Conversation(chat_tokenizer(CHATML), USER)
    text = replied(conversation, CALL, "", [{"role": "tool", "content": "42"}]).text
    assert text == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tool_results_without_a_tool_role_become_one_user_message():
    conversation = Conversation(chat_tokenizer(CHATML), USER)
    results = [{"role": "tool", "content": "42"}, {"role": "tool", "content": "Error: no"}]
    assert conversation.observation_messages(results) == [
        {"role": "user",
         "content": "<tool_response>\n42\n</tool_response>\n<tool_response>\nError: no\n"
                    "</tool_response>"}
    ]  # fmt: skip


def test_tool_results_with_a_tool_role_are_the_templates_to_render():
    conversation = Conversation(chat_tokenizer(CHATML_TOOLS), USER)
    results = [{"role": "tool", "content": "42"}]
    assert conversation.observation_messages(results) == results
    text = replied(conversation, CALL, "<|im_end|>", results).text
    assert text == (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_a_stop_token_other_than_the_templates_close_stays_and_the_close_follows():
    """The model ended with ``<eos>``, not the template's ``<|im_end|>``: its ``<eos>`` stays its
    own, and the whole close is the environment's."""
    conversation = Conversation(chat_tokenizer(CHATML), USER)
    assert replied(conversation, "hi", "<eos>", "ok").text.startswith(
        "<|im_end|>\n<|im_start|>user"
    )


def test_a_template_that_rewrites_past_turns_is_refused():
    conversation = Conversation(chat_tokenizer(FORGETFUL), USER)
    with pytest.raises(ValueError, match="renders the earlier turns differently"):
        conversation.reply("hi", "<|im_end|>", "Say more.")


def test_plain_text_episodes_append_replies_as_they_are():
    conversation = Conversation(chat_tokenizer(None), "12+3=")
    assert conversation.prompt_text == "12+3=" and conversation.prompt_ids[0] == 1  # <bos>
    assert replied(conversation, "15", "<|im_end|>", " ok ").text == " ok "
    with pytest.raises(
        ValueError, match="model.episodes.tools: an episode with tools starts from messages"
    ):
        Conversation(chat_tokenizer(None), "12+3=", ToolRunner([H + "multiply"]).schemas)
    with pytest.raises(
        ValueError, match="model.episodes.environment: the tokenizer has no chat template"
    ):
        Conversation(chat_tokenizer(None), USER)


@pytest.mark.skipif(not SMOLLM2.is_dir(), reason="needs models/SmolLM2-135M-Instruct")
def test_on_smollm2_the_reply_tokens_are_the_rendered_difference():
    from lightning_troll.models.loading import load_tokenizer

    tokenizer = load_tokenizer(SMOLLM2)
    schemas = ToolRunner([H + "multiply"]).schemas
    conversation = Conversation(tokenizer, USER, schemas)
    before = conversation.prompt_text
    reply = replied(conversation, CALL, "", [{"role": "tool", "content": "42"}]).ids
    after = conversation.render(conversation.messages, generation_prompt=True)
    assert tokenizer.decode(reply) == after[len(before + CALL) :]
    assert after[len(before + CALL) :].startswith("<|im_end|>\n<|im_start|>user\n<tool_response>")
    whole = tokenizer(after, add_special_tokens=False)["input_ids"]
    model = tokenizer(CALL, add_special_tokens=False)["input_ids"]
    assert whole == conversation.prompt_ids + model + reply


# -- the protocol and the tool environment ---------------------------------------------------------


def test_a_step_refuses_a_reward_that_is_not_a_finite_number():
    """1e39 is finite as a Python float but inf in float32, where rewards are kept."""
    for reward in (float("nan"), "1", True, 1e39, -(10**40)):
        with pytest.raises(ValueError, match="Step.reward must be a number finite in float32"):
            Step(reward=reward)
    assert Step(reward=3.0e38).reward == 3.0e38


def test_a_step_refuses_counts_that_are_not_counts():
    """Counts that the episode would add up later are checked where the environment made them."""
    for value in (None, "2", -1, 1.0, True):
        with pytest.raises(
            ValueError,
            match=re.escape(f"Step.tool_calls must be an integer >= 0 (a count); got {value!r}"),
        ):
            Step("again", tool_calls=value)
        with pytest.raises(
            ValueError,
            match=re.escape(
                f"Step.tool_errors['raised'] must be an integer >= 0 (a count); got {value!r}"
            ),
        ):
            Step("again", tool_calls=1, tool_errors={"raised": value})
    assert Step("again", tool_calls=2, tool_errors={"raised": 1}).tool_calls == 2


def test_a_step_refuses_an_observation_that_is_not_text_or_messages():
    """Each malformed observation is refused where the environment made it, naming what is
    wrong, instead of failing later inside the chat template."""
    cases = [
        (3, "Step.observation (a string, messages or None) must be a list of messages; got a int"),
        (["Try again."], "message 0 is a str ('Try again.'); a message is a mapping"),
        ([{"role": "user"}], "message 0 needs a string 'content'; got {'role': 'user'}"),
        ([{"role": "tool", "text": "42"}], "message 0 needs a string 'content'"),
        ([{"role": "user", "content": "ok"}, {"content": "x"}], "message 1 needs a string 'role'"),
        ([{"role": "user", "content": 42}], "message 0 needs a string 'content'"),
    ]
    for observation, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            Step(observation=observation)
    with pytest.raises(ValueError, match="Step.role must be a string; got None"):
        Step("ok", role=None)
    assert Step([{"role": "tool", "name": "f", "content": "4"}]).observation[0]["content"] == "4"


def test_the_tool_environment_answers_calls_and_ends_at_an_answer():
    env = ToolEnvironment(ToolRunner([H + "multiply", H + "divide"]))
    assert env.reset({"prompt": "6*7?"}) == USER
    assert env.reset({"prompt": USER}) == USER
    assert env.tool_schemas == env.runner.schemas
    step = env.step("Let me see. " + CALL + CALL.replace("multiply", "divide").replace("7", "0"))
    assert step == Step(
        [{"role": "tool", "name": "multiply", "content": "42"},
         {"role": "tool", "name": "divide",
          "content": "Error: tool 'divide' raised ZeroDivisionError: division by zero"}],
        tool_calls=2, tool_errors={"raised": 1},
    )  # fmt: skip
    assert env.step("It is 42.") == Step(done=True)
    with pytest.raises(ValueError, match="the row has no field 'prompt'"):
        env.reset({"question": "6*7?"})


def test_step_all_runs_the_calls_of_a_batch_together(monkeypatch):
    runner = ToolRunner([H + "multiply"])
    batches = []
    run = runner.run
    monkeypatch.setattr(runner, "run", lambda calls: batches.append(len(calls)) or run(calls))

    class Scored(ToolEnvironment):
        def step(self, turn):
            return Step(reward=0.5, done=True)

    envs = [
        ToolEnvironment(runner),
        ToolEnvironment(runner),
        ToolEnvironment(runner),
        Scored(runner),
    ]
    steps = step_all(envs, [CALL, "42", CALL + CALL, CALL])
    assert batches == [3]  # one batch: the calls of the first and the third environment
    assert [s.tool_calls for s in steps] == [1, 0, 2, 0]
    assert steps[1] == Step(done=True) and steps[3] == Step(reward=0.5, done=True)
    assert steps[2].observation[1]["content"] == "42"


def test_the_factory_makes_a_fresh_environment_per_episode():
    factory = EnvironmentFactory(tools=[H + "multiply"])
    first, second = factory(), factory()
    assert isinstance(first, ToolEnvironment) and first is not second
    assert first.runner is second.runner is factory.runner
    countdown = EnvironmentFactory(H + "Countdown")()
    assert isinstance(countdown, tool_helpers.Countdown)
    assert load_environment(tool_helpers.Countdown) is tool_helpers.Countdown


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "model.episodes.environment and model.episodes.tools are both unset"),
        ({"environment": H + "Countdown", "tools": [H + "multiply"]},
         "model.episodes.tools lists tools, but model.episodes.environment='tests.tool_helpers:Countdown' is not a "
         "ToolEnvironment subclass"),
        ({"environment": ToolEnvironment}, "is a ToolEnvironment: list its tools in model.episodes.tools"),
        ({"environment": H + "NotAnEnvironment"},
         "model.episodes.environment: 'tests.tool_helpers:NotAnEnvironment' has no reset or step method"),
        ({"environment": H + "Countdwn"}, "model.episodes.environment: 'tests.tool_helpers:Countdwn': .* "
         "has no class or function 'Countdwn'; did you mean 'Countdown'\\? \\(it defines .*, "
         r"and \d+ more\)"),
        ({"environment": "Countdown"}, "model.episodes.environment: 'Countdown' is not an import path"),
        ({"environment": H + "Countdown", "tool_workers": 2, "tool_timeout": 5},
         "model.episodes.tool_workers=2 with model.episodes.environment='tests.tool_helpers:"
         "Countdown', which runs no tools of model.episodes.tools: the workers would have no "
         "call to run"),
    ],
)  # fmt: skip
def test_the_factory_refuses_what_cannot_make_episodes(options, message):
    with pytest.raises(ValueError, match=message):
        EnvironmentFactory(**options)
