"""Tools as plain Python functions (``model.episodes.tools``): their JSON schemas, their arguments checked
against them, and their results rendered as text.

A tool is a function with a type hint on every argument and a Google-style docstring whose
``Args:`` section describes each one::

    def multiply(a: float, b: float) -> float:
        \"\"\"Multiply two numbers.

        Args:
            a: The first number.
            b: The second number.
        \"\"\"
        return a * b

Its JSON schema (``{"type": "function", "function": {"name", "description", "parameters"}}``)
comes from the signature and the docstring through transformers'
``transformers.utils.get_json_schema``, the form chat templates take in
``apply_chat_template(..., tools=...)``. ``model.episodes.tools`` names tools by import path
(``my_tools:multiply``), found in the working directory, beside the config, or as any importable
module, as a reward named by import path is (:mod:`lightning_troll.tasks.rewards.lookup`).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_troll.tasks.data.messages import NOT_TEXT, is_text
from lightning_troll.tasks.rewards.calls import describe
from lightning_troll.tasks.rewards.lookup import load_by_import_path

__all__ = [
    "Tool",
    "check_arguments",
    "check_callable_as_written",
    "conform_arguments",
    "load_tool",
    "load_tools",
    "render_result",
    "tool_schema",
]

OPTION = "model.episodes.tools"
"""The option that lists the tools, as errors name it."""


@dataclass(frozen=True)
class Tool:
    """One tool: the function the model calls by name, and the schema the prompt shows it."""

    name: str
    """The function's ``__name__``: the ``"name"`` of a tool call."""
    function: Callable[..., Any]
    """What a call runs, with the call's ``"arguments"`` as keyword arguments."""
    schema: dict[str, Any]
    """``{"type": "function", "function": {"name", "description", "parameters"}}``."""
    spec: str
    """How ``model.episodes.tools`` named it (an import path, or the function's name)."""

    @property
    def parameters(self) -> dict[str, Any]:
        """The JSON schema of the arguments (``{"type": "object", "properties", "required"}``)."""
        return self.schema["function"].get("parameters", {})


def tool_schema(function: Callable[..., Any], spec: str, option: str = OPTION) -> dict[str, Any]:
    """The JSON schema of ``function``; ``ValueError`` naming ``option`` (``model.episodes.tools``)
    and ``spec`` when its type hints or docstring do not give one."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(function)
    except Exception as exc:  # DocstringParsingException, TypeHintParsingException, ...
        raise ValueError(
            f"{option}: {spec!r} cannot be a tool: {str(exc).rstrip('.')}. A tool is a function "
            "with a type hint on every argument and a docstring: a description, then an 'Args:' "
            "section with a line 'name: description' per argument"
        ) from None


def load_tool(
    spec: str | Callable[..., Any] | Tool, label: str | None = None, option: str = OPTION
) -> Tool:
    """A tool from an import path (``"my_tools:multiply"``) or a function (a :class:`Tool` is
    returned as it is). Errors name ``option`` and ``label`` (by default, the spec)."""
    if isinstance(spec, Tool):
        return spec
    function = spec if callable(spec) else load_by_import_path(spec, option)
    if label is None:
        label = spec if isinstance(spec, str) else getattr(spec, "__name__", repr(spec))
    if inspect.isclass(function) or not callable(function):
        what = "a class" if inspect.isclass(function) else f"a {type(function).__name__}"
        raise ValueError(f"{option}: {label!r} is {what}; a tool is a function")
    check_callable_as_written(function, label, option)
    schema = tool_schema(function, label, option)
    return Tool(schema["function"]["name"], function, schema, label)


_NOT_BY_NAME = {
    inspect.Parameter.VAR_POSITIONAL: "*{}, which takes positional arguments",
    inspect.Parameter.VAR_KEYWORD: "**{}, which takes any keyword",
    inspect.Parameter.POSITIONAL_ONLY: "{} positional-only (before a /)",
}


def check_callable_as_written(
    function: Callable[..., Any], spec: str, option: str = OPTION
) -> None:
    """Refuses a function that a call of its schema could not reach: the model's call gives
    each argument by name, one per parameter its schema shows, so a ``*args``, a ``**kwargs`` or
    a positional-only parameter cannot be given (the schema would ask for ``nums: integer`` of
    ``*nums: int``, and every call would fail)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a built-in without a signature: its schema check decides
        return
    for parameter in parameters:
        how = _NOT_BY_NAME.get(parameter.kind)
        if how is not None:
            raise ValueError(
                f"{option}: {spec!r} cannot be a tool: its parameter is "
                f"{how.format(parameter.name)}; a tool call gives its arguments by name, one per "
                "parameter, so a tool's parameters are ordinary named ones (no *args, **kwargs "
                "or /)"
            )


def load_tools(specs: Sequence[str | Callable[..., Any] | Tool]) -> dict[str, Tool]:
    """name -> tool, for every entry of ``model.episodes.tools`` (and any tools already built);
    refuses a name given twice."""
    if isinstance(specs, str) or callable(specs):
        specs = [specs]
    tools: dict[str, Tool] = {}
    for spec in specs:
        tool = load_tool(spec)
        if tool.name in tools:
            raise ValueError(
                f"{OPTION}: {tools[tool.name].spec!r} and {tool.spec!r} are both named "
                f"{tool.name!r}; the model calls tools by name, so each needs its own"
            )
        tools[tool.name] = tool
    return tools


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def _type_name(value: Any) -> str:
    return {str: "string", bool: "boolean", int: "integer", float: "number", list: "array",
            dict: "object", type(None): "null"}.get(type(value), type(value).__name__)  # fmt: skip


