"""What a checkpoint carries beyond Lightning's own state, and the checks made before resuming.

- :func:`rng_states` / :func:`restore_rng_states`: the global torch (CPU and CUDA), Python and
  NumPy random states, kept per global rank (:func:`rng_states_by_rank` gathers them). Sampling
  draws from torch's global generator (through ``generate``), so a resumed run samples the same
  completions only if these come back.
- :func:`seed_per_rank`: gives every process random streams of its own, derived from the
  shared seed, so that processes do not sample their completions from the same numbers.
- :func:`check_checkpoint_file`: a ``--ckpt_path`` that is missing, truncated or not a
  checkpoint is refused with its path named, before any training.
- :func:`check_compatible`: a checkpoint written for another model (other vocabulary or layer
  sizes) is refused with the first differing tensor and both shapes named.

Nothing here imports Lightning; the hooks that use these are in :mod:`lightning_troll.training.resume`.
"""

from __future__ import annotations

import dataclasses
import random
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_troll.training.moved import load_checkpoint_file

__all__ = [
    "CheckpointError",
    "aside_path",
    "changed_options",
    "check_checkpoint_file",
    "check_compatible",
    "restore_rng_states",
    "rng_states",
    "rng_states_by_rank",
    "seed_per_rank",
    "stored_data_seed",
]


def changed_options(now: Mapping[str, Any], stored: Mapping[str, Any]) -> list[str]:
    """``model.<key>: <stored> -> <now>`` for every key both have with different values; for an
    option record, ``model.<key>.<field>: <stored> -> <now>`` for each field that differs.

    An option record and the dict of its fields count as equal (the command line stores dicts,
    a module built in Python or by ``load_from_checkpoint`` holds the records); keys starting
    with ``_`` (the command line's own, such as ``_instantiator``) are left out. A field that a
    record gained after the checkpoint was written counts only when it is set: away from the
    field's default, or, where the record is a plain dict, to anything but null."""
    said = []
    for key, value in now.items():
        if key not in stored or key.startswith("_"):
            continue
        fields = _fields_that_differ(stored[key], value)
        if fields is None:
            if _plain(stored[key]) != _plain(value):
                said.append(f"model.{key}: {stored[key]!r} -> {value!r}")
            continue
        old, new = _plain(stored[key]), _plain(value)
        for field in fields:
            was = repr(old[field]) if field in old else "(not stored)"
            given = repr(new[field]) if field in new else "(not given)"
            said.append(f"model.{key}.{field}: {was} -> {given}")
    return said


def _fields_that_differ(stored: Any, now: Any) -> list[str] | None:
    """The fields of two option records (or dicts of fields) that differ, in order; None where
    they are not both records."""
    old, new = _plain(stored), _plain(now)
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return None
    defaults = {}
    if dataclasses.is_dataclass(now) and not isinstance(now, type):
        defaults = {f.name: f.default for f in dataclasses.fields(now)}
    return [
        key
        for key in [*old, *(k for k in new if k not in old)]
        if key not in new
        or (key in old and old[key] != new[key])
        or (key not in old and new[key] != defaults.get(key))  # a field newer than the file
    ]


def _plain(value: Any) -> Any:
    """An option record as the dict of its fields; anything else unchanged."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


class CheckpointError(ValueError):
    """A checkpoint cannot be read, or was written for another model."""


def rng_states() -> dict[str, Any]:
    """This process's global random states, in types ``torch.load(weights_only=True)`` reads."""
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def rng_states_by_rank(rank: int, world_size: int) -> dict[int, dict[str, Any]]:
    """Every process's :func:`rng_states` by global rank; with several processes, all of them
    must call this (the states are gathered to each)."""
    states = rng_states()
    if world_size == 1:
        return {rank: states}
    everyone: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(everyone, states)
    return dict(enumerate(everyone))


