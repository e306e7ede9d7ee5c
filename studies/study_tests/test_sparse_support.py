"""studies/sparse_support.py: its core on a tiny model, and the invariants of its figures."""

from __future__ import annotations

import math

import pytest

from .helpers import load

EPS = 0.05

script = load("sparse_support")


@pytest.fixture(scope="module")
def records(tiny_model_dir):
    """A rollout of the tiny model (V = 17) on TinyMath prompts, two AdamW steps at a large
    learning rate, then the grid: nothing cut (K >= V, delta 0) and two cut supports."""
    config = {
        "model": {"rewards": {"tests.reward_helpers:length_reward": 1.0}, "loss": {}},
        "data": {"source": "tinymath", "num_train": 16, "num_val": 0},
    }
    model = str(tiny_model_dir)
    module = script.build_module(model, config, temperature=1.0, max_new_tokens=6, group=4)
    batch = script.prompt_batch(model, config, count=4, seed=0)
    data = script.rollout_logits(module, batch, steps=2, lr=3e-2, minibatch=8, seed=0)
    assert data.old.shape == data.new.shape and data.old.shape[-1] == 17
    assert (data.new - data.old).abs().max() > 1e-3, "the steps moved the policy"
    assert data.advantages.abs().max() > 0
    return script.compare(data, EPS, 1.0, [(64, 0.0), (4, 1e-3), (16, 1e-5)], repeats=1)


def test_nothing_cut_equals_the_dense_projection(records):
    full = records[0]
    assert (full["max_tokens"], full["mass_delta"]) == (64, 0.0)
    assert full["cap_frac"] == 0 and full["outside_max"] < 1e-6
    assert full["support_mean"] == 17
    assert full["projected_dense"] > 0, "the case must project some tokens"
    assert full["projected"] == full["projected_dense"]
    for name in ("logprob_err_max", "kl_after_err_max", "rebuilt_logprob_err_max"):
        assert full[name] < 1e-5, name
    assert full["grad_err"] < 1e-4
    assert full["full_kl_after_max"] <= EPS * (1 + 1e-4) and full["over_bound_frac"] == 0


def test_figures_keep_their_invariants(records):
    for record in records:
        for name in ("cap_frac", "outside_mean", "outside_max", "projected", "projected_dense"):
            assert 0 <= record[name] <= 1, name
        assert record["outside_mean"] <= record["outside_max"] + 1e-12
        assert 1 <= record["support_mean"] <= record["support_max"] <= 17
        assert record["logprob_err_mean"] <= record["logprob_err_max"]
        assert record["kl_after_max"] <= EPS * (1 + 1e-4)  # the bound the layer holds
        # the script's independent rebuild agrees with the layer on the token's log-prob
        assert record["rebuilt_logprob_err_max"] < 1e-5
        assert record["ms_per_1k"] > 0 and record["cache_mib_per_1m"] > 0
        assert record["peak_mib"] >= 0
        assert math.isfinite(record["grad_err"])
    capped = records[1]  # K = 4 of 17 tokens with delta 1e-3: an untrained model is flat
    assert capped["cap_frac"] == 1 and capped["outside_mean"] > 1e-3
    # 4 ids + log-probs, plus the sampled token, plus the tail: at most (5 * 12 + 4) bytes
    assert capped["cache_mib_per_1m"] <= (5 * 12 + 4) * 1e6 / 2**20


def test_table_has_a_row_per_record(records):
    lines = script.table(records).splitlines()
    assert len(lines) == 2 + len(records)
    assert lines[0].count("|") == len(script.COLUMNS) + 1
    assert "| 1 | 64 | 0 |" in lines[2]
