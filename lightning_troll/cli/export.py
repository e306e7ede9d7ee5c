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
  the adapters alone, for ``peft``. A 4-bit base is not merged (rounding the merged weights back
  to 4 bits would lose the update): export its adapters.

The checkpoint is a ``.ckpt`` file, or the folder of shards an FSDP2 run writes (gathered in
this one process's CPU memory). The folder is written beside ``output_dir`` and renamed into
place once complete, so a failed export leaves no half-written model; an ``output_dir`` that
exists and is not empty is refused unless ``--overwrite`` is given (it is then replaced whole,
once the new one is complete).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_troll.training.checkpoints import CheckpointError, check_checkpoint_file

__all__ = ["export_policy", "main", "read_checkpoint"]


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint at ``path`` as one dict on the CPU: a ``.ckpt`` file (its archive checked
    first), or a sharded checkpoint's folder, its shards gathered."""
    where = Path(path).expanduser()
    if where.is_dir():
        if not (where / ".metadata").is_file():
            raise CheckpointError(
                f"--ckpt_path {str(path)!r} is a folder but not a sharded checkpoint (it has no "
                "'.metadata' file); give a .ckpt file or the folder an FSDP2 fit wrote"
            )
        from lightning.fabric.utilities.load import _load_distributed_checkpoint

        return _load_distributed_checkpoint(where)
    check_checkpoint_file(where)
    # The checkpoint's own hyper-parameters hold the option records (allow-listed for
    # weights_only in lightning_troll.training.resume); LightningCLI's adds its instantiator.
    return torch.load(where, map_location="cpu", weights_only=False)


def _check_output(output_dir: Path, overwrite: bool) -> None:
    if output_dir.exists() and not output_dir.is_dir():
        raise FileExistsError(f"--output_dir {str(output_dir)!r} is a file; give a folder")
    if output_dir.is_dir() and any(output_dir.iterdir()) and not overwrite:
        raise FileExistsError(
            f"--output_dir {str(output_dir)!r} exists and is not empty; give another folder, or "
            "--overwrite to replace it"
        )


def export_policy(
    ckpt_path: str | Path,
    output_dir: str | Path,
    adapters_only: bool = False,
    overwrite: bool = False,
) -> Path:
    """Writes the trained policy of ``ckpt_path`` and its tokenizer to ``output_dir`` with
    ``save_pretrained``; returns ``output_dir``. See the module docstring for what is written."""
    from lightning.pytorch.core.saving import _load_state

    from lightning_troll.training.module import TrollModule

    output_dir = Path(output_dir).expanduser()
    _check_output(output_dir, overwrite)  # before the minutes a big checkpoint takes to read
    checkpoint = read_checkpoint(ckpt_path)
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
        policy = policy.merge_and_unload()
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.", dir=output_dir.parent))
    try:
        if adapters_only:  # the trained adapter, not the snapshot's copy of it
            policy.save_pretrained(staging, selected_adapters=[policy.active_adapter])
        else:
            policy.save_pretrained(staging)
        module.tokenizer.save_pretrained(staging)
        _replace(output_dir, staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output_dir


def _replace(output_dir: Path, staging: Path) -> None:
    """Moves the complete ``staging`` folder to ``output_dir``; an existing ``output_dir`` is
    set aside first and removed only once the new one is in place (put back if that fails)."""
    old = None
    if output_dir.exists():
        old = output_dir.with_name(f"{staging.name}.old")
        output_dir.rename(old)
    try:
        staging.rename(output_dir)
    except BaseException:
        if old is not None:
            old.rename(output_dir)
        raise
    if old is not None:
        shutil.rmtree(old)


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
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --output_dir")
    return p.parse_args(argv)


def main(argv: Sequence[str]) -> Path:
    """``lightning-troll export ...``: parses ``argv`` (what follows ``export``) and exports."""
    args = parse_args(argv)
    out = export_policy(args.ckpt_path, args.output_dir, args.adapters_only, args.overwrite)
    print(f"lightning-troll: wrote the policy and tokenizer of {args.ckpt_path} to {out}")
    return out
