"""ReleaseFreedMemory: gives the memory an iteration freed back to the system (glibc's malloc_trim)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor
from typing_extensions import override

from lightning_troll.models.loading import is_checkpointed

__all__ = ["ReleaseFreedMemory", "release_freed_memory", "resident_bytes"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _trim_function():
    """glibc's ``malloc_trim``, or None where the C library has none (macOS, musl, Windows)."""
    try:
        name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(name) if name else ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (AttributeError, OSError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _trim_function()


def resident_bytes() -> int | None:
    """This process's resident memory in bytes (``/proc/self/statm``), None where unreadable."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def release_freed_memory() -> bool:
    """Returns the free pages of the C heap to the system (``malloc_trim(0)``): False where the
    C library cannot. Live tensors are untouched; a later allocation faults its pages in again."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


class ReleaseFreedMemory(Callback):
    """Gives the host memory an iteration freed back to the system: after the rollout, before
    each backward pass, after the optimiser steps and after validation.

    PyTorch's CPU tensors come from the C library's allocator. glibc's serves large blocks as
    mappings of their own, returned to the system when freed, but each time such a block is
    freed it raises the size from which it maps to that block's size (at most 32 MiB). After
    the first iteration most of the KV cache and the activations come from the heap instead,
    whose free pages stay with the process, and the next iteration's peak is reached on top of
    them. ``malloc_trim(0)`` hands those free pages back. On SmolLM2 with gradient
    checkpointing this lowers the process's peak from 5.9 to 5.0 GiB (docs/benchmarks.md,
    "Where the memory goes"). Tensors on a GPU are not affected, and neither is PyTorch's CUDA
    caching allocator. Where the C library has no ``malloc_trim`` (not glibc) the callback does
    nothing.

    Logs ``memory/resident_gib``, the process's resident memory once the iteration's freed
    memory is released, and ``memory/released_gib``, what the release gave back over the
    iteration.

    Place it after :class:`~lightning_troll.callbacks.RolloutGeneration` among a trainer's
    callbacks, so that its release after the rollout follows the sampling (the
    ``lightning-troll`` command does).

    The release costs time: the pages it gives back fault in again when the next phase
    allocates (an iteration 1.08-1.09x as long on SmolLM2 on 2 CPU cores). So by default it
    runs only where the policy uses gradient checkpointing (``model.optimization.gradient_checkpointing``),
    a run that already trades time for memory.

    Args:
        enabled: True releases in every run, False never; None (the default) releases where
            the policy recomputes its activations (gradient checkpointing).
    """

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = enabled
        self._follows: bool = False
        """With ``enabled=None``: whether the policy recomputes its activations (set at setup)."""
        self._released = 0

    @property
    def active(self) -> bool:
        """Whether this callback releases anything in this process."""
        wanted = self._follows if self.enabled is None else self.enabled
        return wanted and _TRIM is not None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        policy = getattr(pl_module, "policy", None)
        self._follows = policy is not None and is_checkpointed(policy)

    def _release(self) -> None:
        before = resident_bytes()
        release_freed_memory()
        after = resident_bytes()
        if before is not None and after is not None:
            self._released += max(before - after, 0)

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.active:
            self._released = 0
            self._release()  # the rollout's KV cache and sampling buffers

    @override
    def on_before_backward(
        self, trainer: Trainer, pl_module: LightningModule, loss: Tensor
    ) -> None:
        if self.active:
            self._release()  # what the loss freed, before backward recomputes and allocates

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.active:
            return
        self._release()  # the optimiser steps' activations and gradients of the loss
        resident = resident_bytes()
        if resident is not None:
            pl_module.log("memory/resident_gib", resident / 2**30)
        pl_module.log("memory/released_gib", self._released / 2**30)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.active:
            self._release()
