"""TROLL: the importance ratio of the projected policy, and a regression onto it.

    J_TROLL = agg_t[ pi_proj(o_t) / pi_old(o_t) * A_t ] - alpha * agg_t[ KL(pi_new || sg(pi_proj)) ]

The projection is :class:`~lightning_troll.trust_region.projection.TrustRegionProjection`; the
importance level, aggregation, penalties and the two-stage computation are
:class:`~lightning_troll.objectives.base.PolicyObjective`'s (notation there: B sequences,
T response positions, V vocabulary, N response tokens, n rows of one chunk). Nothing here
imports Lightning or transformers.
"""

from __future__ import annotations

import math

import torch

from lightning_troll.objectives.base import PolicyObjective, TokenTerms
from lightning_troll.objectives.chunking import HiddenRows
from lightning_troll.objectives.options import TrustRegionConfig
from lightning_troll.objectives.stats import TrollStats
from lightning_troll.trust_region.projection import TrustRegionProjection

__all__ = ["TrollObjective"]


class TrollObjective(PolicyObjective):
    """TROLL: the ratio uses the projected policy, plus a regression of pi_new onto pi_proj.

    Args:
        eps: KL bound per token, > 0.
        alpha: weight of the regression term KL(pi_new || sg(pi_proj)), >= 0.
        max_tokens: the most tokens kept per row by probability, >= 1.
        mass_delta: stop keeping tokens once their mass reaches ``1 - mass_delta``, in [0, 1).
        keep_sampled_token: always add the sampled token to the projection's support (see
            :class:`~lightning_troll.trust_region.projection.TrustRegionProjection`); the behaviour policy's
            cached distributions should then hold it too (``sparsify(..., keep=tokens)``).
        support: ``union``, ``official`` or ``dense`` (:mod:`lightning_troll.trust_region.supports`); with
            ``dense`` the objective's ``old`` is the old policy's logit rows (an ``(N, V)``
            tensor, or :class:`~lightning_troll.objectives.chunking.HiddenRows`) instead of sparse rows.
        compile_solver: the projection's root finder through ``torch.compile``: True, False or
            'auto' (on a GPU only).
        **kwargs: see :class:`PolicyObjective`.
    """

    _stats_type = TrollStats

    def __init__(
        self,
        eps: float = TrustRegionConfig.eps,
        alpha: float = TrustRegionConfig.alpha,
        max_tokens: int = TrustRegionConfig.max_tokens,
        mass_delta: float = TrustRegionConfig.mass_delta,
        keep_sampled_token: bool = TrustRegionConfig.keep_sampled_token,
        support: str = TrustRegionConfig.support,
        compile_solver: bool | str = TrustRegionConfig.compile_solver,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if not (alpha >= 0 and math.isfinite(alpha)):
            raise ValueError(f"alpha must be a finite number >= 0; got {alpha!r}")
        self.alpha = float(alpha)
        self.projection = TrustRegionProjection(
            eps=eps,
            max_tokens=max_tokens,
            mass_delta=mass_delta,
            keep_token=keep_sampled_token,
            support=support,
            compile_solver=compile_solver,
        )

    @property
    def needs_old_logits(self) -> bool:
        """Whether ``old`` must be the old policy's logit rows (``support: dense``)."""
        return self.projection.needs_old_logits

    @property
    def _regression_weight(self) -> float:  # type: ignore[override]
        return self.alpha

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}"

    def _check_rows(self, tokens, old, vocab) -> None:
        """The projection's checks of the token ids, once for the whole batch: one wait on the
        device per call, where each chunk (and its recomputation in the backward pass) would
        wait again."""
        if old is None:
            raise ValueError("TrollObjective needs old: the behaviour policy's SparseDistribution")
        if isinstance(old, HiddenRows):
            with torch.no_grad():
                old = old.select(slice(0, 0)).logits()  # (0, V): the vocabulary, no rows
        if vocab is None:
            vocab = old.shape[-1] if isinstance(old, torch.Tensor) else old.vocab_size
        self.projection.check_tokens(tokens, old, vocab)

    def _token_terms(self, rows, tokens, old) -> TokenTerms:
        if isinstance(old, HiddenRows):
            with torch.no_grad():
                old = old.logits()  # (n, V)
        # The per-row shape checks run here; the token values were checked in _check_rows.
        result = self.projection(rows, old, tokens, check_values=False)
        return TokenTerms(
            result.logprob,
            result.new_logprob,
            result.regression_kl,
            projection=result.detach(),
        )

    def _token_stats(self, terms: TokenTerms) -> dict:
        projected = terms.projection.eta > 0  # (N,)
        count = max(projected.numel(), 1)
        return {
            "projection": terms.projection,
            "active_frac": projected.sum() / count,
            "infeasible_frac": terms.projection.infeasible.sum() / count,
        }

    def _surrogate(self, ratio, adv, response):
        return ratio * adv, {}
