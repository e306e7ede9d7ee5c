"""The KL trust-region projection of token distributions (TROLL's maths).

- :mod:`~lightning_troll.trust_region.sparse`: the few tokens that carry almost all of a row's
  probability (:func:`sparsify`, :class:`SparseDistribution`);
- :mod:`~lightning_troll.trust_region.kl_solver`: the projection on dense ``(M, C)`` arrays, the
  root finder for eta* and the implicit gradient through it;
- :mod:`~lightning_troll.trust_region.union`, :mod:`~lightning_troll.trust_region.supports`: the
  supports a projection runs on (union with a rest bucket; official; dense);
- :mod:`~lightning_troll.trust_region.projection`: the layer :class:`TrustRegionProjection`.

Torch only: nothing here imports Lightning or transformers, nor any other part of the package.
"""

from lightning_troll.trust_region.projection import (
    SUPPORTS,
    ProjectionResult,
    SparseDistribution,
    TrustRegionProjection,
    kl_projection,
    sparsify,
)

__all__ = [
    "SUPPORTS",
    "ProjectionResult",
    "SparseDistribution",
    "TrustRegionProjection",
    "kl_projection",
    "sparsify",
]
