"""Bounded staleness (``old_policy.max_staleness``): rollout k + 1 is sampled by the policy
version k - s, exactly; the versions and the staleness are logged; the option's mistakes are
named before training."""

from __future__ import annotations

import re

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
    """corrections.anchor proximal with a sampler 2 versions behind: the old policy the objective sees
    is the current weights before the update (their log-probs and sparse rows), and each token's
    advantage carries min(p_proximal / p_behaviour, 2)."""
    from lightning_troll.objectives import CorrectionsConfig

    anchors = Anchors()
    callbacks = [RolloutGeneration(log_samples=0), anchors, OldPolicyRefresh(max_staleness=2)]
    trainer = make_trainer(tmp_path, 4, callbacks=callbacks, limit_val_batches=0)
    module = make_module(tiny_model_dir, corrections=CorrectionsConfig(anchor="proximal"))
    torch.manual_seed(0)
    trainer.fit(module, datamodule=make_data(tiny_model_dir))
    assert anchors.checked == 4
    mean = float(trainer.callback_metrics["rollout/proximal_is_weight_mean"])
    assert mean != pytest.approx(1.0, abs=1e-6)  # the sampler is stale: the weights moved


def test_the_proximal_pass_reads_the_policy_without_dropout(tmp_path, tiny_model_dir):
    """The proximal pass reads the policy as the snapshot samples it, in eval mode: with LoRA
    dropout 0.5 and a sampler that is not stale, p_proximal = p_behaviour, so every weight is 1
    (in train mode dropout made them random)."""
    from lightning_troll.models.lora import LoraConfig
    from lightning_troll.objectives import CorrectionsConfig

    callbacks = [RolloutGeneration(log_samples=0), OldPolicyRefresh()]
    trainer = make_trainer(tmp_path, 2, callbacks=callbacks, limit_val_batches=0)
    module = make_module(
        tiny_model_dir,
        lora=LoraConfig(dropout=0.5),
        corrections=CorrectionsConfig(anchor="proximal"),
    )
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="max_staleness=0"):  # nothing to correct, as here
        trainer.fit(module, datamodule=make_data(tiny_model_dir))
    metrics = trainer.callback_metrics
    assert float(metrics["rollout/proximal_is_weight_mean"]) == pytest.approx(1.0, abs=1e-6)
    assert module.policy.training  # the pass gave the policy its train mode back


def test_anchor_mistakes_are_named():
    from lightning_troll.objectives import CorrectionsConfig

    with pytest.raises(
        ValueError, match=r"model.corrections.anchor must be one of \['behaviour', 'proximal'\]"
    ):
        CorrectionsConfig(anchor="current")
    for cap, shown in (
        (0.5, "0.5"),
        (float("inf"), "inf"),
        (float("1e400"), "inf"),
        (True, "True"),
    ):
        with pytest.raises(
            ValueError,
            match=rf"model.corrections.anchor_is_cap must be a finite number >= 1; got {shown} ",
        ):
            CorrectionsConfig(anchor="proximal", anchor_is_cap=cap)
    with pytest.raises(
        ValueError,
        match=r"model.corrections.anchor_is_cap=5.0 caps the weight of model.corrections.anchor 'proximal', "
        r"but the anchor is 'behaviour', which has no such weight",
    ):
        CorrectionsConfig(anchor_is_cap=5.0)
    assert (
        CorrectionsConfig(anchor_is_cap=2.0).anchor == "behaviour"
    )  # the default cap is no mistake


def test_the_proximal_anchor_is_refused_on_the_dense_support_before_the_model_loads(
    tiny_model_dir, monkeypatch
):
    """The dense support reads the old logits from the snapshot (the stale sampler) in the loss
    pass, while the proximal anchor's old log-probs are the weights before the update: the loss
    would mix two old policies. Clipping has no support, so it takes the proximal anchor."""
    from lightning_troll.objectives import CorrectionsConfig, TrustRegionConfig
    from lightning_troll.training import policies

    loaded = []
    monkeypatch.setattr(policies, "load_policy", lambda *a, **k: loaded.append(a))
    dense, proximal = TrustRegionConfig(support="dense"), CorrectionsConfig(anchor="proximal")
    with pytest.raises(ValueError) as error:
        make_module(tiny_model_dir, trust_region=dense, corrections=proximal)
    assert str(error.value).startswith(
        "model.corrections.anchor='proximal' does not work with model.trust_region.support='dense': "
    )
    assert "use model.trust_region.support 'union' or 'official'" in str(error.value)
    assert "or model.corrections.anchor 'behaviour'" in str(error.value)
    assert not loaded, "the model was loaded before the options were refused"
    monkeypatch.undo()
    for objective, trust_region, corrections in (
        ("troll", dense, CorrectionsConfig()),
        ("troll", TrustRegionConfig(support="union"), proximal),
        ("clip", dense, proximal),
    ):
        make_module(
            tiny_model_dir, objective=objective, trust_region=trust_region, corrections=corrections
        )


