"""Seeded fuzzing of the data and reward paths: malformed input works or gets our clear error.

Never a bare TypeError/IndexError from deep inside, and never a NaN that reaches the loss.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from lightning_troll.tasks.data.datamodule import PromptDataModule
from lightning_troll.tasks.data.prompts import collate_prompts
from lightning_troll.tasks.rewards.options import RewardOptions
from lightning_troll.tasks.rewards.registry import RewardError, RewardScorer
from tests.test_training import make_module

PROMPTS = [
    "12+3=",
    "",
    " ",
    "9" * 500,  # longer than max_prompt_tokens
    "\ud800",  # a lone surrogate, as JSON's \\ud800 escape reads back
    "é中\x00\x7f",
    7,
    None,
    3.5,
    ["1+1="],
    {"text": "1+1="},
    True,
]
ANSWERS = ["15", 15, None, float("nan"), "", ["15"], "∞"]


def random_row(rng: random.Random) -> dict:
    prompt = rng.choice(PROMPTS) if rng.random() < 0.2 else PROMPTS[0]
    row = {"prompt": prompt, "answer": rng.choice(ANSWERS)}
    if rng.random() < 0.1:
        del row[rng.choice(["prompt", "answer"])]
    if rng.random() < 0.1:
        row["extra"] = rng.choice(PROMPTS)
    return row


def write_rows(path: Path, rows: list[dict]) -> Path:
    # ensure_ascii keeps lone surrogates writable (as \\ud800); NaN is written as NaN
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize("seed", range(4))
def test_malformed_prompt_rows_work_or_name_the_option(seed, tmp_path, tiny_model_dir):
    rng = random.Random(seed)
    vocab = len(PromptDataModule(tokenizer=str(tiny_model_dir)).tokenizer)
    outcomes = {"ok": 0, "refused": 0}
    for trial in range(15):
        rows = [random_row(rng) for _ in range(rng.randint(1, 6))]
        source = write_rows(tmp_path / f"rows{trial}.jsonl", rows)
        data = PromptDataModule(
            source=str(source), tokenizer=str(tiny_model_dir), batch_size=1, num_val=0,
            max_prompt_tokens=rng.choice([8, 64]), template=rng.choice(["{prompt}", "Q{prompt}"]),
        )  # fmt: skip
        try:
            data.setup("fit")
        except ValueError as error:
            assert str(error).startswith(("data.", str(source))), error
            outcomes["refused"] += 1
            continue
        batches = list(data.train_dataloader())
        assert len(batches) == len(rows)
        for batch in batches:
            ids = batch.prompt_ids[0]
            assert isinstance(batch.prompts[0], str) and 0 < len(ids) <= data.max_prompt_tokens
            assert all(0 <= i < vocab for i in ids)
            assert "answer" in batch.rows[0]
        outcomes["ok"] += 1
    assert outcomes["ok"] and outcomes["refused"], outcomes  # both kinds were exercised


class FuzzedReward:
    """Returns, or raises, the next of a seeded sequence of malformed and valid rewards."""

    __name__ = "fuzzed"

    VALID = [0.0, 1.0, -2.5, True, 3, torch.tensor(0.5), 1e30]
    INVALID = [
        None,
        math.nan,
        math.inf,
        -math.inf,
        "1.0",
        [1.0],
        [1.0, 2.0],
        {},
        torch.tensor([1.0, 2.0]),
        torch.tensor(math.nan),
        10**400,  # an int no float holds
        1e300,  # finite in float64, inf in float32
        ValueError("bad answer"),
        ZeroDivisionError("oops"),
        IndexError("deep"),
    ]

    def __init__(self, seed: int, invalid_rate: float, valid: list | None = None) -> None:
        self.rng = random.Random(seed)
        self.invalid_rate = invalid_rate
        self.valid = self.VALID if valid is None else valid

    def __call__(self, prompt, completion, row):
        pool = self.INVALID if self.rng.random() < self.invalid_rate else self.valid
        value = self.rng.choice(pool)
        if isinstance(value, Exception):
            raise value
        return value


@pytest.mark.parametrize("seed", range(6))
def test_malformed_rewards_raise_a_reward_error_or_are_dropped(seed):
    size = 16
    prompts, completions, rows = ["1+1="] * size, ["2"] * size, [{"answer": "2"}] * size
    strict = RewardScorer({FuzzedReward(seed, 0.3): 1.0}, on_error="raise")
    try:
        out = strict(prompts, completions, rows)
    except RewardError as error:
        assert "reward function 'fuzzed' on sample" in str(error)
    else:
        assert torch.isfinite(out.total).all() and out.valid.all()
    lenient = RewardScorer({FuzzedReward(seed, 0.3): 1.0}, on_error="drop")
    with pytest.warns(UserWarning, match=r"dropped \d+ of 16 samples"):
        out = lenient(prompts, completions, rows)
    assert torch.isfinite(out.total).all() and not out.valid.all()
    assert (out.total[~out.valid] == 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_dropped_rewards_never_bring_nan_into_the_loss(seed, tiny_model_dir):
    """Valid rewards the advantages can hold (1e30 beside -2.5 cannot: its spread squared
    overflows float32, and the rollout is refused, below) with malformed ones dropped."""
    torch.manual_seed(seed)
    module = make_module(tiny_model_dir, reward_options=RewardOptions(on_error="drop"))
    held = [v for v in FuzzedReward.VALID if not (isinstance(v, float) and v > 1e19)]
    module.scorer = RewardScorer({FuzzedReward(seed, 0.5, held): 1.0}, on_error="drop")
    data = PromptDataModule(tokenizer=str(tiny_model_dir), batch_size=4, num_train=4, num_val=0)
    data.setup("fit")
    with pytest.warns(UserWarning, match=r"dropped"):
        rollout, _ = module.collector.collect(collate_prompts(data.train_items))
    assert torch.isfinite(rollout.rewards).all() and torch.isfinite(rollout.advantages).all()
    loss, stats = module.loss_of(rollout)
    assert torch.isfinite(loss) and torch.isfinite(stats.policy_loss)
    # the collector is built once, on first use: it takes the new scorer itself
    module.collector.scorer = RewardScorer({FuzzedReward(seed, 0.0, [1e30, -2.5]): 1.0})
    with pytest.raises(RewardError, match="spread squared overflows float32"):
        module.collector.collect(collate_prompts(data.train_items))
