"""The ``data`` section's files checked before anything loads, every error naming the file and
its line.

:func:`check_data_files` reads a local ``data.source`` and ``data.val_file`` (not a hub dataset,
which is fetched later, nor the built-in TinyMath) and refuses, in one line that names the
option, the file and the line: a folder or a missing file, a byte that is not UTF-8, a line that
is not a JSON object, a file with no rows, a ``data.num_val`` that would hold out every row of
``data.source`` (without ``data.val_file``), and a row without a field the options need
(``data.prompt_field``, ``data.answer_field``, the fields ``data.template`` names). It warns,
once each, about rows whose prompt repeats an earlier row's, and validation prompts that are
also training prompts. The ``lightning-troll`` command calls it before the model loads, so a
refused start leaves no run folder.

:func:`check_prompts` then formats and tokenizes a local file's prompts as the run will, with the
tokenizer alone (it loads before the model): a conversation's roles and contents, a chat template
that raises on a row or is missing, and prompt lengths (``data.max_prompt_tokens``) are refused
in one line naming the file's line (:class:`~lightning_troll.tasks.data.formatting.PromptFormatter`).

:func:`check_hub_dataset` refuses, as early, a hub dataset name that is not in the cache where
the hub cannot be reached or has no dataset of that name.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from lightning_troll.tasks.data.datamodule import PromptDataModule
from lightning_troll.tasks.data.formatting import PromptFormatter
from lightning_troll.tasks.data.prompts import (
    PLAIN_TEMPLATE,
    check_file,
    looks_like_file,
    read_rows_with_lines,
)
from lightning_troll.tasks.data.sources import check_holdout

__all__ = ["check_data_files", "check_hub_dataset", "check_prompts"]

_DEFAULTS = {"prompt_field": "prompt", "answer_field": None, "template": PLAIN_TEMPLATE}


def _formatter(data: Mapping[str, Any]) -> PromptFormatter:
    """A formatter for the field checks alone (no tokenizer)."""
    options = {key: data.get(key, default) for key, default in _DEFAULTS.items()}
    return PromptFormatter(
        **options,
        chat_template=data.get("chat_template"),
        system_prompt=None,
        max_prompt_tokens=1,
        tokenizer=None,
        describe=str,
    )


def _files(data: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(option, path) of the local files the ``data`` section names."""
    files = []
    source = data.get("source")
    local = isinstance(source, str) and (
        Path(source).expanduser().exists() or looks_like_file(source)
    )
    if local and source != "tinymath":
        files.append(("data.source", source))
    if data.get("val_file"):
        files.append(("data.val_file", data["val_file"]))
    return files


def check_data_files(
    data: Mapping[str, Any], row_problem: Callable[[Mapping[str, Any]], str | None] | None = None
) -> None:
    """Checks the ``data`` section's local files (module docstring), and each row with
    ``row_problem`` (why a row cannot be used, or None) where given; raises ``ValueError`` naming
    the option, the file and the line."""
    formatter = _formatter(data)
    prompts: dict[str, dict[str, int]] = {}
    for option, path in _files(data):
        check_file(option, path)
        rows, lines = read_rows_with_lines(path, option)
        where = f"{option}={path!r}"
        if not rows:
            raise ValueError(f"{where} holds no rows (an empty file); give a file of prompts")
        for i, row in enumerate(rows if row_problem is not None else ()):
            problem = row_problem(row)
            if problem is not None:
                raise ValueError(f"{where}, line {lines[i]}: {problem}")
        missing = formatter.first_missing(rows)
        if missing is not None:
            i, field, needed_by = missing
            raise ValueError(
                f"{where}, line {lines[i]}: the row has no field {field!r}, which "
                f"{formatter.option_value(needed_by, field)} needs; its fields are "
                f"{sorted(rows[i])}"
            )
        num_val = data.get("num_val")
        if option == "data.source" and not data.get("val_file") and isinstance(num_val, int):
            check_holdout(path, num_val, len(rows))  # rows held out of this file
        prompts[option] = _first_lines(option, path, rows, lines, formatter.field_of(rows), data)
    if len(prompts) == 2:
        train, held = prompts["data.source"], prompts["data.val_file"]
        shared = [key for key in held if key in train]
        if shared:
            rank_zero_warn(
                f"{len(shared)} of the {len(held)} prompts of data.val_file={data['val_file']!r} "
                f"are also training prompts of data.source={data['source']!r} (first: line "
                f"{held[shared[0]]} there, line {train[shared[0]]} here): validation then "
                "measures what the policy saw, not what it learned"
            )


