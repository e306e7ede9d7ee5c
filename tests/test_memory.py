"""Memory options in whole fits: snapshot kinds, refresh, checkpoints, 8-bit optimisers, LoRA."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback

from lightning_troll.callbacks import OldPolicyRefresh, RolloutGeneration
from lightning_troll.engines import sampling as sampling_module
from lightning_troll.models.lora import LoraConfig
from lightning_troll.models.quantize import Int8Linear, quantize_rows
from lightning_troll.models.snapshots import SnapshotConfig
from lightning_troll.rollouts.rollout import behaviour_outputs
from lightning_troll.training.module import LossConfig, OptimizationConfig, TrollModule
from tests.test_training import Recorder, fit, make_data, make_module, make_trainer

pytestmark = pytest.mark.slow  # whole fits: seconds each


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().float().flatten() for t in tensors])


def assert_first_minibatch_on_policy(recorder, atol: float = 1e-5) -> None:
    for steps in recorder.stats:
        first = steps[0]
        ones = torch.ones_like(first.token_ratio)
        torch.testing.assert_close(first.token_ratio, ones, rtol=0, atol=atol)
        assert first.projection.kl_before.max() < atol


class ModeSpy(Callback):
    """Records, around sampling (the decoding loop, or ``generate`` where the loop declines the
    model) and around the loss, whether the policy is in train mode."""

    def __init__(self) -> None:
        self.sampling, self.loss = [], []

    def setup(self, trainer, pl_module, stage):
        generate, loss_of = pl_module.policy.generate, pl_module.loss_of
        self.decode = sampling_module.decode

        def spy_sampling(run):
            def spy(*args, **kwargs):
                self.sampling.append((pl_module.policy.training, torch.is_grad_enabled()))
                return run(*args, **kwargs)

            return spy

        def spy_loss(*args, **kwargs):
            self.loss.append((pl_module.policy.training, torch.is_grad_enabled()))
            return loss_of(*args, **kwargs)

        pl_module.policy.generate, pl_module.loss_of = spy_sampling(generate), spy_loss
        sampling_module.decode = spy_sampling(self.decode)

    def teardown(self, trainer, pl_module, stage):
        sampling_module.decode = self.decode


def test_shared_snapshot_samples_in_eval_mode_and_trains_in_train_mode(tmp_path, tiny_model_dir):
    module = make_module(
        tiny_model_dir,
        snapshot=SnapshotConfig(mode="shared"),
        optimization=OptimizationConfig(minibatch_size=8),
    )
    spy = ModeSpy()
    _, _, recorder = fit(tmp_path, tiny_model_dir, max_steps=4, module=module, extra=[spy],
                         limit_val_batches=0)  # fmt: skip
    assert spy.sampling == [(False, False)] * 2, "sampling: eval mode, no grad"
    assert spy.loss == [(True, True)] * 4, "the loss: train mode, with grad"
    assert module.policy.training
    assert_first_minibatch_on_policy(recorder)
    later = torch.cat([s.token_ratio for steps in recorder.stats for s in steps[1:]])
    assert (later - 1).abs().max() > 1e-4, "the policy moved, so later minibatches are off-policy"


def test_shared_snapshot_refuses_a_lagging_refresh_before_training(tmp_path, tiny_model_dir):
    module = make_module(tiny_model_dir, snapshot=SnapshotConfig(mode="shared"))
    before = flat(module.policy.parameters())
    callbacks = [RolloutGeneration(), OldPolicyRefresh(every_n_rollouts=2)]
    trainer = make_trainer(tmp_path, 2, callbacks=callbacks, limit_val_batches=0)
    message = r"every_n_rollouts=2 needs a snapshot .* model.snapshot.mode='shared'"
    with pytest.raises(ValueError, match=message):
        trainer.fit(module, datamodule=make_data(tiny_model_dir))
    assert trainer.global_step == 0
    assert torch.equal(flat(module.policy.parameters()), before)


def snapshot_of(module: TrollModule, dtype: str) -> list[torch.Tensor]:
    """What the snapshot would hold if it were made from the policy's current weights."""
    policy = module.policy
    if dtype == "bfloat16":
        return [p.to(torch.bfloat16) for p in policy.parameters()]
    layers = dict(policy.named_modules())
    return [
        quantize_rows(layers[name].weight)[0]
        for name, m in module.old_policy.named_modules()
        if isinstance(m, Int8Linear)
    ]


