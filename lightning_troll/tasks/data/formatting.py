"""From rows to prompts: the ``data`` options that format and tokenize each row.

:class:`PromptFormatter` checks that the rows hold the fields the options name, formats each row
with ``data.template`` (optionally inside the tokenizer's chat template, after a system prompt),
tokenizes it once and checks its length against ``data.max_prompt_tokens``. Every error names the
option, the row and what to change.

Rows come in TRL's two formats. Plain: the prompt field holds text. Conversational: the prompt
field holds a list of ``{"role", "content"}`` messages, or (with the default
``prompt_field: prompt`` and no such field) a ``messages`` field holds the conversation, whose
prompt is everything before its last assistant turn (all of it if it has none). A conversation
is written with the tokenizer's chat template (unless ``data.chat_template: false``, which refuses
it); ``data.template`` formats the content of its last user message, and ``data.system_prompt``
is put first only where the row brings no system message of its own. Plain text goes through the
chat template with ``data.chat_template: true``, or when ``data.system_prompt`` is set and
``data.chat_template`` is left at null.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from lightning_troll.tasks.data.messages import NOT_TEXT, ROLES, check_messages, is_text
from lightning_troll.tasks.data.prompts import PromptItem, template_fields

__all__ = ["PromptFormatter"]


@dataclass(frozen=True)
class PromptFormatter:
    """Formats and tokenizes rows (the options are :class:`~lightning_troll.tasks.data.PromptDataModule`'s)."""

    prompt_field: str
    answer_field: str | None
    template: str
    chat_template: bool | None
    """True: every prompt; None: conversations (every prompt with a system prompt); False: none."""
    system_prompt: str | None
    max_prompt_tokens: int
    tokenizer: PreTrainedTokenizerBase
    describe: Callable[[str], str]
    """Names the rows of a split in errors (``"the file x.jsonl"``)."""
    lines: Sequence[int] | None = None
    """Each row's line in the file it was read from, as an editor counts (1 for the first; a
    ``.json`` list's or a ``.parquet`` file's place in it), where the rows come from a file:
    errors name that line, also where the rows are a part of the file (the training rows of a
    file that validation rows were held out of)."""

    def name(self, i: int) -> str:
        """How errors name row ``i``: its line in its file, or its place (0 for the first)."""
        return f"row {i}" if self.lines is None else f"line {self.lines[i]}"

    def prepare(self, rows: list[dict[str, Any]], split: str) -> list[PromptItem]:
        """Checks fields, formats, tokenizes and checks the length of every row."""
        if not rows:
            return []
        self.check_fields(rows, split)
        texts = [self.format(row, self.name(i), split) for i, row in enumerate(rows)]
        bos = self.tokenizer.bos_token
        # A chat template usually writes BOS itself: do not add a second one.
        chat = [
            bool(bos) and self._uses_chat(row) and text.startswith(bos)
            for row, text in zip(rows, texts, strict=True)
        ]
        ids: list[list[int]] = [[] for _ in texts]
        for written in (False, True):
            where = [i for i, c in enumerate(chat) if c == written]
            if where:
                batch = self.tokenizer([texts[i] for i in where], add_special_tokens=not written)
                for i, seq in zip(where, batch["input_ids"], strict=True):
                    ids[i] = seq
        lengths = [len(seq) for seq in ids]
        too_long = [i for i, n in enumerate(lengths) if n > self.max_prompt_tokens or n == 0]
        if too_long:
            i = too_long[0]
            raise ValueError(
                f"data.max_prompt_tokens={self.max_prompt_tokens}: {len(too_long)} of {len(rows)} "
                f"{split} prompts of {self.describe(split)} have too many tokens (or none); the "
                f"first is {self.name(i)} with {lengths[i]} tokens "
                f"({texts[i][:60]!r}); raise data.max_prompt_tokens or shorten data.template"
            )
        return [
            PromptItem(text, list(seq), self.kept(row))
            for text, seq, row in zip(texts, ids, rows, strict=True)
        ]

    def kept(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """The copy of ``row`` that rewards and environments get: its gold answer under
        ``"answer"`` and its prompt under ``"prompt"`` (the ``data.prompt_field`` text, or a
        conversation's messages before the answer), unformatted, in place of any fields of those
        names (:meth:`shadowed` names the prompt's): the built-in tool environment starts its
        episodes from it."""
        kept = dict(row)
        if self.answer_field:
            kept["answer"] = row[self.answer_field]
        conversation = self.conversation(row)
        kept["prompt"] = row[self.prompt_field] if conversation is None else conversation
        return kept

    def shadowed(self, rows: list[dict[str, Any]]) -> str | None:
        """The warning for rows with a ``"prompt"`` field that is not their prompt (another
        ``data.prompt_field``): :meth:`kept` puts the prompt in its place; else None."""
        source = self.field_of(rows)
        if not rows or source == "prompt" or "prompt" not in rows[0]:
            return None
        return (
            f"data.prompt_field={source!r}: the rows also have a field 'prompt', which rewards and "
            f"environments do not get: the rows they get hold the {source!r} prompt under "
            "'prompt' (an episode starts from it); rename the field to keep it"
        )

    def field_of(self, rows: list[dict[str, Any]]) -> str:
        """The field the prompts come from: ``prompt_field``, or ``messages`` when the default
        ``prompt`` is not a field of the rows and ``messages`` is."""
        first = rows[0] if rows else {}
        if self.prompt_field == "prompt" and "prompt" not in first and "messages" in first:
            return "messages"
        return self.prompt_field

    def needed_fields(self, rows: list[dict[str, Any]]) -> dict[str, str]:
        """field -> the option that needs it: the prompt's field, the answer's, and the fields
        ``data.template`` names."""
        needed = {self.field_of(rows): "data.prompt_field"}
        if self.answer_field is not None:
            needed[self.answer_field] = "data.answer_field"
        for field in sorted(template_fields(self.template) - {"prompt"}):
            needed.setdefault(field, "data.template")
        return needed

    def first_missing(self, rows: list[dict[str, Any]]) -> tuple[int, str, str] | None:
        """(row index, field, option) of the first needed field a row lacks, or None."""
        for field, option in self.needed_fields(rows).items():
            i = next((i for i, row in enumerate(rows) if field not in row), None)
            if i is not None:
                return i, field, option
        return None

    def option_value(self, option: str, field: str) -> str:
        """How an error shows the option that needs ``field``: ``data.template='...'`` or
        ``data.answer_field='answer'``."""
        return f"{option}={self.template if option == 'data.template' else field!r}"

    def check_fields(self, rows: list[dict[str, Any]], split: str) -> None:
        source = self.field_of(rows)
        missing = self.first_missing(rows)
        if missing is not None:
            i, field, option = missing
            where = f"the {split} rows of {self.describe(split)}"
            if i == 0:
                raise ValueError(
                    f"{self.option_value(option, field)} needs the field {field!r}, which is not "
                    f"a field of {where}; fields are {sorted(rows[0])}"
                )
            raise ValueError(
                f"{self.option_value(option, field)}: {self.name(i)} of {where} has no field "
                f"{field!r}"
            )
        where = f"the {split} rows of {self.describe(split)}"
        for i, row in enumerate(rows):
            value = row[source]
            if isinstance(value, str):
                continue
            if not isinstance(value, list):
                raise ValueError(
                    f"data.prompt_field={source!r}: {self.name(i)} of {where} holds a "
                    f"{type(value).__name__} ({value!r:.40}), not text or a list of "
                    "{role, content} messages"
                )
            at = f"data.prompt_field={source!r}: {self.name(i)} of {where}"
            if not value:
                raise ValueError(f"{at} holds an empty conversation")
            check_messages(value, at, ROLES)
            if self.chat_template is False:
                raise ValueError(
                    f"data.chat_template=false, but {self.name(i)} of {where} is a "
                    f"conversation (a list of messages in {source!r}); leave data.chat_template at null (or true), so "
                    "that the tokenizer's chat template writes it"
                )

    def conversation(self, row: Mapping[str, Any]) -> list[dict[str, Any]] | None:
        """The row's prompt as messages (a conversational row), or None (plain text)."""
        field = self.field_of([row])
        value = row[field]
        if not isinstance(value, list):
            return None
        messages = [dict(m) for m in value]
        if field == "messages":  # the prompt is what comes before the last assistant turn
            turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            messages = messages[: turns[-1]] if turns else messages
        return messages

    def format(self, row: Mapping[str, Any], name: str, split: str) -> str:
        """Row ``row``, named ``name`` in errors (:meth:`name`), as the prompt's text."""
        messages = self.conversation(row)
        if messages is not None:
            text = self._format_messages(messages, row, name, split)
        else:
            text = self._format_text(row, name, split)
        if not is_text(text):  # e.g. a JSON "\ud800" escape in a field the prompt reads
            at = next(i for i, c in enumerate(text) if not is_text(c))
            raise ValueError(
                f"data.source: {split} {name} of {self.describe(split)} {NOT_TEXT} "
                f"(at {text[max(at - 30, 0) : at + 30]!r}); fix or drop the row"
            )
        return text

    def _format_text(self, row: Mapping[str, Any], name: str, split: str) -> str:
        """A plain prompt: ``data.template`` over the row, then the chat template if it is used."""
        try:
            text = self.template.format_map({**row, "prompt": row[self.prompt_field]})
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"data.template={self.template!r} cannot format {split} {name} "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        if not self._uses_chat(row):
            return text
        return self._chat([{"role": "user", "content": text}], f"{split} {name}", split)

    def _uses_chat(self, row: Mapping[str, Any]) -> bool:
        """Whether the chat template writes this row's prompt (see :attr:`chat_template`)."""
        if self.chat_template is not None:
            return self.chat_template
        return self.system_prompt is not None or self.conversation(row) is not None

    def _format_messages(
        self, messages: list[dict[str, Any]], row: Mapping[str, Any], name: str, split: str
    ) -> str:
        """A conversation: ``data.template`` on its last user message, then the chat template."""
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users or messages[-1]["role"] == "assistant":
            raise ValueError(
                f"{split} {name} of {self.describe(split)}: its conversation has no user turn "
                "to answer (a prompt ends with the user's turn; a 'messages' row's last assistant "
                "turn and what follows it are left out)"
            )
        last = messages[users[-1]]
        try:
            last["content"] = self.template.format_map({**row, "prompt": last["content"]})
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"data.template={self.template!r} cannot format the last user message of {split} "
                f"{name} ({type(exc).__name__}: {exc})"
            ) from exc
        return self._chat(messages, f"{split} {name}", split)

    def _chat(self, messages: list[dict[str, Any]], row: str, split: str) -> str:
        """The chat template over ``messages`` (after ``data.system_prompt`` unless they bring a
        system message), the assistant's turn opened; a template that raises is named in one line
        with ``row`` (``"train line 41"``) and its own error, not jinja2's traceback."""
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"{row} of {self.describe(split)}: the tokenizer has no chat template to write a "
                "conversational row or data.system_prompt; use a chat model's tokenizer, or "
                "plain-text prompts without data.system_prompt"
            )
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # noqa: BLE001 - a template's raise_exception, a jinja2 error
            said = " ".join(str(exc).split())
            raise ValueError(
                f"{row} of {self.describe(split)}: the tokenizer's chat template cannot write "
                f"it ({type(exc).__name__}: {said}); fix the row, or give a tokenizer whose "
                "template takes it (model.model names the tokenizer)"
            ) from None
