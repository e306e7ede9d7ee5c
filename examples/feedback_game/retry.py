"""A multi-turn game with feedback: answer a word problem; a wrong answer is told so and may be
tried again, up to the episode's turn limit (``model.episodes.max_turns``).

Two scorings, both planned in studies/feedback-game-plan.md:

- :class:`Scored`, the game (``task.yaml``): the environment scores alone. A right answer ends the
  episode with 1.0, each wrong one costs :data:`RETRY_COST`, and a turn that the token budget
  cuts off (``"max_tokens"``) costs :data:`BUDGET_COST` more. Solved at once 1.0, on the second
  try 0.75, on the third 0.5; never solved in 3 turns -0.75; a wrong answer whose feedback finds
  no room in the budget (``"no_room"``) keeps its -0.25 each, -0.25 or -0.5; cut off inside a
  turn -1.0 or less, below every answered episode.
- :class:`Retry`, the first game (``first_game.yaml``), kept as its runs played it: the reward
  functions of the config (``last_number``) score the final answer, 1.0 when it is right, and each
  wrong answer costs :data:`RETRY_COST`. An episode cut off by the budget paid nothing for it, and
  the first run learned to write until the budget ran out rather than answer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from lightning_troll.tasks.environments import Environment, Step

INSTRUCTION = "Answer in one short sentence that ends with the number."
FEEDBACK = "That is not right. Check your steps and answer again, ending with the number."
RETRY_COST = 0.25
BUDGET_COST = 1.0


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (commas dropped), or None."""
    found = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    return found[-1] if found else None


class Retry(Environment):
    """One word problem; a wrong answer gets :data:`FEEDBACK` and another turn."""

    def reset(self, row: Mapping[str, Any]) -> list[dict[str, str]]:
        self.answer = str(row["answer"])
        return [{"role": "user", "content": f"{row['question']} {INSTRUCTION}"}]

    def step(self, turn: str) -> Step:
        if last_number(turn) == self.answer:
            return Step(done=True)  # the reward functions score the final answer
        return Step(FEEDBACK, reward=-RETRY_COST)


class Scored(Retry):
    """The game: :class:`Retry` that scores its own episodes, running out the budget included."""

    def step(self, turn: str) -> Step:
        if last_number(turn) == self.answer:
            return Step(reward=1.0, done=True)
        return Step(FEEDBACK, reward=-RETRY_COST)

    def on_end(self, end: str) -> float | None:
        """The budget's price, for a turn it cut off; an answer judged before the budget ran out
        (``"no_room"``) has paid its own."""
        return -BUDGET_COST if end == "max_tokens" else None
