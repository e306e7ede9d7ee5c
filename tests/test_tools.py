"""Tools as plain Python functions: their schemas, the calls parsed from the model's output, and
every way a call can fail giving the model an error message instead of ending the run."""

from __future__ import annotations

import asyncio
import math
import sys
import textwrap

import pytest

from lightning_troll.tasks.environments import (
    MalformedCall,
    ToolCall,
    ToolResult,
    ToolRunner,
    load_tool,
    load_tools,
    parse_tool_calls,
)
from lightning_troll.tasks.environments.tools import check_arguments, render_result
from lightning_troll.tasks.rewards.lookup import config_folders
from tests import tool_helpers

H = "tests.tool_helpers:"

# -- schemas ---------------------------------------------------------------------------------------


def test_the_schema_comes_from_the_hints_and_the_docstring():
    """Written by hand: floats are JSON numbers, each argument's description is its Args: line,
    the first docstring line is the description, and both arguments are required."""
    tool = load_tool(H + "multiply")
    assert tool.name == "multiply" and tool.function is tool_helpers.multiply
    assert tool.schema == {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiply two numbers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "number", "description": "The first number."},
                    "b": {"type": "number", "description": "The second number."},
                },
                "required": ["a", "b"],
            },
            "return": {"type": "number"},
        },
    }


def test_optional_literal_and_defaulted_arguments():
    tool = load_tool(tool_helpers.lookup)  # a function works as well as its import path
    assert tool.parameters["required"] == ["city"]
    assert tool.parameters["properties"]["unit"]["enum"] == ["celsius", "fahrenheit"]
    assert tool.parameters["properties"]["days"] == {
        "type": "integer", "nullable": True, "description": "How many days ahead, if any."
    }  # fmt: skip


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        (
            "no_docstring",
            "Cannot generate JSON schema for no_docstring because it has no docstring",
        ),
        ("no_hints", "Argument a is missing a type hint in function no_hints. A tool is"),
    ],
)
def test_a_function_without_hints_or_docstring_is_refused(name, reason):
    with pytest.raises(ValueError) as error:
        load_tools([H + name])
    message = str(error.value)
    assert message.startswith(f"model.episodes.tools: '{H}{name}' cannot be a tool: {reason}")
    assert "a type hint on every argument and a docstring" in message


def test_refused_tools_name_the_option():
    with pytest.raises(
        ValueError, match=r"model.episodes.tools: 'tests.tool_helpers:Countdown' is a class"
    ):
        load_tool(H + "Countdown")
    with pytest.raises(ValueError, match=r"model.episodes.tools: 'tests.tool_helpers:multiplyy': .* has "
                       r"no function 'multiplyy'; did you mean 'multiply'\?"):  # fmt: skip
        load_tool(H + "multiplyy")
    with pytest.raises(ValueError, match=r"model.episodes.tools: 'multiply' is not an import path"):
        load_tool("multiply")
    with pytest.raises(ValueError, match=r"'tests.tool_helpers:multiply' and .* are both named "
                       r"'multiply'"):  # fmt: skip
        load_tools([H + "multiply", tool_helpers.multiply])
    with pytest.raises(ValueError, match="model.episodes.tools must name at least one tool"):
        ToolRunner([])


def tools_module(folder, value):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "my_tools.py").write_text(textwrap.dedent(f'''
        def add(a: int, b: int) -> int:
            """Add two integers.

            Args:
                a: One.
                b: The other.
            """
            return a + b + {value}
    '''))  # fmt: skip


