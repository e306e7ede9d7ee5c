"""The trust-region monitor's reductions, on hand-built statistics (no fit)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from lightning_troll.callbacks import TrustRegionMonitor
from lightning_troll.objectives import ClipStats, LossInputs, TrollObjective
from lightning_troll.trust_region.projection import sparsify


class FakeModule(SimpleNamespace):
    """What the monitor reads from a TrollModule, and what it logs."""

    def log_dict(self, values):
        self.logged.update({k: float(v) for k, v in values.items()})

    def log(self, name, value, **kwargs):
        self.logged[name] = float(value)


def test_infeasible_tokens_are_counted_and_left_out_of_eta():
    """pi_old = [0.5, 0.2, 0.2, 0.1]; rows 0 and 1 of pi_new have no mass on tokens 2 and 3
    (0.3 of the old mass, floor -log 0.7 = 0.357 > eps = 0.05): infeasible, eta* = inf. Rows 2
    and 3 are finite and feasible (row 3 is the old policy: eta* = 0)."""
    old_logits = torch.tensor([0.5, 0.2, 0.2, 0.1], dtype=torch.float64).log().expand(4, 4)
    new = torch.tensor(
        [[0.5, 0.2, 0.0, 0.0], [0.1, 0.9, 0.0, 0.0], [0.3, 0.3, 0.2, 0.2], [0.5, 0.2, 0.2, 0.1]],
        dtype=torch.float64,
    ).log()
    tokens = torch.tensor([0, 1, 2, 3])
    old = sparsify(old_logits, max_tokens=4, mass_delta=0.0, keep=tokens)
    objective = TrollObjective(eps=0.05, max_tokens=4, mass_delta=0.0)
    old_lp = torch.log_softmax(old_logits, -1).gather(-1, tokens[:, None]).reshape(2, 2)
    mask = torch.ones(2, 2, dtype=torch.bool)
    inputs = LossInputs(
        tokens=tokens.reshape(2, 2),
        mask=mask,
        advantages=torch.ones(2),
        old_logprobs=old_lp,
        old=old,
    )
    _, stats = objective(new.reshape(2, 2, 4), inputs)
    eta = stats.projection.eta
    assert eta[:2].isinf().all() and 0 < eta[2] < math.inf and eta[3] == 0

    module = FakeModule(last_stats=[stats], objective=objective, logged={})
    monitor = TrustRegionMonitor(histogram_every_n_rollouts=0)
    monitor.on_train_batch_end(None, module, None, None, 0)
    logged = module.logged
    assert logged["trust_region/infeasible_frac"] == 0.5
    assert logged["trust_region/active_frac"] == 0.75
    assert logged["trust_region/eta_max"] == pytest.approx(float(eta[2]), rel=1e-6)
    assert logged["trust_region/eta_mean"] == pytest.approx(float(eta[2]) / 2, rel=1e-6)
    # the infeasible tokens keep their floor, above the bound, and the violation shows it
    assert logged["trust_region/kl_after_max"] == pytest.approx(-math.log(0.7), rel=1e-6)
    assert logged["trust_region/max_violation"] == pytest.approx(
        -math.log(0.7) / 0.05 - 1, rel=1e-6
    )


def clip_step(n: int, low: float, ratio: float | None = None) -> ClipStats:
    """One optimiser step's clipping statistics over ``n`` tokens, a share ``low`` of them
    clipped below (all or none), every ratio ``ratio`` (0.5 where clipped, else 1)."""
    zero, share = torch.tensor(0.0), torch.tensor(low)
    ratios = torch.full((n,), ratio if ratio is not None else 0.5 if low else 1.0)
    return ClipStats(
        loss=zero, policy_loss=zero, regression_loss=zero, ref_kl=zero, entropy=zero,
        ratio_mean=ratios.mean(), ratio_min=ratios.min(), ratio_max=ratios.max(),
        num_tokens=torch.tensor(n), token_ratio=ratios, token_old_prob=torch.full((n,), 0.5),
        token_advantage=torch.full((n,), -1.0), clip_frac_low=share,
        clip_frac_high=zero, dual_clip_frac=zero,
        token_clipped=torch.full((n,), bool(low)), token_outside=torch.full((n,), bool(low)),
    )  # fmt: skip


def logged_clip_figures(*steps: ClipStats) -> dict[str, float]:
    from lightning_troll.objectives import ClipObjective

    module = FakeModule(last_stats=list(steps), objective=ClipObjective(), logged={})
    TrustRegionMonitor(histogram_every_n_rollouts=0).on_train_batch_end(None, module, None, None, 0)
    return module.logged


def test_clipping_shares_are_pooled_by_token_over_the_steps_of_a_rollout():
    """Two optimiser steps of a rollout: 10 tokens all clipped below, then 990 tokens none
    clipped. The rollout's shares are 10 / 1000 (as TROLL's are pooled), not the mean of the
    steps' shares (0.5)."""
    logged = logged_clip_figures(clip_step(10, 1.0), clip_step(990, 0.0))
    assert logged["clip/active_frac"] == pytest.approx(0.01)
    assert logged["clip/low_frac"] == pytest.approx(0.01)
    assert logged["clip/high_frac"] == 0.0