def held(module: TrollModule, dtype: str) -> list[torch.Tensor]:
    snapshot = module.old_policy
    if dtype == "bfloat16":
        return list(snapshot.parameters())
    return [m.qweight for m in snapshot.modules() if isinstance(m, Int8Linear)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_low_precision_snapshot_trains_resumes_exactly_and_refreshes(
    tmp_path, tiny_model_dir, dtype
):
    """One step with a refresh every 2 rollouts: the snapshot lags; a checkpoint restores that
    lagging snapshot exactly (it is saved, not re-derived); a refresh re-derives it."""
    module = make_module(tiny_model_dir, snapshot=SnapshotConfig(dtype=dtype))
    initial = [t.clone() for t in held(module, dtype)]
    refresh, recorder = OldPolicyRefresh(every_n_rollouts=2), Recorder()
    callbacks = [RolloutGeneration(), refresh, recorder]
    trainer = make_trainer(tmp_path, 1, callbacks=callbacks, limit_val_batches=0)
    torch.manual_seed(0)
    trainer.fit(module, datamodule=make_data(tiny_model_dir))
    stats = recorder.stats[0][0]
    assert torch.isfinite(stats.loss) and (stats.token_ratio - 1).abs().max() < 0.05
    assert recorder.rollouts[0].old.logprobs.dtype == torch.float32
    assert same(held(module, dtype), initial), "no refresh yet"
    assert not same(held(module, dtype), snapshot_of(module, dtype)), "the policy moved on"

    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    resumed = TrollModule.load_from_checkpoint(path, weights_only=False)
    assert same(held(resumed, dtype), initial)
    assert same(list(resumed.policy.parameters()), list(module.policy.parameters()))

    refresh.refresh(resumed)
    assert same(held(resumed, dtype), snapshot_of(resumed, dtype))


def test_lora_trains_adapters_only_and_its_snapshot_follows(tmp_path, tiny_model_dir):
    module = make_module(
        tiny_model_dir,
        lora=LoraConfig(r=4),
        loss=LossConfig(ref_kl_coef=0.01),
        optimization=OptimizationConfig(minibatch_size=8),
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-2),
    )
    named = dict(module.policy.named_parameters())
    base = {n: p.detach().clone() for n, p in named.items() if "lora_" not in n}
    adapter = {n: p.detach().clone() for n, p in named.items() if ".default." in n}
    spy = ModeSpy()
    trainer, _, recorder = fit(tmp_path, tiny_model_dir, max_steps=4, module=module,
                               extra=[spy], limit_val_batches=0)  # fmt: skip

    optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert optimized == {id(named[n]) for n in adapter}, "the optimiser holds adapters only"
    assert all(torch.equal(named[n], w) for n, w in base.items()), "base weights bit-identical"
    assert all(named[n].grad is None for n in base)
    assert max((named[n] - w).abs().max() for n, w in adapter.items()) > 1e-3
    for name in adapter:  # the last rollout's refresh copied the trained adapter
        assert torch.equal(named[name.replace(".default.", ".snapshot.")], named[name])
    assert all(p.requires_grad == (".default." in n) for n, p in named.items())
    assert spy.sampling == [(False, False)] * 2 and all(mode == (True, True) for mode in spy.loss)
    assert_first_minibatch_on_policy(recorder)

    # the reference policy is the base model: the initial policy, whatever the adapters do
    plain = make_module(tiny_model_dir)
    second = recorder.rollouts[1]
    ref_logprobs, _ = behaviour_outputs(
        plain.policy, second.input_ids, second.attention_mask, second.response_mask, 1.0, None
    )
    torch.testing.assert_close(second.ref_logprobs, ref_logprobs, rtol=0, atol=1e-5)
    assert (second.ref_logprobs - second.old_logprobs).abs().max() > 1e-3
