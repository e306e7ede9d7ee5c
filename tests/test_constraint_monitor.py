"""Where each constraint acts: the per-token masks both objectives report, the bins of
:class:`ConstraintMonitor` on hand-built tokens, and its tags in TensorBoard and CSV after a fit
through the command line."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_troll.callbacks import ConstraintMonitor
from lightning_troll.callbacks.constraints import (
    ADVANTAGE_SIGNS,
    CONFIDENCE_BINS,
    constraint_shares,
)
from lightning_troll.cli.command import run as cli_run
from lightning_troll.objectives import ClipObjective, LossInputs, TrollObjective
from lightning_troll.trust_region.projection import sparsify


def test_shares_by_confidence_and_advantage_by_hand():
    """Six tokens. Behaviour probabilities 0.1, 0.6, 0.7, 0.9, 0.97, 0.5 put tokens 0 in
    below_0.5; 1, 2 and 5 in 0.5_0.8 (0.5 is the low edge, included); 3 in 0.8_0.95; 4 in
    above_0.95. Advantages +1, +1, -1, 0, -1, +1: positive 0, 1, 5; negative 2, 4; zero 3.
    The constraint acts on tokens 1, 3 and 4: below_0.5 0/1, 0.5_0.8 1/3, 0.8_0.95 1/1,
    above_0.95 1/1; positive 1/3, negative 1/2, zero 1/1."""
    old_prob = torch.tensor([0.1, 0.6, 0.7, 0.9, 0.97, 0.5])
    advantage = torch.tensor([1.0, 1.0, -1.0, 0.0, -1.0, 1.0])
    acts = {"projected": torch.tensor([False, True, False, True, True, False])}
    out = {k: float(v) for k, v in constraint_shares(old_prob, advantage, acts).items()}
    expected = {
        "by_confidence/below_0.5": (0.0, 1 / 6),
        "by_confidence/0.5_0.8": (1 / 3, 3 / 6),
        "by_confidence/0.8_0.95": (1.0, 1 / 6),
        "by_confidence/above_0.95": (1.0, 1 / 6),
        "by_advantage/positive": (1 / 3, 3 / 6),
        "by_advantage/negative": (0.5, 2 / 6),
        "by_advantage/zero": (1.0, 1 / 6),
    }
    for name, (share, tokens) in expected.items():
        assert out[f"trust_region/{name}/projected"] == pytest.approx(share, abs=1e-7), name
        assert out[f"trust_region/{name}/tokens"] == pytest.approx(tokens, abs=1e-7), name
    assert len(out) == 2 * len(expected)


def test_a_bin_without_tokens_logs_only_its_share():
    old_prob = torch.tensor([0.99, 0.98])
    advantage = torch.tensor([1.0, 2.0])
    out = constraint_shares(old_prob, advantage, {"clipped": torch.tensor([True, False])})
    assert float(out["trust_region/by_confidence/below_0.5/tokens"]) == 0.0
    assert "trust_region/by_confidence/below_0.5/clipped" not in out
    assert "trust_region/by_advantage/negative/clipped" not in out
    assert float(out["trust_region/by_confidence/above_0.95/clipped"]) == 0.5
    assert float(out["trust_region/by_advantage/positive/clipped"]) == 0.5
    tokens = [float(out[f"trust_region/by_confidence/{n}/tokens"]) for n, _, _ in CONFIDENCE_BINS]
    assert sum(tokens) == pytest.approx(1.0)


def clip_stats(ratio: torch.Tensor, adv: torch.Tensor, **options):
    """ClipObjective's statistics where the behaviour probability is 0.2 and the new one ratio x
    0.2, on one sequence of ``len(ratio)`` tokens: logits of two tokens whose first is sampled."""
    old_lp = torch.full((1, len(ratio)), 0.2, dtype=torch.float64).log()
    new_p = ratio.double() * 0.2  # (T,) the sampled token's new probability
    logits = torch.stack([new_p.log(), (1 - new_p).log()], -1)[None]  # (1, T, 2)
    tokens = torch.zeros(1, len(ratio), dtype=torch.long)
    mask = torch.ones(1, len(ratio), dtype=torch.bool)
    inputs = LossInputs(
        tokens=tokens, mask=mask, advantages=adv[None].double(), old_logprobs=old_lp, old=None
    )
    _, stats = ClipObjective(**options)(logits, inputs)
    return stats


def test_clip_masks_stop_the_gradient_in_the_advantages_direction_or_leave_the_range():
    """eps 0.2, dual clip 3: ratios 1.5 (A > 0: clipped high), 1.5 (A < 0: outside only), 0.5
    (A < 0: clipped low), 0.5 (A > 0: outside only), 1.0 (inside), 3.5 (A < 0: dual clip, and
    outside), 1.5 (A = 0: outside only)."""
    ratio = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.0, 3.5, 1.5])
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, -1.0, 0.0])
    stats = clip_stats(ratio, adv, eps_low=0.2, dual_clip=3.0)
    masks = stats.constraint_masks()
    assert masks["clipped"].tolist() == [True, False, True, False, False, True, False]
    assert masks["outside"].tolist() == [True, True, True, True, False, True, True]
    assert float(masks["clipped"].float().mean()) == pytest.approx(float(stats.clip_frac))
    assert stats.token_old_prob.tolist() == pytest.approx([0.2] * 7)
    assert stats.token_advantage.tolist() == adv.tolist()


def test_troll_mask_is_eta_above_zero_and_matches_the_active_share():
    """pi_old = [0.5, 0.3, 0.2]; row 0 is pi_old itself (eta* = 0), row 1 moves far past eps
    (projected)."""
    old_logits = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64).log().expand(2, 3)
    new = torch.tensor([[0.5, 0.3, 0.2], [0.05, 0.05, 0.9]], dtype=torch.float64).log()
    tokens = torch.tensor([0, 2])
    old = sparsify(old_logits, max_tokens=3, mass_delta=0.0, keep=tokens)
    old_lp = torch.log_softmax(old_logits, -1).gather(-1, tokens[:, None]).reshape(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    objective = TrollObjective(eps=0.05, max_tokens=3, mass_delta=0.0)
    inputs = LossInputs(
        tokens=tokens[None], mask=mask, advantages=torch.tensor([1.0]), old_logprobs=old_lp, old=old
    )
    _, stats = objective(new[None], inputs)
    assert stats.constraint_masks()["projected"].tolist() == [False, True]
    assert float(stats.active_frac) == 0.5
    assert stats.token_old_prob.tolist() == pytest.approx([0.5, 0.2])


def test_monitor_logs_the_rollouts_steps_together_and_stays_quiet_without_stats():
    """Two optimiser steps of one rollout: their tokens are binned together."""
    steps = [
        clip_stats(torch.tensor([1.5, 1.0]), torch.tensor([1.0, 1.0])),
        clip_stats(torch.tensor([0.5, 1.0]), torch.tensor([-1.0, -1.0])),
    ]
    logged = {}
    module = SimpleNamespace(last_stats=steps, device=torch.device("cpu"))
    module.log_dict = lambda values: logged.update({k: float(v) for k, v in values.items()})
    monitor = ConstraintMonitor()
    monitor.on_train_batch_end(None, module, None, None, 0)
    assert logged["trust_region/by_confidence/below_0.5/clipped"] == 0.5  # 2 of 4 tokens
    assert logged["trust_region/by_advantage/positive/clipped"] == 0.5
    assert logged["trust_region/by_advantage/negative/clipped"] == 0.5
    assert logged["trust_region/by_advantage/zero/tokens"] == 0.0
    logged.clear()
    module.last_stats = []
    monitor.on_train_batch_end(None, module, None, None, 1)
    assert logged == {}


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["troll", "clip"])
def test_two_step_fit_logs_the_bins_to_tensorboard_and_csv(
    objective, tmp_path, monkeypatch, tiny_model_dir
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.chdir(tmp_path)
    loggers = [
        {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": "tb"}},
        {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "csv"}},
    ]  # fmt: skip
    args = {
        "--config": str(Path(__file__).parents[1] / "configs" / "tinymath.yaml"),
        "--model.model": str(tiny_model_dir),
        "--model.objective": objective,
        "--trainer.max_steps": "4",  # two rollouts of two optimiser steps
        "--trainer.enable_progress_bar": "false",
        "--trainer.enable_checkpointing": "false",
        "--trainer.logger": json.dumps(loggers),
        "--data.batch_size": "2",
        "--data.num_train": "16",
        "--data.num_val": "4",
        "--data.val_batch_size": "4",
        "--model.optimization.minibatch_size": "8",
    }
    cli_run(["fit", *(part for pair in args.items() for part in pair)])
    masks = ["projected"] if objective == "troll" else ["clipped", "outside"]
    bins = [f"by_confidence/{name}" for name, _, _ in CONFIDENCE_BINS]
    bins += [f"by_advantage/{sign}" for sign in ADVANTAGE_SIGNS]
    shares = {f"trust_region/{b}/tokens" for b in bins}

    events = EventAccumulator(str(next((tmp_path / "tb").rglob("version_0"))))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert shares <= scalars
    for b in bins:
        assert len(events.Scalars(f"trust_region/{b}/tokens")) == 2, b
    acting = {s for s in scalars if s.split("/")[-1] in masks and "/by_" in s}
    assert acting, "no bin logged a constraint share"
    for tag in acting:
        assert all(0 <= e.value <= 1 for e in events.Scalars(tag)), tag

    with open(next((tmp_path / "csv").rglob("metrics.csv")), newline="") as file:
        rows = list(csv.DictReader(file))
    assert shares <= set(rows[0])
    assert acting <= set(rows[0])
    for row in (r for r in rows if r["trust_region/by_advantage/positive/tokens"]):
        total = sum(
            float(row[f"trust_region/by_confidence/{n}/tokens"]) for n, *_ in CONFIDENCE_BINS
        )
        assert total == pytest.approx(1.0, abs=1e-6)
