"""Options the command line still takes under the names they had before: folded into their
present place before anything is built, each with a one-line warning (docs/configuration.md,
"Renamed options").

``model.reward_kwargs``, ``model.on_reward_error``, ``model.reward_workers`` and
``model.reward_timeout`` are the fields ``kwargs``, ``on_error``, ``workers`` and ``timeout`` of
``model.reward_options`` now (:class:`~lightning_troll.tasks.rewards.options.RewardOptions`). A
checkpoint written before the rename stores all four: resuming from one folds them over the
defaults, without a warning.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jsonargparse import Namespace

from lightning_troll.tasks.rewards.options import DEPRECATED_KEYS, RewardOptions, merge_deprecated

__all__ = ["fold_renamed_options"]


def fold_renamed_options(model: Namespace, from_checkpoint: bool = False) -> None:
    """Moves the deprecated reward keys given in the parsed ``model`` section into
    ``model.reward_options`` and sets them to null: a value from the command line or a config
    file over the given ``reward_options`` (warned; given beside its new name with another value,
    refused by :func:`~lightning_troll.tasks.rewards.options.merge_deprecated`), or, ``from_checkpoint``,
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
