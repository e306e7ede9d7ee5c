"""Tools and environments that tests name by import path (``tests.tool_helpers:...``); the tool
workers import them from here."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Mapping
from typing import Any, Literal

from lightning_troll.tasks.environments import Environment, Step


def multiply(a: float, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a * b


def lookup(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius", days: int | None = None):
    """Tell the weather in a city.

    Args:
        city: The city's name.
        unit: The temperature unit.
        days: How many days ahead, if any.
    """
    return {"city": city, "unit": unit, "days": days, "temperature": 21}


def divide(a: float, b: float) -> float:
    """Divide one number by another (raises on a zero divisor).

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def sleep(seconds: float) -> str:
    """Sleep for a while, then say so (hangs a worker past its timeout).

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "awake"


async def fetch_square(n: int) -> dict:
    """Square a number after waiting for it, as a tool that awaits a service would.

    Args:
        n: The number.
    """
    await asyncio.sleep(0.01)
    if n < 0:
        raise ValueError("no negative numbers")
    return {"n": n, "square": n * n}


def types_of(n: int, at: tuple[int, str], tags: list[int] | None = None, x: float = 0.0) -> list:
    """The type and value of each number as the tool receives them.

    Args:
        n: A whole number.
        at: A row's number and a column's letter.
        tags: Whole numbers.
        x: A number.
    """
    return [f"{type(v).__name__} {v}" for v in [n, at[0], *(tags or []), x]]


def make_set(n: int) -> set:
    """A set of the numbers below n, which is neither text nor JSON.

    Args:
        n: How many numbers.
    """
    return set(range(n))


def nested(depth: int) -> list:
    """A list nested ``depth`` deep, past what the JSON encoder can write (100,000 is).

    Args:
        depth: How deep.
    """
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def exit_worker(code: int) -> str:
    """End the process at once (a segfault, the OOM killer).

    Args:
        code: The exit status.
    """
    os._exit(code)


async def cancelled(n: int) -> int:
    """Cancel its own task, as an ``async def`` tool whose awaited call was cancelled does.

    Args:
        n: Ignored.
    """
    raise asyncio.CancelledError()


def half_surrogate(n: int) -> str:
    """Text with half a surrogate pair, as ``errors="surrogateescape"`` decoding gives.

    Args:
        n: Ignored.
    """
    return b"caf\xe9".decode("utf-8", errors="surrogateescape")


def echo(text: str) -> str:
    """Say the text back.

    Args:
        text: What to say.
    """
    return text


class Unprintable(Exception):
    """An exception whose own ``__str__`` raises."""

    def __str__(self) -> str:
        raise RuntimeError("no text")


def unprintable(n: int) -> int:
    """Raise an exception that cannot be written as text.

    Args:
        n: Ignored.
    """
    raise Unprintable()


def no_docstring(a: int) -> int:
    return a


def no_hints(a, b):
    """Add two things.

    Args:
        a: One.
        b: The other.
    """
    return a + b


class Countdown(Environment):
    """An episode of ``row["turns"]`` turns: each reply says how many are left; the last turn
    gets reward 1."""

    def reset(self, row: Mapping[str, Any]):
        self.left = int(row["turns"])
        return [{"role": "user", "content": str(row["prompt"])}]

    def step(self, turn: str) -> Step:
        self.left -= 1
        if self.left == 0:
            return Step(reward=1.0, done=True)
        return Step(f"{self.left} left", reward=0.0)


class NotAnEnvironment:
    """Has neither reset nor step."""


class PlainTurns(Environment):
    """A plain-text episode (for a model without a chat template, such as TinyMath) of
    ``turns`` model turns: it starts from the row's prompt, each reply is ``"+1="``, and it gives
    no reward of its own."""

    turns = 1

    def reset(self, row: Mapping[str, Any]) -> str:
        self.left = self.turns
        return str(row["prompt"])

    def step(self, turn: str) -> Step:
        self.left -= 1
        return Step(done=True) if self.left <= 0 else Step("+1=")


class ThreePlainTurns(PlainTurns):
    """:class:`PlainTurns` of three turns."""

    turns = 3


class ScoredPlainTurns(PlainTurns):
    """:class:`PlainTurns` of two turns that rewards each turn with its length in characters."""

    turns = 2

    def step(self, turn: str) -> Step:
        return dataclasses.replace(super().step(turn), reward=float(len(turn)))


def _refuse_to_load():
    raise ImportError("No module named 'gone'")


class LoadsNowhere:
    """Pickles, and raises when unpickled: a function a worker cannot load."""

    def __reduce__(self):
        return (_refuse_to_load, ())


class Counter:
    """An environment in TRL's form: ``reset(**row)``, its tools as public methods, and
    ``get_reward``. It counts the instances made, and what ``reset`` was given."""

    made = 0

    def __init__(self) -> None:
        type(self).made += 1
        self.count = 0
        self.row: dict[str, Any] = {}

    def reset(self, **row: Any) -> str | None:
        self.row, self.count = row, int(row.get("start", 0))
        return f" (start at {self.count})" if "start" in row else None

    def add(self, n: int) -> int:
        """Add to the counter.

        Args:
            n: How much to add.
        """
        self.count += n
        return self.count

    async def double(self) -> int:
        """Double the counter, after a wait."""
        await asyncio.sleep(0.001)
        self.count *= 2
        return self.count

    def get_reward(self) -> float:
        return float(self.count == 10)

    def _hidden(self) -> None:  # private: not a tool
        raise AssertionError("never called")

    @property
    def total(self) -> int:  # a property: not a tool, and never read to find the tools
        raise AssertionError("never read")


class AsyncCounter(Counter):
    """``Counter`` with ``reset`` and ``get_reward`` as ``async def``."""

    async def reset(self, **row: Any) -> str | None:
        await asyncio.sleep(0.001)
        return Counter.reset(self, **row)

    async def get_reward(self) -> float:
        await asyncio.sleep(0.001)
        return float(self.count)


class HalfScored:
    """An environment in TRL's form whose episodes all score 0.5, however they end."""

    def reset(self, **row: Any) -> None:
        return None

    def note(self, text: str) -> str:
        """Write a note down.

        Args:
            text: The note.
        """
        return "noted"

    def get_reward(self) -> float:
        return 0.5


class Undocumented:
    """An environment in TRL's form with a tool method the schema cannot read."""

    def reset(self, **row: Any) -> None:
        return None

    def poke(self, n):
        return n


class NoStep(Environment):
    """An environment that forgot its step: the base class's raises at the first turn."""

    def reset(self, row):
        return row["prompt"]
