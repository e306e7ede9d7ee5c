"""Peak resident set size of the running process, for the benchmarks in this folder (Linux)."""

from __future__ import annotations

import resource


def peak_mib() -> float:
    """The process's peak resident set size so far, in MiB.

    Read from ``VmHWM`` in ``/proc/self/status``, which :func:`reset_peak` lowers; where that
    file is missing, from ``ru_maxrss`` (KiB on Linux). ``ru_maxrss`` alone would not do in a
    process started by a larger one: it keeps the parent's peak across ``exec``.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak() -> bool:
    """Sets the peak resident set size to the current one (Linux >= 4.0); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True
