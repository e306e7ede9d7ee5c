"""Reward functions that tests name by import path (``tests.reward_helpers:...``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def length_reward(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """The completion's length in characters."""
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


def constant(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """0.5 whatever the completion: every group is without spread."""
    return 0.5