@pytest.mark.parametrize("workers", [0, 1])
def test_a_tools_module_is_found_beside_the_config_from_another_directory(
    tmp_path, monkeypatch, workers
):
    """my_tools.py lies beside the config only; the working directory is elsewhere. The tool
    is found there, and a worker process imports it too."""
    configs, elsewhere = tmp_path / "configs", tmp_path / "elsewhere"
    tools_module(configs, 100)
    elsewhere.mkdir()
    (configs / "task.yaml").write_text("model:\n  tools: [my_tools:add]\n")
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "my_tools", raising=False)
    with config_folders([configs / "task.yaml"]):
        runner = ToolRunner(["my_tools:add"], workers=workers)
    try:
        assert runner.run([ToolCall("add", {"a": 1, "b": 2})]) == [ToolResult("add", "103")]
    finally:
        runner.close()
    with pytest.raises(ValueError) as error:  # without the config, it is nowhere
        monkeypatch.delitem(sys.modules, "my_tools", raising=False)
        sys.path.remove(str(configs))
        load_tool("my_tools:add")
    assert str(error.value).startswith(
        f"model.episodes.tools: 'my_tools:add': no module 'my_tools' in the working directory {elsewhere}"
    )
    assert "built-in reward" not in str(error.value)


# -- parsing ---------------------------------------------------------------------------------------


def test_well_formed_calls_are_parsed_in_order():
    text = (
        'Let me compute.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n'
        '</tool_call>\n<tool_call>{"name": "lookup", "arguments": "{\\"city\\": \\"Oslo\\"}"}'
        '</tool_call><tool_call>{"name": "now"}</tool_call>'
    )
    assert parse_tool_calls(text) == [
        ToolCall("multiply", {"a": 6, "b": 7}),
        ToolCall("lookup", {"city": "Oslo"}),  # arguments as a JSON string, as OpenAI writes
        ToolCall("now", {}),
    ]


def test_no_call_gives_an_empty_list():
    assert parse_tool_calls("The answer is 42.") == []
    assert parse_tool_calls("") == []


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ('{"name": "multiply", "arguments": {"a": 6,}}', "is not JSON (Expecting property name "
         "enclosed in double quotes at character 42)"),
        ('["multiply", 6, 7]', "is a JSON list, not an object"),
        ('{"arguments": {"a": 1}}', 'has no "name" string'),
        ('{"name": 3}', 'has no "name" string'),
        ('{"name": "multiply", "arguments": [6, 7]}', 'has "arguments" that are not a JSON object'),
        ('{"name": "multiply", "arguments": "6, 7"}', 'has "arguments" that are not a JSON object'),
        # what json.loads raises besides JSONDecodeError, on text a model can write
        ("[" * 100_000, "is not JSON that can be read (RecursionError)"),
        ('{"name": "f", "arguments": {"a": ' + "9" * 5000 + "}}",
         "is not JSON that can be read (ValueError)"),
        ('{"name": "f", "arguments": "' + "[" * 100_000 + '"}',
         'has "arguments" that are not a JSON object'),
        # half an escaped emoji: all ASCII, but no tokenizer can read what it decodes to
        ('{"name": "echo", "arguments": {"text": "Paris \\ud83d"}}',
         "escapes text that holds half a surrogate pair alone (U+D800-U+DFFF), which no "
         "tokenizer can read"),
    ],
)  # fmt: skip
def test_malformed_calls_say_what_is_wrong(body, problem):
    assert parse_tool_calls(f"x <tool_call>{body}</tool_call> y") == [MalformedCall(body, problem)]


def test_a_whole_escaped_surrogate_pair_is_text():
    text = '<tool_call>{"name": "echo", "arguments": {"text": "\\ud83d\\ude00"}}</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("echo", {"text": "\U0001f600"})]


def test_an_unclosed_call_is_malformed_and_a_good_one_before_it_stays():
    text = '<tool_call>{"name": "a"}</tool_call> then <tool_call>{"name": "b"'
    assert parse_tool_calls(text) == [
        ToolCall("a", {}), MalformedCall('{"name": "b"', "has no closing </tool_call>")
    ]  # fmt: skip


