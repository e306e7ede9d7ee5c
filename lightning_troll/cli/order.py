"""Options that a later ``--config`` file overrides.

``lightning-troll fit`` applies its options in the order given, so a ``--config`` file after an
option sets that option back to the file's value: ``fit --trainer.accelerator gpu --config
configs/tinymath.yaml`` trains on the CPU, since the config says ``accelerator: cpu``. Nothing
fails, and the run can take hours before anyone notices. :func:`overridden_options` finds each
such option before the command line is parsed, so that the command warns at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

__all__ = ["overridden_options"]

_NOT_OPTIONS = ("--print_config", "--help")
"""Options that are no setting a config file could hold."""


def overridden_options(args: list[str]) -> list[str]:
    """A message for each option in ``args`` that a ``--config`` file later in ``args`` sets too
    (the same key, a key under it, or a key above it) and that is not given again after it: the
    option, its value, the file and what the file sets. Files that cannot be read are left to
    the parser, which reports them."""
    given: dict[str, str] = {}  # option key -> its value as given, in order
    messages: dict[str, str] = {}  # option key -> the warning, dropped if given again later
    i = 0
    args = [str(arg) for arg in args]  # a caller may pass paths
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "-c":  # --config's short form
            arg = "--config"
        if not arg.startswith("--"):
            continue
        key, has_value, value = arg[2:].partition("=")
        if not has_value and i < len(args) and not args[i].startswith("--"):
            value, i = args[i], i + 1
        if key == "config":
            for option, (setting, found) in _overrides(given, value).items():
                messages[option] = (
                    f"--{option} {given.pop(option)} comes before --config {value}, which sets "
                    f"{setting}: {_short(found)}; options apply in the order given, so the "
                    "config's value is used. Give --config first, then the options that "
                    "override it."
                )
        elif not arg.startswith(_NOT_OPTIONS) and not key.endswith(".help"):
            given[key] = value
            messages.pop(key, None)
    return list(messages.values())


def _overrides(given: dict[str, str], path: str) -> dict[str, tuple[str, Any]]:
    """Each option of ``given`` that the config file at ``path`` sets, with the key the file sets
    and its value."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        loaded = yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError):
        return {}
    if not isinstance(loaded, dict):
        return {}
    settings = dict(_flatten(loaded))
    found = {}
    for option in given:
        for setting, value in settings.items():
            if (
                setting == option
                or setting.startswith(option + ".")
                or option.startswith(setting + ".")
            ):
                found[option] = (setting, value)
                break
    return found


def _flatten(mapping: dict, prefix: str = ""):
    """``(dotted key, value)`` for every leaf of a nested mapping (an empty mapping is a leaf)."""
    for key, value in mapping.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from _flatten(value, dotted + ".")
        else:
            yield dotted, value


def _short(value: Any, limit: int = 60) -> str:
    text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
