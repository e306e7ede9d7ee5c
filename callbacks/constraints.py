"""Where each constraint acts: the share of response tokens it holds, by confidence and advantage.

Per rollout, :class:`ConstraintMonitor` bins every response token of the rollout's optimiser
steps twice: by the old policy's probability of the sampled token (its confidence: the
behaviour policy's, or under ``model.corrections.anchor: proximal`` the proximal policy's;
:data:`CONFIDENCE_BINS`) and by the sign of its advantage (:data:`ADVANTAGE_SIGNS`). In each bin
it logs the share of the bin's tokens that each of the objective's constraint masks holds
(:meth:`~lightning_troll.objectives.ObjectiveStats.constraint_masks`):

- TROLL: ``projected``, the token's distribution was moved onto the bound (eta* > 0);
- clipping: ``clipped``, the clip stops the token's gradient (the ratio left its range in the
  direction its advantage pushes, or the dual clip), and ``outside``, the ratio left its range in
  either direction, whatever the advantage.

and ``tokens``, the bin's share of all response tokens, as

    trust_region/by_confidence/<bin>/<mask>     trust_region/by_advantage/<sign>/<mask>
    trust_region/by_confidence/<bin>/tokens     trust_region/by_advantage/<sign>/tokens

A bin without tokens in a rollout logs only its ``tokens`` (0). Counts are summed over processes
(a torchmetrics state) before the shares are taken, so every process logs the same values.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor
from torchmetrics import Metric
from typing_extensions import override

__all__ = ["ADVANTAGE_SIGNS", "CONFIDENCE_BINS", "ConstraintMonitor"]

CONFIDENCE_BINS: tuple[tuple[str, float, float], ...] = (
    ("below_0.5", 0.0, 0.5),
    ("0.5_0.8", 0.5, 0.8),
    ("0.8_0.95", 0.8, 0.95),
    ("above_0.95", 0.95, float("inf")),
)
"""(name, low, high): a token's behaviour probability p falls in the bin where low <= p < high."""

ADVANTAGE_SIGNS = ("positive", "negative", "zero")
"""The advantage bins: A > 0, A < 0, A = 0 (a group whose rewards are all equal)."""


class _Counts(Metric):
    """A vector of counts summed over processes."""

    full_state_update = False

    def __init__(self, size: int) -> None:
        super().__init__()
        self.add_state(
            "counts", default=torch.zeros(size, dtype=torch.float64), dist_reduce_fx="sum"
        )

    def update(self, counts: Tensor) -> None:
        self.counts += counts.to(self.counts)

    def compute(self) -> Tensor:
        return self.counts


def bin_masks(old_prob: Tensor, advantage: Tensor) -> dict[str, Tensor]:
    """(N,) bool per bin, named ``by_confidence/<bin>`` and ``by_advantage/<sign>``."""
    bins = {
        f"by_confidence/{name}": (old_prob >= low) & (old_prob < high)
        for name, low, high in CONFIDENCE_BINS
    }
    signs = (advantage > 0, advantage < 0, advantage == 0)
    bins.update({f"by_advantage/{n}": s for n, s in zip(ADVANTAGE_SIGNS, signs, strict=True)})
    return bins


def constraint_shares(
    old_prob: Tensor, advantage: Tensor, acts: dict[str, Tensor], counts: _Counts | None = None
) -> dict[str, Tensor]:
    """``trust_region/<bin>/<mask>`` and ``trust_region/<bin>/tokens`` from (N,) per-token
    tensors: the behaviour probability, the advantage and each constraint mask. ``counts``
    sums the counts over processes first."""
    bins = bin_masks(old_prob, advantage)
    names = [*acts, "tokens"]
    table = torch.stack(
        [torch.stack([(b & a).sum() for a in acts.values()] + [b.sum()]) for b in bins.values()]
    ).double()  # (bins, masks + 1)
    flat = torch.cat([table.flatten(), old_prob.new_tensor([old_prob.numel()]).double()])
    if counts is not None:
        counts.update(flat)
        flat = counts.compute()
        counts.reset()
    table, total = flat[:-1].view(len(bins), len(names)), flat[-1]
    out = {}
    for row, bin_name in zip(table, bins, strict=True):
        in_bin = row[-1]
        out[f"trust_region/{bin_name}/tokens"] = (in_bin / total.clamp_min(1)).float()
        if in_bin > 0:
            for value, name in zip(row[:-1], acts, strict=True):
                out[f"trust_region/{bin_name}/{name}"] = (value / in_bin).float()
    return out


class ConstraintMonitor(Callback):
    """Logs, per rollout, the share of response tokens each constraint acts on, by the behaviour
    policy's confidence in the sampled token and by the sign of its advantage (module
    docstring). Reads ``model.last_stats`` after each training step and writes only to the
    loggers; on for both objectives, and silent for an objective without a constraint."""

    def __init__(self) -> None:
        self.counts: _Counts | None = None
        """The counts summed over processes, made at the first rollout (their number depends on
        the objective's masks)."""

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stats = pl_module.last_stats
        if not stats:
            return
        masks = [s.constraint_masks() for s in stats]
        names = list(masks[0])
        if not names:
            return
        acts = {n: torch.cat([m[n] for m in masks]) for n in names}  # (N,)
        old_prob = torch.cat([s.token_old_prob for s in stats])  # (N,)
        advantage = torch.cat([s.token_advantage for s in stats])  # (N,)
        size = (len(CONFIDENCE_BINS) + len(ADVANTAGE_SIGNS)) * (len(names) + 1) + 1
        if self.counts is None or self.counts.counts.numel() != size:
            self.counts = _Counts(size).to(pl_module.device)
        pl_module.log_dict(constraint_shares(old_prob, advantage, acts, self.counts))
