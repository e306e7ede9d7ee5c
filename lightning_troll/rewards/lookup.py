"""Where a reward named by import path is found: the working directory, then beside the configs.

A reward ``"my_reward:score"`` in ``model.rewards`` names the module ``my_reward``. It is looked
for, in this order:

1. in the working directory (``my_reward.py``, or a folder ``my_reward/``);
2. beside each ``--config`` file, in the order the files were given (the ``lightning-troll``
   command sets these with :func:`config_folders`; from Python, use it yourself);
3. as any importable module (an installed package, ``PYTHONPATH``).

The folder a module is found in joins ``sys.path`` (as a script's own folder does), so that its
own imports, and processes started from this one, find it again. A module of the same name
imported earlier from somewhere else is replaced by the one found here.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import os
import sys
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["config_folders", "find_attribute", "import_reward_module", "search_folders"]

_FOUND: dict[str, Path] = {}
"""Top-level module name -> the folder a lookup found it in (and put on ``sys.path``)."""
_ADDED: set[str] = set()
"""The ``sys.path`` entries a lookup added (an entry that was there before is never removed)."""
_CONFIGS: ContextVar[tuple[Path, ...]] = ContextVar("reward_config_files", default=())


@contextlib.contextmanager
def config_folders(config_files: Sequence[str | os.PathLike]) -> Iterator[None]:
    """Within the block, reward modules are looked for beside ``config_files`` too (after the
    working directory)."""
    files = tuple(Path(f).expanduser().absolute() for f in config_files)
    token = _CONFIGS.set(files)
    try:
        yield
    finally:
        _CONFIGS.reset(token)


def search_folders() -> list[tuple[Path, str]]:
    """(folder, how a message names it): the working directory, then each config's folder."""
    cwd = Path.cwd()
    found = [(cwd, f"the working directory {cwd}")]
    for config in _CONFIGS.get():
        folder = config.parent
        if all(folder != seen for seen, _ in found):
            found.append((folder, f"beside the config {config}"))
    return found


def _holds(folder: Path, top: str) -> Path | None:
    """The file or folder of the module ``top`` in ``folder``, if it is there."""
    for candidate in (folder / f"{top}.py", folder / top):
        if candidate.is_file() or (candidate.is_dir() and candidate.suffix == ""):
            return candidate
    return None


def _loaded_from(module: ModuleType, folder: Path) -> bool:
    places = [getattr(module, "__file__", None), *list(getattr(module, "__path__", []) or [])]
    return any(p and Path(p).resolve().is_relative_to(folder.resolve()) for p in places)


def _forget(top: str) -> None:
    """Drops ``top`` and its submodules from the import cache."""
    for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
        del sys.modules[name]


def import_reward_module(module_name: str, spec: str) -> tuple[ModuleType, str]:
    """The module ``module_name`` of the reward ``spec``, and where it came from (for messages).

    Raises ``ValueError`` in one line naming what was looked for and where."""
    top = module_name.partition(".")[0]
    folders = search_folders()
    for folder, _ in folders:
        place = _holds(folder, top)
        if place is None:
            continue
        loaded = sys.modules.get(top)
        if loaded is not None and not _loaded_from(loaded, folder):
            _forget(top)
        if str(folder) in sys.path:
            sys.path.remove(str(folder))
        else:
            _ADDED.add(str(folder))
        sys.path.insert(0, str(folder))  # first: this folder's module, not another's
        importlib.invalidate_caches()
        _FOUND[top] = folder
        module = _import(module_name, spec, str(place))
        return module, getattr(module, "__file__", None) or str(place)
    earlier = _FOUND.pop(top, None)
    if earlier is not None and str(earlier) in _ADDED:
        # found before in a folder only a lookup had put on the path, and not searched now: that
        # module is not importable as such any more (a folder that was on the path stays)
        loaded = sys.modules.get(top)
        if loaded is not None and _loaded_from(loaded, earlier):
            _forget(top)
        with contextlib.suppress(ValueError):
            sys.path.remove(str(earlier))
        _ADDED.discard(str(earlier))
    try:
        return importlib.import_module(module_name), module_name
    except ModuleNotFoundError as exc:
        if exc.name and (module_name + ".").startswith(exc.name + "."):
            places = " or ".join(name for _, name in folders)
            raise ValueError(
                f"model.rewards: {spec!r}: no module {top!r} in {places} (and not importable); "
                f"put {top}.py with the function in one of these folders, or name a built-in reward"
            ) from None
        raise _failed(spec, module_name, exc) from exc
    except Exception as exc:  # the user's module itself failed to import
        raise _failed(spec, module_name, exc) from exc


def _import(module_name: str, spec: str, place: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except Exception as exc:  # a syntax error, a missing dependency, anything the module raises
        raise _failed(spec, place, exc) from exc


def _failed(spec: str, place: str, exc: BaseException) -> ValueError:
    where = ""
    if isinstance(exc, SyntaxError) and exc.lineno:
        where = f" ({exc.filename}, line {exc.lineno})"
    message = " ".join(str(exc).split())
    return ValueError(
        f"model.rewards: {spec!r}: importing {place} failed: {type(exc).__name__}: {message}{where}"
    )


def find_attribute(module: ModuleType, attr_path: str, spec: str, place: str) -> Any:
    """``module.<attr_path>`` (dotted), or ``ValueError`` naming what the module does define."""
    obj: Any = module
    for part in attr_path.split("."):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        own = getattr(obj, "__name__", None)  # what the module defines, not what it imports
        names = [
            n
            for n in dir(obj)
            if not n.startswith("_")
            and callable(getattr(obj, n, None))
            and getattr(getattr(obj, n), "__module__", own) == own
        ]
        close = difflib.get_close_matches(part, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        defined = f" (it defines {', '.join(sorted(names)[:8])})" if names else ""
        raise ValueError(
            f"model.rewards: {spec!r}: {place} has no function {part!r}{hint}{defined}"
        )
    return obj