def _types(schema: Mapping[str, Any]) -> list[str]:
    names = schema.get("type")
    return [names] if isinstance(names, str) else list(names or [])


def _is(value: Any, name: str) -> bool:
    """Whether ``value`` is of JSON type ``name``: a boolean is no number, and a whole number
    written with a fraction (``3.0``) is an integer, as JSON Schema counts it."""
    if isinstance(value, bool) and name != "boolean":
        return False
    whole = name == "integer" and isinstance(value, float) and value.is_integer()
    return whole or isinstance(value, _JSON_TYPES[name])


def _parts(value: Any, schema: Mapping[str, Any]) -> list[tuple[str, Any, Any, Mapping[str, Any]]]:
    """``(where, key, item, item_schema)`` for each item of an array or a tuple and each value of
    a mapping that ``schema`` describes; empty for anything else."""
    if isinstance(value, list) and isinstance(schema.get("prefixItems"), list):  # a tuple
        # _mismatch checks the length before the items; _conform is given checked values
        return [
            (f"item {i}", i, v, s)
            for i, (v, s) in enumerate(zip(value, schema["prefixItems"], strict=False))
        ]
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [(f"item {i}", i, v, schema["items"]) for i, v in enumerate(value)]
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), Mapping):
        return [(f"key {k!r}", k, v, schema["additionalProperties"]) for k, v in value.items()]
    return []


def _mismatch(value: Any, schema: Mapping[str, Any]) -> str | None:
    """Why ``value`` (parsed JSON) does not fit ``schema`` (type, nullable, enum, the items of an
    array or a tuple, the values of a mapping); None when it fits. Types the check does not know
    pass."""
    if value is None and schema.get("nullable"):
        return None
    if "enum" in schema and value not in schema["enum"]:
        return f"is {value!r}, not one of {schema['enum']}"
    names = _types(schema)
    known = [n for n in names if n in _JSON_TYPES]
    if known and len(known) == len(names) and not any(_is(value, n) for n in known):
        return f"should be {' or '.join(known)}, got {_type_name(value)} {value!r:.40}"
    items = schema.get("prefixItems")
    if isinstance(value, list) and isinstance(items, list) and len(value) != len(items):
        return f"should be an array of {len(items)} items, got {len(value)}"
    for where, _, item, item_schema in _parts(value, schema):
        problem = _mismatch(item, item_schema)
        if problem is not None:
            return f"{where} {problem}"
    return None


def _conform(value: Any, schema: Mapping[str, Any]) -> Any:
    """``value`` with each whole number written with a fraction made an ``int`` where ``schema``
    asks for an integer and not for a number."""
    names = _types(schema)
    if _is(value, "integer") and "integer" in names and "number" not in names:
        return int(value)
    parts = _parts(value, schema)
    if not parts:
        return value
    conformed = list(value) if isinstance(value, list) else dict(value)
    for _, key, item, item_schema in parts:
        conformed[key] = _conform(item, item_schema)
    return conformed


def check_arguments(tool: Tool, arguments: Mapping[str, Any]) -> str | None:
    """Why the call's ``arguments`` do not fit the tool (an unexpected or missing argument, a
    value of the wrong JSON type); None when they do."""
    properties = tool.parameters.get("properties", {})
    unexpected = sorted(set(arguments) - set(properties))
    if unexpected:
        return f"unexpected argument {unexpected[0]!r} (it takes {', '.join(properties) or 'none'})"
    missing = [n for n in tool.parameters.get("required", []) if n not in arguments]
    if missing:
        return f"missing argument {missing[0]!r}"
    for name, value in arguments.items():
        problem = _mismatch(value, properties[name])
        if problem is not None:
            return f"argument {name!r} {problem}"
    return None


def conform_arguments(tool: Tool, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments of a call that :func:`check_arguments` passed, as the tool's type hints
    declare them: ``{"n": 3.0}`` for ``n: int`` (or ``list[int]``, ...) calls it with ``n=3``."""
    properties = tool.parameters.get("properties", {})
    return {name: _conform(value, properties[name]) for name, value in arguments.items()}


def render_result(value: Any) -> tuple[str | None, str | None]:
    """``(text, None)``: a string as it is, anything JSON-serialisable as JSON; ``(None,
    problem)`` for a value that is neither, whose rendering raised anything at all (a circular or
    too deeply nested structure, a subclass whose methods raise), or whose text is not
    :func:`~lightning_troll.tasks.data.messages.is_text`: it never raises."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False)
        except Exception as exc:  # noqa: BLE001 - not serialisable, circular, nested past the stack
            return None, (
                f"returned a {type(value).__name__}, which is neither text nor JSON-serialisable "
                f"({describe(exc)})"
            )
    if not is_text(text):
        return None, f"returned text that {NOT_TEXT}"
    return text, None
