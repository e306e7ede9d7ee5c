"""Importance weights for a sampler apart from the trainer (``model.corrections.engine_is_*``): each
level and mode against a hand-computed case, what each logs, and the options' checks."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_troll.objectives.mismatch import mismatch_weights
from lightning_troll.objectives.options import check_engine_is

# trainer / sampler probability ratios of two completions; the second has two response tokens
RATIOS = torch.tensor([[1.0, 3.0, 0.2, 1.5], [0.5, 1.2, 9.0, 1.0]])
MASK = torch.tensor([[True, True, True, True], [True, True, False, False]])


def weights(**options):
    got, stay, figures = mismatch_weights(RATIOS.log(), MASK, **options)
    # the tokens that stay in the loss: all when truncating, the unmasked ones when masking
    assert torch.equal(stay, MASK if options.get("mode", "truncate") == "truncate" else got > 0)
    return [[round(v, 6) for v in row] for row in got.tolist()], figures


def test_token_truncation_caps_each_ratio():
    got, figures = weights(cap=2.0)
    assert got == [[1.0, 2.0, 0.2, 1.5], [0.5, 1.2, 0.0, 0.0]]
    assert figures["rollout/engine_is_capped_frac"] == pytest.approx(1 / 6)
    assert figures["rollout/engine_is_weight_mean"] == pytest.approx(
        (1 + 2 + 0.2 + 1.5 + 0.5 + 1.2) / 6
    )


def test_token_masking_drops_the_ratios_outside_the_band():
    got, figures = weights(cap=2.0, mode="mask")
    assert got == [[1.0, 0.0, 0.2, 1.5], [0.5, 1.2, 0.0, 0.0]]  # 3.0 masked; padding stays 0
    assert figures["rollout/engine_is_masked_frac"] == pytest.approx(1 / 6)
    got, figures = weights(cap=2.0, mode="mask", floor=0.3)  # IcePop's two-sided band
    assert got == [[1.0, 0.0, 0.0, 1.5], [0.5, 1.2, 0.0, 0.0]]
    assert figures["rollout/engine_is_masked_frac"] == pytest.approx(2 / 6)
    assert figures["rollout/engine_is_weight_mean"] == pytest.approx((1 + 1.5 + 0.5 + 1.2) / 6)


def test_sequence_level_weighs_every_token_by_the_product_of_its_ratios():
    got, figures = weights(cap=2.0, level="sequence")
    assert got == [[0.9] * 4, [0.6, 0.6, 0.0, 0.0]]  # 1 x 3 x 0.2 x 1.5 and 0.5 x 1.2
    assert figures["rollout/engine_is_capped_frac"] == 0.0
    got, figures = weights(cap=1.0, level="sequence", mode="mask", floor=0.7)
    assert got == [[0.9] * 4, [0.0, 0.0, 0.0, 0.0]]  # 0.6 is below the floor: its 2 tokens go
    assert figures["rollout/engine_is_masked_frac"] == pytest.approx(2 / 6)


def test_a_sequence_whose_product_overflows_is_capped_or_masked_not_nan():
    log_ratio = torch.full((1, 200), 1.0)  # e^200 overflows float32
    mask = torch.ones(1, 200, dtype=torch.bool)
    capped, _, _ = mismatch_weights(log_ratio, mask, 2.0, "sequence")
    masked, stay, figures = mismatch_weights(log_ratio, mask, 2.0, "sequence", "mask")
    assert not bool(stay.any())
    assert torch.equal(capped, torch.full((1, 200), 2.0))
    assert (
        torch.equal(masked, torch.zeros(1, 200)) and figures["rollout/engine_is_masked_frac"] == 1.0
    )
    assert math.isfinite(figures["rollout/engine_is_weight_mean"])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"cap": 0.5}, "model.corrections.engine_is_cap must be a finite number >= 1 (weights above it are truncated or masked), or null to switch the correction off; got 0.5"),
        ({"cap": math.inf}, "model.corrections.engine_is_cap must be a finite number >= 1 (weights above it are truncated or masked), or null to switch the correction off; got inf"),
        ({"cap": float("1e400")}, "model.corrections.engine_is_cap must be a finite number >= 1"),
        ({"cap": math.nan}, "model.corrections.engine_is_cap must be a finite number >= 1"),
        ({"cap": True}, "model.corrections.engine_is_cap must be a finite number >= 1"),
        ({"cap": 2.0, "level": "batch"}, "model.corrections.engine_is_level must be one of ['token', 'sequence']; got 'batch'"),
        ({"cap": 2.0, "mode": "clip"}, "model.corrections.engine_is_mode must be one of ['truncate', 'mask']; got 'clip'"),
        ({"cap": 2.0, "mode": "mask", "floor": 1.5}, "model.corrections.engine_is_floor must be in (0, 1] or null; got 1.5"),
        ({"cap": 2.0, "floor": 0.5}, "model.corrections.engine_is_floor=0.5 masks the ratios below it, so it needs model.corrections.engine_is_mode 'mask'"),
        ({"cap": None, "mode": "mask"}, "shape the weights of model.corrections.engine_is_cap, which is null (off)"),
        ({"cap": None, "floor": 0.5}, "which is null (off); got engine_is_level='token', engine_is_mode='truncate', engine_is_floor=0.5; set the cap"),
        ({"cap": 2.0, "mode": "mask", "floor": True}, "model.corrections.engine_is_floor must be in (0, 1] or null; got True"),
    ],
)  # fmt: skip
def test_option_mistakes_are_named(options, message):
    full = {"cap": None, "level": "token", "mode": "truncate", "floor": None, **options}
    with pytest.raises(ValueError) as error:
        check_engine_is(**full)
    assert message in str(error.value)
