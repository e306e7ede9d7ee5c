"""From rows to prompts: the ``data`` options that format and tokenize each row.

:class:`PromptFormatter` checks that the rows hold the fields the options name, formats each row
with ``data.template`` (optionally inside the tokenizer's chat template, after a system prompt),
tokenizes it once and checks its length against ``data.max_prompt_tokens``. Every error names the
option, the row and what to change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from lightning_troll.data.prompts import PromptItem, template_fields

__all__ = ["PromptFormatter"]


@dataclass(frozen=True)
class PromptFormatter:
    """Formats and tokenizes rows (the options are :class:`~lightning_troll.data.PromptDataModule`'s)."""

    prompt_field: str
    answer_field: str | None
    template: str
    chat_template: bool
    system_prompt: str | None
    max_prompt_tokens: int
    tokenizer: PreTrainedTokenizerBase
    describe: Callable[[str], str]
    """Names the rows of a split in errors (``"the file x.jsonl"``)."""

    def prepare(self, rows: list[dict[str, Any]], split: str) -> list[PromptItem]:
        """Checks fields, formats, tokenizes and checks the length of every row."""
        if not rows:
            return []
        self.check_fields(rows, split)
        texts = [self.format(row, i, split) for i, row in enumerate(rows)]
        bos = self.tokenizer.bos_token
        # A chat template usually writes BOS itself: do not add a second one.
        add_special = not (self.chat_template and bos and texts[0].startswith(bos))
        ids = self.tokenizer(texts, add_special_tokens=add_special)["input_ids"]
        lengths = [len(seq) for seq in ids]
        too_long = [i for i, n in enumerate(lengths) if n > self.max_prompt_tokens or n == 0]
        if too_long:
            i = too_long[0]
            raise ValueError(
                f"data.max_prompt_tokens={self.max_prompt_tokens}: {len(too_long)} of {len(rows)} "
                f"{split} prompts of {self.describe(split)} have too many tokens (or none); the "
                f"first is row {i} with {lengths[i]} tokens ({texts[i][:60]!r}); raise "
                "data.max_prompt_tokens or shorten data.template"
            )
        answer = self.answer_field
        return [
            PromptItem(text, list(seq), {**row, "answer": row[answer]} if answer else dict(row))
            for text, seq, row in zip(texts, ids, rows, strict=True)
        ]

    def check_fields(self, rows: list[dict[str, Any]], split: str) -> None:
        needed = {self.prompt_field: "data.prompt_field"}
        if self.answer_field is not None:
            needed[self.answer_field] = "data.answer_field"
        for field in sorted(template_fields(self.template) - {"prompt"}):
            needed.setdefault(field, "data.template")
        for field, option in needed.items():
            i = next((i for i, row in enumerate(rows) if field not in row), None)
            if i is None:
                continue
            value = self.template if option == "data.template" else field
            where = f"the {split} rows of {self.describe(split)}"
            if i == 0:
                raise ValueError(
                    f"{option}={value!r} needs the field {field!r}, which is not a field of "
                    f"{where}; fields are {sorted(rows[0])}"
                )
            raise ValueError(f"{option}={value!r}: row {i} of {where} has no field {field!r}")
        bad = next(
            (i for i, r in enumerate(rows) if not isinstance(r[self.prompt_field], str)), None
        )
        if bad is not None:
            value = rows[bad][self.prompt_field]
            raise ValueError(
                f"data.prompt_field={self.prompt_field!r}: row {bad} of the {split} rows holds a "
                f"{type(value).__name__} ({value!r:.40}), not text"
            )

    def format(self, row: Mapping[str, Any], index: int, split: str) -> str:
        try:
            text = self.template.format_map({**row, "prompt": row[self.prompt_field]})
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"data.template={self.template!r} cannot format {split} row {index} "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate, e.g. from a JSON "\ud800" escape
            raise ValueError(
                f"data.source: {split} row {index} of {self.describe(split)} is not valid Unicode "
                f"text ({exc.reason} at position {exc.start} of {text[:60]!r}); fix or drop the row"
            ) from exc
        if not self.chat_template:
            return text
        messages = [{"role": "user", "content": text}]
        if self.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
