"""Reward calls in worker processes, with a timeout per call (``model.reward_options.workers``,
``model.reward_options.timeout``).

:class:`RewardWorkers` keeps ``count`` processes; the calls of one scoring go to whichever is free,
one call at a time each, so a rollout's rewards are scored in parallel. It is a
:class:`WorkerPool` whose workers run :func:`~lightning_troll.tasks.rewards.calls.call_one`; a pool of
another kind of call (the tools of :mod:`lightning_troll.tasks.environments.tool_workers`) names its own
``runner``, a function at a module's top level, and its own options. A call past its timeout is
abandoned: its worker cannot be interrupted from outside (the function may be in C code, or
asleep), so it is killed and a fresh one started in its place. A worker that dies on its own (a
segfault, the OOM killer, ``os._exit``) fails the call it held and is replaced too; the trainer
never dies with it.

Workers are started with ``forkserver``: each is forked from a small server process that imported
this module (and torch with it) and the trainer's main module once
(:mod:`~lightning_troll.tasks.rewards.worker_server`), so a restart costs milliseconds, and none inherits the
trainer's threads or CUDA state as a plain ``fork`` would. Each worker watches a pipe whose only
writing end the trainer holds and exits when it closes, so no worker outlives its trainer, even
one killed with SIGKILL (the server and Python's resource tracker then exit as well). What a
worker runs must therefore pickle: a function by reference (a built-in, anything named by import
path, a function defined at a module's top level, ``__main__`` included when the script guards
its entry point) or a picklable object. Lambdas and closures run in-process only
(``reward_options.workers: 0``).
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import numbers
import os
import pickle
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from multiprocessing import spawn
from multiprocessing.connection import Connection, wait
from typing import Any

from lightning_troll.tasks.rewards.calls import UNLOADABLE, Outcome, call_one, describe

__all__ = [
    "RewardWorkers",
    "WorkerPool",
    "WorkersFailed",
    "check_picklable",
    "check_timeout",
    "leave_stop_signals_to_the_trainer",
]

SERVER_START = "lightning_troll.tasks.rewards.worker_server"
"""The module the workers' server imports first as it starts, which makes it ignore SIGTERM (see
its docstring); named, not imported, as no other process may import it."""
_START_LIMIT = 300.0
"""Seconds a new worker may take to start before scoring gives up (a broken environment)."""
_START_DEATHS = 3
"""Workers that may die while starting, one after another with none started between, before the
pool gives up (one killed by the OOM killer is replaced; a worker that cannot start is named)."""


def check_timeout(option: str, timeout: float | None) -> None:
    """``model.<option>``, the seconds a pool's call may take: null (no limit) or a finite number
    > 0 (not a bool); raises ``ValueError`` naming the option and the value otherwise."""
    if timeout is not None and not (
        isinstance(timeout, numbers.Real)
        and not isinstance(timeout, bool)
        and math.isfinite(timeout)
        and timeout > 0
    ):
        raise ValueError(
            f"model.{option} must be null (no limit) or a finite number > 0 of seconds; "
            f"got {timeout!r}"
        )


class WorkersFailed(RuntimeError):
    """The pool cannot go on: its workers do not start. (A call that fails is an outcome.)"""


def check_picklable(
    name: str, fn: Callable[..., Any], noun: str = "reward", option: str = "reward_options.workers"
) -> bytes:
    """``fn`` pickled, or a ValueError that says why it cannot run in a worker process (a
    ``noun`` run in workers when ``model.<option>`` > 0)."""
    try:
        return pickle.dumps(fn)
    except Exception as exc:  # PicklingError, AttributeError, TypeError: all say "cannot"
        verb = "score" if noun == "reward" else "run"
        raise ValueError(
            f"{noun} {name!r} cannot run in a worker process (model.{option} > 0): it does "
            f"not pickle ({type(exc).__name__}: {exc}); define it at a module's top level and "
            f"name it by import path, or {verb} in-process with model.{option} 0"
        ) from None


def leave_stop_signals_to_the_trainer() -> None:
    """Makes this child process (a reward or tool worker, their server, an engine in its own
    process) ignore SIGINT and SIGTERM. A Ctrl-C in a terminal, or a scheduler's SIGTERM to the job, reaches every
    process of the group, and the trainer answers the first by finishing its rollout and saving
    (``RolloutCheckpoint``): a child that died of it would fail that rollout's rewards, tools or
    samples. The trainer ends its children itself, and a child whose trainer is gone exits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _exit_with(alive: Connection) -> None:  # pragma: no cover - runs in the worker process
    """Blocks until the trainer's end of ``alive`` closes (the trainer exited or was killed,
    however), then ends this worker at once, whatever its reward call is doing."""
    with contextlib.suppress(EOFError, OSError):
        alive.recv()
    os._exit(0)


