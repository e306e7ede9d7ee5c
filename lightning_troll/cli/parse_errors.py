"""The command line's parse errors, said in a line or two a person can act on.

jsonargparse reports a bad command line or config file with the whole usage (a hundred lines)
and a message written for its own types. :func:`explain` turns its message into at most two
lines: a misspelt option or YAML key with the closest valid names ("did you mean ..."), a YAML
syntax error with its file and line, a value outside a Literal with the allowed values, a wrong
type with the type expected, a missing config file with where it was looked for.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib
import inspect
import re
import types
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from lightning_troll.training.moved import RENAMED_OPTIONS, RETIRED_OPTIONS

__all__ = ["config_paths", "explain", "suggest"]

_CONFIG_FLAGS = ("--config", "-c")


def config_paths(args: Sequence[str]) -> list[str]:
    """The values of ``--config`` (or ``-c``) on a command line, in order."""
    found = []
    for i, arg in enumerate(args):
        if arg in _CONFIG_FLAGS and i + 1 < len(args):
            found.append(args[i + 1])
        elif arg.startswith("--config="):
            found.append(arg.partition("=")[2])
    return found


def option_names(parser) -> set[str]:
    """The dotted option names of ``parser`` (``model.trust_region.eps``), help flags left out."""
    names = set()
    for flag, action in parser._option_string_actions.items():
        if flag.startswith("--") and "help" not in type(action).__name__.lower():
            names.add(flag[2:])
    return names - {"config", "print_config", "help"}


def suggest(key: str, names: Iterable[str]) -> str | None:
    """The valid name closest to ``key``, correcting one dotted part at a time; None if none is
    close."""
    names = set(names)
    fixed: list[str] = []
    for part in key.split("."):
        prefix = ".".join(fixed) + "." if fixed else ""
        children = {n[len(prefix) :].split(".")[0] for n in names if n.startswith(prefix)}
        if part not in children:
            close = difflib.get_close_matches(part, children, n=1, cutoff=0.6)
            if not close:
                return None
            part = close[0]
        fixed.append(part)
    candidate = ".".join(fixed)
    return candidate if candidate != key else None


def describe(hint: Any) -> str:
    """A type hint in words: ``an integer``, ``one of troll, clip``, ``a number or null``."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(describe(h) for h in typing.get_args(hint)))
    if origin is typing.Literal:
        return "one of " + ", ".join(str(v) for v in typing.get_args(hint))
    words = {int: "an integer", float: "a number", bool: "true or false", str: "text"}
    if hint in words:
        return words[hint]
    if hint is type(None):
        return "null"
    if origin in (dict, typing.Mapping) or hint is dict:
        return "a mapping (key: value)"
    if origin in (list, tuple, typing.Sequence) or hint in (list, tuple):
        return "a list"
    return getattr(hint, "__name__", str(hint))


