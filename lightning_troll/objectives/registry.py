"""The objectives by name: ``model.objective`` picks one of :data:`OBJECTIVES`."""

from __future__ import annotations

from lightning_troll.objectives.base import PolicyObjective, check_choice
from lightning_troll.objectives.clip import ClipObjective
from lightning_troll.objectives.troll import TrollObjective

__all__ = ["OBJECTIVES", "build_objective"]


OBJECTIVES: dict[str, type[PolicyObjective]] = {"troll": TrollObjective, "clip": ClipObjective}


def build_objective(name: str, **kwargs) -> PolicyObjective:
    """An objective by name (``troll`` or ``clip``) with its keyword arguments."""
    return OBJECTIVES[check_choice("objective", name, OBJECTIVES)](**kwargs)
