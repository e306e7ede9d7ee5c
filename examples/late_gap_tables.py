"""Tables and plots of the late-gap branch test (:mod:`late_gap_branches`)."""

from __future__ import annotations

from pathlib import Path


def report(out: Path, trunks: list[dict], branches: list[dict]) -> None:
    print(f"{len(trunks)} trunks and {len(branches)} branches finished")
