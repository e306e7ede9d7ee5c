"""RolloutCheckpoint: ``last.ckpt`` every N rollouts, at the end of a fit, and when it is stopped.

The command line adds it when checkpointing is on and no other checkpoint callback is given,
as Lightning adds its own ``ModelCheckpoint``. It writes only between two rollouts, where a
resumed run continues step for step (a checkpoint inside a rollout would make it sample that
rollout again; see docs/troubleshooting.md, "Resuming").
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_troll.training.checkpoint_io import (
    SaveFailed,
    install_atomic_saves,
    remove_partial_files,
)
from lightning_troll.training.checkpoints import aside_path
from lightning_troll.training.faults import RunFault

__all__ = ["OWN_CHECKPOINT_ONLY", "RolloutCheckpoint"]

OWN_CHECKPOINT_ONLY = (
    "trainer.callbacks holds a checkpoint callback of your own, which replaces RolloutCheckpoint: "
    "only your callback's schedule saves now, so a Ctrl-C, a SIGTERM or a reward's failure no "
    "longer saves the rollouts trained since its last file. To keep both, add "
    "lightning_troll.callbacks.RolloutCheckpoint to trainer.callbacks (in a dirpath apart from a "
    "ModelCheckpoint with save_last)"
)
"""The warning for a checkpoint callback given without :class:`RolloutCheckpoint`."""

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RolloutCheckpoint(Checkpoint):
    """Keeps ``<dirpath>/last.ckpt`` up to date, always between two rollouts.

    Saves after every ``every_n_rollouts``-th rollout, after the last rollout of the fit
    (``max_steps``, ``max_epochs``, or a stop set by another callback) and when the run is asked
    to stop: the first Ctrl-C (SIGINT) or SIGTERM lets the rollout in progress (and a
    validation in progress) finish, then saves and ends the fit cleanly. A second Ctrl-C stops at
    once without saving: ``last.ckpt`` is then the one written last. Saves go through
    ``Trainer.save_checkpoint`` and, unless the trainer has a checkpoint IO of its own,
    :class:`~lightning_troll.training.checkpoint_io.AtomicCheckpointIO` (installed at setup, for
    every checkpoint callback of the trainer): each is written beside ``last.ckpt``, synced and
    renamed over it, so a process killed while saving, or a disk that fills, leaves the previous
    ``last.ckpt`` whole; a full disk stops the run with
    :class:`~lightning_troll.training.checkpoint_io.SaveFailed`. A sharded strategy's folder
    (FSDP2) is written beside it and swapped in by renames
    (:func:`~lightning_troll.training.checkpoint_io.save_folder_checkpoint`, also installed at
    setup for every save), as safely.

    Args:
        every_n_rollouts: rollouts between two saves, >= 0; 0 saves only when the fit ends or
            is stopped.
        dirpath: folder of ``last.ckpt``; null follows Lightning's rule: ``checkpoints`` in the
            logger's version folder, or in ``trainer.default_root_dir`` without a logger.
    """

    FILENAME = "last.ckpt"

    def __init__(self, every_n_rollouts: int = 10, dirpath: str | None = None) -> None:
        if isinstance(every_n_rollouts, bool) or every_n_rollouts < 0:
            raise ValueError(
                f"checkpoint.every_n_rollouts must be an integer >= 0; got {every_n_rollouts!r}"
            )
        self.every_n_rollouts = every_n_rollouts
        self.dirpath = dirpath
        self.rollouts = 0
        self.last_model_path: str | None = None
        """The file written last, or None before the first save."""
        self.stopped_by: signal.Signals | None = None
        """The signal that stopped the fit (SIGTERM when another process received it)."""
        self._requested: int | None = None  # the signal this process received
        self._saved_at = -1  # the rollout count of the last save
        self._previous_handlers: dict[int, Any] = {}
        self.filename = self.FILENAME
        """``last.ckpt``, or ``last-v<n>.ckpt`` where another run's ``last.ckpt`` is in the way."""

    @property
    def path(self) -> str | None:
        """Where ``last.ckpt`` is written (known once the fit has started)."""
        return None if self.dirpath is None else os.path.join(self.dirpath, self.filename)

    def _claim(self, trainer: Trainer) -> None:
        """Never writes over another run's checkpoint: where the folder (a fixed ``dirpath``, a
        logger without version folders, or none) holds a ``last.ckpt`` that this fit did not
        resume from, this run's is ``last-v1.ckpt`` (or the first free ``last-v<n>.ckpt``). The
        partial files of saves killed while writing, in that folder and in the resumed
        checkpoint's, are removed (:func:`remove_partial_files`)."""
        if self._saved_at >= 0:  # this callback's own file, from an earlier fit call
            return
        resumed = trainer.ckpt_path
        resumed = None if not resumed or "://" in str(resumed) else Path(resumed).resolve()
        if trainer.is_global_zero:  # what a save killed while writing left here or there
            for folder in {Path(self.dirpath), *([resumed.parent] if resumed else [])}:
                remove_partial_files(folder)
        name, n = self.FILENAME, 0
        while True:
            there = Path(self.dirpath, name)
            taken = there.exists() or aside_path(there).exists()
            if not taken or there.resolve() == resumed:
                break
            n += 1
            name = f"last-v{n}.ckpt"
        self.filename = trainer.strategy.broadcast(name)
        if self.filename != self.FILENAME:
            rank_zero_warn(
                f"{Path(self.dirpath, self.FILENAME)} holds another run's checkpoint, which this "
                f"run did not resume from (--ckpt_path): this run saves to {self.path} instead, "
                "and leaves that one as it is"
            )

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        install_atomic_saves(trainer.strategy)
        if self.dirpath is None:
            self.dirpath = os.path.join(trainer.log_dir or trainer.default_root_dir, "checkpoints")
        # all processes must agree: only the first one's log folder exists
        self.dirpath = trainer.strategy.broadcast(self.dirpath)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._claim(trainer)
        self.stopped_by = None
        self._requested = None
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._requested is None:
            self._requested = signum
            rank_zero_info(
                f"\nlightning-troll: {signal.Signals(signum).name} received: the rollout (or "
                f"validation) in progress finishes, then {self.path} is saved and the run stops. "
                "Press Ctrl-C again to stop at once without saving."
            )
        elif signum == signal.SIGINT:
            self._restore_handlers()
            raise KeyboardInterrupt

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers = {}

    def _stop_requested(self, trainer: Trainer) -> bool:
        """Whether any process received a stop signal; every process must call this."""
        requested = self._requested is not None
        if trainer.world_size > 1:
            requested = trainer.strategy.reduce_boolean_decision(requested, all=False)
        if requested and self.stopped_by is None:
            self.stopped_by = signal.Signals(self._requested or signal.SIGTERM)
        return requested

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.rollouts += 1  # one training batch is one rollout
        if self._stop_requested(trainer):
            trainer.should_stop = True
        due = self.every_n_rollouts > 0 and self.rollouts % self.every_n_rollouts == 0
        if due or trainer.should_stop or self._fit_ends_here(trainer):
            self._save(trainer)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A stop asked for (or set by an early-stopping callback) during a validation that
        runs after a rollout: saved here, where Lightning's own checkpoints are written."""
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        if self._stop_requested(trainer):
            trainer.should_stop = True
        if trainer.should_stop:
            self._save(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Whatever ended the fit after the last save, nothing trained is left unsaved."""
        self._restore_handlers()
        self._save(trainer)

    @override
    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        """An exception may strike inside a rollout: nothing is saved, unless it is a
        :class:`~lightning_troll.training.faults.RunFault` that leaves the state whole (a reward
        that failed while the rollout was scored) in a single process; then ``last.ckpt`` is
        saved, resuming at that rollout, and the fault names it; another fault names the last
        checkpoint (``kept``)."""
        self._restore_handlers()
        if isinstance(exception, RunFault) and exception.resumable and trainer.world_size == 1:
            self._save(trainer)
            exception.saved = self.path
        elif isinstance(exception, RunFault) and not isinstance(exception, SaveFailed):
            resumed = trainer.ckpt_path  # the last one this run saved, or the one it resumed from
            exception.kept = self.last_model_path or (str(resumed) if resumed else None)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore_handlers()

    @staticmethod
    def _fit_ends_here(trainer: Trainer) -> bool:
        """Whether this rollout is the fit's last (max_steps reached, or the last epoch's end)."""
        if 0 <= trainer.max_steps <= trainer.global_step:
            return True
        epochs = trainer.max_epochs
        if epochs is None or epochs < 0:
            return False
        last_batch = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        return last_batch and trainer.current_epoch + 1 >= epochs

    def _save(self, trainer: Trainer) -> None:
        """Writes last.ckpt unless it already holds this rollout."""
        if self._saved_at == self.rollouts:
            return
        # every process: sharded strategies write their part
        trainer.save_checkpoint(self.path, weights_only=False)
        self._saved_at = self.rollouts
        self.last_model_path = self.path

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"rollouts": self.rollouts}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rollouts = state_dict["rollouts"]