# -- arguments and results -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        ({"a": 1, "b": 2.5}, None),
        ({"a": 1}, "missing argument 'b'"),
        ({"a": 1, "b": 2, "c": 3}, "unexpected argument 'c' (it takes a, b)"),
        ({"a": "six", "b": 2}, "argument 'a' should be number, got string 'six'"),
        ({"a": True, "b": 2}, "argument 'a' should be number, got boolean True"),
    ],
)
def test_arguments_are_checked_against_the_schema(arguments, problem):
    assert check_arguments(load_tool(H + "multiply"), arguments) == problem


def test_nullable_and_enum_arguments():
    tool = load_tool(H + "lookup")
    assert check_arguments(tool, {"city": "Oslo", "days": None}) is None
    assert check_arguments(tool, {"city": "Oslo", "unit": "kelvin"}) == (
        "argument 'unit' is 'kelvin', not one of ['celsius', 'fahrenheit']"
    )
    assert check_arguments(tool, {"city": "Oslo", "days": 2.0}) is None  # JSON Schema's integer
    assert check_arguments(tool, {"city": "Oslo", "days": 1.5}) == (
        "argument 'days' should be integer, got number 1.5"
    )


def place(at: tuple[int, str], scores: dict[str, float], tags: list[int] | None = None) -> str:
    """Place a piece.

    Args:
        at: The row and the column's letter.
        scores: The score of each player.
        tags: Numbers to tag the piece with.
    """
    return "ok"


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        ({"at": [2, "b"], "scores": {"ann": 1, "bo": 0.5}, "tags": None}, None),
        ({"at": [2, "b", 3], "scores": {}}, "argument 'at' should be an array of 2 items, got 3"),
        ({"at": ["b", 2], "scores": {}}, "argument 'at' item 0 should be integer, got string 'b'"),
        (
            {"at": [2, "b"], "scores": {"ann": "high"}},
            "argument 'scores' key 'ann' should be number, got string 'high'",
        ),
        ({"at": [2, "b"], "scores": {}, "tags": [1, 2.5]}, "argument 'tags' item 1 should be "
         "integer, got number 2.5"),
    ],
)  # fmt: skip
def test_tuple_mapping_and_list_arguments_are_checked_item_by_item(arguments, problem):
    """A tuple's items by position (transformers writes it as ``prefixItems``), a mapping's values
    (``additionalProperties``) and a list's items, each named where it does not fit."""
    assert check_arguments(load_tool(place), arguments) == problem


@pytest.mark.parametrize("workers", [0, 1])
def test_a_whole_number_written_with_a_fraction_is_an_integer(workers):
    """JSON Schema counts ``3.0`` an integer: the call is run, and the tool gets an ``int`` where
    its hints say ``int`` (alone, in a tuple, in a list) and the number as written where they say
    ``float``, in this process and in workers alike."""
    arguments = {"n": 3.0, "at": [2.0, "b"], "tags": [1.0, 4], "x": 5.0}
    assert check_arguments(load_tool(H + "types_of"), arguments) is None
    assert check_arguments(load_tool(H + "types_of"), {**arguments, "tags": [1.5]}) == (
        "argument 'tags' item 0 should be integer, got number 1.5"
    )
    runner = ToolRunner([H + "types_of"], workers=workers)
    try:
        results = runner.run([ToolCall("types_of", arguments)])
    finally:
        runner.close()
    assert results == [ToolResult("types_of", '["int 3", "int 2", "int 1", "int 4", "float 5.0"]')]


def test_results_render_as_text_or_json():
    assert render_result("42") == ("42", None)
    assert render_result(42.0) == ("42.0", None)
    assert render_result({"t": [1, None, "é"]}) == ('{"t": [1, null, "é"]}', None)
    text, problem = render_result({1, 2})
    assert text is None and problem.startswith("returned a set, which is neither text nor JSON")


# -- calls that fail -------------------------------------------------------------------------------