def restore_rng_states(states: Mapping[str, Any]) -> None:
    """Sets the global random states saved by :func:`rng_states`."""
    torch.set_rng_state(states["torch"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    if "cuda" in states and torch.cuda.is_available():
        cuda = states["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


def seed_per_rank(rank: int) -> None:
    """Reseeds the global torch (CPU and CUDA), Python and NumPy generators for global ``rank``.

    ``seed_everything`` seeds every process alike, so without this all of them would draw the
    same random numbers: the j-th completion of a prompt on one process would be sampled from
    the same uniforms as the j-th completion of another prompt on every other process, which
    correlates the samples of a global batch. Every process must call this with identical states
    (it draws the new base seed from them); the result is a function of the shared seed and the
    rank, so a run repeats as long as the process count does.
    """
    if rank < 0:
        raise ValueError(f"rank must be >= 0; got {rank}")
    base = int(torch.randint(0, 2**62, (), dtype=torch.int64))  # the same on every process
    seed = (base + rank * 0x9E3779B97F4A7C15) % 2**63  # golden-ratio stride: far-apart seeds
    torch.manual_seed(seed)  # CPU and every CUDA device
    random.seed(seed)
    np.random.seed(seed % 2**32)


def stored_data_seed(path: str | Path) -> int | None:
    """The ``data.seed`` a checkpoint's data module saved (its state, under the class's name), or
    None where the checkpoint holds none or cannot be read here. A folder checkpoint (FSDP2) keeps
    it in ``meta.pt``; a file is mapped, not read whole."""
    path = Path(path)
    source = path / "meta.pt" if path.is_dir() else path
    try:
        checkpoint = load_checkpoint_file(source, map_location="cpu", mmap=True)
    except Exception:  # noqa: BLE001 - not a checkpoint this can read: Lightning will say
        return None
    state = checkpoint.get("PromptDataModule") if isinstance(checkpoint, dict) else None
    seed = state.get("seed") if isinstance(state, dict) else None
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def aside_path(target: Path) -> Path:
    """Where a folder checkpoint's previous version waits while the new one is renamed into
    place (:func:`~lightning_troll.training.checkpoint_io.save_folder_checkpoint`): a process
    killed between the two renames leaves the whole previous one here."""
    return target.with_name(f".{target.name}.old")


def check_checkpoint_file(path: str | Path) -> None:
    """Raises :class:`CheckpointError` naming ``path`` unless it is a readable torch checkpoint.

    Reads the archive's directory and checks every member's CRC, which finds truncated files and
    overwritten bytes without unpickling anything.
    """
    where = f"--ckpt_path {str(path)!r}"
    file = Path(path).expanduser()
    if file.is_dir():
        _check_folder(file, where)
        return
    if not file.is_file():
        aside = aside_path(file)
        if aside.exists():  # a sharded save killed between its two renames
            raise CheckpointError(
                f"{where}: no such file, but {aside} holds the checkpoint saved before it (a "
                "save was stopped while it swapped the new one in): resume from that one"
            )
        raise CheckpointError(f"{where}: no such file; give a .ckpt file written by a fit")
    try:
        with zipfile.ZipFile(file) as archive:
            bad = archive.testzip()
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise CheckpointError(
            f"{where} is not a readable checkpoint ({type(exc).__name__}: {exc}); the file is "
            "truncated or corrupt (a save that was killed?): resume from an earlier checkpoint"
        ) from exc
    if bad is not None:
        raise CheckpointError(
            f"{where} is corrupt: its member {bad!r} fails its checksum; resume from an earlier "
            "checkpoint"
        )
    if not any(name.endswith("data.pkl") for name in names):
        raise CheckpointError(f"{where} is a zip archive but not a torch checkpoint")


def _check_folder(folder: Path, where: str) -> None:
    """A sharded checkpoint's folder (FSDP2): its metadata, Lightning's part and its shards."""
    missing = [n for n in (".metadata", "meta.pt") if not (folder / n).is_file()]
    if missing or not any(folder.glob("*.distcp")):
        what = ", ".join(repr(n) for n in missing) or "no '*.distcp' shard"
        raise CheckpointError(
            f"{where} is a folder but not a whole sharded checkpoint (it lacks {what}); give a "
            ".ckpt file, or the folder an FSDP2 fit wrote"
        )


def check_compatible(
    expected: Mapping[str, Tensor], loaded: Mapping[str, Tensor], what: str = "the model"
) -> None:
    """Raises :class:`CheckpointError` unless ``loaded`` has the keys and shapes of ``expected``.

    Names the first tensor whose shape differs (with both shapes), or the tensors one side lacks.
    """
    for name, tensor in expected.items():
        if name in loaded and loaded[name].shape != tensor.shape:
            raise CheckpointError(
                f"the checkpoint was written for another model: {name} has shape "
                f"{tuple(loaded[name].shape)} in the checkpoint but {tuple(tensor.shape)} in "
                f"{what} (other vocabulary or layer sizes); resume with the model.model it was "
                "trained with"
            )
    missing = [name for name in expected if name not in loaded]
    extra = [name for name in loaded if name not in expected]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} tensors are missing from it (first: {missing[0]})")
        if extra:
            parts.append(f"it has {len(extra)} tensors {what} lacks (first: {extra[0]})")
        raise CheckpointError(
            f"the checkpoint was written for another model: {'; '.join(parts)}. A reference "
            "policy is kept only with loss.ref_kl_coef > 0: resume with the model.model and "
            "loss.ref_kl_coef it was trained with"
        )
