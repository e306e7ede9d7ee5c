"""Tool calls run, in this process or in worker processes with a timeout (``model.episodes.tools``,
``model.episodes.tool_workers``, ``model.episodes.tool_timeout``).

:class:`ToolRunner` holds the tools and answers a turn's calls with one :class:`ToolResult`
each: the tool's rendered result, or an error message the model reads as the result. A call
never ends the run, whatever it does:

============== =============================================================================
kind           the model reads (``multiply`` being the tool)
============== =============================================================================
malformed      ``Error: the tool call is malformed: it is not JSON (...); write ...``
unknown        ``Error: unknown tool 'divide'; the tools are multiply``
bad_arguments  ``Error: tool 'multiply' got bad arguments: missing argument 'b'``
raised         ``Error: tool 'multiply' raised ZeroDivisionError: division by zero``
timeout        ``Error: tool 'multiply' timed out after 5 s``
unrenderable   ``Error: tool 'multiply' returned a set, which is neither text nor ...``
crashed        ``Error: tool 'multiply' killed its worker process (exit code -9); ...``
============== =============================================================================

With ``workers`` >= 1 the calls run in :class:`ToolWorkers`, the reward workers' pool
(:class:`~lightning_troll.tasks.rewards.workers.WorkerPool`) running
:func:`~lightning_troll.tasks.environments.calls.run_tool`: the calls of a batch in parallel, a call
past ``timeout`` abandoned and its worker replaced, a worker that dies replaced too. With 0 they
run in this process, one after another, each interrupted by an alarm past ``timeout``
(:func:`~lightning_troll.tasks.environments.calls.run_tool_within`). A reply longer than
``reply_chars`` is cut (:func:`cut_reply`). A rollout whose tools fail too often stops the run
(:func:`tool_failure_problem`, ``model.episodes.tool_failures``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_troll.tasks.environments.calls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    MalformedCall,
    ToolCall,
    ToolErrorKind,
    ToolOutcome,
    run_tool,
    run_tool_within,
)
from lightning_troll.tasks.environments.options import check_tool_workers
from lightning_troll.tasks.environments.protocol import EnvironmentFailure
from lightning_troll.tasks.environments.tools import (
    Tool,
    check_arguments,
    conform_arguments,
    load_tools,
)
from lightning_troll.tasks.rewards.calls import UNLOADABLE
from lightning_troll.tasks.rewards.workers import WorkerPool, WorkersFailed, check_picklable

__all__ = [
    "TOOL_FAULTS",
    "ToolResult",
    "ToolRunner",
    "ToolWorkers",
    "count_errors",
    "cut_reply",
    "tool_failure_problem",
]

TOOL_FAULTS = ("raised", "timeout", "unrenderable", "crashed")
"""The kinds of tool error that are the tool's fault, not the model's: what
``model.episodes.tool_failure_limit`` counts."""

TOOL_REPLY_CHARS = 8192
"""The default of ``model.episodes.tool_reply_chars``."""


class ToolWorkers(WorkerPool):
    """Worker processes that run tool calls, each abandoned after ``timeout`` seconds."""

    runner = staticmethod(run_tool)
    noun = "tool"
    workers_option = "episodes.tool_workers"
    timeout_option = "episodes.tool_timeout"
    outcome = ToolOutcome
    failed_value = ""


@dataclass(frozen=True)
class ToolResult:
    """What the model reads back for one call."""

    name: str | None
    """The tool called; None for a malformed call."""
    text: str
    """The tool's result rendered as text, or the error message (``"Error: ..."``)."""
    error: ToolErrorKind | None = None
    """Why the call failed; None when the tool ran and its result rendered."""
    cut: bool = False
    """Whether the reply was longer than ``model.episodes.tool_reply_chars`` and cut there."""


def count_errors(results: Sequence[ToolResult]) -> dict[str, int]:
    """kind -> the failed calls of that kind among ``results`` (kinds with none left out)."""
    return dict(Counter(r.error for r in results if r.error is not None))


def cut_reply(text: str, limit: int) -> tuple[str, bool]:
    """``text`` cut to its first ``limit`` characters with a note of its length, and whether it
    was cut; ``text`` itself where it fits."""
    if len(text) <= limit:
        return text, False
    return (
        f"{text[:limit]}\n[cut: the reply was {len(text):,} characters; the first {limit:,} shown]",
        True,
    )


TOOL_FAILURE_MIN = 4
"""The fewest failed tool calls in a rollout that stop the run or warn (``tool_failures``): a tool
that raises on one odd input early in training is the model's lesson, not a broken tool."""


def tool_failure_problem(calls: int, errors: Mapping[str, int], limit: float) -> str | None:
    """Why a rollout's tool calls stop the run (``model.episodes.tool_failures``): of ``calls``
    made, those the model wrote well (not ``malformed``, ``unknown`` or ``bad_arguments``) ran,
    and the tools' own failures (:data:`TOOL_FAULTS`) among them reach ``limit``; None where
    they do not, where none ran, or where fewer than :data:`TOOL_FAILURE_MIN` failed."""
    ran = calls - sum(n for kind, n in errors.items() if kind not in TOOL_FAULTS)
    failed = sum(errors.get(kind, 0) for kind in TOOL_FAULTS)
    if ran <= 0 or failed < limit * ran or failed < TOOL_FAILURE_MIN:
        return None
    kinds = ", ".join(f"{kind} {errors[kind]}" for kind in TOOL_FAULTS if errors.get(kind))
    return (
        f"{failed} of the {ran} tool calls that ran in this rollout failed ({kinds}), at or above "
        f"model.episodes.tool_failure_limit={limit:g}"
    )


