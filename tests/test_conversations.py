"""Conversational rows (TRL's formats): a ``prompt`` list of messages, or a ``messages`` column cut
before its last assistant turn; system prompts per row; the chat template applied to them by
default (and to plain rows on request);
the gold answer and the other columns reaching reward functions in ``row``."""

from __future__ import annotations

import json
import string

import pytest

from lightning_troll.models.tinymath import char_tokenizer
from lightning_troll.tasks.data.datamodule import PromptDataModule, write_jsonl
from lightning_troll.tasks.data.prompts import collate_prompts
from lightning_troll.tasks.rewards.registry import RewardScorer

# a chat template that writes every message as [role]content: what it received shows in the text
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


@pytest.fixture(scope="module")
def chat_tok():
    tok = char_tokenizer("".join(sorted(set(string.printable) - set("\r\x0b\x0c"))), 512)
    tok.chat_template = TEMPLATE
    return tok


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def system(text: str) -> dict:
    return {"role": "system", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def texts(rows: list[dict], tok, tmp_path, **options) -> list[str]:
    """The prompt texts ``rows`` become (as validation rows, in order); the file escapes what is
    not ASCII, as ``json.dumps`` does, so that half a surrogate pair can be written."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    dm = PromptDataModule(
        str(path), tokenizer=tok, val_file=str(path), batch_size=1, max_prompt_tokens=200, **options
    )
    dm.setup("fit")
    return [item.text for item in dm.val_items]


def test_a_prompt_list_with_its_own_system_message(chat_tok, tmp_path):
    """Row 0 brings its system message (kept; data.system_prompt not added); row 1 has none (the
    default is put first); row 2 is plain text in the same file."""
    rows = [
        {"prompt": [system("Be terse."), user("2+2?")], "answer": "4"},
        {"prompt": [user("3+3?")], "answer": "6"},
        {"prompt": "4+4?", "answer": "8"},
    ]
    got = texts(rows, chat_tok, tmp_path, chat_template=True, system_prompt="Default.")
    assert got == [
        "<bos>[system]Be terse.[user]2+2?[assistant]",
        "<bos>[system]Default.[user]3+3?[assistant]",
        "<bos>[system]Default.[user]4+4?[assistant]",
    ]


def test_a_messages_column_is_cut_before_its_last_assistant_turn(chat_tok, tmp_path):
    rows = [
        {  # a few-shot conversation and the reference answer: the prompt ends before it
            "messages": [system("S"), user("1+1?"), assistant("2"), user("2+2?"), assistant("4")],
            "answer": "4",
        },
        {"messages": [user("5+5?")], "answer": "10"},  # no assistant turn: all of it
    ]
    got = texts(rows, chat_tok, tmp_path, chat_template=True)
    assert got == [
        "<bos>[system]S[user]1+1?[assistant]2[user]2+2?[assistant]",
        "<bos>[user]5+5?[assistant]",
    ]


def test_the_template_formats_the_last_user_message(chat_tok, tmp_path):
    rows = [
        {"prompt": [user("1+1?"), assistant("2"), user("2+2?")], "answer": "4", "level": "easy"}
    ]
    got = texts(
        rows, chat_tok, tmp_path, chat_template=True, template="({level}) {prompt} Be brief."
    )
    assert got == ["<bos>[user]1+1?[assistant]2[user](easy) 2+2? Be brief.[assistant]"]


def test_conversations_reach_the_reward_with_their_answer_and_columns(chat_tok, tmp_path):
    seen = []

    def spy(prompt, completion, row):
        seen.append((prompt, row))
        return float(completion == row["answer"])

    rows = [{"messages": [user("2+2?"), assistant("4")], "solution": "4", "id": 7}]
    path = write_jsonl(tmp_path / "rows.jsonl", rows * 2)
    dm = PromptDataModule(
        str(path), tokenizer=chat_tok, chat_template=True, answer_field="solution", num_val=0,
        batch_size=2, max_prompt_tokens=200,
    )  # fmt: skip
    dm.setup("fit")
    batch = collate_prompts(dm.train_items[:1])
    out = RewardScorer([spy])(batch.prompts, ["4"], batch.rows)
    assert out.total.tolist() == [1.0]
    prompt, row = seen[0]
    assert prompt == "<bos>[user]2+2?[assistant]"
    assert row["answer"] == "4" and row["id"] == 7
    assert row["messages"] == rows[0]["messages"]  # the whole conversation, reference included


def items(rows: list[dict], tok, tmp_path, **options):
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    dm = PromptDataModule(
        str(path), tokenizer=tok, val_file=str(path), batch_size=1, max_prompt_tokens=200, **options
    )
    dm.setup("fit")
    return dm.val_items


def test_by_default_conversations_get_the_chat_template_and_plain_text_does_not(chat_tok, tmp_path):
    """As TRL does: data.chat_template left at null writes conversational rows with the chat
    template and leaves plain rows as they are; each is tokenized once, with one BOS."""
    rows = [{"prompt": [user("2+2?")], "answer": "4"}, {"prompt": "3+3=", "answer": "6"}]
    got = items(rows, chat_tok, tmp_path)
    assert [item.text for item in got] == ["<bos>[user]2+2?[assistant]", "3+3="]
    plain = chat_tok("3+3=", add_special_tokens=True)["input_ids"]
    written = chat_tok("<bos>[user]2+2?[assistant]", add_special_tokens=False)["input_ids"]
    assert [item.ids for item in got] == [written, plain]
    assert written.count(chat_tok.bos_token_id) == 1


def test_chat_template_true_wraps_plain_text_and_a_system_prompt_wraps_it_by_default(
    chat_tok, tmp_path
):
    rows = [{"prompt": "3+3=", "answer": "6"}]
    assert texts(rows, chat_tok, tmp_path, chat_template=True) == ["<bos>[user]3+3=[assistant]"]
    assert texts(rows, chat_tok, tmp_path, system_prompt="Be terse.") == [
        "<bos>[system]Be terse.[user]3+3=[assistant]"
    ]


def test_chat_template_false_refuses_conversations_and_a_system_prompt(chat_tok, tmp_path):
    rows = [{"prompt": [user("2+2?")], "answer": "4"}]
    with pytest.raises(ValueError) as error:
        texts(rows, chat_tok, tmp_path, chat_template=False)
    assert "data.chat_template=false, but line 1 of the train rows" in str(error.value)
    assert "leave data.chat_template at null (or true)" in str(error.value)
    with pytest.raises(ValueError, match="data.system_prompt='Be terse.' needs the chat template, "
                       "but data.chat_template=false"):  # fmt: skip
        PromptDataModule("tinymath", chat_template=False, system_prompt="Be terse.")
    with pytest.raises(ValueError, match="data.chat_template must be true, false or null"):
        PromptDataModule("tinymath", chat_template="yes")


def test_a_conversation_with_a_tokenizer_without_chat_template_is_named(tmp_path):
    plain = char_tokenizer("".join(sorted(set(string.printable) - set("\r\x0b\x0c"))), 512)
    rows = [{"prompt": [user("2+2?")], "answer": "4"}]
    with pytest.raises(ValueError, match="the tokenizer has no chat template to write a "
                       "conversational row or data.system_prompt"):  # fmt: skip
        texts(rows, plain, tmp_path)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "holds an empty conversation"),
        (["2+2?"], "message 0 is a str ('2+2?'); a message is a mapping"),
        (
            [{"role": "human", "content": "2+2?"}],
            "message 0 has role 'human'; roles are system, user, assistant, tool",
        ),
        ([{"role": "user", "content": None}], "message 0 needs a string 'content'"),
        ([user("caf\udce9?")], "message 0's 'content' holds half a surrogate pair alone"),
        ([assistant("4")], "has no user turn to answer"),
        (42, "holds a int (42), not text or a list of {role, content} messages"),
    ],
)
def test_malformed_conversations_are_refused_by_row(prompt, message, chat_tok, tmp_path):
    rows = [{"prompt": "1+1?", "answer": "2"}, {"prompt": prompt, "answer": "4"}]
    with pytest.raises(ValueError, match="line 2") as error:
        texts(rows, chat_tok, tmp_path, chat_template=True)
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("row", "at"),
    [
        ({"prompt": "caf\udce9?", "answer": "4"}, "(at 'caf\\udce9? ')"),
        ({"prompt": [user("2+2?")], "extra": "x\ud83d", "answer": "4"}, "2+2? x\\ud83d"),
    ],
)
def test_a_prompt_that_no_tokenizer_can_read_is_refused_by_row(row, at, chat_tok, tmp_path):
    """Half a surrogate pair, in the prompt or in a field the template brings into a conversation's
    last message, is refused naming the row and showing where, not passed to the tokenizer."""
    rows = [{"prompt": "1+1?", "answer": "2", "extra": ""}, {"extra": "", **row}]
    with pytest.raises(ValueError, match="line 2 of ") as error:
        texts(rows, chat_tok, tmp_path, template="{prompt} {extra}")
    message = str(error.value)
    assert "holds half a surrogate pair alone (U+D800-U+DFFF)" in message and at in message


def test_an_empty_validation_set_is_refused(chat_tok, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1+1?", "answer": "2"}] * 2)
    empty = tmp_path / "val.jsonl"
    empty.write_text("")
    dm = PromptDataModule(str(train), tokenizer=chat_tok, val_file=str(empty), batch_size=1)
    with pytest.raises(ValueError, match=r"^data.num_val=200: there are no validation rows in"):
        dm.setup("fit")
    dm = PromptDataModule(
        str(train), tokenizer=chat_tok, val_file=str(empty), num_val=0, batch_size=1
    )
    dm.setup("fit")  # validation off: nothing to refuse
    assert dm.val_items == []