def literal_values(hint: Any) -> list[Any]:
    """The values a Literal (possibly inside a Union) allows; empty when there is none."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return list(typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return [v for h in typing.get_args(hint) for v in literal_values(h)]
    return []


def _given_value(message: str) -> str | None:
    found = re.findall(r"(?:Given|Got) value: (.*)", message)
    return found[-1].strip() if found else None


def _where_key(key: str, files: Sequence[str], value: str | None = None) -> str | None:
    """The last config file (they override in order) that sets the dotted ``key`` (to
    ``value``, written as jsonargparse reports it, when given)."""
    holder = None
    for name in files:
        try:
            node: Any = yaml.safe_load(Path(name).read_text())
        except (OSError, yaml.YAMLError):
            continue
        for part in key.split("."):
            node = node.get(part, KeyError) if isinstance(node, dict) else KeyError
        if node is not KeyError and (value is None or str(node) == value):
            holder = name
    return holder


def _unknown_key(key: str, parser, files: Sequence[str], flag: bool) -> str:
    old = key.removeprefix("model.")
    if key.startswith("model.") and old in RENAMED_OPTIONS:
        dash = "--" if flag else ""
        return (
            f"{dash}{key} is {dash}model.{RENAMED_OPTIONS[old]} since 0.2.0 (CHANGELOG.md, "
            "Renamed options)"
        )
    if key.startswith("model.") and old in RETIRED_OPTIONS:
        dash = "--" if flag else ""
        return f"{dash}{key} is retired in 0.2.0: {dash}{RETIRED_OPTIONS[old]}"
    names = option_names(parser)
    close = suggest(key, names)
    hint = f"; did you mean {'--' if flag else ''}{close}?" if close else ""
    if flag:
        return f"no option --{key}{hint}"
    where = _where_key(key, files)
    return f"{where + ': ' if where else ''}no option {key}{hint}"


def _syntax_error(message: str, files: Sequence[str]) -> str:
    for name in files:
        path = Path(name)
        if not path.is_file():
            continue
        try:
            yaml.safe_load(path.read_text())
        except yaml.MarkedYAMLError as exc:
            mark, opened = exc.problem_mark, exc.context_mark
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            context = ""
            if exc.context and opened is not None:
                context = f" ({exc.context} at line {opened.line + 1}, column {opened.column + 1})"
            return f"{name}{where}: {exc.problem or 'not valid YAML'}{context}"
        except yaml.YAMLError as exc:
            return f"{name}: not valid YAML: {' '.join(str(exc).split())}"
    return "a config is not valid YAML: " + " ".join(message.split("config:", 1)[-1].split())


def _class_option(key: str, message: str, files: Sequence[str] = ()) -> str | None:
    """A class-typed option (``model.optimizer``): an unknown init argument or class path."""
    option = re.search(r"Option '(\w+)' is not accepted", message)
    class_path = re.search(r"class_path[= ]'([\w.]+)'", message)
    if option and class_path:
        name = class_path.group(1)
        module_name, _, attr = name.rpartition(".")
        try:
            made = getattr(importlib.import_module(module_name), attr)
            params = list(inspect.signature(made).parameters)
        except Exception:  # the class named could not be inspected: say what is known
            made, params = None, []
        close = difflib.get_close_matches(option.group(1), params, n=1)
        if dataclasses.is_dataclass(made):  # an optional record's field (model.episodes)
            hint = f"; did you mean {key}.{close[0]}?" if close else ""
            where = _where_key(f"{key}.{option.group(1)}", files)
            return f"{where + ': ' if where else ''}no option {key}.{option.group(1)}{hint}"
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"{key}: {name} takes no argument {option.group(1)!r}{hint}"
    missing = re.search(r"Expected a path but (\S+) either not accessible", message)
    if missing:
        return f"{key}: cannot import {missing.group(1)!r}; give a class path such as torch.optim.AdamW"
    return None


def _nested_field(key: str, message: str) -> str | None:
    """A bad value of one field of an optional record (``model.episodes.max_turns 1.5``), which
    jsonargparse reports against the whole record."""
    found = re.search(
        r"Problem with given class_path '([\w.]+)':\s*Parser key \"(\w+)\":(.*)", message, re.S
    )
    if found is None:
        return None
    class_path, field, rest = found.groups()
    module_name, _, name = class_path.rpartition(".")
    try:
        hint = typing.get_type_hints(getattr(importlib.import_module(module_name), name))[field]
    except Exception:  # the record could not be inspected: say what is known
        return None
    value = re.search(r"(?:Given|Got) value: (.*)", rest)
    got = f"; got {value.group(1).strip()!r}" if value else ""
    return f"{key}.{field}: expected {describe(hint)}{got}"


def _mapped_to(hint: Any) -> Any:
    """The value type of a mapping hint (``dict[str, float] | None`` gives ``float``), or None."""
    for part in (
        typing.get_args(hint)
        if typing.get_origin(hint) in (typing.Union, types.UnionType)
        else [hint]
    ):
        if typing.get_origin(part) in (dict, typing.Mapping) and len(typing.get_args(part)) == 2:
            return typing.get_args(part)[1]
    return None


def _bad_entry(key: str, hint: Any, value: str, at: str) -> str | None:
    """For a mapping of weights (``model.rewards``) given with one that is not a number: which
    entry, and that weights are numbers; else None."""
    if _mapped_to(hint) not in (float, int):
        return None
    try:
        given = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return None
    if not isinstance(given, dict):
        return None
    for name, weight in given.items():
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            return (
                f"{key}: the weight of {name!r} is {weight!r}{at}; weights are numbers "
                f"({key} '{{{name}: 1.0}}')"
            )
    return None


def _bad_value(key: str, message: str, parser, files: Sequence[str]) -> str:
    action = parser._option_string_actions.get(f"--{key}")
    hint = getattr(action, "_typehint", None)
    value = _given_value(message)
    where = _where_key(key, files, value)
    at = f" (in {where})" if where else ""
    allowed = literal_values(hint)
    if allowed:
        flags = ["true", "false"] if bool in typing.get_args(hint) else []  # bool | Literal[...]
        choices = ", ".join(flags + [str(v) for v in allowed])
        none = " or null" if type(None) in typing.get_args(hint) else ""
        return f"{key}: {value!r} is not allowed{at}; choose one of {choices}{none}"
    special = _nested_field(key, message) or _class_option(key, message, files)
    if special:
        return special
    if hint is not None and value is not None:
        return (
            _bad_entry(key, hint, value, at)
            or f"{key}: expected {describe(hint)}; got {value!r}{at}"
        )
    detail = [line.strip() for line in message.splitlines()[1:] if line.strip()]
    return f"{key}: {detail[0] if detail else 'bad value'}{at}"


def _negative_value(args: Sequence[str]) -> str | None:
    """For an option given a negative number the command line takes for an option of its own
    (``--model.optimizer.init_args.lr -1e-4``): how to write it; else None."""
    for flag, value in zip(args, args[1:], strict=False):
        if not flag.startswith("--") or "=" in flag or not value.startswith("-"):
            continue
        try:
            float(value)
        except ValueError:
            continue
        return (
            f"{flag} {value}: a value that starts with '-' is read as an option; write "
            f"{flag}={value}"
        )
    return None


def explain(message: str, parser, args: Sequence[str]) -> str:
    """One line for a jsonargparse error ``message`` raised by ``parser`` (the subcommand's)
    while parsing ``args``."""
    files = config_paths(args)
    unknown = re.match(r"unrecognized arguments: (.*)", message)
    if unknown:
        first = unknown.group(1).split()[0]
        if first.startswith("--"):
            return _unknown_key(first[2:].split("=", 1)[0], parser, files, flag=True)
        return f"unexpected argument {first!r}"
    unknown = re.search(r"does not accept (?:option|nested key) '([\w.]+)'", message)
    if unknown:
        return _unknown_key(unknown.group(1), parser, files, flag=False)
    if message.startswith("Problems parsing config"):
        return _syntax_error(message, files)
    missing = re.match(r'Parser key "config": File does not exist: (.*)', message)
    if missing:
        path = missing.group(1).strip("'")
        given = next((f for f in files if str(Path(f).absolute()) == path), path)
        return f"--config {given}: no such file: {path}"
    command = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if command:
        known = re.findall(r"'(\w+)'", command.group(2)) + ["export"]
        close = difflib.get_close_matches(command.group(1), known, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        return f"no command {command.group(1)!r}{hint} (commands: {', '.join(known)})"
    if re.match(r"argument --[\w.]+: expected one argument", message):
        negative = _negative_value(args)
        if negative is not None:
            return negative
    keyed = re.match(r'Parser key "([\w.]+)":', message)
    if keyed:
        return _bad_value(keyed.group(1), message, parser, files)
    return " ".join(message.split())
