"""A multi-turn game with feedback: answer a word problem; a wrong answer is told so and may be
tried again, up to the episode's turn limit (``model.episodes.max_turns``).

Scoring: the reward functions of the config (``last_number``) score the final answer, 1.0 when
it is right; each wrong answer that is sent back costs :data:`RETRY_COST` (the environment's own
reward for that turn). A problem solved at once scores 1.0, on the second try 0.75, on the third
0.5; one never solved scores -0.25 per wrong answer sent back.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from lightning_troll.environments import Environment, Step

INSTRUCTION = "Answer in one short sentence that ends with the number."
FEEDBACK = "That is not right. Check your steps and answer again, ending with the number."
RETRY_COST = 0.25


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
