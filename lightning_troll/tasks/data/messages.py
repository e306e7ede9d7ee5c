"""Conversations as the library reads them: a list of ``{"role", "content"}`` messages whose
text a tokenizer can read.

One check serves every place a conversation comes from: a data row's prompt
(:mod:`lightning_troll.tasks.data.formatting`), an environment's start and observations, and a tool's
result (:mod:`lightning_troll.tasks.environments`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["NOT_TEXT", "ROLES", "check_messages", "is_text"]

ROLES = ("system", "user", "assistant", "tool")
"""The roles of a data row's conversation."""

NOT_TEXT = "holds half a surrogate pair alone (U+D800-U+DFFF), which no tokenizer can read"
"""Why a string that is not :func:`is_text` is refused, as a sentence's end."""


def is_text(text: str) -> bool:
    """Whether ``text`` can be written as UTF-8: no half of a surrogate pair alone (which JSON's
    ``\\ud83d`` escapes and ``errors="surrogateescape"`` decoding give), since a tokenizer
    cannot read it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_messages(messages: object, where: str, roles: Sequence[str] | None = None) -> None:
    """Refuses ``messages`` unless they are a list of mappings, each with a string ``role`` (one
    of ``roles``, when given) and a string ``content``, both :func:`is_text`; the error names
    ``where`` they came from and the message that is wrong."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ValueError(f"{where} must be a list of messages; got a {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(
                f"{where}: message {i} is a {type(message).__name__} ({message!r:.60}); a message "
                'is a mapping {"role": ..., "content": ...}'
            )
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(
                    f"{where}: message {i} needs a string {key!r}; got {message!r:.80}"
                )
            if not is_text(message[key]):
                raise ValueError(f"{where}: message {i}'s {key!r} {NOT_TEXT}")
        if roles is not None and message["role"] not in roles:
            raise ValueError(
                f"{where}: message {i} has role {message['role']!r}; roles are {', '.join(roles)}"
            )
