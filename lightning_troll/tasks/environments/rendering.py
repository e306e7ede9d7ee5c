"""An episode's conversation as the chat template renders it, and an environment's reply as the
tokens the template puts between the model's turn and its next one.

The prompt is ``apply_chat_template(messages, add_generation_prompt=True)``. After each model
turn, the environment's reply is the difference of two renderings: the conversation with the
model's turn closed (``add_generation_prompt=False``) and the conversation with the reply and the
next turn's generation prompt (``add_generation_prompt=True``); what the template writes after an
assistant turn's content (``<|im_end|>\\n``, say) and the model did not generate itself goes in
front. Those tokens are the environment's (mask 0); the model's own tokens stay exactly as it
generated them. The model's turn enters the conversation as its text, tool calls and all (no
``tool_calls`` field), so the template renders what the model wrote.

Tools reach the template in one of two ways:

- A template that supports tools (its source mentions ``tools``) gets their schemas as
  ``apply_chat_template(..., tools=schemas)``.
- Otherwise (SmolLM2's template, for one), a section listing the schemas as JSON and the call
  format (:func:`tool_section`) ends the conversation's system message, or becomes one.

A tool's result is a message of role ``tool`` where the template renders that role (its source
names ``"tool"``); otherwise the results of a turn become one user message, each in
``<tool_response>...</tool_response>``.

A conversation started from a plain string (a model without a chat template) appends each reply's
text as it is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_troll.tasks.data.messages import check_messages
from lightning_troll.tasks.environments.calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from lightning_troll.tasks.environments.protocol import EnvironmentFailure
from lightning_troll.tasks.rewards.calls import describe

__all__ = [
    "TOOL_RESPONSE_CLOSE",
    "TOOL_RESPONSE_OPEN",
    "Conversation",
    "Reply",
    "TemplateSupport",
    "check_chat_template",
    "template_support",
    "tool_section",
    "unrendered",
]

TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"
"""The tags around one tool result in a user turn, where the template has no ``tool`` role."""

Message = dict[str, Any]

_SENTINEL = "\ue000"
"""A private-use character standing for an assistant turn's content, to find where it ends."""


@dataclass(frozen=True)
class Reply:
    """An environment's reply, as :meth:`Conversation.reply` renders it."""

    text: str
    """What the template writes between the model's turn and its next one."""
    ids: list[int]
    """``text``'s tokens (no special tokens added): the environment's, mask 0."""
    messages: list[Message]
    """The model's turn and the reply's messages, which :meth:`Conversation.add` appends (none
    in a plain-text conversation)."""


@dataclass(frozen=True)
class TemplateSupport:
    """What a tokenizer's chat template renders of tools."""

    tools: bool
    """It renders a ``tools`` list of schemas (its source mentions ``tools``)."""
    tool_role: bool
    """It renders messages of role ``tool`` (its source names the string ``"tool"``)."""


