"""Differentiable KL trust-region projection of token distributions (TROLL).

Per response token, with ``a = log pi_new`` (differentiable) and ``b = log pi_old`` (fixed),
the projection solves

    minimise KL(pi || pi_new)   subject to   KL(pi || pi_old) <= eps

whose solution is the geometric interpolation

    log pi_eta = (a + eta * b) / (1 + eta) - logZ(eta)

with ``eta* = 0`` when ``KL(pi_new || pi_old) <= eps`` (the identity) and otherwise the root of
``KL(pi_eta || pi_old) = eps``; the KL falls monotonically in ``eta``. The root is found by a
safeguarded Newton iteration in ``log eta`` and the gradient flows through ``eta*`` by implicit
differentiation (the exact gradient, not the "eta held fixed" shortcut).

No root exists when pi_new gives zero probability to tokens that hold ``1 - exp(-eps)`` or more
of pi_old's mass: every interpolation keeps those zeros, so its KL to pi_old never falls below
``-log pi_old(supp(pi_new)) >= eps``. Such a row is *infeasible*
(:attr:`ProjectionResult.infeasible`): it gets the limit ``eta* = inf``, pi_old restricted to
pi_new's support, as a constant (no gradient through its log-probs), and its KL after projection
is that floor, at or above the bound. Finite logits give every token some probability (the
sparse layer sums a rest mass too small for linear sums in log space), so only logits of -inf in
the new policy make a row infeasible (see :mod:`lightning_troll.trust_region.kl_solver`).

:func:`sparsify` keeps, per row, the most probable tokens of a distribution; the layer
:class:`TrustRegionProjection` runs the projection on one of three supports: by default the old
policy's kept tokens alone (``official``, :mod:`lightning_troll.trust_region.supports`, which also
holds the dense :func:`kl_projection`); the union of the old and new supports plus one lumped
"rest" bucket (:mod:`lightning_troll.trust_region.union`), whose cost is ``O(N * K)`` after one pass
over the vocabulary; or the whole vocabulary. Its defaults are
:mod:`lightning_troll.trust_region.defaults`, the configuration's too.

Notation (shape comments below use these letters):

    N   rows (response tokens)          V   vocabulary size
    K   kept tokens per row (old)       k   kept tokens per row (new), <= max_tokens
    L   union support U = S_old + S_new + {token}, before de-duplication
    C   categories of a projection problem (V dense, L + 1 sparse)
    M   rows whose bound is violated (the only rows the root finder sees)

Nothing here imports Lightning or transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

from lightning_troll.trust_region import defaults
from lightning_troll.trust_region.kl_solver import kl_terms
from lightning_troll.trust_region.sparse import (
    SparseDistribution,
    check_sparsity,
    check_tokens,
    compute_dtype,
    sparsify,
    token_range_error,
    tokens_out_of_range,
)
from lightning_troll.trust_region.supports import (
    OFFICIAL_NEEDS_TOKEN,
    SUPPORTS,
    check_support,
    dense_rows,
    kl_projection,
    misses_sampled_token,
    official_rows,
)
from lightning_troll.trust_region.union import lumped_problem, union_rows

__all__ = [
    "SUPPORTS",
    "ProjectionResult",
    "SparseDistribution",
    "TrustRegionProjection",
    "kl_projection",
    "sparsify",
]

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class ProjectionResult:
    """Per-row output of :class:`TrustRegionProjection`; masked rows hold zeros."""

    logprob: Tensor
    """(N,) projected log-probability of the token, differentiable."""
    new_logprob: Tensor
    """(N,) unprojected log-probability of the token under the new policy, differentiable."""
    old_logprob: Tensor
    """(N,) log-probability of the token under the old (sparse) distribution."""
    regression_kl: Tensor
    """(N,) KL(pi_new || stopgrad(pi_proj)) on the support plus rest bucket, differentiable."""
    kl_before: Tensor
    """(N,) KL(pi_new || pi_old) before projection."""
    kl_after: Tensor
    """(N,) KL(pi_proj || pi_old) after projection: <= eps up to solver tolerance, except on
    infeasible rows, where it is the smallest KL any interpolation reaches (>= eps)."""
    eta: Tensor
    """(N,) the dual variable eta* (0 where the bound was already met, inf on infeasible rows)."""
    coverage: Tensor
    """(N,) old-policy mass covered by its kept tokens."""
    support_size: Tensor
    """(N,) number of tokens |U| the projection ran on (the rest bucket not counted)."""

    @property
    def infeasible(self) -> Tensor:
        """(N,) bool: rows whose bound no interpolation reaches (eta* = inf)."""
        return self.eta.isinf()

    def detach(self) -> ProjectionResult:
        return ProjectionResult(**{f.name: getattr(self, f.name).detach() for f in fields(self)})


def _check_eps(eps: float) -> None:
    if not (isinstance(eps, (int, float)) and eps > 0 and math.isfinite(eps)):  # and NaN
        raise ValueError(f"eps must be a finite number > 0 (the KL bound); got {eps!r}")


def _check_old_rows(old: SparseDistribution, n: int, vocab: int) -> None:
    """Refuses sparse old rows that are not one per row over the vocabulary ``vocab``."""
    if old.num_rows != n or old.vocab_size != vocab:
        raise ValueError(
            f"old must have one row per row of new_logits and their vocabulary: (N, V) = "
            f"({n}, {vocab}); got {old.num_rows} rows over a vocabulary of {old.vocab_size}"
        )


# --------------------------------------------------------------------------------------------
# The sparse layer
# --------------------------------------------------------------------------------------------


class TrustRegionProjection(nn.Module):
    """Projects each row's new token distribution onto ``KL(. || pi_old) <= eps``, sparsely.

    The projection runs on the support ``U = S_old + S_new + {token}`` plus one rest bucket: S_old
    is the cached old distribution (:func:`sparsify`), S_new the new policy's most probable tokens
    chosen with the same ``max_tokens`` / ``mass_delta`` rule. Old mass outside S_old is spread
    uniformly over the ``V - |S_old|`` tokens it covers; the new rest mass is summed from the
    logits outside U. With ``max_tokens >= V`` and ``mass_delta = 0`` this equals
    :func:`kl_projection`. Rows whose bound no interpolation reaches get the limit eta* = inf
    (:attr:`ProjectionResult.infeasible`).

    With ``keep_token=False`` the sampled token joins U only if S_old or S_new holds it; otherwise
    it lies in the rest bucket, and the bucket's projected mass is shared out in proportion to the
    new policy: ``log pi_proj(token) = log pi_proj(rest) + log pi_new(token) - log pi_new(rest)``
    (the new policy's own log-prob wherever the projection is the identity).

    ``support`` chooses the categories the projection runs on (:mod:`lightning_troll.trust_region.supports`):
    ``union`` (above), ``official`` (the old policy's kept tokens only, both distributions
    renormalised there) or ``dense`` (the whole vocabulary: ``old`` is then the old policy's
    ``(N, V)`` logits, not its sparse rows). :meth:`kl_to_old`, which the monitors use, always
    measures on the union's lumped distributions.

    Args:
        eps: the KL bound per token, > 0 (0.05 in the paper).
        max_tokens: the most tokens kept per row by probability, >= 1 (64 in the paper).
        mass_delta: stop keeping tokens once their mass reaches ``1 - mass_delta``, in [0, 1).
        keep_token: always add the sampled token to the support U.
        support: ``union``, ``official`` or ``dense``.
        compile_solver: run the root finder for eta* through ``torch.compile``
            (:func:`~lightning_troll.trust_region.kl_solver.solve_eta`): each of its steps
            becomes a few fused kernels instead of some forty; the first projection compiles.
            True, False, or 'auto' (the default): compiled where the rows are on a GPU.
    """

    def __init__(
        self,
        eps: float = defaults.EPS,
        max_tokens: int = defaults.MAX_TOKENS,
        mass_delta: float = defaults.MASS_DELTA,
        keep_token: bool = defaults.KEEP_TOKEN,
        support: str = defaults.SUPPORT,
        compile_solver: bool | str = defaults.COMPILE_SOLVER,
    ) -> None:
        super().__init__()
        _check_eps(eps)
        check_sparsity(max_tokens, mass_delta)
        if not isinstance(keep_token, bool):
            raise ValueError(f"keep_token must be True or False; got {keep_token!r}")
        self.support = check_support(support)
        defaults.check_keep_token(support, keep_token)
        self.eps = float(eps)
        self.max_tokens = max_tokens
        self.mass_delta = float(mass_delta)
        self.keep_token = keep_token
        self.compile_solver = defaults.check_compile_solver(compile_solver)

    @classmethod
    def from_config(cls, config: Any) -> TrustRegionProjection:
        """The layer of an option record with ``model.trust_region``'s fields (a
        :class:`~lightning_troll.objectives.TrustRegionConfig`, whose ``keep_sampled_token`` is
        ``keep_token`` here), taken whole; its ``alpha`` weighs the objective's regression, not
        the layer."""
        return cls(
            eps=config.eps,
            max_tokens=config.max_tokens,
            mass_delta=config.mass_delta,
            keep_token=config.keep_sampled_token,
            support=config.support,
            compile_solver=config.compile_solver,
        )

    @property
    def needs_old_logits(self) -> bool:
        """Whether :meth:`forward` takes the old policy's full logits (``dense``) rather than
        its sparse rows."""
        return self.support == "dense"

    def extra_repr(self) -> str:
        return (
            f"eps={self.eps}, max_tokens={self.max_tokens}, mass_delta={self.mass_delta}, "
            f"keep_token={self.keep_token}, support={self.support}, "
            f"compile_solver={self.compile_solver!r}"
        )

    def forward(
        self,
        new_logits: Tensor,
        old: SparseDistribution | Tensor,
        tokens: Tensor,
        mask: Tensor | None = None,
        *,
        check_values: bool = True,
    ) -> ProjectionResult:
        """Projects every row (or every row where ``mask`` is True).

        Args:
            new_logits: ``(N, V)`` logits of the policy being trained.
            old: the old policy's sparse distributions, one row per row of ``new_logits``; for
                ``support='dense'`` its ``(N, V)`` logits instead.
            tokens: ``(N,)`` the sampled token of each row.
            mask: optional ``(N,)`` bool; rows where it is False are skipped (their results are 0
                and they get no gradient), so padding never produces NaNs.
            check_values: run :meth:`check_tokens`, which reads the tokens on the device (a host
                synchronisation). A caller that projects a batch chunk by chunk checks it once
                and passes False, as :class:`~lightning_troll.objectives.TrollObjective` does
                every step.
        """
        self._check_inputs(new_logits, old, tokens, mask)
        if check_values:
            self.check_tokens(tokens, old, new_logits.shape[1])
        if mask is None:
            return self._dispatch(new_logits, old, tokens)
        rows = mask.nonzero().squeeze(-1)  # (n,)
        old_rows = old[rows] if isinstance(old, Tensor) else old.select(rows)
        part = self._dispatch(new_logits[rows], old_rows, tokens[rows])
        n = new_logits.shape[0]
        return ProjectionResult(
            **{
                f.name: getattr(part, f.name).new_zeros(n).index_put((rows,), getattr(part, f.name))
                for f in fields(part)
            }
        )

    def _check_inputs(
        self,
        new_logits: Tensor,
        old: SparseDistribution | Tensor,
        tokens: Tensor,
        mask: Tensor | None,
        dense: bool | None = None,
        values: bool = False,
    ) -> None:
        """Refuses inputs of the wrong kind or shape; ``dense`` (default: this layer's support)
        says whether ``old`` must be (N, V) logits rather than sparse rows, ``values`` whether
        the tokens' range is checked too (a wait on the device; :meth:`check_tokens` checks it
        for :meth:`forward`)."""
        if new_logits.dim() != 2:
            raise ValueError(f"new_logits must be (N, V); got shape {tuple(new_logits.shape)}")
        n, vocab = new_logits.shape
        compute_dtype(new_logits)
        dense = self.needs_old_logits if dense is None else dense
        if dense != isinstance(old, Tensor):
            want = "the old policy's (N, V) logits" if dense else "the old policy's sparse rows"
            raise ValueError(
                f"old must be {want} here (support={self.support!r}); got {type(old).__name__}"
            )
        if isinstance(old, Tensor):
            if old.shape != new_logits.shape or old.device != new_logits.device:
                raise ValueError(
                    f"old logits must match new_logits: {tuple(new_logits.shape)} on "
                    f"{new_logits.device}; got {tuple(old.shape)} on {old.device}"
                )
            compute_dtype(old)
        else:
            _check_old_rows(old, n, vocab)
        if not isinstance(old, Tensor) and old.indices.device != new_logits.device:
            raise ValueError(
                f"old is on {old.indices.device} but new_logits on {new_logits.device}"
            )
        check_tokens(tokens, n, vocab, new_logits.device, "tokens", values)
        if mask is not None and (mask.shape != (n,) or mask.dtype != torch.bool):
            raise ValueError(
                f"mask must be a ({n},) bool tensor; got {tuple(mask.shape)} {mask.dtype}"
            )

    @torch.no_grad()
    def check_tokens(self, tokens: Tensor, old: SparseDistribution | Tensor, vocab: int) -> None:
        """Refuses token ids outside ``[0, vocab)`` and, with ``support='official'``, old rows
        that lack their sampled token; both read in one wait on the device.

        Args:
            tokens: ``(N,)`` the sampled tokens (their shape, dtype and device checked already).
            old: as in :meth:`forward`.
            vocab: the vocabulary size V.
        """
        if tokens.numel() == 0:
            return
        # official rows must hold their token; old of the wrong kind or device is refused by
        # forward's own checks
        official = (
            self.support == "official"
            and isinstance(old, SparseDistribution)
            and old.indices.device == tokens.device
        )
        if official:
            _check_old_rows(old, tokens.shape[0], vocab)
        out_of_range = tokens_out_of_range(tokens, vocab)
        bad = out_of_range | misses_sampled_token(old, tokens) if official else out_of_range
        if bool(bad):  # the one wait; which check failed is read only then
            if bool(out_of_range):
                raise token_range_error(tokens, vocab, "tokens")
            raise ValueError(OFFICIAL_NEEDS_TOKEN)

    @torch.no_grad()
    def kl_to_old(self, new_logits: Tensor, old: SparseDistribution, tokens: Tensor) -> Tensor:
        """(N,) KL(pi_new || pi_old) between the lumped distributions the projection works on (the
        support U plus the rest bucket): :meth:`forward`'s ``kl_before``, without projecting.

        Arguments as in :meth:`forward` (no mask); no gradient.
        """
        self._check_inputs(new_logits, old, tokens, None, dense=False, values=True)
        lumped = lumped_problem(self, new_logits, old, tokens, compute_dtype(new_logits))
        return kl_terms(lumped.a, lumped.b)[2]

    def _dispatch(self, x: Tensor, old, tokens: Tensor) -> ProjectionResult:
        eps = torch.full((x.shape[0],), self.eps, dtype=compute_dtype(x), device=x.device)
        compiled = self.compile_solver
        if self.support == "union":
            return ProjectionResult(**union_rows(self, x, old, tokens, eps, compiled))
        rows = official_rows if self.support == "official" else dense_rows
        return ProjectionResult(**rows(x, old, tokens, eps, compiled))
