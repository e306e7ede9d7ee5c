"""The reward of the task: a function (prompt, completion, row) -> float.

``row`` is the data row the prompt came from, here with ``answer``; any other column of the
file reaches it too.
"""

import re


def number_reward(prompt: str, completion: str, row: dict) -> float:
    """1.0 when the reply's last number is the answer, 0.2 when the answer is in it elsewhere."""
    numbers = re.findall(r"-?\d+", completion)
    if numbers and numbers[-1] == row["answer"]:
        return 1.0
    return 0.2 if row["answer"] in numbers else 0.0
