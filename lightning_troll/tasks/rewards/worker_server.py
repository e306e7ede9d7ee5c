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
