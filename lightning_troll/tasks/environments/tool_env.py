"""The built-in environment of tools (``model.episodes.tools``), and the environments of a batch
stepped together.

:class:`ToolEnvironment`: a model turn that calls a tool gets its result as its observation (a
``tool`` message; one a turn, since the episode loop ends a turn at its first ``</tool_call>``,
though a text given to :meth:`ToolEnvironment.step` by hand may hold several calls, one message
each, in order); a turn without a tool call is the final answer and ends the episode, scored by
the ordinary rewards (``model.rewards``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_troll.tasks.environments.calls import MalformedCall, ToolCall, parse_tool_calls
from lightning_troll.tasks.environments.protocol import (
    Environment,
    Step,
    call_environment,
)
from lightning_troll.tasks.environments.tool_workers import ToolResult, ToolRunner, count_errors

__all__ = ["ToolEnvironment", "step_all"]


class ToolEnvironment(Environment):
    """Tools for the model to call in its turns; a turn without a call ends the episode.

    Args:
        runner: The tools, and how their calls run (shared by the environments of a batch).
        prompt_field: The row's field that holds the prompt: messages, or a string that becomes
            one user message.
    """

    def __init__(self, runner: ToolRunner, prompt_field: str = "prompt") -> None:
        self.runner = runner
        self.prompt_field = prompt_field

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return self.runner.schemas

    def reset(self, row: Mapping[str, Any]) -> list[dict[str, Any]]:
        if self.prompt_field not in row:
            raise ValueError(
                f"ToolEnvironment: the row has no field {self.prompt_field!r} to start the episode "
                f"from (it has {', '.join(map(str, row)) or 'none'})"
            )
        prompt = row[self.prompt_field]
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        return [dict(message) for message in prompt]

    def calls(self, turn: str) -> list[ToolCall | MalformedCall]:
        """The tool calls the turn makes (one at most in the episode loop, which ends a turn at
        its first ``</tool_call>``)."""
        return parse_tool_calls(turn)

    def answer(self, turn: str) -> Step:
        """The step of a turn without a tool call: the episode ends (a subclass may score it)."""
        return Step(done=True)

    def observe(self, turn: str, results: Sequence[ToolResult]) -> Step:
        """The step of a turn whose calls gave ``results``: one ``tool`` message each."""
        messages = [{"role": "tool", "name": r.name or "", "content": r.text} for r in results]
        return Step(
            messages,
            tool_calls=len(results),
            tool_errors=count_errors(results),
            tool_replies_cut=sum(r.cut for r in results),
        )

    def step(self, turn: str) -> Step:
        calls = self.calls(turn)
        if not calls:
            return self.answer(turn)
        return self.observe(turn, self.runner.run(calls))


def step_all(environments: Sequence[Any], turns: Sequence[str]) -> list[Step]:
    """``environments[i].step(turns[i])`` for every i, with the tool calls of the
    :class:`ToolEnvironment` s that share a runner (and keep its ``step``) run in one batch, in
    parallel across its workers."""
    steps: list[Step | None] = [None] * len(environments)
    batches: dict[int, list[tuple[int, list[ToolCall | MalformedCall]]]] = {}
    for i, (env, turn) in enumerate(zip(environments, turns, strict=True)):
        if isinstance(env, ToolEnvironment) and type(env).step is ToolEnvironment.step:
            calls = call_environment(env, "calls", turn)
            if calls:
                batches.setdefault(id(env.runner), []).append((i, calls))
                continue
            steps[i] = call_environment(env, "answer", turn)
        else:
            steps[i] = call_environment(env, "step", turn)
    for batch in batches.values():
        runner = environments[batch[0][0]].runner
        results = iter(runner.run([call for _, calls in batch for call in calls]))
        for i, calls in batch:
            outcomes = [next(results) for _ in calls]
            steps[i] = call_environment(environments[i], "observe", turns[i], outcomes)
    return steps  # type: ignore[return-value]