@pytest.mark.parametrize(
    ("anchor", "refresh", "snapshot", "why"),
    [
        ("proximal", {}, {}, "old_policy.max_staleness=0 and old_policy.every_n_rollouts=1"),
        ("proximal", {}, {"mode": "shared"}, "model.snapshot.mode='shared'"),
        ("proximal", {"max_staleness": 2}, {}, None),
        ("proximal", {"every_n_rollouts": 2}, {}, None),
        ("proximal", {}, {"dtype": "bfloat16"}, None),  # the sampler rounds: the weight is not 1
        ("behaviour", {}, {}, None),
    ],
)
def test_a_proximal_anchor_with_nothing_to_correct_is_warned(anchor, refresh, snapshot, why):
    from lightning_troll.callbacks.refresh_options import idle_proximal

    every_n, staleness = refresh.get("every_n_rollouts", 1), refresh.get("max_staleness", 0)
    message = idle_proximal(anchor, every_n, staleness, SnapshotConfig(**snapshot))
    if why is None:
        assert message is None
    else:
        assert message.startswith(
            f"model.corrections.anchor='proximal' has nothing to correct: {why}"
        )


def test_the_idle_proximal_warning_comes_once_at_the_start(tmp_path, tiny_model_dir):
    from lightning_troll.objectives import CorrectionsConfig

    callbacks = [RolloutGeneration(log_samples=0), OldPolicyRefresh()]
    trainer = make_trainer(tmp_path, 2, callbacks=callbacks, limit_val_batches=0)
    module = make_module(tiny_model_dir, corrections=CorrectionsConfig(anchor="proximal"))
    with pytest.warns(UserWarning) as caught:
        trainer.fit(module, datamodule=make_data(tiny_model_dir))
    idle = [w for w in caught if "has nothing to correct" in str(w.message)]
    assert len(idle) == 1


def run(tmp_path, model_dir, name: str, rollouts: int, ckpt_path=None, **refresh):
    """A fit with a checkpoint after every rollout (``tmp_path/name/step=k.ckpt``)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    versions = Versions()
    saves = ModelCheckpoint(
        dirpath=tmp_path / name, filename="{step}", every_n_train_steps=1, save_top_k=-1
    )
    callbacks = [RolloutGeneration(log_samples=0), versions, OldPolicyRefresh(**refresh), saves]
    trainer = make_trainer(
        tmp_path, rollouts, callbacks=callbacks, limit_val_batches=0, enable_checkpointing=True
    )
    torch.manual_seed(0)
    module = make_module(model_dir)
    trainer.fit(module, datamodule=make_data(model_dir), ckpt_path=ckpt_path)
    return versions


def kept(path) -> dict:
    """OldPolicyRefresh's state in a checkpoint."""
    return torch.load(path, map_location="cpu", weights_only=True)["callbacks"]["OldPolicyRefresh"]


@pytest.mark.parametrize(
    ("now", "message", "logged", "waiting"),
    [
        # 4 rollouts at s = 2: the snapshot holds version 2, versions 3 and 4 wait
        (1, "from version 2 to version 3 (rollouts 4 - 1); versions [4] stay queued", [3, 4, 5], [7]),
        (0, "from version 2 to the current policy (version 4) and the queued versions [3, 4] are dropped", [4, 5, 6], []),
    ],
)  # fmt: skip
def test_a_resume_with_less_staleness_moves_the_sampler_at_once(
    tmp_path, tiny_model_dir, now, message, logged, waiting
):
    """Stopped after 4 rollouts at max_staleness 2, resumed with 1 (or 0) for 3 more: the first
    resumed rollout is sampled by version 4 - s' (the checkpoint's queued copy of version 3, or
    the current policy), the staleness logged is s' from then on, and the queue (in the state
    and in the next checkpoint) holds s' versions."""
    first = run(tmp_path, tiny_model_dir, "first", 4, max_staleness=2)
    expected = (
        f"old_policy.max_staleness={now} differs from the checkpoint's 2: .*{re.escape(message)}"
    )
    with pytest.warns(UserWarning, match=expected):
        resumed = run(
            tmp_path, tiny_model_dir, "resumed", 7, tmp_path / "first" / "step=4.ckpt",
            max_staleness=now,
        )  # fmt: skip
    assert resumed.logged == [(float(v), float(now)) for v in logged]
    version = first.policy[logged[0] - 1]  # the policy after rollout 3 (or 4)
    for name, value in resumed.sampler[0].items():
        assert torch.equal(value, version[name]), name
    state = kept(tmp_path / "resumed" / "step=7.ckpt")
    assert state["max_staleness"] == now
    assert [entry["version"] for entry in state.get("waiting", [])] == waiting


