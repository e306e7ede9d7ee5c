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
    "check_compile_solver",
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
COMPILE_SOLVER = "auto"
"""Compile the root finder's steps (``torch.compile``) where the projected rows are on a GPU, and
run them eagerly elsewhere. On a GPU the host launching the eager steps' small kernels one by one
is most of TROLL's extra time (the fourth GPU report: TROLL's step x1.39 of clipping's at the
Qwen3-4B shape, x1.13 compiled); on a CPU the compile needs a C++ compiler and pays back little."""


def check_compile_solver(value: object) -> bool | str:
    """``value`` if it is True, False or 'auto'; else a ValueError that says what is allowed."""
    if value is True or value is False or value == "auto":
        return value  # type: ignore[return-value]
    raise ValueError(f"compile_solver must be True, False or 'auto'; got {value!r}")


def check_keep_token(support: str, keep_token: bool) -> None:
    """The official support always holds the sampled token: refuses ``keep_token`` False there."""
    if support == "official" and not keep_token:
        raise ValueError(
            "trust_region.keep_sampled_token=False needs trust_region.support 'union' or "
            "'dense': the official support always holds the sampled token"
        )
