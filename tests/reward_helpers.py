"""Reward functions that tests name by import path (``tests.reward_helpers:...``)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any


def length_reward(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """The completion's length in characters."""
    return float(len(completion))


def digit_sum(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """The sum of the completion's digits: it varies within a group wherever the sampled answers
    differ, also where their lengths do not (a trained model's answers are all of one length)."""
    return float(sum(int(c) for c in completion if c.isdigit()))


def gold_answer(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """The row's gold answer as a number: a score that differs from row to row whatever the
    completion (an untrained model's greedy answers are often all alike)."""
    return float(row["answer"])


async def awaited_length(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """``length_reward`` as an ``async def`` function, as one that awaits a judge would be."""
    await asyncio.sleep(0.001)
    return float(len(completion))


class Rewards:
    """Holds a reward as a static method, for dotted paths after the colon."""

    @staticmethod
    def contains_answer(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
        """1.0 if the gold answer appears anywhere in the completion."""
        return float(str(row["answer"]) in completion)


NOT_CALLABLE = 3


def raises(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """Always fails, like a buggy user reward."""
    raise KeyError("gold")


def none_for_even_lengths(prompt: str, completion: str, row: Mapping[str, Any]) -> float | None:
    """None (an invalid reward) for completions of even length, else 1.0."""
    return None if len(completion) % 2 == 0 else 1.0


def used_the_budget(
    prompt: str, completion: str, row: Mapping[str, Any], *, completion_tokens: int,
    max_new_tokens: int,
) -> float:  # fmt: skip
    """1.0 if the completion took the whole token budget (often all or none of a group)."""
    return float(completion_tokens >= max_new_tokens)


def token_count(
    prompt: str, completion: str, row: Mapping[str, Any], *, completion_tokens: int
) -> float:
    """The ``completion_tokens`` the scorer passed (an episode's: its whole response)."""
    return float(completion_tokens)


def constant(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """0.5 whatever the completion: every group is without spread."""
    return 0.5


# -- rewards for the worker processes (named by import path, so a worker can import them) --------


def signals_itself(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """Sends its own process a Ctrl-C (SIGINT) and a SIGTERM, as a terminal or a scheduler sends
    them to every process of a job, then returns 1.0 if it is still alive."""
    import os
    import signal
    import time

    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)  # a signal's default action has come by now
    return 1.0


def slow_half(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """0.5 after 50 ms: a slow reward (a verifier, a sandbox) for parallel scoring."""
    import time

    time.sleep(0.05)
    return 0.5


def hangs_on_a_third(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """Sleeps for ever on about a third of the completions (by a hash of prompt and completion),
    1.0 on the rest."""
    import time
    import zlib

    if zlib.crc32((prompt + completion).encode()) % 3 == 0:
        while True:
            time.sleep(1.0)
    return 1.0


def hangs_on_hang(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """Sleeps for ever when the completion is ``"hang"``, else 1.0."""
    import time

    while completion == "hang":
        time.sleep(1.0)
    return 1.0


def dies_on_die(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """Kills its own process when the completion is ``"die"`` (``"kill"``: SIGKILL), else 1.0."""
    import os
    import signal

    if completion == "die":
        os._exit(3)
    if completion == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    return 1.0


def bad_values(prompt: str, completion: str, row: Mapping[str, Any]) -> Any:
    """The completion names what to return: ``nan``, ``none``, ``text``, ``raise``; else 1.0."""
    if completion == "raise":
        raise RuntimeError("broken verifier")
    return {"nan": float("nan"), "none": None, "text": "1.0"}.get(completion, 1.0)


def process_id(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """The id of the process that scored the call, after 100 ms (so that calls spread)."""
    import os
    import time

    time.sleep(0.1)
    return float(os.getpid())


def hangs_and_counts(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """Writes a file named after the completion into the folder ``row["calls"]`` (the calls
    that started), then sleeps for ever when the completion is ``"hang"``, else 1.0."""
    import time
    from pathlib import Path

    Path(row["calls"], completion).touch()
    while completion == "hang":
        time.sleep(1.0)
    return 1.0