@pytest.mark.parametrize(
    ("before", "logged"),
    [(1, [(3, 1), (3, 2), (4, 2), (5, 2)]), (0, [(4, 0), (4, 1), (4, 2), (5, 2)])],
)
def test_a_resume_with_more_staleness_lets_the_lag_grow_one_rollout_at_a_time(
    tmp_path, tiny_model_dir, before, logged
):
    """Stopped after 4 rollouts at max_staleness 1 (or 0), resumed with 2 for 4 more: no version
    is missing, the lag grows by one rollout a time to 2, as at a fresh run's start, and the run
    trains."""
    run(tmp_path, tiny_model_dir, "first", 4, max_staleness=before)
    lag = 4 - logged[0][0]
    expected = f"max_staleness=2 differs from the checkpoint's {before}: .* from {lag} to 2"
    with pytest.warns(UserWarning, match=expected):
        resumed = run(
            tmp_path, tiny_model_dir, "resumed", 8, tmp_path / "first" / "step=4.ckpt",
            max_staleness=2,
        )  # fmt: skip
    assert resumed.logged == [(float(v), float(s)) for v, s in logged]
    for name, value in resumed.sampler[3].items():  # version 5: the first resumed rollout's
        assert torch.equal(value, resumed.policy[0][name]), name
    assert not all(
        torch.equal(resumed.policy[0][n], resumed.policy[3][n]) for n in resumed.policy[0]
    )
    state = kept(tmp_path / "resumed" / "step=8.ckpt")
    assert [entry["version"] for entry in state["waiting"]] == [7, 8]


@pytest.mark.parametrize(
    ("every", "message", "logged"),
    [
        (1, "the snapshot moves at once from version 3 to the current policy (version 4), which it lagged by 1 rollout", [(4, 0), (5, 0)]),
        (2, "the snapshot stays at version 3 and is refreshed once it lags 2 rollouts", [(3, 1), (5, 0), (5, 1)]),
    ],
)  # fmt: skip
def test_a_resume_with_another_every_n_rollouts_refreshes_once_the_snapshot_lags_that_many(
    tmp_path, tiny_model_dir, every, message, logged
):
    """Stopped after 4 rollouts refreshed every 3 (the snapshot holds version 3) and resumed
    refreshing every 1 (or 2): the snapshot is refreshed whenever it lags that many rollouts, at
    once if it already does, so no rollout is staler than the new setting allows; a warning
    says so."""
    run(tmp_path, tiny_model_dir, "first", 4, every_n_rollouts=3)
    expected = f"every_n_rollouts={every} differs from the checkpoint's 3: {re.escape(message)}"
    with pytest.warns(UserWarning, match=expected):
        resumed = run(
            tmp_path, tiny_model_dir, "resumed", 4 + len(logged),
            tmp_path / "first" / "step=4.ckpt", every_n_rollouts=every,
        )  # fmt: skip
    assert resumed.logged == [(float(v), float(s)) for v, s in logged]
    assert kept(tmp_path / "resumed" / f"step={4 + len(logged)}.ckpt")["every_n_rollouts"] == every


def test_a_resume_from_every_n_rollouts_to_a_staleness_takes_the_next_version_kept(
    tmp_path, tiny_model_dir
):
    """Stopped after 3 rollouts refreshed every 4 (the snapshot holds version 0, versions 1 and 2
    were never kept) and resumed with max_staleness 1: version 2 is due but gone, so the next one
    kept, the current policy (version 3), samples; the lag then grows to 1."""
    run(tmp_path, tiny_model_dir, "first", 3, every_n_rollouts=4)
    expected = r"from version 0 to version 3 \(the next kept after version 2 = rollouts 3 - 1, "
    with pytest.warns(UserWarning, match=expected):
        resumed = run(
            tmp_path, tiny_model_dir, "resumed", 6, tmp_path / "first" / "step=3.ckpt",
            max_staleness=1,
        )  # fmt: skip
    assert resumed.logged == [(3.0, 0.0), (3.0, 1.0), (4.0, 1.0)]


def test_a_lag_is_bounded_and_its_cost_printed():
    """max_staleness above the documented limit is refused with the other options; at a fit's
    start the kept versions' bytes are told (with a warning's words where the run never reaches
    the lag), and a lag the host cannot hold is refused in one line naming the option."""
    from lightning_troll.callbacks.refresh_options import (
        check_refresh,
        check_versions_fit,
        rollouts_of_run,
    )
    from lightning_troll.training.staleness import MAX_STALENESS

    check_refresh(1, MAX_STALENESS)
    with pytest.raises(ValueError, match=rf"max_staleness must be at most {MAX_STALENESS}.*got 65"):
        check_refresh(1, MAX_STALENESS + 1)
    mib = 2**20
    assert check_versions_fit(4, 3 * mib, 100 * mib, 20) == (
        "old_policy.max_staleness=4 keeps 4 past versions of the weights on the CPU and in every "
        "checkpoint: 4 x 3.0 MiB = 12.0 MiB"
    )
    outlasts = check_versions_fit(20, mib, None, 20)
    assert outlasts.endswith(
        "; it is not below the run's 20 rollouts, so the starting weights sample every rollout of "
        "this run"
    )
    with pytest.raises(
        ValueError, match=r"4 x 30.0 MiB = 120.0 MiB.*than the 100.0 MiB.*at most 3"
    ):
        check_versions_fit(4, 30 * mib, 100 * mib, None)
    # 1,024 sequences in minibatches of 256, two epochs: 8 steps a rollout; 100 steps: 13
    assert rollouts_of_run(100, 2, 256, 1024) == 13
    assert rollouts_of_run(100, 1, None, 1024) == 100 and rollouts_of_run(-1, 1, None, 64) is None
