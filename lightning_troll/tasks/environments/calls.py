"""Tool calls in the model's output, and one call run.

The model calls a tool by writing, anywhere in its turn, the Hermes tool-call convention that
many chat templates render (Qwen2.5's among them)::

    <tool_call>
    {"name": "multiply", "arguments": {"a": 6, "b": 7}}
    </tool_call>

one block per call. A turn makes one call: the episode loop ends every model turn at the end of
its first ``</tool_call>`` (whatever the environment, one of your own included), so its results
come back before the model writes anything more (:func:`parse_tool_calls` reads every block of
a text it is given, as a :class:`~lightning_troll.tasks.environments.ToolEnvironment` called outside
the loop may be). The block's text is a JSON object with a string ``"name"`` and an object
``"arguments"`` (given as a JSON string holding an object, as OpenAI's API writes them, it is
read too; left out, it is ``{}``). A block that is not that is a :class:`MalformedCall`, and so
is a ``<tool_call>`` never closed.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, get_args

from lightning_troll.tasks.data.messages import NOT_TEXT, is_text
from lightning_troll.tasks.environments.tools import render_result
from lightning_troll.tasks.rewards.calls import awaited, describe, short

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "MalformedCall",
    "TOOL_ERROR_KINDS",
    "ToolCall",
    "ToolErrorKind",
    "ToolOutcome",
    "parse_tool_calls",
    "run_tool",
    "run_tool_within",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
"""The tags around one tool call; a model's turn that writes the closing tag stops there (one
call a turn)."""


@dataclass(frozen=True)
class ToolCall:
    """One well-formed tool call."""

    name: str
    """The tool called."""
    arguments: dict[str, Any] = field(default_factory=dict)
    """Its keyword arguments, as parsed from JSON."""


@dataclass(frozen=True)
class MalformedCall:
    """A ``<tool_call>`` block that is not a JSON object with a name and arguments."""

    text: str
    """The block's text, between the tags."""
    problem: str
    """What is wrong with it, as a sentence's end (``"is not JSON (...)"``)."""


def _call_of(body: str) -> ToolCall | MalformedCall:
    """The call written in one block's text."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        return MalformedCall(body, f"is not JSON ({exc.msg} at character {exc.pos})")
    except (ValueError, RecursionError) as exc:  # nested too deep, an integer too long to read
        return MalformedCall(body, f"is not JSON that can be read ({type(exc).__name__})")
    if not isinstance(data, dict):
        return MalformedCall(body, f"is a JSON {type(data).__name__}, not an object")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return MalformedCall(body, 'has no "name" string')
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # {"arguments": "{\"a\": 1}"}, as OpenAI's API writes them
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
            return MalformedCall(body, 'has "arguments" that are not a JSON object')
    if not isinstance(arguments, dict):
        return MalformedCall(body, 'has "arguments" that are not a JSON object')
    if not is_text(json.dumps([name, arguments], ensure_ascii=False)):
        return MalformedCall(body, f"escapes text that {NOT_TEXT}")
    return ToolCall(name, arguments)


def parse_tool_calls(text: str) -> list[ToolCall | MalformedCall]:
    """Every ``<tool_call>...</tool_call>`` block of ``text``, in order; an empty list when the
    text calls no tool."""
    calls: list[ToolCall | MalformedCall] = []
    start = text.find(TOOL_CALL_OPEN)
    while start >= 0:
        begin = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, begin)
        if end < 0:
            calls.append(MalformedCall(text[begin:].strip(), f"has no closing {TOOL_CALL_CLOSE}"))
            break
        calls.append(_call_of(text[begin:end].strip()))
        start = text.find(TOOL_CALL_OPEN, end + len(TOOL_CALL_CLOSE))
    return calls


_PROBLEM_CHARACTERS = 300
"""The longest error message a tool's exception gives the model."""


ToolErrorKind = Literal[
    "malformed", "unknown", "bad_arguments", "raised", "timeout", "unrenderable", "crashed"
]
"""Why a tool call gave the model an error message: a block that is not a call, a tool not
listed, arguments that do not fit its schema, an exception, the timeout (``model.episodes.tool_timeout``),
a result that cannot be rendered as text (neither text nor JSON-serialisable, or its rendering
failed), its worker process dying."""

TOOL_ERROR_KINDS: tuple[str, ...] = get_args(ToolErrorKind)
"""Every kind of :data:`ToolErrorKind`, in order: the ``episodes/tool_errors_<kind>`` figures."""


class ToolOutcome(NamedTuple):
    """What one tool run gave (in this process or a worker)."""

    text: str
    """The rendered result; ``""`` when the run failed."""
    problem: str | None = None
    """What went wrong, as a sentence's end (``"timed out after 5 s"``); None when it ran."""
    kind: ToolErrorKind | None = None
    """The kind of failure; None when it ran."""


def run_tool(function: Callable[..., Any], arguments: Mapping[str, Any]) -> ToolOutcome:
    """``function(**arguments)`` (awaited, for an ``async def`` tool), its result rendered; or an
    outcome whose ``problem`` says what went wrong and whose ``kind`` is ``"raised"`` or
    ``"unrenderable"`` (whatever rendering the result raised). Runs in this process or in a tool
    worker (:mod:`lightning_troll.tasks.environments.tool_workers`)."""
    try:
        value = awaited(function(**arguments))  # an ``async def`` tool's coroutine run to its end
    except (Exception, SystemExit, GeneratorExit, asyncio.CancelledError) as exc:
        # a tool may raise anything, call sys.exit, or cancel its own task: only
        # KeyboardInterrupt stops the run
        problem = short(f"raised {describe(exc)}", _PROBLEM_CHARACTERS)
        return ToolOutcome("", problem, "raised")
    text, problem = render_result(value)
    if problem is not None:
        return ToolOutcome("", short(problem, _PROBLEM_CHARACTERS), "unrenderable")
    return ToolOutcome(text)


class _Overtime(BaseException):
    """Raised into a tool call in the trainer's process by the alarm of its timeout: a
    BaseException, so that the tool's own ``except Exception`` does not keep it."""


def run_tool_within(
    function: Callable[..., Any], arguments: Mapping[str, Any], timeout: float | None
) -> ToolOutcome:
    """:func:`run_tool` in this process, interrupted after ``timeout`` seconds (a ``"timeout"``
    outcome) by a SIGALRM, where this is the main thread of a system that has one; elsewhere, or
    with ``timeout`` None, without a limit. A tool blocked in C code that holds off signals is
    interrupted only when it returns to Python."""
    bounded = (
        timeout is not None
        and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
    )
    if not bounded:
        return run_tool(function, arguments)

    def overtime(signum: int, frame: Any) -> None:
        raise _Overtime

    previous = signal.signal(signal.SIGALRM, overtime)
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            return run_tool(function, arguments)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Overtime:
        return ToolOutcome("", f"timed out after {timeout:g} s", "timeout")
    finally:
        signal.signal(signal.SIGALRM, previous)