FAILING_CALLS = [
    (ToolCall("divide", {"a": 1, "b": 0}), "raised",
     "Error: tool 'divide' raised ZeroDivisionError: division by zero"),
    (ToolCall("unprintable", {"n": 1}), "raised",
     "Error: tool 'unprintable' raised Unprintable: (its message could not be written)"),
    (ToolCall("square_root", {"x": 4}), "unknown",
     "Error: unknown tool 'square_root'; the tools are multiply, divide, make_set, nested, "
     "sleep, exit_worker, unprintable, cancelled, half_surrogate"),
    (ToolCall("multiply", {"a": 6}), "bad_arguments",
     "Error: tool 'multiply' got bad arguments: missing argument 'b'"),
    (ToolCall("make_set", {"n": 2}), "unrenderable",
     "Error: tool 'make_set' returned a set, which is neither text nor JSON-serialisable "
     "(TypeError: Object of type set is not JSON serializable)"),
    (ToolCall("nested", {"depth": 100_000}), "unrenderable",
     "Error: tool 'nested' returned a list, which is neither text nor JSON-serialisable "
     "(RecursionError: maximum recursion depth exceeded while encoding a JSON object)"),
    (ToolCall("cancelled", {"n": 1}), "raised",  # a BaseException, as KeyboardInterrupt is
     "Error: tool 'cancelled' raised CancelledError"),
    (ToolCall("half_surrogate", {"n": 1}), "unrenderable",
     "Error: tool 'half_surrogate' returned text that holds half a surrogate pair alone "
     "(U+D800-U+DFFF), which no tokenizer can read"),
    (MalformedCall("{", "is not JSON (Expecting property name at character 1)"), "malformed",
     'Error: the tool call is malformed: it is not JSON (Expecting property name at character '
     '1); write <tool_call>{"name": ..., "arguments": {...}}</tool_call>'),
]  # fmt: skip
TOOLS = [
    H + n
    for n in ("multiply", "divide", "make_set", "nested", "sleep", "exit_worker", "unprintable",
              "cancelled", "half_surrogate")
]  # fmt: skip


@pytest.mark.parametrize("workers", [0, 2])
def test_each_failing_call_gives_its_error_text_and_kind(workers):
    """In this process and in workers alike; the good call among them is answered."""
    runner = ToolRunner(TOOLS, workers=workers)
    try:
        calls = [ToolCall("multiply", {"a": 6, "b": 7})] + [c for c, _, _ in FAILING_CALLS]
        results = runner.run(calls)
    finally:
        runner.close()
    assert results[0] == ToolResult("multiply", "42")
    for result, (call, kind, text) in zip(results[1:], FAILING_CALLS, strict=True):
        assert (result.error, result.text) == (kind, text)
        assert result.name == (None if kind == "malformed" else call.name)


@pytest.mark.parametrize("workers", [0, 1])
def test_an_async_tool_is_awaited_and_its_exception_is_an_error(workers):
    """``async def`` tools, as TRL users may write them: the coroutine runs to its end; what it
    raises is the ``raised`` kind. With 0 workers, also from inside a running event loop (a
    notebook's), where the coroutine gets a loop in a thread of its own."""
    runner = ToolRunner([H + "fetch_square"], workers=workers)
    calls = [ToolCall("fetch_square", {"n": 7}), ToolCall("fetch_square", {"n": -1})]
    expected = [
        ToolResult("fetch_square", '{"n": 7, "square": 49}'),
        ToolResult(
            "fetch_square",
            "Error: tool 'fetch_square' raised ValueError: no negative numbers",
            "raised",
        ),
    ]

    async def from_a_loop():
        return runner.run(calls)

    try:
        assert runner.run(calls) == expected
        if workers == 0:
            assert asyncio.run(from_a_loop()) == expected
    finally:
        runner.close()


