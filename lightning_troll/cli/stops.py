"""How the ``lightning-troll`` command ends when something stops it: one line each.

Bad input found before training: ``lightning-troll: error: <message>``, exit status 2 (a class in
the config whose constructor refused its arguments, a logger's own check, is named with its
refusal rather than the parser's union-type report). A fault during training
(:class:`~lightning_troll.training.faults.RunFault`) or a write that found its disk full:
``lightning-troll: stopped: <message>``, exit status 3, with the checkpoint to resume from.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_troll.training.checkpoint_io import NO_SPACE
from lightning_troll.training.faults import FAULT_EXIT_CODE, RunFault

__all__ = ["TrainingStarted", "fresh_folder", "full_disk", "quiet_about_no_space", "refuse", "stop"]


def full_disk(error: BaseException | None) -> OSError | None:
    """The write that found no room in ``error`` or what caused it (a logger wraps it in a
    ``ValueError``), or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno in NO_SPACE:
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


_UNION_FAILED = "Does not validate against any of the Union subtypes"


def _said(error: BaseException) -> str:
    """``error`` on one line. A class given in the config whose constructor refused its arguments
    (a logger's own check) reaches here as the parser's union-type error: say the class and its
    refusal instead."""
    message = str(error)
    cause = error.__cause__
    if message.startswith(_UNION_FAILED) and cause is not None:
        named = re.search(r"class_path='([\w.]+)'", message)
        name = named.group(1) if named else "a class in the config"
        message = f"{name} refused its arguments: {type(cause).__name__}: {cause}"
    return " ".join(message.split()) or type(error).__name__


def no_space(error: OSError) -> str:
    """One line for a write that found its disk full outside a checkpoint save (the logs, the
    config copy): where, the free space, what to change, and the checkpoint that is whole."""
    where = error.filename or getattr(error, "log_dir", None) or os.getcwd()
    folder = Path(where).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    kept = getattr(error, "kept", None)
    resume = (f"the last checkpoint, {kept}, is whole: resume with --ckpt_path {kept}" if kept
              else "no checkpoint had been saved")  # fmt: skip
    return (
        f"no space left on the device of {where} ({os.strerror(error.errno)}; {free / 2**20:.1f} "
        "MiB free): free space there, or put the run's logs (trainer.default_root_dir, the "
        f"logger's save_dir) and checkpoints (checkpoint.dirpath) on another disk; {resume}"
    )


def quiet_about_no_space(previous: Callable[[Any], None]) -> Callable[[Any], None]:
    """A ``threading.excepthook`` that leaves a writer thread's full disk (TensorBoard's) to the
    main thread, which meets the same error at its next write and reports it in one line."""

    def hook(args: Any) -> None:
        if not (isinstance(args.exc_value, OSError) and args.exc_value.errno in NO_SPACE):
            previous(args)

    return hook


def stop(error: BaseException) -> None:
    """Ends the command for ``error``, raised by a fit: a :class:`RunFault` or a full disk in one
    line (and the checkpoint saved on the way out), exit status 3; bad input found before
    training in one line, exit status 2; anything else raised during training as it is."""
    full = full_disk(error)
    if full is not None and not isinstance(error, RunFault):
        print(f"lightning-troll: stopped: {no_space(full)}", file=sys.stderr)
        raise SystemExit(FAULT_EXIT_CODE) from None
    if isinstance(error, RunFault):
        print(f"lightning-troll: stopped: {' '.join(str(error).split())}", file=sys.stderr)
        if error.saved:
            print(f"  saved {error.saved}: fix the cause, then resume with the same command and "
                  f"--ckpt_path {error.saved}", file=sys.stderr)  # fmt: skip
        elif error.kept:
            print(f"  the last checkpoint, {error.kept}, is as it was: fix the cause, then resume "
                  f"with the same command and --ckpt_path {error.kept}", file=sys.stderr)  # fmt: skip
        raise SystemExit(FAULT_EXIT_CODE) from None
    if getattr(error, "during_training", False):
        raise error
    refuse(error)


def fresh_folder(logger: Any) -> tuple[Path, Path] | None:
    """(the folder, its nearest folder that exists) of a TensorBoard or CSV ``logger`` whose
    folder (``runs/lightning_logs/version_<n>``) does not exist yet, or None; asked before the fit,
    which creates it."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    if not isinstance(logger, TensorBoardLogger | CSVLogger):
        return None
    folder = Path(logger.log_dir).absolute()
    if folder.exists():
        return None
    existing = folder.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return folder, existing


def remove_fresh_folder(error: BaseException) -> None:
    """Removes the logger's folder a start refused before training created (``error``'s
    ``fresh_folder``: its config copy and an events file), and the empty folders above it that
    the start created, unless it holds a checkpoint."""
    fresh = getattr(error, "fresh_folder", None)
    if fresh is None:
        return
    folder, existing = fresh
    if not folder.is_dir() or any(p.name.endswith(".ckpt") for p in folder.rglob("*")):
        return
    shutil.rmtree(folder, ignore_errors=True)
    parent = folder.parent
    while parent != existing and parent.is_dir() and not any(parent.iterdir()):
        parent.rmdir()
        parent = parent.parent


def refuse(error: BaseException) -> None:
    """Prints ``error`` as one line and exits with status 2; a run folder the refused start
    created is removed (:func:`remove_fresh_folder`)."""
    remove_fresh_folder(error)
    print(f"lightning-troll: error: {_said(error)}", file=sys.stderr)
    raise SystemExit(2) from None


class TrainingStarted(Callback):
    """Marks an exception raised once training has started: a crash, not bad input."""

    def __init__(self) -> None:
        self.started = False
        self.fresh: tuple[Path, Path] | None = None
        """(the logger's folder, its nearest folder that existed) where this run creates the
        logger's folder: a start refused before training removes it (``stops.refuse``)."""

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.started = True

    @override
    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        if self.started:
            with contextlib.suppress(AttributeError):
                exception.during_training = True  # read by main()
        elif self.fresh is not None and trainer.is_global_zero:
            with contextlib.suppress(AttributeError):
                exception.fresh_folder = self.fresh  # removed by stops.refuse
        full = full_disk(exception)
        if full is not None:  # read by stops.no_space
            full.log_dir = trainer.log_dir  # type: ignore[attr-defined]
            full.kept = getattr(trainer.checkpoint_callback, "last_model_path", None)  # type: ignore[attr-defined]
