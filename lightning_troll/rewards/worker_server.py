"""Imported by the workers' server process as it starts, and by no other: it ignores SIGTERM.

:class:`~lightning_troll.rewards.workers.WorkerPool` names this module first in the server's
preload (``forkserver`` imports the list before it serves; it ignores SIGINT by itself). Nothing
else imports it, as it changes the signals of the process that does. A scheduler's SIGTERM
reaches every process of the job; had it ended the server, the pipes that carry its workers'
exit statuses would close, and every worker, alive, would read as dead (exit code 255) and fail
the call it holds, in the rollout the trainer finishes before it saves. The server still exits
with its trainer (it watches a pipe the trainer holds), and each worker sets its own signals
(:func:`~lightning_troll.rewards.workers.leave_stop_signals_to_the_trainer`).
"""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