def test_a_hanging_tool_times_out_and_the_workers_go_on():
    """One call sleeps past the 1 s timeout: it is abandoned, its worker replaced, and the calls
    beside it and after it are answered."""
    runner = ToolRunner(TOOLS, workers=2, timeout=1.0)
    try:
        results = runner.run(
            [ToolCall("sleep", {"seconds": 30}), ToolCall("multiply", {"a": 2, "b": 3})]
        )
        assert results == [
            ToolResult("sleep", "Error: tool 'sleep' timed out after 1 s", "timeout"),
            ToolResult("multiply", "6"),
        ]
        assert runner.workers.restarts == 1
        assert runner.run([ToolCall("sleep", {"seconds": 0.01})]) == [ToolResult("sleep", "awake")]
    finally:
        runner.close()


def test_a_tool_that_kills_its_worker_is_an_error_and_the_worker_is_replaced():
    runner = ToolRunner(TOOLS, workers=1, timeout=30.0)
    try:
        (result,) = runner.run([ToolCall("exit_worker", {"code": 3})])
        assert result.error == "crashed"
        assert result.text == (
            "Error: tool 'exit_worker' killed its worker process (exit code 3); the worker was "
            "restarted"
        )
        assert runner.run([ToolCall("multiply", {"a": 2, "b": 2})]) == [ToolResult("multiply", "4")]
    finally:
        runner.close()


@pytest.mark.usefixtures("workers_die_at_start")
def test_tool_workers_that_cannot_start_fail_the_environment_not_a_call():
    """No call failed: the pool cannot run any. That is the environment's failure, which stops
    the run cleanly (saved, resumable), not an error text the model would train on."""
    from lightning_troll.tasks.environments.protocol import EnvironmentFailure

    runner = ToolRunner(TOOLS, workers=1, timeout=30.0)
    try:
        with pytest.raises(EnvironmentFailure, match=r"^the tool workers failed: 3 tool worker "
                           r"processes in a row exited while starting"):  # fmt: skip
            runner.run([ToolCall("multiply", {"a": 2, "b": 3})])
    finally:
        runner.close()


def test_a_tool_a_worker_cannot_load_stops_the_run_instead_of_training_on_its_error():
    import pickle

    from lightning_troll.tasks.environments.protocol import EnvironmentFailure

    runner = ToolRunner(TOOLS, workers=1, timeout=30.0)
    runner._payloads["multiply"] = pickle.dumps(tool_helpers.LoadsNowhere())
    try:
        with pytest.raises(EnvironmentFailure, match=r"^tool 'multiply' cannot be loaded in a "
                           r"worker: ImportError: No module named 'gone'; "
                           r"model.episodes.tool_workers 0 runs tools"):  # fmt: skip
            runner.run([ToolCall("multiply", {"a": 2, "b": 3})])
    finally:
        runner.close()


def test_worker_options_are_checked():
    with pytest.raises(
        ValueError, match=r"model.episodes.tool_workers must be an integer >= 0; got -1"
    ):
        ToolRunner(TOOLS, workers=-1)
    # inf: the in-process alarm cannot be set that far (an OverflowError mid-rollout)
    for timeout in (0, "5", True, math.inf, math.nan):
        with pytest.raises(
            ValueError,
            match=rf"model.episodes.tool_timeout must be null \(no limit\) or a finite number > 0 "
            rf"of seconds; got {timeout!r}$",
        ):
            ToolRunner(TOOLS, workers=1, timeout=timeout)


def test_a_tool_that_does_not_pickle_runs_in_process_only():
    def local(a: int) -> int:
        """A closure.

        Args:
            a: A number.
        """
        return a

    assert ToolRunner([local]).run([ToolCall("local", {"a": 1})]) == [ToolResult("local", "1")]
    refused = (
        r"tool 'local' cannot run in a worker process \(model.episodes.tool_workers > 0\).*or run "
        r"in-process with model.episodes.tool_workers 0"
    )
    with pytest.raises(ValueError, match=refused):
        ToolRunner([local], workers=1)
