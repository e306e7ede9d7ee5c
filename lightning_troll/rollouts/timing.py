"""Wall-clock readings that account for asynchronous CUDA work."""

from __future__ import annotations

import time

import torch

__all__ = ["clock"]


def clock(device: torch.device | str | None = None) -> float:
    """``time.perf_counter()`` after the work queued on ``device`` has finished (CUDA kernels
    run asynchronously: without the synchronisation a reading would miss them)."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.synchronize(device)
    return time.perf_counter()
