"""Module paths and option names of earlier releases, folded in one place where a checkpoint or a
config is read.

Modules moved twice: out of the flat package into sub-packages (0.1.0), then sampling into
``engines/`` and the task's parts into ``tasks/`` (0.2.0; ``CHANGELOG.md`` lists every move).
No import of an old path works any more; what older runs wrote down still loads:

- a checkpoint pickles the option records a module is built from by their module path. Read with
  ``weights_only=True`` (Lightning's default for a local file), the records are allow-listed under
  every path they had (:data:`MOVED_RECORDS`); read with ``weights_only=False``
  (:func:`load_checkpoint_file`), the unpickler looks old paths up in the same tables;
- a config file, a command line or a checkpoint's stored options may name a module by import
  path (a reward, a tool, an environment, an engine): :func:`fold_moved_paths` rewrites an old
  path to its place now, with a one-line warning;
- options of 0.1's flat ``model`` section now live in records (``model.estimator`` is
  ``model.advantages.estimator``, :data:`RENAMED_OPTIONS`): :func:`fold_renamed_options` moves
  them, in a config file as it is read and in a checkpoint's stored options, with a one-line
  warning for a config. The command line's own flags are not folded: an old one is refused,
  naming its new place. The rollout's corrections moved from ``model.loss`` into a record of their
  own (``model.loss.anchor`` is ``model.corrections.anchor``), folded the same way; an option that
  0.2.0 retired (:data:`RETIRED_OPTIONS`) is dropped.
"""

from __future__ import annotations

import dataclasses
import importlib
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "MOVED_MODULES",
    "MOVED_RECORDS",
    "RENAMED_OPTIONS",
    "RETIRED_OPTIONS",
    "allow_moved_records",
    "fold_moved_options",
    "fold_moved_paths",
    "fold_renamed_options",
    "load_checkpoint_file",
    "moved_path",
    "renamed_warning",
]

_FLAT = {
    "sparse": "trust_region.sparse",
    "kl_solver": "trust_region.kl_solver",
    "union": "trust_region.union",
    "supports": "trust_region.supports",
    "projection": "trust_region.projection",
    "aggregation": "objectives.aggregation",
    "advantages": "objectives.advantages",
    "chunking": "objectives.chunking",
    "objective_stats": "objectives.stats",
    "policy_objective": "objectives.base",
    "lora": "models.lora",
    "quantize": "models.quantize",
    "gguf": "models.gguf",
    "smollm2": "models.smollm2",
    "snapshots": "models.snapshots",
    "sharding": "models.sharding",
    "tinymath": "models.tinymath",
    "prompts": "tasks.data.prompts",
    "sources": "tasks.data.sources",
    "reward_functions": "tasks.rewards.functions",
    "reward_options": "tasks.rewards.options",
    "rollout": "rollouts.rollout",
    "behaviour": "engines.behaviour",
    "forward": "rollouts.forward",
    "dynamic_sampling": "rollouts.dynamic_sampling",
    "drift": "rollouts.drift",
    "timing": "rollouts.timing",
    "module": "training.module",
    "optimization": "training.optimization",
    "validation": "training.validation",
    "checkpoints": "training.checkpoints",
    "resume": "training.resume",
    "preflight": "training.preflight",
    "export": "cli.export",
}
"""The flat layout's modules (``lightning_troll.<old>``, before 0.1.0's sub-packages)."""

_SAMPLING = ("SamplingConfig", "sample", "left_pad", "response_mask_of", "own_budgets")

MOVED_MODULES: dict[str, str] = {
    **{f"lightning_troll.{old}": f"lightning_troll.{new}" for old, new in _FLAT.items()},
    **{f"lightning_troll.rollout.{name}": "lightning_troll.engines.sampling" for name in _SAMPLING},
    **{
        f"lightning_troll.rollouts.rollout.{n}": "lightning_troll.engines.sampling"
        for n in _SAMPLING
    },
    "lightning_troll.rollouts.engine": "lightning_troll.engines.base",
    "lightning_troll.rollouts.engine.HFEngine": "lightning_troll.engines.hf",
    "lightning_troll.rollouts.decode": "lightning_troll.engines.decode",
    "lightning_troll.rollouts.graph_decode": "lightning_troll.engines.graph_decode",
    "lightning_troll.rollouts.behaviour": "lightning_troll.engines.behaviour",
    "lightning_troll.rollouts.engine_process": "lightning_troll.engines.process",
    "lightning_troll.rollouts.vllm_engine": "lightning_troll.engines.vllm",
    "lightning_troll.rollouts.forward.is_checkpointed": "lightning_troll.models.loading",
    "lightning_troll.data": "lightning_troll.tasks.data",
    "lightning_troll.rewards": "lightning_troll.tasks.rewards",
    "lightning_troll.environments": "lightning_troll.tasks.environments",
}
"""An old module path -> the module's place now; a key that ends in a name (a capitalised class
or a function) moves that name alone, to the module its value names."""