def test_a_nan_figure_is_logged_as_nan_not_dropped():
    """A NaN ratio is a fault: the KL estimate it enters is logged as NaN, not the mean of the
    other tokens (torchmetrics drops NaN by default)."""
    logged = logged_clip_figures(clip_step(3, 0.0), clip_step(1, 0.0, ratio=math.nan))
    assert math.isnan(logged["clip/approx_kl"])
    assert logged_clip_figures(clip_step(3, 0.0))["clip/approx_kl"] == 0.0


def test_kl_end_asks_the_module_for_its_cache(tmp_path, tiny_model_dir):
    """A clipping module caches the old distributions only once a reader asks; the kl_end and
    kl_start monitors ask at the fit's set-up, and a monitor asking for neither leaves it be."""
    from lightning.pytorch import Trainer

    from lightning_troll.callbacks import TrustRegionMonitor
    from tests.test_training import make_module

    module = make_module(tiny_model_dir, objective="clip")
    assert module.cache_old_distributions is False
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    TrustRegionMonitor().setup(trainer, module, "fit")
    assert module.cache_old_distributions is False
    TrustRegionMonitor(kl_end=True).setup(trainer, module, "validate")
    assert module.cache_old_distributions is False
    for asked in ({"kl_end": True}, {"kl_start": True}):
        module = make_module(tiny_model_dir, objective="clip")
        TrustRegionMonitor(**asked).setup(trainer, module, "fit")
        assert module.cache_old_distributions is True


def test_kl_end_on_the_command_line_caches_the_rows(tmp_path, monkeypatch, capsys, tiny_model_dir):
    """A clipping run with ``trust_region_monitor.kl_end`` or ``kl_start`` caches the old
    distributions (and logs the KL at each rollout's end or start) without a module option; an
    option of the release that set it by hand is refused, naming the monitor's."""
    from lightning_troll.cli.command import run
    from tests.test_cli import ROOT, one_step

    monkeypatch.chdir(tmp_path)
    args = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml"), *one_step(tiny_model_dir)]
    cli = run([*args, "--model.objective", "clip", "--trust_region_monitor.kl_end", "true"])
    assert cli.model.cache_old_distributions is True
    assert "trust_region/kl_end_mean" in cli.trainer.callback_metrics
    cli = run([*args, "--model.objective", "clip", "--trust_region_monitor.kl_start", "true"])
    assert cli.model.cache_old_distributions is True
    assert "trust_region/kl_start_mean" in cli.trainer.callback_metrics
    assert "trust_region/kl_end_mean" not in cli.trainer.callback_metrics
    cli = run([*args, "--model.objective", "clip"])
    assert cli.model.cache_old_distributions is False
    with pytest.raises(SystemExit) as refused:
        run([*args, "--model.cache_old_distributions", "true"])
    assert refused.value.code == 2
    assert (
        "--model.cache_old_distributions is retired in 0.2.0: --trust_region_monitor.kl_end "
        "and kl_start ask for what they read" in capsys.readouterr().err
    )