CALL_FORMAT = f'{TOOL_CALL_OPEN}{{"name": ..., "arguments": {{...}}}}{TOOL_CALL_CLOSE}'


class ToolRunner:
    """The tools of ``model.episodes.tools``, and the calls of a turn (or of many) run.

    Args:
        tools: Import paths (``"my_tools:multiply"``) or functions, each type-hinted and with a
            docstring (:mod:`~lightning_troll.tasks.environments.tools`), or tools already built.
        workers: Worker processes that run the calls (``model.episodes.tool_workers``); 0 runs them in
            this process.
        timeout: Seconds a call may take in a worker before it is abandoned
            (``model.episodes.tool_timeout``), or interrupted in this process
            (:func:`~lightning_troll.tasks.environments.calls.run_tool_within`); None waits for ever.
        reply_chars: The most characters of a reply the model reads
            (``model.episodes.tool_reply_chars``); a longer one is cut (:func:`cut_reply`).
    """

    def __init__(
        self,
        tools: Sequence[str | Callable[..., Any] | Tool],
        workers: int = 0,
        timeout: float | None = None,
        reply_chars: int = TOOL_REPLY_CHARS,
    ) -> None:
        check_tool_workers(workers, timeout)
        self.timeout = timeout
        self.reply_chars = reply_chars
        self.tools: dict[str, Tool] = load_tools(tools)
        """name -> tool."""
        if not self.tools:
            raise ValueError("model.episodes.tools must name at least one tool; got none")
        self.workers = None if workers == 0 else ToolWorkers(workers, timeout)
        """The worker processes, or None to run calls in this process."""
        self._payloads = {}
        if self.workers is not None:
            self._payloads = {
                name: check_picklable(name, tool.function, "tool", ToolWorkers.workers_option)
                for name, tool in self.tools.items()
            }

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas, in the order of ``model.episodes.tools``."""
        return [tool.schema for tool in self.tools.values()]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self.tools)!r}, workers={self.workers!r})"

    def close(self) -> None:
        """Stops the worker processes, if any (the next :meth:`run` starts them again)."""
        if self.workers is not None:
            self.workers.close()

    def run(self, calls: Sequence[ToolCall | MalformedCall]) -> list[ToolResult]:
        """One result per call, in order: the checks here, then the tools (in parallel across the
        workers, if any)."""
        results: list[ToolResult | None] = [self._refused(call) for call in calls]
        todo = [i for i, r in enumerate(results) if r is None]
        arguments = {
            i: conform_arguments(self.tools[calls[i].name], calls[i].arguments) for i in todo
        }
        if self.workers is not None:
            jobs = []
            for i in todo:
                name = calls[i].name
                function = self.tools[name].function
                jobs.append((f"{name}@{id(function)}", self._payloads[name], function,
                             arguments[i]))  # fmt: skip
            try:
                outcomes = self.workers.run(jobs)
            except WorkersFailed as error:  # no call failed: no tool can run at all
                raise EnvironmentFailure(f"the tool workers failed: {error}") from error
        else:
            outcomes = [run_tool_within(self.tools[calls[i].name].function, arguments[i],
                                        self.timeout) for i in todo]  # fmt: skip
        for i, outcome in zip(todo, outcomes, strict=True):
            result = self._result(calls[i].name, outcome)
            if result.error is None:  # an error's text is short (its problem is cut at 300)
                text, cut = cut_reply(result.text, self.reply_chars)
                result = ToolResult(result.name, text, None, cut)
            results[i] = result
        return results  # type: ignore[return-value]

    def _refused(self, call: ToolCall | MalformedCall) -> ToolResult | None:
        """The error result of a call that is not run (malformed, unknown tool, bad arguments);
        None for one that runs."""
        if isinstance(call, MalformedCall):
            return ToolResult(
                None,
                f"Error: the tool call is malformed: it {call.problem}; write {CALL_FORMAT}",
                "malformed",
            )
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(
                call.name,
                f"Error: unknown tool {call.name!r}; the tools are {', '.join(self.tools)}",
                "unknown",
            )
        problem = check_arguments(tool, call.arguments)
        if problem is not None:
            return ToolResult(
                call.name,
                f"Error: tool {call.name!r} got bad arguments: {problem}",
                "bad_arguments",
            )
        return None

    @staticmethod
    def _result(name: str, outcome: ToolOutcome) -> ToolResult:
        """The result of a call that ran; a worker's death (kind ``"error"``) is ``"crashed"``;
        a tool that cannot be loaded in a worker stops the run (:class:`EnvironmentFailure`)."""
        text, problem, kind = outcome
        if problem is None:
            return ToolResult(name, text)
        if kind == UNLOADABLE:  # not the model's error: no call of the tool can run
            raise EnvironmentFailure(
                f"tool {name!r} {problem}; model.episodes.tool_workers 0 runs tools in the "
                "trainer's process"
            )
        kind = kind if kind in ("raised", "timeout", "unrenderable") else "crashed"
        return ToolResult(name, f"Error: tool {name!r} {problem}", kind)
