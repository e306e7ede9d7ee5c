"""A study run's CSV logs (one ``version_<k>`` folder per attempt, as Lightning's CSVLogger
writes them): the kept metrics per rollout, merged over attempts (:func:`read_history`), and the
attempts and seconds the run took (:func:`attempts_spent`), for :mod:`study_kit`."""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "TIME",
    "attempts_spent",
    "kept",
    "log_versions",
    "measured_attempts",
    "read_history",
]

TIME = "time/iteration"
"""The metric that times a rollout (sampling and optimiser steps)."""


def kept(name: str, metrics: Sequence[str]) -> bool:
    """Whether the logged metric ``name`` is one of ``metrics``: a name, or a prefix ending in
    ``/`` that keeps every metric under it (``trust_region/`` keeps all the monitor logs)."""
    return name in metrics or any(m.endswith("/") and name.startswith(m) for m in metrics)


def log_versions(log_root: Path) -> list[int]:
    """The attempts' CSV log versions under ``log_root`` (``version_<k>``), in order."""
    found = (re.fullmatch(r"version_(\d+)", p.name) for p in log_root.glob("version_*"))
    return sorted(int(m.group(1)) for m in found if m)


def read_history(log_root: Path, metrics: Sequence[str]) -> list[dict[str, float]]:
    """Per rollout, ``metrics`` (names, or prefixes: :func:`kept`) of every attempt's CSV log
    (``log_root/version_<k>``) merged in attempt order, a later attempt's rows replacing the
    rollouts it ran again. Lightning's logging step counts rollouts from 0: rollout r (from 1)
    is step r - 1."""
    versions = [log_root / f"version_{v}" for v in log_versions(log_root)]
    rollouts: dict[int, dict[str, float]] = {}
    for path in (p for p in versions if (p / "metrics.csv").exists()):
        rows: dict[int, dict[str, float]] = {}
        with (path / "metrics.csv").open() as f:
            for row in csv.DictReader(f):
                rollout = int(row["step"]) + 1
                merged = rows.setdefault(rollout, {"rollout": rollout})
                merged.update({k: float(v) for k, v in row.items() if kept(k, metrics) and v != ""})
        rollouts.update(rows)
    return [rollouts[r] for r in sorted(rollouts)]


def measured_attempts(path: Path, log_root: Path) -> dict[str, float]:
    """The seconds of a run's attempts that returned, by log version, from ``path``
    (``attempts.json``); a list, as older runs kept it, holds the last attempts' seconds."""
    if not path.exists():
        return {}
    stored = json.loads(path.read_text())
    if isinstance(stored, dict):
        return stored
    latest = zip(reversed(log_versions(log_root)), reversed(stored), strict=False)
    return {str(v): seconds for v, seconds in latest}


def attempts_spent(log_root: Path, measured: dict[str, float]) -> tuple[float, int]:
    """(seconds, attempts) of a run: each log version is an attempt. One that returned counts
    its measured seconds; one whose process was killed (a session's end) counts the sum of its
    rollouts' ``time/iteration``, which leaves out its start-up and validations."""
    seconds = 0.0
    versions = log_versions(log_root)
    for version in versions:
        if str(version) in measured:
            seconds += measured[str(version)]
        elif (log := log_root / f"version_{version}" / "metrics.csv").exists():
            with log.open() as f:
                seconds += sum(float(row[TIME]) for row in csv.DictReader(f) if row.get(TIME))
    return seconds, len(versions)
