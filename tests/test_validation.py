"""Validation: pass@k by hand, sampled answers beside the greedy ones, repeatable and without
moving the training run's random streams."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_troll.engines.sampling import sample
from lightning_troll.tasks.data.datamodule import PromptDataModule
from lightning_troll.tasks.data.prompts import seeded_generator
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


def test_validation_logs_each_figure_weighed_by_what_it_counts(tiny_model_dir, monkeypatch):
    """Two batches, counting 3 and 1 prompts (and 2 and 0 for a per-function mean): each figure
    is the mean over everything counted on every process (here the strategy's sum stands in for
    a second process that counted the same), reduced as float64 sums on the module's device and
    logged there with sync_dist."""
    from types import SimpleNamespace

    import lightning_troll.training.module as module_file

    module = make_module(tiny_model_dir)
    batches = iter(
        [
            {"val/accuracy": (torch.tensor(1 / 3), 3), "val/reward/a/mean": (torch.tensor(0.5), 2)},
            {"val/accuracy": (torch.tensor(1.0), 1), "val/reward/a/mean": (torch.tensor(0.0), 0)},
        ]
    )
    monkeypatch.setattr(module_file, "validation_metrics", lambda *args: next(batches))
    monkeypatch.setattr(module_file, "stopping_between_validations", lambda trainer: False)
    reduced = []

    def reduce(tensor, reduce_op):
        reduced.append((tensor.dtype, tensor.device, reduce_op))
        return tensor * 2  # two processes that counted the same

    module._trainer = SimpleNamespace(strategy=SimpleNamespace(reduce=reduce))
    logged = {}
    monkeypatch.setattr(module, "log", lambda name, value, **kw: logged.update({name: (value, kw)}))
    module.validation_step(SimpleNamespace(prompts=["a", "b", "c"]), 0)
    module.validation_step(SimpleNamespace(prompts=["d"]), 1)
    module.on_validation_epoch_end()
    assert reduced == [(torch.float64, module.device, "sum")]
    assert {name: round(value.item(), 6) for name, (value, _) in logged.items()} == {
        "val/accuracy": 0.5,  # (1 + 1) / 4 prompts
        "val/reward/a/mean": 0.5,
    }
    assert all(kw == {"sync_dist": True} for _, kw in logged.values())
    assert all(value.dtype == torch.float32 for value, _ in logged.values())
    logged.clear()
    module.on_validation_epoch_end()  # the totals started again: nothing to log
    assert logged == {}


def test_copies_that_pad_a_shared_validation_set_are_answered_but_not_counted(tiny_model_dir):
    """Five rows over two processes: the first gets rows 0, 2 and 4, the second rows 1 and 3
    and a marked copy of row 0 (so both run one batch of three). The second's figures are those
    of its two rows alone, each weighed by two; counting the copy would change them."""
    import dataclasses
    from types import SimpleNamespace

    from lightning_troll.tasks.data.prompts import collate_prompts
    from lightning_troll.training.validation import validation_metrics

    data = make_data(tiny_model_dir, num_val=5, val_samples=2)
    data.setup("validate")
    batches = []
    for rank in (0, 1):
        data.trainer = SimpleNamespace(distributed_sampler_kwargs={"rank": rank, "num_replicas": 2})
        batches.append(list(data.val_dataloader()))
    assert [len(b) for b in batches[0]] == [len(b) for b in batches[1]] == [3]
    first, second = batches[0][0], batches[1][0]
    texts = [item.text for item in data.val_items]
    assert first.prompts == texts[0::2] and first.counted is None
    assert second.prompts == [texts[1], texts[3], texts[0]]
    assert second.counted == [True, True, False] and second.samples == 2

    module = make_module(tiny_model_dir, rewards={"tests.reward_helpers:gold_answer": 1.0})
    padded = validation_metrics(module, second, 0)
    alone = validation_metrics(module, collate_prompts(data.val_items[1:4:2], samples=2), 0)
    assert set(padded) == set(alone) == {"val/accuracy", "val/reward", "val/pass@2", "val/mean@2"}
    assert all(count == 2 for _, count in padded.values())
    for name in ("val/accuracy", "val/reward"):
        assert padded[name][0].item() == pytest.approx(alone[name][0].item(), abs=1e-6), name
    counted = validation_metrics(module, dataclasses.replace(second, counted=None), 0)
    assert counted["val/reward"][1] == 3
    assert abs(counted["val/reward"][0].item() - alone["val/reward"][0].item()) > 1e-3


def test_a_batch_of_padding_only_weighs_nothing(tiny_model_dir):
    """One row over three processes: the last two answer a copy each, and count none."""
    from types import SimpleNamespace

    from lightning_troll.training.validation import validation_metrics

    data = make_data(tiny_model_dir, num_val=1, val_samples=2)
    data.setup("validate")
    data.trainer = SimpleNamespace(distributed_sampler_kwargs={"rank": 2, "num_replicas": 3})
    (batch,) = list(data.val_dataloader())
    assert batch.counted == [False] and batch.prompts == [data.val_items[0].text]
    figures = validation_metrics(make_module(tiny_model_dir), batch, 0)
    assert {name: (value.item(), count) for name, (value, count) in figures.items()} == {
        "val/accuracy": (0.0, 0),
        "val/reward": (0.0, 0),
        "val/pass@2": (0.0, 0),
        "val/mean@2": (0.0, 0),
    }
