"""``lightning-troll export``: a trained policy out of a checkpoint, as a Hugging Face model folder.

    lightning-troll export --ckpt_path runs/last.ckpt --output_dir smollm2-troll
    lightning-troll export --ckpt_path runs/last.ckpt --output_dir adapter --adapters_only

A fit's checkpoint holds the whole training state (weights, optimiser, snapshot, random states);
``transformers``, ``vllm`` or ``peft`` want what ``save_pretrained`` writes. This rebuilds the
module from the checkpoint's own options (the base model it names must still be where it was,
for its config and tokenizer), loads the trained weights and writes the policy and tokenizer to
``output_dir``:

- full fine-tuning: the policy as trained, in its training dtype;
- LoRA: the adapters merged into the base weights (a plain model), or with ``--adapters_only``
  the adapters alone, for ``peft``. The merge is written in the base's dtype unless rounding to it
  would change the adapters' update by more than :data:`ROUNDING_LIMIT` of its norm (an RL update
  is small beside a bfloat16 weight's rounding step), in which case it is merged and written in
  float32, and the command says so. ``--dtype`` chooses the written dtype instead. A 4-bit base is
  not merged (rounding the merged weights back to 4 bits would lose the update): export its
  adapters.

The checkpoint is a ``.ckpt`` file, or the folder of shards an FSDP2 run writes (gathered in
this one process's CPU memory, and read again where a running fit swaps a new one in meanwhile:
:func:`read_checkpoint`). Only the policy is rebuilt: the run's rewards, reward workers and
rollout engine, tools and environment are not (:data:`POLICY_ONLY`, :data:`DEFAULTED`), so a
reward or tool module that is not importable where the export runs does not matter. The folder is
written beside ``output_dir`` and renamed into
place once complete, so a failed export leaves no half-written model. An ``output_dir`` that
exists and is not empty is refused unless ``--overwrite`` is given, and ``--overwrite`` replaces
only a folder an earlier export wrote (its :data:`MARKER` lists every file it wrote): a folder
that holds the checkpoint being exported, a run's logs or any file no export wrote is refused,
and nothing is deleted. The written files and the folder are synced before the rename, and the
folder takes the permissions of any folder the user creates (the umask's). An ``output_dir`` that
is a symbolic link is written where it points, so that the link names the new model; one inside
a sharded checkpoint's folder is refused, since the run replaces that folder whole at its next
save.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_troll.models.folders import replace_folder, sync_tree
from lightning_troll.models.loading import DTYPES
from lightning_troll.models.weights import carries_adapter, ties_an_adapted_embedding
from lightning_troll.training.checkpoints import CheckpointError, check_checkpoint_file
from lightning_troll.training.moved import fold_renamed_options, load_checkpoint_file

__all__ = [
    "FOLDER_READS",
    "MARKER",
    "POLICY_ONLY",
    "ROUNDING_LIMIT",
    "export_policy",
    "main",
    "read_checkpoint",
]

MARKER = ".lightning-troll-export.json"
"""The file an export writes into its folder: the checkpoint it came from and every file it
wrote, which is what ``--overwrite`` may replace."""
POLICY_ONLY: dict[str, Any] = {"rewards": None, "episodes": None}
"""The module options an export replaces in the checkpoint's: what scores rollouts and an
episode's tools and environment, which writing a policy never uses (a reward or tool module of
one's own need not be importable)."""
ROUNDING_LIMIT = 0.1
"""With ``--dtype auto``, a LoRA merge is written in float32 instead of the base's dtype when
rounding the merged weights to that dtype changes the adapters' update by more than this share of
its norm (:func:`rounding_loss`)."""
FOLDER_READS = 3
"""Reads of a sharded checkpoint's folder that a running fit's saves may cut short before an
export gives up (:func:`read_checkpoint`)."""
DEFAULTED = ("reward_options", "advantages", "dynamic_sampling", "engine", "corrections")
"""The module options an export leaves out of the checkpoint's (the options 0.2.0 renamed folded
first), so that they take their defaults: how rewards are called and turned into advantages, what
samples rollouts and what corrects them, none of which writing a policy uses."""


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint at ``path`` as one dict on the CPU: a ``.ckpt`` file (its archive checked
    first), or a sharded checkpoint's folder, its shards gathered.

    A running fit replaces a sharded checkpoint's folder whole at its next save (two renames);
    shards read across that swap would mix two saves. The folder is read again when it is not
    the same folder after the read as before it (or vanished during it), up to
    :data:`FOLDER_READS` times. A file is opened once: a save renamed over it leaves the open
    file as it was.
    """
    where = Path(path).expanduser()
    check_checkpoint_file(where)
    if not where.is_dir():
        # The checkpoint's own hyper-parameters hold the option records (allow-listed for
        # weights_only in lightning_troll.training.resume); LightningCLI's adds its instantiator.
        # Records pickled under the paths of an earlier layout are found at their places now.
        return load_checkpoint_file(where, map_location="cpu")
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    for _ in range(FOLDER_READS):
        before = _identity(where)
        try:
            check_checkpoint_file(where)
            state = _load_distributed_checkpoint(where)
        except Exception:
            if _identity(where) == before:  # not a swap: the error is the folder's own
                raise
            continue
        if _identity(where) == before:
            return state
    raise CheckpointError(
        f"--ckpt_path {str(where)!r}: the run replaced this folder while it was read, "
        f"{FOLDER_READS} times over; export it between two saves, or from a copy"
    )


def _identity(folder: Path) -> tuple[int, int] | None:
    """(device, inode) of ``folder``, or None where nothing is there: a swapped-in folder is
    another directory, with another inode."""
    try:
        info = os.stat(folder)
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino


def _adapted_layers(policy: Any) -> list[Any]:
    """The layers of a peft ``policy`` that carry its active adapter."""
    adapter = policy.active_adapter
    return [
        module
        for module in policy.modules()
        if hasattr(module, "get_delta_weight") and carries_adapter(module, adapter)
    ]


def rounding_loss(policy: Any, dtype: torch.dtype) -> float:
    """How much rounding the merged weights of a peft ``policy`` to ``dtype`` changes the update
    its active adapter makes: ``||round(W + D) - (W + D)|| / ||D||`` over every adapted layer,
    ``W`` its base weight and ``D`` the adapter's delta weight, in float32 (0.0 when ``D`` is 0)."""
    adapter, lost, moved = policy.active_adapter, 0.0, 0.0
    with torch.no_grad():
        for layer in _adapted_layers(policy):
            delta = layer.get_delta_weight(adapter).float()
            merged = layer.get_base_layer().weight.float() + delta
            lost += (merged.to(dtype).float() - merged).square().sum().item()
            moved += delta.square().sum().item()
    return (lost / moved) ** 0.5 if moved > 0 else 0.0


