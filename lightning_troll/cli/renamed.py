"""Options the command line still takes under the names they had before: folded into their
present place before anything is built, each with a one-line warning (docs/configuration.md,
"Renamed options").

``model.reward_kwargs``, ``model.on_reward_error``, ``model.reward_workers`` and
``model.reward_timeout`` are the fields ``kwargs``, ``on_error``, ``workers`` and ``timeout`` of
``model.reward_options`` now (:class:`~lightning_troll.rewards.options.RewardOptions`). A
checkpoint written before the rename stores all four: resuming from one folds them over the
defaults, without a warning.

A resumed run keeps the model options its checkpoint stores, but takes ``model.episodes.tools``
and ``model.episodes.environment`` as given (:func:`take_given_code`): they name code of one's
own, which may have been renamed or moved since the checkpoint was written.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jsonargparse import Namespace

from lightning_troll.rewards.options import DEPRECATED_KEYS, RewardOptions, merge_deprecated

__all__ = ["GIVEN_ON_RESUME", "fold_renamed_options", "take_given_code"]

GIVEN_ON_RESUME = ("tools", "environment")
"""The ``model.episodes`` fields a resumed run takes from the command line, not the checkpoint."""


def fold_renamed_options(model: Namespace, from_checkpoint: bool = False) -> None:
    """Moves the deprecated reward keys given in the parsed ``model`` section into
    ``model.reward_options`` and sets them to null: a value from the command line or a config
    file over the given ``reward_options`` (warned; given beside its new name with another value,
    refused by :func:`~lightning_troll.rewards.options.merge_deprecated`), or, ``from_checkpoint``,
    the values an old checkpoint stored, over the defaults and silently."""
    old = {key: model.get(key) for key in DEPRECATED_KEYS}
    if all(value is None for value in old.values()):
        return
    given = (
        RewardOptions()
        if from_checkpoint
        else RewardOptions(**_fields(model.get("reward_options")))
    )
    merged = merge_deprecated(given, **old, warn=not from_checkpoint)
    model["reward_options"] = Namespace(**dataclasses.asdict(merged))
    for key in old:
        model[key] = None


def _fields(options: Any) -> dict[str, Any]:
    """The fields of ``model.reward_options`` as parsed (a Namespace), a record or a dict."""
    if options is None:
        return {}
    if isinstance(options, Namespace):
        return options.as_dict()
    if dataclasses.is_dataclass(options) and not isinstance(options, type):
        return dataclasses.asdict(options)
    return dict(options)


def take_given_code(given: Namespace, stored: Namespace) -> None:
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
