"""The statistics records the policy objectives return: detached tensors, read by the monitors.

Every objective returns ``(loss, stats)``; ``stats`` is an :class:`ObjectiveStats` (a
:class:`ClipStats` or :class:`TrollStats` for the two built-in objectives). Scalars are 0-d
tensors, per-token tensors are ``(N,)`` with N response tokens. Nothing here imports Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from lightning_troll.trust_region.projection import ProjectionResult

__all__ = ["ClipStats", "ObjectiveStats", "TrollStats"]


@dataclass(frozen=True)
class ObjectiveStats:
    """What every objective reports; scalars are 0-d tensors, per-token tensors are (N,)."""

    loss: Tensor
    policy_loss: Tensor
    regression_loss: Tensor
    ref_kl: Tensor
    entropy: Tensor
    ratio_mean: Tensor
    ratio_min: Tensor
    ratio_max: Tensor
    num_tokens: Tensor
    token_ratio: Tensor
    """(N,) importance ratio of each response token."""
    token_old_prob: Tensor
    """(N,) the old policy's probability of each sampled token (its confidence): the behaviour
    policy's, or under ``model.corrections.anchor: proximal`` the proximal policy's."""
    token_advantage: Tensor
    """(N,) the advantage each response token is trained with."""

    def constraint_masks(self) -> dict[str, Tensor]:
        """(N,) bool per way the objective's constraint acts on a token, by name (none for an
        objective without a constraint)."""
        return {}


@dataclass(frozen=True)
class ClipStats(ObjectiveStats):
    clip_frac_low: Tensor
    """Fraction of tokens with A < 0 and r < 1 - eps_low (no gradient)."""
    clip_frac_high: Tensor
    """Fraction of tokens with A > 0 and r > 1 + eps_high (no gradient)."""
    dual_clip_frac: Tensor
    """Fraction of tokens with A < 0 and r > dual_clip (no gradient)."""
    token_clipped: Tensor
    """(N,) bool: the clip stops the token's gradient (the three cases above)."""
    token_outside: Tensor
    """(N,) bool: the ratio lies outside [1 - eps_low, 1 + eps_high], in either direction,
    whatever the advantage's sign."""

    @property
    def clip_frac(self) -> Tensor:
        return self.clip_frac_low + self.clip_frac_high + self.dual_clip_frac

    def constraint_masks(self) -> dict[str, Tensor]:
        """``clipped``: the gradient is stopped; ``outside``: the ratio left its range."""
        return {"clipped": self.token_clipped, "outside": self.token_outside}


@dataclass(frozen=True)
class TrollStats(ObjectiveStats):
    projection: ProjectionResult
    """Per-token projection outputs (kl_before, kl_after, eta, coverage, support_size), detached."""
    active_frac: Tensor
    """Fraction of tokens whose distribution was projected (eta > 0)."""
    infeasible_frac: Tensor
    """Fraction of tokens whose bound no interpolation reaches (eta = inf; see
    :attr:`~lightning_troll.trust_region.projection.ProjectionResult.infeasible`)."""

    def constraint_masks(self) -> dict[str, Tensor]:
        """``projected``: the token's distribution was moved onto the bound (eta > 0)."""
        return {"projected": self.projection.eta > 0}
