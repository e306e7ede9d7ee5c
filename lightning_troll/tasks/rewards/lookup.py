"""Where a reward named by import path is found: the working directory, then beside the configs.

A reward ``"my_reward:score"`` in ``model.rewards`` names the module ``my_reward``; a tool in
``model.episodes.tools`` and an environment in ``model.episodes.environment`` are named and found the same way
(:func:`load_by_import_path`). The module is looked for, in this order:

1. in the working directory (``my_reward.py``, or a folder ``my_reward/``);
2. beside each ``--config`` file, in the order the files were given (the ``lightning-troll``
   command sets these with :func:`config_folders`; from Python, use it yourself);
3. as any importable module (an installed package, ``PYTHONPATH``).

The folder a module is found in joins ``sys.path`` (as a script's own folder does), so that its
own imports, and processes started from this one, find it again. A module of the same name
imported earlier from somewhere else is replaced by the one found here, and so is one a lookup
imported from the same place whose source has changed since (a reward fixed between two runs in
one Python process, a notebook's, trains with the fix).
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

__all__ = [
    "config_folders",
    "find_attribute",
    "import_reward_module",
    "load_by_import_path",
    "search_folders",
    "split_import_path",
]

_FOUND: dict[str, Path] = {}
"""Top-level module name -> the folder a lookup found it in (and put on ``sys.path``)."""
_ADDED: set[str] = set()
"""The ``sys.path`` entries a lookup added (an entry that was there before is never removed)."""
_SOURCES: dict[str, tuple] = {}
"""Top-level module name -> the state of its source (:func:`_source_state`) when a lookup
imported it."""
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


def _source_state(place: Path) -> tuple:
    """The modification time and size of the module's file, or of every ``.py`` file in its
    package folder: what changes when its source is edited."""
    files = sorted(place.rglob("*.py")) if place.is_dir() else [place]
    return tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files)


def _forget(top: str) -> None:
    """Drops ``top`` and its submodules from the import cache."""
    for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
        del sys.modules[name]


def import_reward_module(
    module_name: str, spec: str, option: str = "model.rewards"
) -> tuple[ModuleType, str]:
    """The module ``module_name`` of the reward ``spec``, and where it came from (for messages).

    Raises ``ValueError`` in one line naming the option (``model.rewards``, or another that names
    functions by import path), what was looked for and where."""
    top = module_name.partition(".")[0]
    folders = search_folders()
    for folder, _ in folders:
        place = _holds(folder, top)
        if place is None:
            continue
        loaded = sys.modules.get(top)
        source = _source_state(place)
        edited = _SOURCES.get(top, source) != source  # since a lookup imported it
        if loaded is not None and (edited or not _loaded_from(loaded, folder)):
            _forget(top)
        if str(folder) in sys.path:
            sys.path.remove(str(folder))
        else:
            _ADDED.add(str(folder))
        sys.path.insert(0, str(folder))  # first: this folder's module, not another's
        importlib.invalidate_caches()
        _FOUND[top] = folder
        module = _import(module_name, spec, str(place), option)
        _SOURCES[top] = source
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
            otherwise = ", or name a built-in reward" if option == "model.rewards" else ""
            raise ValueError(
                f"{option}: {spec!r}: no module {top!r} in {places} (and not importable); "
                f"put {top}.py with the function in one of these folders{otherwise}"
            ) from None
        raise _failed(spec, module_name, exc, option) from exc
    except Exception as exc:  # the user's module itself failed to import
        raise _failed(spec, module_name, exc, option) from exc


def _import(module_name: str, spec: str, place: str, option: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except Exception as exc:  # a syntax error, a missing dependency, anything the module raises
        raise _failed(spec, place, exc, option) from exc


def _failed(spec: str, place: str, exc: BaseException, option: str) -> ValueError:
    where = ""
    if isinstance(exc, SyntaxError) and exc.lineno:
        where = f" ({exc.filename}, line {exc.lineno})"
    message = " ".join(str(exc).split())
    return ValueError(
        f"{option}: {spec!r}: importing {place} failed: {type(exc).__name__}: {message}{where}"
    )


def find_attribute(
    module: ModuleType, attr_path: str, spec: str, place: str, option: str = "model.rewards"
) -> Any:
    """``module.<attr_path>`` (dotted), or ``ValueError`` naming ``option`` and what the module
    does define."""
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
        shown = sorted(names)[:8] + ([f"and {len(names) - 8} more"] if len(names) > 8 else [])
        defined = f" (it defines {', '.join(shown)})" if names else ""
        kind = "class or function" if option.endswith(".environment") else "function"
        raise ValueError(f"{option}: {spec!r}: {place} has no {kind} {part!r}{hint}{defined}")
    return obj


def split_import_path(spec: str) -> tuple[str, str] | None:
    """``(module, attribute path)`` of ``"package.module:function"`` (the part after ``:`` may be
    dotted, ``"module:Class.method"``) or ``"package.module.function"``; None for a bare name."""
    if ":" in spec:
        module_name, _, attr_path = spec.partition(":")
    elif "." in spec:
        module_name, _, attr_path = spec.rpartition(".")
    else:
        return None
    return module_name, attr_path


def load_by_import_path(spec: str, option: str) -> Any:
    """What the import path ``spec`` names, its module found as a reward's is (the working
    directory, then beside each config, then anything importable); ``ValueError`` naming
    ``option`` for a bare name, a module not found or an attribute it lacks."""
    parts = split_import_path(spec) if isinstance(spec, str) else None
    if parts is None:
        raise ValueError(
            f"{option}: {spec!r} is not an import path; give 'module:name' (module.py in the "
            "working directory or beside the config) or 'package.module.name'"
        )
    module, place = import_reward_module(parts[0], spec, option)
    return find_attribute(module, parts[1], spec, place, option)