def _serve(conn: Connection, alive: Connection) -> None:  # pragma: no cover - worker process
    """A worker's loop: load functions as they come, call each through the runner sent with it,
    send back ``(value, problem, kind)``; a thread ends the worker when the trainer is gone
    (:func:`_exit_with`)."""
    leave_stop_signals_to_the_trainer()
    threading.Thread(target=_exit_with, args=(alive,), daemon=True).start()
    functions: dict[str, Any] = {}
    conn.send(("ready",))
    while True:
        try:
            key, payload, runner, arguments = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if payload is not None:
                functions[key] = pickle.loads(payload)
            outcome = runner(functions[key], *arguments)
        except Exception as exc:  # the function did not unpickle here
            outcome = (None, f"cannot be loaded in a worker: {describe(exc)}", UNLOADABLE)
        conn.send(tuple(outcome)[:3])  # (value, problem, kind) of the runner's record


class _Worker:
    def __init__(self, context: Any) -> None:
        parent, child = context.Pipe()
        # only this process holds the writing end: when it dies, however, the worker reads EOF
        alive_r, self.alive = context.Pipe(duplex=False)
        self.process = context.Process(target=_serve, args=(child, alive_r), daemon=True)
        self.process.start()
        os.environ.pop("LIGHTNING_TROLL_WORKER_MAIN", None)  # the server has read it (_context)
        child.close()
        alive_r.close()
        self.conn: Connection = parent
        self.ready = False
        self.born = time.monotonic()
        self.task: int | None = None
        self.deadline = float("inf")
        self.known: set[str] = set()

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()
        self.alive.close()


def _poll(conn: Connection) -> bool:
    try:
        return conn.poll()
    except (EOFError, OSError):
        return False


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.stop()
    workers.clear()


Call = tuple[str, bytes, Callable[..., Any], str, str, Mapping[str, Any], dict]
"""A reward call: (key, pickled function, function, prompt, completion, row, keyword arguments).
A :class:`WorkerPool` call in general is (key, pickled function, function, *arguments)."""


