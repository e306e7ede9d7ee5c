"""Peak memory of the running process, for the benchmarks and checks in this folder.

- :func:`peak_mib` and :func:`reset_peak`: the peak resident set size (Linux's ``VmHWM``) and
  lowering it to the current size;
- :class:`PeakRss`: the highest resident set size while a block runs, above its start;
- :class:`PeakMemory`: the peak of a stretch of work, CUDA's allocator on a GPU, else the
  resident set size;
- :func:`peak_memory_gib`: the process's peak over its whole life (CUDA's, else ``ru_maxrss``).
"""

from __future__ import annotations

import resource
import threading


def status_mib(field: str) -> float:
    """A ``/proc/self/status`` field (Linux), MiB; NaN where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return float("nan")


def peak_mib() -> float:
    """The process's peak resident set size so far, in MiB.

    Read from ``VmHWM`` in ``/proc/self/status``, which :func:`reset_peak` lowers; where that
    file is missing, from ``ru_maxrss`` (KiB on Linux). ``ru_maxrss`` alone would not do in a
    process started by a larger one: it keeps the parent's peak across ``exec``.
    """
    high = status_mib("VmHWM")
    if high == high:  # not NaN
        return high
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak() -> bool:
    """Sets the peak resident set size to the current one (Linux >= 4.0); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


class PeakRss:
    """Context manager: the highest resident set size while the block runs, above its level at
    the start, in MiB (``.mib``). The kernel's high-water mark ``VmHWM`` is reset at the start
    (``/proc/self/clear_refs``) and read at the end; a thread also samples ``VmRSS`` every
    2 ms, in case the reset is refused."""

    def __enter__(self) -> PeakRss:
        self.base = self.peak = status_mib("VmRSS")
        self._reset = reset_peak()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, status_mib("VmRSS"))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        high = status_mib("VmHWM") if self._reset else float("nan")
        self.mib = max(self.peak, status_mib("VmRSS"), high if high == high else 0) - self.base


class PeakMemory:
    """The peak memory of a stretch of work: ``torch.cuda.max_memory_allocated`` on a GPU; on a
    CPU the peak resident set size of the process (``VmHWM``, which includes the interpreter)."""

    def __init__(self) -> None:
        import torch

        self.cuda = torch.cuda.is_available()
        self.source = "torch.cuda.max_memory_allocated" if self.cuda else "peak resident set size"

    def reset(self) -> float:
        """Starts a stretch; returns the memory in use now (MiB)."""
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated() / 2**20
        reset_peak()
        return peak_mib()

    def peak(self) -> float:
        """The peak since :meth:`reset` (MiB)."""
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() / 2**20
        return peak_mib()


def peak_memory_gib() -> float:
    """The process's peak memory: CUDA's max allocated if CUDA was used, else ``ru_maxrss``."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
