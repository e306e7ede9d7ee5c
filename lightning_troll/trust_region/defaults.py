"""The projection's defaults, written once: ``TrustRegionProjection()``, ``TrollObjective()`` and
the configuration's ``model.trust_region`` all take them from here. Nothing here imports torch."""

from __future__ import annotations

__all__ = [
    "COMPILE_SOLVER",
    "EPS",
    "KEEP_TOKEN",
    "MASS_DELTA",
    "MAX_TOKENS",
    "SUPPORT",
    "check_keep_token",
]

EPS = 0.05
"""KL bound per token."""
MAX_TOKENS = 256
"""The most tokens kept per distribution (the paper keeps 64; with the official support, 256 keeps
the loss gradient within 3% of the exact projection's on SmolLM2, 64 within 8%)."""
MASS_DELTA = 1e-5
"""Keep tokens until their mass reaches 1 - mass_delta."""
KEEP_TOKEN = True
"""Always add the sampled token to the sparse supports."""
SUPPORT = "official"
"""The old policy's kept tokens, as the paper describes its sparsification."""
COMPILE_SOLVER = False
"""Run the root finder's steps eagerly: compiling them (``torch.compile``) fuses each step's
kernels, but costs a compile in every process and has not yet been timed on a GPU."""


def check_keep_token(support: str, keep_token: bool) -> None:
    """The official support always holds the sampled token: refuses ``keep_token`` False there."""
    if support == "official" and not keep_token:
        raise ValueError(
            "trust_region.keep_sampled_token=False needs trust_region.support 'union' or "
            "'dense': the official support always holds the sampled token"
        )
