"""Trust-region and sparsity monitors: per-token KL, projection and coverage statistics.

Both read ``model.last_stats`` (the detached statistics of every optimiser step of the last
rollout) after each training step, reduce them across processes with torchmetrics, and log them.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor
from torchmetrics import MaxMetric, MeanMetric, Metric, MinMetric
from typing_extensions import override

from lightning_troll.callbacks.figures import (
    declare_chart,
    each_logger,
    logged_step,
    write_chart,
    write_histogram,
)
from lightning_troll.objectives import ClipStats, TrollStats

__all__ = ["SparsityCoverageMonitor", "TrustRegionMonitor"]


_KL_CHART = "KL after projection vs bound"
_BOUND = "trust_region/bound"


class _Reductions(torch.nn.Module):
    """Named torchmetrics reductions, updated with per-token tensors (or ``(values, counts)``
    pairs: each value counted as many times), synced on compute."""

    def __init__(self, spec: dict[str, type[Metric]]) -> None:
        super().__init__()
        self.names = list(spec)
        # a NaN is a fault to show, not a value to drop (torchmetrics drops it by default)
        self.metrics = torch.nn.ModuleList(
            metric(nan_strategy="disable") for metric in spec.values()
        )

    def compute(self, values: dict[str, Tensor]) -> dict[str, Tensor]:
        out = {}
        for name, metric in zip(self.names, self.metrics, strict=True):
            value = values[name]
            if isinstance(value, tuple):  # one value per count of tokens (with NaN checks off,
                value = value[0].repeat_interleave(value[1].long())  # torchmetrics drops weights)
            metric.update(value.float())
            out[name] = metric.compute()
            metric.reset()
        return out


class TrustRegionMonitor(Callback):
    """Logs how the trust region behaves, per rollout.

    TROLL runs: ``trust_region/kl_before_{mean,max}``, ``trust_region/kl_after_{mean,max}``,
    ``trust_region/bound``, ``trust_region/active_frac``, ``trust_region/infeasible_frac`` (tokens
    whose bound no interpolation reaches: they keep the smallest KL reachable, above the bound),
    ``trust_region/eta_{mean,max}`` (over the tokens with a finite eta*, infeasible ones left
    out) and ``trust_region/max_violation`` (largest kl_after / bound - 1, 0 when the bound
    holds), plus histograms of per-token KL, eta and support size and a chart of kl_after
    against the bound, in every logger (:mod:`~lightning_troll.callbacks.figures`). Clip runs:
    ``clip/active_frac``, ``clip/low_frac``, ``clip/high_frac`` and ``clip/approx_kl`` (the k3
    estimate of KL(old || new) from the ratios).

    With ``kl_end``, both kinds of run also log how far the policy has moved from the behaviour
    policy by the end of each rollout: after its last optimiser step, a forward pass without
    gradients over that step's minibatch gives per token KL(pi || pi_old), as
    ``trust_region/kl_end_{mean,max}`` (between the lumped sparse distributions of
    ``model.trust_region``'s rule, like ``kl_before``; the monitor asks a clipping run to cache
    those distributions too, ``TrollModule.keep_old_distributions``, which changes no update)
    and ``trust_region/kl_end_sampled`` (the mean of ``r log r - r + 1`` over the sampled tokens, an unbiased estimate of the mean KL over the whole vocabulary unless
    ``sampling.top_p`` or ``top_k`` truncates the sampling).

    With ``kl_start``, the same figures at a rollout's start, ``trust_region/kl_start_{mean,max,
    sampled}``: before its first optimiser step, on that step's minibatch. On-policy data gives 0
    (the behaviour policy is the policy); with ``old_policy.max_staleness`` it is how far the
    stale sampler lies from the weights that train on its data.

    Both measure against the old policy the objective bounds, the rollout's cached log-probs and
    sparse rows: under ``model.corrections.anchor: behaviour`` the sampler, as above; under
    ``proximal`` the weights the rollout's update starts from, so ``kl_start`` is 0 at every
    rollout whatever the staleness, ``kl_end`` is how far the update moved from them, and ``kl_end_sampled`` is
    biased (its tokens come from the stale sampler, not from that old policy). How far the stale
    sampler lies from the weights is then ``rollout/proximal_is_weight_mean`` (1 when it is not
    stale) and ``rollout/proximal_is_capped_frac``.

    Args:
        histogram_every_n_rollouts: how often the per-token histograms (and, in W&B and MLflow,
            the chart of KL against the bound) are written; 0 = never.
        kl_end: log the KL at the end of each rollout (one more forward pass per rollout).
        kl_start: log the KL at the start of each rollout (one more forward pass per rollout).
    """

    def __init__(
        self, histogram_every_n_rollouts: int = 10, kl_end: bool = False, kl_start: bool = False
    ) -> None:
        if histogram_every_n_rollouts < 0:
            raise ValueError(
                "trust_region_monitor.histogram_every_n_rollouts must be an integer >= 0; got "
                f"{histogram_every_n_rollouts}"
            )
        for name, value in (("kl_end", kl_end), ("kl_start", kl_start)):
            if not isinstance(value, bool):
                raise ValueError(
                    f"trust_region_monitor.{name} must be true or false; got {value!r}"
                )
        self.histogram_every_n_rollouts = histogram_every_n_rollouts
        self.kl_end = kl_end
        self.kl_start = kl_start
        self._start: tuple[Tensor, Tensor] | None = None
        """This rollout's KL at its start (lumped, sampled), until it is logged."""
        self.rollouts = 0
        self.kl_history: list[list[float]] = []
        """[step, kl_after_max, kl_after_mean, bound] of every TROLL rollout, for the chart."""
        self.troll = _Reductions(
            {
                "trust_region/kl_before_mean": MeanMetric,
                "trust_region/kl_before_max": MaxMetric,
                "trust_region/kl_after_mean": MeanMetric,
                "trust_region/kl_after_max": MaxMetric,
                "trust_region/active_frac": MeanMetric,
                "trust_region/infeasible_frac": MeanMetric,
                "trust_region/eta_mean": MeanMetric,
                "trust_region/eta_max": MaxMetric,
            }
        )
        self.end, self.start = (
            _Reductions(
                {
                    f"trust_region/kl_{at}_mean": MeanMetric,
                    f"trust_region/kl_{at}_max": MaxMetric,
                    f"trust_region/kl_{at}_sampled": MeanMetric,
                }
            )
            for at in ("end", "start")
        )
        self.clip = _Reductions(
            {
                "clip/active_frac": MeanMetric,
                "clip/low_frac": MeanMetric,
                "clip/high_frac": MeanMetric,
                "clip/approx_kl": MeanMetric,
            }
        )

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.troll.to(pl_module.device)
        self.clip.to(pl_module.device)
        self.end.to(pl_module.device)
        self.start.to(pl_module.device)
        if (self.kl_end or self.kl_start) and stage == "fit":
            pl_module.keep_old_distributions()  # clipping caches them once asked; TROLL always

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._add_layout(trainer)

    @rank_zero_only
    def _add_layout(self, trainer: Trainer) -> None:
        charts = {
            _KL_CHART: ["trust_region/kl_after_max", "trust_region/kl_after_mean", _BOUND],
            "KL before projection": ["trust_region/kl_before_max", "trust_region/kl_before_mean"],
        }
        each_logger(trainer, declare_chart, "trust region", charts)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._draw_chart(trainer)

    @rank_zero_only
    def _draw_chart(self, trainer: Trainer) -> None:
        """kl_after (max, mean) against the bound over every rollout so far, in loggers that
        draw charts from data (W&B, MLflow)."""
        if self.kl_history:
            steps = [int(row[0]) for row in self.kl_history]
            keys = ["trust_region/kl_after_max", "trust_region/kl_after_mean", _BOUND]
            series = {k: [row[i + 1] for row in self.kl_history] for i, k in enumerate(keys)}
            each_logger(trainer, write_chart, _KL_CHART, steps, series, logged_step(trainer))

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stats = pl_module.last_stats
        if not stats:
            return
        self.rollouts += 1
        if isinstance(stats[0], TrollStats):
            self._log_troll(trainer, pl_module, stats)
        elif isinstance(stats[0], ClipStats):
            self._log_clip(pl_module, stats)
        if self.kl_end and pl_module.minibatch_loop.last_minibatch is not None:
            kl = pl_module.kl_to_behaviour(pl_module.minibatch_loop.last_minibatch)
            pl_module.log_dict(self._kl_figures(self.end, "end", *kl))
        if self._start is not None:
            pl_module.log_dict(self._kl_figures(self.start, "start", *self._start))
            self._start = None

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer):
        loop = getattr(pl_module, "minibatch_loop", None)
        first = loop is not None and loop.last_minibatch is None and self._start is None
        if self.kl_start and first and loop.current_minibatch is not None:
            # the weights are still those the rollout started with: the step comes after this
            self._start = pl_module.kl_to_behaviour(loop.current_minibatch)

    @staticmethod
    def _kl_figures(reductions: _Reductions, at: str, lumped: Tensor, sampled: Tensor) -> dict:
        return reductions.compute(
            {
                f"trust_region/kl_{at}_mean": lumped,
                f"trust_region/kl_{at}_max": lumped,
                f"trust_region/kl_{at}_sampled": sampled,
            }
        )

    def _log_troll(self, trainer, pl_module, stats: list[TrollStats]) -> None:
        cat = lambda name: torch.cat([getattr(s.projection, name) for s in stats])  # noqa: E731
        kl_before, kl_after, eta = cat("kl_before"), cat("kl_after"), cat("eta")
        infeasible = eta.isinf()  # (N,)
        finite_eta = eta[~infeasible]
        values = self.troll.compute(
            {
                "trust_region/kl_before_mean": kl_before,
                "trust_region/kl_before_max": kl_before,
                "trust_region/kl_after_mean": kl_after,
                "trust_region/kl_after_max": kl_after,
                "trust_region/active_frac": (eta > 0).float(),
                "trust_region/infeasible_frac": infeasible.float(),
                "trust_region/eta_mean": finite_eta,
                "trust_region/eta_max": finite_eta,
            }
        )
        bound = pl_module.objective.projection.eps
        values["trust_region/bound"] = torch.tensor(bound)
        values["trust_region/max_violation"] = (
            values["trust_region/kl_after_max"] / bound - 1
        ).clamp_min(0)
        pl_module.log_dict(values)
        pl_module.log("kl", values["trust_region/kl_after_mean"], prog_bar=True, logger=False)
        self.kl_history.append(
            [logged_step(trainer) if trainer is not None else self.rollouts]
            + [
                float(values[k])
                for k in ("trust_region/kl_after_max", "trust_region/kl_after_mean")
            ]
            + [float(bound)]
        )
        every = self.histogram_every_n_rollouts
        if every and (self.rollouts - 1) % every == 0:
            support = torch.cat([s.projection.support_size for s in stats])
            per_token = {"kl_before": kl_before, "kl_after": kl_after, "eta": finite_eta}
            self._histograms(trainer, {**per_token, "support_size": support})
            self._draw_chart(trainer)

    def _log_clip(self, pl_module, stats: list[ClipStats]) -> None:
        ratios = torch.cat([s.token_ratio for s in stats]).clamp_min(1e-12)
        tokens = torch.stack([s.num_tokens for s in stats])  # (parts,)
        # each part's share weighted by its tokens: pooled by token, as TROLL's shares are
        per_step = lambda name: (torch.stack([getattr(s, name) for s in stats]), tokens)  # noqa: E731
        values = self.clip.compute(
            {
                "clip/active_frac": per_step("clip_frac"),
                "clip/low_frac": per_step("clip_frac_low"),
                "clip/high_frac": per_step("clip_frac_high"),
                "clip/approx_kl": ratios - 1 - ratios.log(),
            }
        )
        pl_module.log_dict(values)
        pl_module.log("kl", values["clip/approx_kl"], prog_bar=True, logger=False)

    @rank_zero_only
    def _histograms(self, trainer: Trainer, values: dict[str, Tensor]) -> None:
        for name, value in values.items():
            if value.numel():
                tag = f"trust_region/{name}_per_token"
                each_logger(trainer, write_histogram, tag, value, logged_step(trainer))

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"rollouts": self.rollouts, "kl_history": [list(r) for r in self.kl_history]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rollouts = state_dict["rollouts"]
        self.kl_history = [list(r) for r in state_dict.get("kl_history", [])]


class SparsityCoverageMonitor(Callback):
    """Logs how well the sparse supports cover the distributions (TROLL runs).

    ``sparsity/coverage_{min,mean,max}``: old-policy mass held by its kept tokens (1 - tail);
    ``sparsity/support_{min,mean,max}``: tokens |U| each projection ran on.
    """

    def __init__(self) -> None:
        self.reductions = _Reductions(
            {
                f"sparsity/{name}_{stat}": metric
                for name in ("coverage", "support")
                for stat, metric in (("min", MinMetric), ("mean", MeanMetric), ("max", MaxMetric))
            }
        )

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.reductions.to(pl_module.device)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stats = pl_module.last_stats
        if not stats or not isinstance(stats[0], TrollStats):
            return
        coverage = torch.cat([s.projection.coverage for s in stats])
        support = torch.cat([s.projection.support_size for s in stats])
        values = self.reductions.compute(
            {
                f"sparsity/{name}_{stat}": value
                for name, value in (("coverage", coverage), ("support", support))
                for stat in ("min", "mean", "max")
            }
        )
        pl_module.log_dict(values)
        pl_module.log("coverage", values["sparsity/coverage_min"], prog_bar=True, logger=False)
