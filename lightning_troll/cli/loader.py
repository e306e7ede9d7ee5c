"""How the command line reads a config file and a resumed checkpoint's options: YAML, with the options that 0.2.0 moved into records
folded into their places (:func:`~lightning_troll.training.moved.fold_renamed_options`), so a
config written for 0.1 still runs, warned once in a line naming the new places.

jsonargparse reads every config file (and every value given on the command line) through the
loader of its ``parser_mode``; this module registers :data:`MODE`, which the command's parser
uses. Only a mapping with a ``model`` section (at the top, or under a subcommand) is folded: a
value such as ``--model.rewards '{tinymath: 1.0}'`` passes through unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml
from jsonargparse import get_loader, set_loader
from lightning.pytorch.utilities import rank_zero_warn

from lightning_troll.training.moved import fold_renamed_options, renamed_warning

__all__ = ["GIVEN_ON_RESUME", "MODE", "register", "stored_options", "take_given_code"]

MODE = "lightning_troll"
"""The ``parser_mode`` whose loader folds renamed options."""

SUBCOMMANDS = ("fit", "validate", "test", "predict")


def _load(text: str) -> Any:
    value = get_loader("yaml")(text)
    if not isinstance(value, dict):
        return value
    moves: list[str] = []
    for holder in [value, *(value[c] for c in SUBCOMMANDS if isinstance(value.get(c), dict))]:
        if isinstance(holder.get("model"), dict):
            holder["model"], made = fold_renamed_options(holder["model"])
            moves += made
    if moves:
        rank_zero_warn(renamed_warning(moves, "a config"))
    return value


def register() -> None:
    """Registers the folding loader under :data:`MODE` (again is harmless)."""
    set_loader(MODE, _load, (yaml.YAMLError,))  # a value that is no YAML stays a string


def stored_options(path: str | None) -> dict[str, Any] | None:
    """The ``model`` options a checkpoint file at ``path`` stored, in the shape Lightning's CLI
    parses over the config when it resumes, the options 0.2.0 renamed folded (warned in a line);
    None for no such file or no stored options."""
    if not path or not Path(path).is_file():
        return None
    stored = torch.load(path, weights_only=True, map_location="cpu")
    hparams = dict(stored.get("hyper_parameters", {}))
    hparams.pop("_instantiator", None)
    if not hparams:
        return None
    hparams, moves = fold_renamed_options(hparams)
    if moves:
        rank_zero_warn(renamed_warning(moves, f"--ckpt_path {path}", written=False))
    if "_class_path" in hparams:
        return {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
    return hparams


GIVEN_ON_RESUME = ("tools", "environment")
"""The ``model.episodes`` fields a resumed run takes from the command line, not the checkpoint:
they name code of one's own, which may have been renamed or moved since the checkpoint was
written."""


def take_given_code(given: Any, stored: Any) -> None:
    """Sets in ``stored`` (the ``model`` section a resumed run takes from its checkpoint) the
    fields of :data:`GIVEN_ON_RESUME` that ``given`` (the command line's and configs' ``model``)
    sets to another value; the module's resume warns, naming the stored and the new value."""
    new, old = given.get("episodes"), stored.get("episodes")
    if new is None or old is None:
        return
    for field in GIVEN_ON_RESUME:
        value = new.get(field)
        if value and value != old.get(field):
            old[field] = value
