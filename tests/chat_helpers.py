"""Chat tokenizers for the episode tests: a character-level tokenizer over printable text with
ChatML's two special tokens, and chat templates with and without tools."""

from __future__ import annotations

import string

from tokenizers import Regex, pre_tokenizers

from lightning_troll.models.tinymath import char_tokenizer

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML without a tools section or a tool role (as SmolLM2-135M-Instruct's template)."""

CHATML_TOOLS = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}"
    "{{ messages[0].content }}\n\n{% endif %}# Tools\n<tools>{% for tool in tools %}"
    "{{ '\\n' + (tool | tojson) }}{% endfor %}{{ '\\n' }}</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if message.role == 'system' and tools %}"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ message.role }}\n"
    "{{ message.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML with a tools section and a ``tool`` role, after the Hermes convention."""

FORGETFUL = (
    "{% for message in messages %}{% if message.role == 'assistant' and not loop.last %}"
    "<|im_start|>assistant\n<|im_end|>\n{% else %}<|im_start|>{{ message.role }}\n"
    "{{ message.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A template that drops the content of every assistant turn but the last one."""


def chat_tokenizer(template: str | None = CHATML):
    """Printable characters one token each, ``<|im_start|>`` and ``<|im_end|>`` one token each
    (``<|im_end|>`` is the eos token), and ``template`` as the chat template."""
    tokenizer = char_tokenizer("".join(sorted(set(string.printable) - set("\r\x0b\x0c"))), 4096)
    # one token per character, newlines included (a plain "." would keep "\n\n" whole)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Split(
        Regex("[\\s\\S]"), behavior="isolated"
    )
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = template
    return tokenizer


def encode(tokenizer, text: str) -> list[int]:
    """``text``'s tokens, no special tokens added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
