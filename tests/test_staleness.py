"""Bounded staleness (``old_policy.max_staleness``): rollout k + 1 is sampled by the policy
version k - s, exactly; the versions and the staleness are logged; the option's mistakes are
named before training."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback

from lightning_troll.callbacks import OldPolicyRefresh, RolloutGeneration
from lightning_troll.models.snapshots import SnapshotConfig
from tests.test_training import make_data, make_module, make_trainer


def clone(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class Versions(Callback):
    """The policy after each rollout, the snapshot that sampled each, the logged figures."""

    def __init__(self) -> None:
        self.policy, self.sampler, self.logged = [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.sampler.append(clone(pl_module.old_policy))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.policy.append(clone(pl_module.policy))
        metrics = trainer.callback_metrics
        self.logged.append(
            (float(metrics["rollout/policy_version"]), float(metrics["rollout/staleness"]))
        )


def fit(tmp_path, model_dir, rollouts: int, **refresh):
    versions = Versions()
    callbacks = [RolloutGeneration(log_samples=0), versions, OldPolicyRefresh(**refresh)]
    trainer = make_trainer(tmp_path, rollouts, callbacks=callbacks, limit_val_batches=0)
    module = make_module(model_dir)
    start = clone(module.policy)
    torch.manual_seed(0)
    trainer.fit(module, datamodule=make_data(model_dir))
    return [start, *versions.policy], versions


@pytest.mark.parametrize("staleness", [0, 2])
def test_each_rollout_is_sampled_by_the_version_s_rollouts_old(tmp_path, tiny_model_dir, staleness):
    policy, versions = fit(tmp_path, tiny_model_dir, 5, max_staleness=staleness)
    expected = [max(0, k - staleness) for k in range(5)]  # the version sampling rollout k + 1
    assert versions.logged == [(float(v), float(k - v)) for k, v in enumerate(expected)]
    for k, version in enumerate(expected):
        for name, value in versions.sampler[k].items():
            assert torch.equal(value, policy[version][name]), (k, version, name)
    assert not all(torch.equal(policy[0][n], policy[5][n]) for n in policy[0])  # it trained


def test_every_n_rollouts_logs_its_own_staleness(tmp_path, tiny_model_dir):
    _, versions = fit(tmp_path, tiny_model_dir, 4, every_n_rollouts=2)
    assert versions.logged == [(0.0, 0.0), (0.0, 1.0), (2.0, 0.0), (2.0, 1.0)]


def test_staleness_mistakes_are_named_before_training(tiny_model_dir):
    from types import SimpleNamespace

    with pytest.raises(
        ValueError, match=r"old_policy.max_staleness must be an integer >= 0; got -1"
    ):
        OldPolicyRefresh(max_staleness=-1)
    with pytest.raises(ValueError, match=r"every_n_rollouts=2 and old_policy.max_staleness=1 both"):
        OldPolicyRefresh(every_n_rollouts=2, max_staleness=1)
    module = make_module(tiny_model_dir, snapshot=SnapshotConfig(dtype="int8"))
    trainer = SimpleNamespace(world_size=1)
    with pytest.raises(
        ValueError, match=r"max_staleness=1 .* needs model.snapshot.mode .copy. with dtype"
    ):
        OldPolicyRefresh(max_staleness=1).setup(trainer, module, "fit")


class Anchors(Callback):
    """Per rollout: its old log-probs against the current policy's and the stale sampler's."""

    def __init__(self) -> None:
        self.checked = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from lightning_troll.rollouts.forward import response_logits

        rollout = pl_module.rollout
        mask = rollout.response_mask
        args = (rollout.input_ids, rollout.attention_mask, mask.shape[1], rollout.temperature)
        with torch.no_grad():
            own = {}
            for name, model in (("policy", pl_module.policy), ("sampler", pl_module.old_policy)):
                logits = response_logits(model, *args)
                own[name] = torch.log_softmax(logits, -1).gather(-1, rollout.tokens[..., None])[
                    ..., 0
                ]
        torch.testing.assert_close(
            rollout.old_logprobs[mask], own["policy"][mask], atol=1e-5, rtol=0
        )
        assert rollout.old.num_rows == int(mask.sum())
        weights = (own["policy"] - own["sampler"]).exp().clamp(max=2.0) * mask
        per_sequence = rollout.advantages.sum(-1) / weights.sum(-1)
        torch.testing.assert_close(
            rollout.advantages, per_sequence[:, None] * weights, atol=1e-5, rtol=1e-4
        )
        assert bool((per_sequence.view(-1, 4).sum(-1).abs() < 1e-4).all())  # GRPO: mean zero
        self.checked += 1


def test_the_proximal_anchor_bounds_the_current_weights_and_weighs_the_stale_sampler(
    tmp_path, tiny_model_dir
):
    """loss.anchor proximal with a sampler 2 versions behind: the old policy the objective sees
    is the current weights before the update (their log-probs and sparse rows), and each token's
    advantage carries min(p_proximal / p_behaviour, 2)."""
    from lightning_troll.objectives import LossConfig

    anchors = Anchors()
    callbacks = [RolloutGeneration(log_samples=0), anchors, OldPolicyRefresh(max_staleness=2)]
    trainer = make_trainer(tmp_path, 4, callbacks=callbacks, limit_val_batches=0)
    module = make_module(tiny_model_dir, loss=LossConfig(anchor="proximal"))
    torch.manual_seed(0)
    trainer.fit(module, datamodule=make_data(tiny_model_dir))
    assert anchors.checked == 4
    mean = float(trainer.callback_metrics["rollout/proximal_is_weight_mean"])
    assert mean != pytest.approx(1.0, abs=1e-6)  # the sampler is stale: the weights moved


def test_anchor_mistakes_are_named():
    from lightning_troll.objectives import LossConfig

    with pytest.raises(ValueError, match=r"loss.anchor must be one of \['behaviour', 'proximal'\]"):
        LossConfig(anchor="current")
    with pytest.raises(ValueError, match=r"loss.anchor_is_cap must be a number >= 1; got 0.5"):
        LossConfig(anchor="proximal", anchor_is_cap=0.5)
