"""How a study stops: a signal ends it with the signal's exit status (128 + the signal) and a
line saying that the same command goes on from there.

While a run trains, the trainer's checkpoint callback holds Ctrl-C and SIGTERM: the rollout in
progress finishes, the run saves and stops, and the grid raises :class:`Interrupted`. While no
run trains (between two runs, or while one sets up before its first rollout) :func:`resumable`
holds them: the study ends at once, as nothing of a run is there to save.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["Interrupted", "resumable"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(RuntimeError):
    """A signal stopped the study: a run stopped before its last rollout (its ``last.ckpt``
    resumes it), or the signal came during a run's last rollout, the run finished, and the grid
    stops before the next run (``finished``)."""

    def __init__(self, name: str, exit_code: int, finished: bool = False) -> None:
        what = ("finished; the grid stopped before the next run" if finished
                else "stopped before its last rollout")  # fmt: skip
        super().__init__(f"{name} {what}")
        self.name, self.exit_code, self.finished = name, exit_code, finished


def _stop_outside_a_run(signum: int, frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    print(f"{name} received while no run was training: the study stops here, nothing to save; "
          "the same command goes on from here", flush=True)  # fmt: skip
    sys.exit(128 + signum)


@contextmanager
def resumable() -> Iterator[None]:
    """Around a study's runs: a run stopped by a signal ends the process with its exit status
    (128 + the signal), saying that the same command resumes it; a signal while no run trains
    ends it the same way at once. The signals' handlers are as they were afterwards."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, _stop_outside_a_run) for s in STOP_SIGNALS}
    try:
        yield
    except Interrupted as stopped:
        again = "goes on with the next run" if stopped.finished else "resumes it"
        print(f"{stopped}; the same command {again}", flush=True)
        sys.exit(stopped.exit_code)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