def _template_source(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(template.values()) if isinstance(template, Mapping) else str(template)


def template_support(tokenizer: Any) -> TemplateSupport:
    """What ``tokenizer``'s chat template renders of tools (both False without a template)."""
    source = _template_source(tokenizer)
    return TemplateSupport(
        tools=re.search(r"\btools\b", source) is not None,
        tool_role=re.search(r"""["']tool["']""", source) is not None,
    )


def tool_section(schemas: Sequence[Mapping[str, Any]]) -> str:
    """The system-message text that lists the tools and the call format, for a template that
    renders no tools."""
    lines = "\n".join(json.dumps(schema, ensure_ascii=False) for schema in schemas)
    return (
        "# Tools\n\nYou may call one or more functions to answer. The functions are listed "
        f"here, one JSON schema a line:\n<tools>\n{lines}\n</tools>\n\nTo call a function, "
        "write a JSON object with its name and arguments between the tags "
        f'{TOOL_CALL_OPEN} and {TOOL_CALL_CLOSE}:\n{TOOL_CALL_OPEN}\n{{"name": <function name>, '
        f'"arguments": <arguments as a JSON object>}}\n{TOOL_CALL_CLOSE}\nEach result comes back '
        f"between {TOOL_RESPONSE_OPEN} and {TOOL_RESPONSE_CLOSE}. When you have the answer, "
        "write it without a tool call."
    )


def _with_tool_section(messages: list[Message], schemas: Sequence[Mapping]) -> list[Message]:
    section = tool_section(schemas)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{section}"
        return [first, *messages[1:]]
    return [{"role": "system", "content": section}, *messages]


def prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` tokenized as a prompt: special tokens added unless the text already starts with
    the BOS token (as a chat template often writes it), as the DataModule does."""
    bos = getattr(tokenizer, "bos_token", None)
    add = not (bos and text.startswith(bos))
    return list(tokenizer(text, add_special_tokens=add)["input_ids"])


def unrendered(what: str, error: Exception) -> EnvironmentFailure:
    """The failure to render ``what`` (an episode's start, an environment's reply): a refusal of
    ours (a ``ValueError`` that names the option), or whatever the chat template raised (its
    ``raise_exception`` raises ``jinja2.TemplateError``), named with its type."""
    told = error if isinstance(error, ValueError) else f"the chat template raised {describe(error)}"
    return EnvironmentFailure(f"{what}: {told}")


def check_chat_template(tokenizer: Any, tools: bool) -> None:
    """Refuses a tokenizer without a chat template for episodes of messages (``tools``: with
    tools, which only messages can show)."""
    if _template_source(tokenizer):
        return
    if tools:
        raise ValueError(
            "model.episodes.tools: the model's tokenizer has no chat template to show the tools "
            "and write their results; tools need a chat model (one whose tokenizer has a "
            "chat_template)"
        )
    raise ValueError(
        "model.episodes.environment: the tokenizer has no chat template to write the episode's "
        "messages and the environment's replies; use a chat model's tokenizer, or start "
        "episodes from a plain string (reset returning text)"
    )


class Conversation:
    """One episode's conversation: its prompt, and each environment reply as tokens.

    Args:
        tokenizer: The policy's tokenizer (a chat template for a conversation of messages).
        start: The episode's start (:meth:`Environment.reset`): messages, or a plain prompt.
        schemas: The JSON schemas of the episode's tools (none for an environment without).
    """

    def __init__(
        self,
        tokenizer: Any,
        start: Sequence[Mapping[str, Any]] | str,
        schemas: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.schemas = [dict(s) for s in schemas]
        self.support = template_support(tokenizer)
        self.plain = isinstance(start, str)
        """A plain-text episode: replies are appended as they are."""
        if self.plain:
            if self.schemas:
                raise ValueError(
                    "model.episodes.tools: an episode with tools starts from messages (the environment's "
                    "reset returned a plain string), so that the chat template can show the tools"
                )
            self.messages: list[Message] = []
            self.prompt_text = str(start)
        else:
            check_messages(start, "reset(row) (a plain prompt string, or messages)")
            check_chat_template(tokenizer, bool(self.schemas))
            self.messages = [dict(m) for m in start]
            if self.schemas and not self.support.tools:
                self.messages = _with_tool_section(self.messages, self.schemas)
            self.prompt_text = self.render(self.messages, generation_prompt=True)

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt's tokens."""
        return prompt_ids(self.tokenizer, self.prompt_text)

    def render(self, messages: Sequence[Message], generation_prompt: bool) -> str:
        """``messages`` through the chat template, with the tools where it renders them."""
        extra = {"tools": self.schemas} if self.schemas and self.support.tools else {}
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt, **extra
        )

    def observation_messages(
        self, observation: str | Sequence[Mapping[str, Any]] | None, role: str = "user"
    ) -> list[Message]:
        """An environment's reply as messages: a string is one message of ``role``; tool results
        without a ``tool`` role in the template become one user message."""
        if observation is None:
            return []
        if isinstance(observation, str):
            messages = [{"role": role, "content": observation}]
        else:
            messages = [dict(m) for m in observation]
        if self.support.tool_role or self.plain:
            return messages
        merged: list[Message] = []
        results = None  # the user message that holds the results of consecutive tool messages
        for message in messages:
            if message.get("role") != "tool":
                merged.append(message)
                results = None
                continue
            block = f"{TOOL_RESPONSE_OPEN}\n{message['content']}\n{TOOL_RESPONSE_CLOSE}"
            if results is None:
                results = {"role": "user", "content": block}
                merged.append(results)
            else:
                results["content"] += "\n" + block
        return merged

    def reply(
        self,
        content: str,
        closing: str,
        observation: str | Sequence[Mapping[str, Any]] | None,
        role: str = "user",
    ) -> Reply:
        """What the environment's reply puts between the model's turn and its next one; the
        conversation stays as it was until :meth:`add` takes the reply (an episode whose budget
        has no room for it ends without it).

        ``content`` is the model's turn as text, its final stop token left out; ``closing`` that
        stop token's text (``""`` when a stop string ended the turn)."""
        replies = self.observation_messages(observation, role)
        if self.plain:
            return self._reply("".join(str(m["content"]) for m in replies), [])
        turn = {"role": "assistant", "content": content}
        close = self._turn_close(closing)
        closed = self.render([*self.messages, turn], generation_prompt=False)
        following = self.render([*self.messages, turn, *replies], generation_prompt=True)
        if not following.startswith(closed):
            raise ValueError(
                "model.episodes.environment: the chat template renders the earlier turns "
                "differently once the environment's reply follows (it rewrites past assistant turns, as templates "
                "that drop past reasoning do), so the reply cannot be told apart as tokens; use a "
                "template that leaves past turns as they were"
            )
        return self._reply(close + following[len(closed) :], [turn, *replies])

    def _reply(self, text: str, messages: list[Message]) -> Reply:
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
        return Reply(text, ids, messages)

    def add(self, reply: Reply) -> None:
        """Moves the conversation on by ``reply`` (the model's turn and the environment's
        messages)."""
        self.messages += reply.messages

    def _turn_close(self, closing: str) -> str:
        """What the template writes after the next assistant turn's content that the model did
        not generate: the template's close (``<|im_end|>\\n``) less the stop token the model
        wrote."""
        probe = [*self.messages, {"role": "assistant", "content": _SENTINEL}]
        rendered = self.render(probe, generation_prompt=False)
        close = rendered[rendered.rindex(_SENTINEL) + len(_SENTINEL) :]
        return close[len(closing) :] if closing and close.startswith(closing) else close