def _merge(policy: Any, dtype: str) -> Any:
    """The adapters of ``policy`` merged into its base weights, written in ``dtype`` (``"auto"``:
    the base's, or float32 past :data:`ROUNDING_LIMIT`, module docstring); a merge written in
    another dtype than the base's is computed in float32 and rounded once, to ``dtype``, as
    :func:`rounding_loss` measures it (a float32 one rounds nothing). An output layer tied to
    an embedding that carries an adapter is written untied, as the policy computed it: the
    embedding merged, the output layer the embedding's base weight."""
    layers = _adapted_layers(policy)
    base = layers[0].get_base_layer().weight.dtype if layers else torch.float32
    target = base if dtype == "auto" else DTYPES[dtype]
    if target != torch.float32:
        loss = rounding_loss(policy, target)
        if loss > ROUNDING_LIMIT:
            rounded = f"rounding the merged weights to {str(target).removeprefix('torch.')}"
            changes = f"changes the adapters' update by {100 * loss:.0f}% of its norm"
            if dtype == "auto":
                target = torch.float32
                print(
                    f"lightning-troll: {rounded} {changes}, so the merge is written in float32; "
                    "--dtype chooses another",
                    file=sys.stderr,
                )
            else:
                print(
                    f"lightning-troll: warning: --dtype {dtype}: {rounded} {changes}; "
                    "--dtype float32 keeps it",
                    file=sys.stderr,
                )
    if target != base:  # not in the base's dtype first, which would round twice
        policy = policy.float()
    head = None
    if ties_an_adapted_embedding(policy):  # the trained head is the embedding's base weight
        head = policy.get_output_embeddings().weight.detach().clone()
    merged = policy.merge_and_unload().to(target)
    if head is not None:  # the merge moved the tied head with the embedding: untie it
        merged.config.tie_word_embeddings = False
        merged.get_output_embeddings().weight = torch.nn.Parameter(head.to(target))
    return merged


