"""Validation: pass@k by hand, sampled answers beside the greedy ones, repeatable and without
moving the training run's random streams."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_troll.data.datamodule import PromptDataModule
from lightning_troll.data.prompts import seeded_generator
from lightning_troll.rollouts.rollout import sample
from lightning_troll.training.validation import pass_at_k
from tests.test_training import make_data, make_module

BUDGET = "tests.reward_helpers:used_the_budget"


def test_pass_at_k_by_hand():
    """Prompt 0: one of 3 right; prompt 1: none; prompt 2: all three. pass@3 = 2/3 (prompts with
    a right answer), mean@3 = 4/9 (right answers)."""
    correct = torch.tensor([[True, False, False], [False, False, False], [True, True, True]])
    passed, mean = pass_at_k(correct)
    assert passed.item() == pytest.approx(2 / 3, abs=1e-7)
    assert mean.item() == pytest.approx(4 / 9, abs=1e-7)


def test_val_samples_is_checked(tiny_model_dir):
    with pytest.raises(ValueError, match=r"data.val_samples must be an integer >= 0; got -1"):
        PromptDataModule(tokenizer=str(tiny_model_dir), val_samples=-1)


def validate(module, model_dir, val_samples: int) -> dict[str, float]:
    trainer = Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.validate(module, datamodule=make_data(model_dir, val_samples=val_samples))
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


@pytest.mark.slow
def test_pass_at_k_samples_beside_the_greedy_answers(tiny_model_dir):
    """The budget reward: an answer is right when it takes all 4 tokens. pass@4 and mean@4 are
    those of 4 answers per prompt sampled from the seeded random state of (batch 0, rank 0);
    the greedy accuracy does not change, a second validation repeats the values, and the global
    random state is where it was."""
    module = make_module(tiny_model_dir, rewards={BUDGET: 1.0})
    greedy = validate(module, tiny_model_dir, 0)
    assert "val/pass@4" not in greedy
    state = torch.get_rng_state()
    first = validate(module, tiny_model_dir, 4)
    assert torch.equal(torch.get_rng_state(), state), "validation must not move the RNG"
    assert validate(module, tiny_model_dir, 4) == first
    assert first["val/accuracy"] == greedy["val/accuracy"]

    data = make_data(tiny_model_dir, val_samples=4)
    data.setup("validate")
    batch = next(iter(data.val_dataloader()))
    assert batch.samples == 4 and len(batch.prompts) == 8
    torch.manual_seed(seeded_generator(0, "validation-0").initial_seed())
    _, _, response_mask, _ = sample(
        module.policy,
        batch.prompt_ids,
        4,
        module.sampling,
        module.policies.pad_id,
        module.policies.eos_id,
    )
    right = (response_mask.sum(-1) >= 4).view(8, 4)
    assert 0 < right.float().mean() < 1, "the case must mix right and wrong answers"
    assert first["val/pass@4"] == pytest.approx(right.any(-1).float().mean().item(), abs=1e-7)
    assert first["val/mean@4"] == pytest.approx(right.float().mean().item(), abs=1e-7)
    one = validate(module, tiny_model_dir, 1)
    assert one["val/pass@1"] == one["val/mean@1"]


def test_validation_logs_its_figures_on_the_module_device(tiny_model_dir, monkeypatch):
    """The scores are CPU tensors; with ``sync_dist`` NCCL reduces only tensors on the module's
    device, so each figure moves there before it is logged."""
    from types import SimpleNamespace

    import lightning_troll.training.module as module_file

    module = make_module(tiny_model_dir)
    figures = {"val/accuracy": torch.tensor(0.5), "val/reward": torch.tensor(0.25)}
    monkeypatch.setattr(module_file, "validation_metrics", lambda *args: figures)
    monkeypatch.setattr(module_file, "stopping_between_validations", lambda trainer: False)
    monkeypatch.setattr(type(module), "device", property(lambda self: torch.device("meta")))
    module._trainer = SimpleNamespace()  # read by stopping_between_validations only
    logged = {}
    monkeypatch.setattr(module, "log", lambda name, value, **kw: logged.update({name: (value, kw)}))
    module.validation_step(SimpleNamespace(prompts=["a", "b", "c"]), 0)
    assert set(logged) == set(figures)
    for name, (value, options) in logged.items():
        assert value.device == torch.device("meta"), name
        assert options == {"batch_size": 3, "sync_dist": True}
