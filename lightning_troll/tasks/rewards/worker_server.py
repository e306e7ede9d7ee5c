"""Imported by the workers' server process as it starts, and by no other: it ignores SIGTERM (and
SIGINT, which it ignores by itself), as the workers and the trainer's other children do.

:class:`~lightning_troll.tasks.rewards.workers.WorkerPool` names this module first in the server's
preload (``forkserver`` imports the list before it serves). Nothing else imports it, as it
changes the signals of the process that does. A scheduler's SIGTERM reaches every process of the
job; had it ended the server, the pipes that carry its workers' exit statuses would close, and
every worker, alive, would read as dead (exit code 255) and fail the call it holds, in the
rollout the trainer finishes before it saves. The server still exits with its trainer (it
watches a pipe the trainer holds), and each worker it forks sets its own signals with the same
function.
"""

from lightning_troll.tasks.rewards.workers import leave_stop_signals_to_the_trainer

leave_stop_signals_to_the_trainer()


def _import_main_once() -> None:
    """Runs the trainer's main module here, once, as ``__mp_main__`` (its guarded entry point
    does not run), so that every worker forked from here has it and none imports it again as it
    starts: seconds each for a main module that imports Lightning, as the ``lightning-troll``
    command's does. ``forkserver`` means to do this for a ``"__main__"`` in its preload, but never
    passes the server the main module's path; the pool passes it in :data:`MAIN_VARIABLE`."""
    import contextlib
    import os
    from multiprocessing import spawn

    path = os.environ.pop(MAIN_VARIABLE, "")
    if path:  # where it fails, each worker imports it as it starts, and reports its error
        with contextlib.suppress(BaseException):
            spawn.import_main_path(path)


MAIN_VARIABLE = "LIGHTNING_TROLL_WORKER_MAIN"
"""The environment variable that hands the server the trainer's main module's path."""

_import_main_once()