def _files(folder: Path) -> list[str]:
    """Every file under ``folder``, as paths relative to it, sorted."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir())


def _check_output(output_dir: Path, overwrite: bool, ckpt_path: Path) -> None:
    """Refuses an ``output_dir`` that is a file, that holds the checkpoint, or that is not empty
    (with ``overwrite``: that holds any file an earlier export did not write)."""
    where = f"--output_dir {str(output_dir)!r}"
    if output_dir.exists() and not output_dir.is_dir():
        raise FileExistsError(f"{where} is a file; give a folder")
    if ckpt_path.is_dir() and output_dir.resolve().is_relative_to(ckpt_path.resolve()):
        raise FileExistsError(
            f"{where} lies inside the sharded checkpoint's folder {str(ckpt_path)!r}, which the "
            "run replaces whole at its next save; give a folder outside it"
        )
    if not output_dir.is_dir() or not any(output_dir.iterdir()):
        return
    if ckpt_path.resolve().is_relative_to(output_dir.resolve()):
        raise FileExistsError(
            f"{where} holds the checkpoint being exported ({str(ckpt_path)!r}); give another folder"
        )
    if not overwrite:
        raise FileExistsError(
            f"{where} exists and is not empty; give another folder, or --overwrite to replace an "
            "earlier export there"
        )
    marker = output_dir / MARKER
    written = set(json.loads(marker.read_text())["files"]) if marker.is_file() else set()
    foreign = [f for f in _files(output_dir) if f != MARKER and f not in written]
    if foreign:
        raise FileExistsError(
            f"{where}: --overwrite replaces only a folder an export wrote, and this one holds "
            f"{len(foreign)} file(s) no export wrote (first: {foreign[0]!r}); nothing was "
            "deleted: give another folder"
        )


def export_policy(
    ckpt_path: str | Path,
    output_dir: str | Path,
    adapters_only: bool = False,
    overwrite: bool = False,
    dtype: str = "auto",
) -> Path:
    """Writes the trained policy of ``ckpt_path`` and its tokenizer to ``output_dir`` with
    ``save_pretrained``, in ``dtype`` (one of :data:`DTYPES`; ``"auto"``: the dtype it trained
    in, or for a LoRA merge the module docstring's rule); returns ``output_dir``."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {list(DTYPES)}; got {dtype!r}")
    if adapters_only and dtype != "auto":
        raise ValueError(
            f"--dtype {dtype} with --adapters_only: the adapters are written as they trained; "
            "leave --dtype out, or export the merged model"
        )
    from lightning.pytorch.core.saving import _load_state

    from lightning_troll.training.module import TrollModule

    given = output_dir = Path(output_dir).expanduser()
    if output_dir.is_symlink():  # written where the link points, so the link names the new model
        output_dir = output_dir.resolve()
    # before the minutes a big checkpoint takes to read
    _check_output(output_dir, overwrite, Path(ckpt_path).expanduser())
    checkpoint = read_checkpoint(ckpt_path)
    stored, _ = fold_renamed_options(checkpoint.get("hyper_parameters", {}))
    kept = {key: value for key, value in stored.items() if key not in DEFAULTED}
    checkpoint["hyper_parameters"] = {**kept, **POLICY_ONLY}
    lora = checkpoint.get("hyper_parameters", {}).get("lora")
    if adapters_only and lora is None:
        raise ValueError(
            f"--adapters_only: the checkpoint {str(ckpt_path)!r} trained every weight (model.lora "
            "is null), so it has no adapters; leave the option out to export the whole model"
        )
    four_bit = (
        lora.get("load_in_4bit") if isinstance(lora, dict) else getattr(lora, "load_in_4bit", 0)
    )
    if lora is not None and not adapters_only and four_bit:
        raise ValueError(
            "the checkpoint's LoRA adapters sit on a 4-bit base (model.lora.load_in_4bit), which "
            "cannot take the merged update without rounding it away; export with --adapters_only"
        )
    # Lightning's own loader of a checkpoint dict (load_from_checkpoint reads only files, and a
    # sharded checkpoint is a folder): rebuilds the module from its hyper-parameters, then loads
    # the weights and runs on_load_checkpoint.
    module = _load_state(TrollModule, checkpoint, strict=True)
    policy = module.policy
    if lora is not None and not adapters_only:
        policy = _merge(policy, dtype)
    elif dtype != "auto":
        policy = policy.to(DTYPES[dtype])
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.", dir=output_dir.parent))
    try:
        if adapters_only:  # the trained adapter, not the snapshot's copy of it
            policy.save_pretrained(staging, selected_adapters=[policy.active_adapter])
        else:
            policy.save_pretrained(staging)
        module.tokenizer.save_pretrained(staging)
        record = {
            "ckpt_path": str(Path(ckpt_path).expanduser().resolve()),
            "files": _files(staging),
        }
        (staging / MARKER).write_text(json.dumps(record, indent=1) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)  # mkdtemp's folder is the user's alone
        sync_tree(staging)
        replace_folder(output_dir, staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return given


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="lightning-troll export",
        description="Writes a fit checkpoint's trained policy and tokenizer as a Hugging Face "
        "model folder (save_pretrained).",
    )
    p.add_argument(
        "--ckpt_path", required=True, help="a .ckpt file, or the folder an FSDP2 fit wrote"
    )
    p.add_argument("--output_dir", required=True, help="the model folder to write")
    p.add_argument(
        "--adapters_only",
        action="store_true",
        help="LoRA: write the adapters alone (peft) instead of merging them into the base",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace an earlier export in --output_dir"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=list(DTYPES),
        help="the dtype of the written weights (auto: as trained; a LoRA merge in float32 when "
        "rounding to the base's dtype would change the update, see the docs)",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str]) -> Path:
    """``lightning-troll export ...``: parses ``argv`` (what follows ``export``) and exports."""
    args = parse_args(argv)
    out = export_policy(
        args.ckpt_path, args.output_dir, args.adapters_only, args.overwrite, args.dtype
    )
    print(f"lightning-troll: wrote the policy and tokenizer of {args.ckpt_path} to {out}")
    return out