def check_prompts(module: PromptDataModule) -> None:
    """Prepares the prompts of ``module`` (the rows read, checked, formatted and tokenized, as
    its ``setup`` does) where its ``data.source`` is a local file, so that a conversation, a chat
    template or a prompt length the run cannot use is refused before the model loads; TinyMath's
    rows need no check and a hub dataset's are fetched later."""
    if module.row_source.kind == "file":
        module.setup("fit")


def _in_cache(name: str) -> bool:
    """Whether the hub dataset ``name`` has been fetched here before: the hub's file cache or
    ``datasets``' own prepared one holds a folder of it."""
    import datasets.config
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    hub = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=name, repo_type="dataset")
    prepared = Path(datasets.config.HF_DATASETS_CACHE) / name.replace("/", "___")
    return hub.is_dir() or prepared.is_dir()


def check_hub_dataset(source: Any, timeout: float = 5.0) -> None:
    """Refuses a ``data.source`` that names a hub dataset (not a local file, not TinyMath) this
    machine can neither read from its cache nor fetch: the hub is off or out of reach, or it has
    no dataset of that name (a misspelt one, or a private one without a token). Without this the
    name is looked up after the model has loaded."""
    if not isinstance(source, str) or not source or source == "tinymath":
        return
    if looks_like_file(source) or Path(source).expanduser().exists() or _in_cache(source):
        return
    import datasets.config

    from lightning_troll.models.loading import hub_unreachable

    why = "HF_DATASETS_OFFLINE is set" if datasets.config.HF_DATASETS_OFFLINE else None
    why = why or hub_unreachable(timeout)
    if why is None:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import RepositoryNotFoundError

        try:
            HfApi().dataset_info(source, timeout=timeout)
            return
        except RepositoryNotFoundError:
            why = (
                "the hub has no dataset of that name this machine may read (a misspelt name, "
                "or a private dataset without a token: `hf auth login`)"
            )
        except Exception:  # noqa: BLE001 - not an answer about the name: the load will say
            return
    raise ValueError(
        f"data.source={source!r} is neither a local file nor a hub dataset in the Hugging Face "
        f"cache, and {why}; give a .json, .jsonl or .parquet file, 'tinymath', or a hub "
        "dataset name (owner/name)"
    )


def _first_lines(option, path, rows, lines, field, data) -> dict[str, int]:
    """Each distinct prompt -> the line it first appears on; warns about repeated prompts."""
    first: dict[str, int] = {}
    repeats: list[tuple[int, int]] = []
    for row, line in zip(rows, lines, strict=True):
        key = json.dumps(row[field], sort_keys=True, ensure_ascii=False)
        if key in first:
            repeats.append((line, first[key]))
        else:
            first[key] = line
    if repeats:
        held_out = option == "data.source" and not data.get("val_file") and data.get("num_val")
        rank_zero_warn(
            f"{option}={path!r}: {len(repeats)} of {len(rows)} rows repeat an earlier row's "
            f"prompt (first: line {repeats[0][0]} repeats line {repeats[0][1]}); repeated prompts "
            "weigh more in training"
            + (
                ", and with data.num_val held out of the same file a prompt can be in both the "
                "training and the validation rows"
                if held_out
                else ""
            )
        )
    return first