def _moves_a_name(key: str) -> bool:
    """Whether the key ``key`` of :data:`MOVED_MODULES` moves one name (else a whole module)."""
    return key.rpartition(".")[2] in (*_SAMPLING, "HFEngine", "is_checkpointed")


def moved_path(path: str) -> str | None:
    """``path`` (``package.module``, ``package.module.Name`` or ``package.module:Name``) at its
    place now, or None where it names nothing that moved."""
    if not path.startswith("lightning_troll."):
        return None
    module, colon, attribute = path.partition(":")
    dotted = f"{module}.{attribute}" if colon else module
    keys = [k for k in MOVED_MODULES if dotted == k or dotted.startswith(k + ".")]
    if not keys:
        return None
    key = max(keys, key=len)
    if _moves_a_name(key):
        new = f"{MOVED_MODULES[key]}.{key.rpartition('.')[2]}{dotted[len(key) :]}"
    else:
        new = MOVED_MODULES[key] + dotted[len(key) :]
    if not colon:
        return new
    tail = len(attribute.split("."))  # the colon goes back before the attribute's parts
    parts = new.split(".")
    return ".".join(parts[:-tail]) + ":" + ".".join(parts[-tail:])


def fold_moved_paths(values: Any) -> tuple[Any, list[str]]:
    """``values`` (a string, or dicts and lists of them, keys included) with every old module path
    at its place now, and the folds made (``old -> new``)."""
    folds: list[str] = []

    def fold(value: Any) -> Any:
        if isinstance(value, str):
            new = moved_path(value)
            if new is None:
                return value
            folds.append(f"{value} -> {new}")
            return new
        if isinstance(value, dict):
            return {fold(k): fold(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(fold(v) for v in value)
        return value

    return fold(values), folds


def fold_moved_options(*sections: Any) -> str | None:
    """Folds, in place, every old module path among the options of parsed config ``sections``
    (jsonargparse Namespaces, whose ``items`` are their leaves by dotted key); returns the
    one-line warning that says what was folded, or None where nothing was."""
    folds: list[str] = []
    for section in sections:
        for key, value in list((section or {}).items()):
            new, made = fold_moved_paths(value)
            if made:
                section[key] = new
                folds += made
    if not folds:
        return None
    return (
        "the options name modules by paths they had before (CHANGELOG.md, Moved modules), read "
        "at their places now; write the new paths: " + "; ".join(dict.fromkeys(folds))
    )


def records_by_old_path(records: Iterable[type], known: dict[str, type]) -> dict[str, type]:
    """Every path a checkpoint of an earlier layout may name one of ``records`` by -> the record:
    ``known`` (paths a module re-exported it under) and every old module path that folds to the
    record's own."""
    found = dict(known)
    for record in records:
        here = f"{record.__module__}.{record.__qualname__}"
        for old, new in MOVED_MODULES.items():
            if _moves_a_name(old):
                if here == f"{new}.{old.rpartition('.')[2]}":
                    found[old] = record
            elif here.startswith(new + "."):
                found[old + here[len(new) :]] = record
    return found


MOVED_RECORDS: dict[str, type] = {}
"""Old path -> option record, filled by :func:`allow_moved_records` (the records live above this
module, in ``training/resume.py``)."""


def allow_moved_records(records: Iterable[type], known: dict[str, type]) -> None:
    """Allows ``records`` under every old path of :func:`records_by_old_path` for
    ``torch.load(weights_only=True)``, and for :func:`load_checkpoint_file`."""
    MOVED_RECORDS.update(records_by_old_path(records, known))
    torch.serialization.add_safe_globals([(r, p) for p, r in MOVED_RECORDS.items()])


class _FoldingUnpickler(pickle.Unpickler):
    """An unpickler that finds a class by its old path at its place now."""

    def find_class(self, module: str, name: str) -> Any:
        path = f"{module}.{name}"
        if path in MOVED_RECORDS:
            return MOVED_RECORDS[path]
        new = moved_path(path)
        if new is not None:
            module, _, name = new.rpartition(".")
            return getattr(importlib.import_module(module), name)
        return super().find_class(module, name)


class _FoldingPickle:
    """What ``torch.load(pickle_module=...)`` reads of a pickle module."""

    Unpickler = _FoldingUnpickler
    __name__ = "pickle"

    @staticmethod
    def load(file: Any, **kwargs: Any) -> Any:
        return _FoldingUnpickler(file, **kwargs).load()


def load_checkpoint_file(path: str | Path, **kwargs: Any) -> Any:
    """``torch.load(path, weights_only=False, **kwargs)``, old module paths folded."""
    return torch.load(path, weights_only=False, pickle_module=_FoldingPickle, **kwargs)


CORRECTIONS = ("mask_truncated", "engine_is_cap", "engine_is_level", "engine_is_mode",
               "engine_is_floor", "anchor", "anchor_is_cap")  # fmt: skip
"""The fields ``model.loss`` held in 0.1 that ``model.corrections`` holds in 0.2.0."""

RENAMED_OPTIONS: dict[str, str] = {
    "estimator": "advantages.estimator",
    "scale_rewards": "advantages.scale_rewards",
    "dynamic_sampling": "dynamic_sampling.enabled",
    "dynamic_sampling_max_rounds": "dynamic_sampling.max_rounds",
    "seed": "optimization.seed",
    "gradient_checkpointing": "optimization.gradient_checkpointing",
    "logits_chunk_size": "optimization.logits_chunk_size",
    "share_prompts": "optimization.share_prompts",
    "rollout_engine": "engine.name",
    "rollout_engine_options": "engine.options",
    "behaviour_logprobs": "engine.behaviour_logprobs",
    "reward_kwargs": "reward_options.kwargs",
    "on_reward_error": "reward_options.on_error",
    "reward_workers": "reward_options.workers",
    "reward_timeout": "reward_options.timeout",
    **{f"loss.{field}": f"corrections.{field}" for field in CORRECTIONS},
}
"""A ``model`` option of 0.1 -> its place in 0.2.0's records (``model.<section>.<field>``).
``model.dynamic_sampling`` was a switch and is the record's ``enabled`` where it is one; a dotted
old name is a field that moved from one record to another."""

RETIRED_OPTIONS: dict[str, str] = {
    "cache_old_distributions": "trust_region_monitor.kl_end and kl_start ask for what they read"
}
"""A ``model`` option of 0.1 that 0.2.0 no longer takes -> what does its work now. A config's is
dropped with a warning where it was set, a checkpoint's silently; a flag is refused."""


def fold_renamed_options(model: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A ``model`` section (a config's, or a checkpoint's stored hyper-parameters) with every
    option of :data:`RENAMED_OPTIONS` moved into its record and every one of
    :data:`RETIRED_OPTIONS` dropped, and the moves made (``old -> new``). A record found there (a
    module built in Python stores records) is replaced with the field set; a dict is updated; an
    absent one becomes a dict. An old key stored as null (a checkpoint of the release that kept
    the old reward keys beside their record) is dropped; so is a retired option, named among the
    moves only where it was set (true)."""
    folded, moves = dict(model), []
    for old, new in RENAMED_OPTIONS.items():
        value = _take(folded, old)
        if value is _ABSENT or value is None:
            continue
        section, field = new.split(".")
        folded[section] = _with_field(folded.get(section), field, value)
        moves.append(f"model.{old} -> model.{new}")
    for old, instead in RETIRED_OPTIONS.items():
        if folded.pop(old, None):
            moves.append(f"model.{old} (retired: {instead})")
    return folded, moves


_ABSENT = object()


def _take(model: dict[str, Any], old: str) -> Any:
    """Takes the option ``old`` out of ``model`` and returns it (``_ABSENT`` where it is not
    there). A dotted ``old`` is a field of a record: of a dict, of a Namespace, or one that a
    record unpickled from an older checkpoint still carries beside its fields now."""
    if "." not in old:
        if old not in model or (old == "dynamic_sampling" and not isinstance(model[old], bool)):
            return _ABSENT
        return model.pop(old)
    name, field = old.split(".")
    section = model.get(name)
    if dataclasses.is_dataclass(section) and not isinstance(section, type):
        own = {f.name for f in dataclasses.fields(section)}
        if field in own or field not in vars(section):
            return _ABSENT
        kept = dataclasses.replace(section)  # the fields it has now
        others = {k: v for k, v in vars(section).items() if k not in own and k != field}
        vars(kept).update(others)  # old fields still to move
        model[name] = kept
        return vars(section)[field]
    if hasattr(section, "as_dict"):  # a jsonargparse Namespace
        section = section.as_dict()
    if not isinstance(section, dict) or field not in section:
        return _ABSENT
    model[name] = {k: v for k, v in section.items() if k != field}
    return section[field]


def _with_field(section: Any, field: str, value: Any) -> Any:
    if dataclasses.is_dataclass(section) and not isinstance(section, type):
        return dataclasses.replace(section, **{field: value})
    if hasattr(section, "as_dict"):  # a jsonargparse Namespace
        section = section.as_dict()
    return {**(section or {}), field: value}


def renamed_warning(moves: list[str], where: str, written: bool = True) -> str:
    """The one-line warning for options folded from ``where``: a config the user wrote
    (``written``: it asks for the new names), or a checkpoint (it says what was read where)."""
    ask = "write the new names" if written else "nothing to change"
    return (
        f"{where} names options renamed in 0.2.0 (CHANGELOG.md, Renamed options), read at their "
        f"places now ({ask}): " + "; ".join(dict.fromkeys(moves))
    )