class WorkerPool:
    """``count`` worker processes that run calls ``runner(function, *arguments)``, each abandoned
    after ``timeout`` seconds; a subclass names its ``runner`` and the options it answers to.

    Started on the first :meth:`run`; stopped by :meth:`close`, when the pool is collected, or at
    exit. A pool pickles (and deep-copies) as its settings: the copy starts its own processes.
    """

    runner: Callable[..., Any] = staticmethod(call_one)
    """What a worker runs: ``runner(function, *arguments)`` returns a record whose first three
    fields are ``(value, problem, kind)`` (an :class:`Outcome`); a function at a module's top
    level, as it travels to the workers by reference."""
    noun = "reward"
    """What a call is, in messages (``"a reward worker process did not start"``)."""
    workers_option = "reward_options.workers"
    """The option that sets ``count``, in messages."""
    timeout_option = "reward_options.timeout"
    """The option that sets ``timeout``, in messages."""
    outcome: Callable[..., Any] = Outcome
    """The record of what a call gave: ``outcome(value, problem, kind)``."""
    failed_value: Any = 0.0
    """The ``value`` of a call that failed (raised, timed out, lost its worker)."""

    def __init__(self, count: int, timeout: float | None = None) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(
                f"model.{self.workers_option} must be an integer >= 0 (0: no worker processes); "
                f"got {count!r}"
            )
        check_timeout(self.timeout_option, timeout)
        self.count = count
        self.timeout = timeout
        self.restarts = 0
        """Workers replaced so far (timeouts and deaths)."""
        self._start_deaths = 0
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    def __getstate__(self) -> dict[str, Any]:
        return {"count": self.count, "timeout": self.timeout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["count"], state["timeout"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(count={self.count}, timeout={self.timeout})"

    def close(self) -> None:
        """Stops every worker (a later :meth:`run` starts new ones)."""
        _stop_all(self._workers)

    def _arguments(self, call: tuple) -> tuple:
        """What follows the function in ``runner(function, *arguments)`` for ``call``."""
        return tuple(call[3:])

    def _failed(self, problem: str, kind: str, value: Any = None) -> Any:
        """The record of a call that failed: ``problem`` and ``kind``, its value ``value`` or the
        pool's ``failed_value``."""
        return self.outcome(self.failed_value if value is None else value, problem, kind)

    def _context(self) -> Any:
        context = multiprocessing.get_context("forkserver")
        main = spawn.get_preparation_data("worker").get("init_main_from_path")
        if main:  # read by the server as it starts (worker_server): it imports it once
            os.environ["LIGHTNING_TROLL_WORKER_MAIN"] = main
        preload = [SERVER_START, __name__, self.runner.__module__]
        context.set_forkserver_preload(list(dict.fromkeys(preload)))
        return context

    def _replace(self, worker: _Worker) -> None:
        worker.stop()
        self._workers[self._workers.index(worker)] = _Worker(self._context())
        self.restarts += 1

    def run(self, calls: Sequence[Call], stop_keys: frozenset[str] = frozenset()) -> list[Outcome]:
        """The outcome of every call, in order; calls run in parallel across the workers. The
        first failed call of a function whose key is in ``stop_keys`` (one that stops the run)
        ends the scoring: calls not yet answered are abandoned, their workers replaced, and
        their outcomes are ``"skipped"``."""
        while len(self._workers) < self.count:
            self._workers.append(_Worker(self._context()))
        pending = deque(range(len(calls)))
        outcomes: list[Outcome | None] = [None] * len(calls)

        def stopping() -> bool:
            return any(
                o is not None and o.problem is not None and calls[i][0] in stop_keys
                for i, o in enumerate(outcomes)
            )

        while pending or any(w.task is not None for w in self._workers):
            if stop_keys and stopping():
                pending.clear()
                for worker in list(self._workers):
                    if worker.task is not None:
                        self._replace(worker)
                return [o if o is not None else self._failed("was not scored", "skipped")
                        for o in outcomes]  # fmt: skip
            for worker in list(self._workers):
                if worker.ready and worker.task is None and pending:
                    index = pending.popleft()
                    if not self._send(worker, index, calls):  # it died while idle
                        pending.appendleft(index)
                        self._replace(worker)
            self._wait(outcomes)
        return [o if o is not None else self._failed("was not scored", "error") for o in outcomes]

    def _send(self, worker: _Worker, index: int, calls: Sequence[Call]) -> bool:
        """Hands call ``index`` to ``worker``; False when its pipe is broken (it died)."""
        key, payload = calls[index][:2]
        first = key not in worker.known
        try:
            worker.conn.send(
                (key, payload if first else None, self.runner, self._arguments(calls[index]))
            )
        except OSError:
            return False
        worker.known.add(key)
        worker.task = index
        worker.deadline = time.monotonic() + (self.timeout or float("inf"))
        return True

    def _wait(self, outcomes: list[Outcome | None]) -> None:
        """Waits for a worker to answer, start, die or time out, and handles what happened."""
        now = time.monotonic()
        deadlines = [w.deadline for w in self._workers if w.task is not None]
        deadlines += [w.born + _START_LIMIT for w in self._workers if not w.ready]
        left = min(60.0, max(0.0, min(deadlines, default=now + 1.0) - now))
        handles = {w.conn: w for w in self._workers} | {
            w.process.sentinel: w for w in self._workers
        }
        for handle in wait(list(handles), timeout=left):
            worker = handles[handle]
            if worker not in self._workers:  # already replaced in this round
                continue
            if handle is worker.conn and self._receive(worker, outcomes):
                continue
            if worker.process.is_alive() and handle is worker.conn:
                continue  # pragma: no cover - a closed pipe with a live process
            self._died(worker, outcomes)
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.task is not None and now >= worker.deadline:
                outcomes[worker.task] = self._failed(
                    f"timed out after {self.timeout:g} s", "timeout"
                )
                self._replace(worker)
            elif not worker.ready and now >= worker.born + _START_LIMIT:
                raise WorkersFailed(
                    f"a {self.noun} worker process did not start in {_START_LIMIT:g} s (exit code "
                    f"{worker.process.exitcode})"
                )

    def _receive(self, worker: _Worker, outcomes: list[Outcome | None]) -> bool:
        """Reads one message; False when the pipe is closed (the worker died)."""
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            return False
        if message == ("ready",):
            worker.ready = True
            self._start_deaths = 0
        elif worker.task is not None:
            value, problem, kind = message
            if problem is None:
                outcomes[worker.task] = self.outcome(value, None, None)
            else:
                outcomes[worker.task] = self._failed(problem, kind or "error", value)
            worker.task, worker.deadline = None, float("inf")
        return True

    def _died(self, worker: _Worker, outcomes: list[Outcome | None]) -> None:
        while worker.task is not None and _poll(worker.conn):  # an answer sent before it died
            if not self._receive(worker, outcomes):
                break
        worker.process.join(timeout=5)
        if not worker.ready:
            self._start_deaths += 1
            if self._start_deaths >= _START_DEATHS:
                raise WorkersFailed(
                    f"{_START_DEATHS} {self.noun} worker processes in a row exited while starting "
                    f"(the last with exit code {worker.process.exitcode}); run with "
                    f"model.{self.workers_option} 0 to see why"
                )
        if worker.task is not None:
            code = worker.process.exitcode
            outcomes[worker.task] = self._failed(
                f"killed its worker process (exit code {code}); the worker was restarted", "error"
            )
        self._replace(worker)


class RewardWorkers(WorkerPool):
    """``count`` worker processes that run reward calls, each abandoned after ``timeout`` seconds
    (``model.reward_options.workers``, ``.timeout``); see :class:`WorkerPool`."""

    def _arguments(self, call: tuple) -> tuple:
        """``(prompt, completion, row, keyword arguments)`` of a reward :data:`Call`."""
        _, _, _, prompt, completion, row, extra = call
        return (prompt, completion, dict(row), extra)
