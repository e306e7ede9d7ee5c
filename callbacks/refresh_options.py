"""The ``old_policy`` options' checks and the warnings a fit gives at its start about them:
:func:`check_refresh` (also called by the command line before the model loads),
:func:`one_step_trap` (every optimiser step on-policy) and :func:`idle_proximal` (a proximal
anchor with nothing to correct). :class:`~lightning_troll.callbacks.old_policy.OldPolicyRefresh`
calls them."""

from __future__ import annotations

import math
from typing import Any

from lightning_troll.models.snapshots import SnapshotConfig
from lightning_troll.training.preflight import field_of
from lightning_troll.training.staleness import MAX_STALENESS

__all__ = [
    "check_refresh",
    "check_staleness_world",
    "check_versions_fit",
    "rollouts_of_run",
    "idle_proximal",
    "one_step_trap",
    "shared_cannot_lag",
]


def check_refresh(
    every_n_rollouts: int, max_staleness: int, snapshot: Any = None, lora: Any = None
) -> None:
    """Refuses ``old_policy`` options that cannot work, in one line naming the option; with the
    module's ``snapshot`` options and ``lora`` (records or the command line's dicts), a lagging
    snapshot that is the policy itself and a stale sampler on a snapshot that cannot hold past
    versions too. The command line calls it before
    the model loads."""
    if (
        isinstance(every_n_rollouts, bool)
        or not isinstance(every_n_rollouts, int)
        or every_n_rollouts < 1
    ):
        raise ValueError(
            f"old_policy.every_n_rollouts must be an integer >= 1; got {every_n_rollouts!r}"
        )
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(f"old_policy.max_staleness must be an integer >= 0; got {max_staleness!r}")
    if max_staleness > MAX_STALENESS:
        raise ValueError(
            f"old_policy.max_staleness must be at most {MAX_STALENESS} (each version of lag keeps "
            f"one more copy of the weights on the CPU and in every checkpoint); got {max_staleness}"
        )
    if max_staleness and every_n_rollouts > 1:
        raise ValueError(
            f"old_policy.every_n_rollouts={every_n_rollouts} and old_policy.max_staleness="
            f"{max_staleness} both make the sampler lag; set one of them"
        )
    if every_n_rollouts > 1 and field_of(snapshot, SnapshotConfig, "mode") == "shared":
        raise ValueError(shared_cannot_lag(every_n_rollouts))
    if not max_staleness:
        return
    mode, dtype = (field_of(snapshot, SnapshotConfig, f) for f in ("mode", "dtype"))
    if mode != "copy" or dtype == "int8" or lora is not None:
        raise ValueError(
            f"old_policy.max_staleness={max_staleness} keeps past versions of the weights to load "
            "into the snapshot, which needs model.snapshot.mode 'copy' with dtype 'same' or "
            f"'bfloat16' and no model.lora; got mode {mode!r}, dtype {dtype!r}"
            + (" and LoRA" if lora is not None else "")
        )


def check_staleness_world(max_staleness: int, world: int) -> None:
    """Refuses ``old_policy.max_staleness`` above 0 in a run of ``world`` processes, more than
    one (checked before the model loads where ``trainer.devices`` says how many, else at
    setup)."""
    if max_staleness and world > 1:
        raise ValueError(
            f"old_policy.max_staleness={max_staleness} runs in one process for now; this run has "
            f"{world} (trainer.devices x trainer.num_nodes): set max_staleness 0, or one device"
        )


def shared_cannot_lag(every_n_rollouts: int) -> str:
    """The refusal of ``old_policy.every_n_rollouts`` above 1 with a shared snapshot."""
    return (
        f"old_policy.every_n_rollouts={every_n_rollouts} needs a snapshot that can lag behind the "
        "policy, but model.snapshot.mode='shared' makes the snapshot the policy itself; use "
        "old_policy.every_n_rollouts 1 or model.snapshot.mode 'copy'"
    )


def one_step_trap(
    epochs_per_rollout: int,
    minibatch_size: int | None,
    rollout_sequences: int | None,
    every_n_rollouts: int,
    objective: str = "troll",
    max_staleness: int = 0,
    anchor: str = "behaviour",
) -> str | None:
    """The warning for a configuration whose every optimiser step is on-policy, else None.

    One epoch over a rollout taken as one minibatch (``minibatch_size`` null, or at least the
    ``rollout_sequences``) makes one step per rollout. With the snapshot refreshed after every
    rollout and no staleness, or under ``model.corrections.anchor: proximal`` whatever the snapshot
    (the old policy is then the current weights before the rollout's update), that step starts
    from the very policy the objective bounds it against: the importance ratios are 1, the
    projection (or the clip) never acts, and the update is a plain policy gradient.
    """
    one_minibatch = minibatch_size is None or (
        rollout_sequences is not None and minibatch_size >= rollout_sequences
    )
    lags = every_n_rollouts != 1 or max_staleness > 0
    proximal = anchor == "proximal"
    if epochs_per_rollout != 1 or not one_minibatch or (lags and not proximal):
        return None
    acts = "TROLL's projection" if objective == "troll" else "the clip"
    size = f"{rollout_sequences} sequences" if rollout_sequences is not None else "the rollout"
    smaller = f"below {rollout_sequences}" if rollout_sequences is not None else "to a number"
    if proximal:
        old = (
            "model.corrections.anchor='proximal' takes the old policy from the current weights before "
            "each rollout's update, whatever the sampler"
        )
    else:
        old = "old_policy.every_n_rollouts=1 refreshes the snapshot after each"
    fixes = [
        f"model.optimization.minibatch_size {smaller} (data.batch_size x model.group_size "
        "sequences make a rollout)",
        "model.optimization.epochs_per_rollout above 1",
    ]
    if not proximal:
        fixes += ["old_policy.every_n_rollouts above 1", "old_policy.max_staleness above 0"]
    return (
        f"every optimiser step is on-policy: model.optimization.epochs_per_rollout=1 and "
        f"model.optimization.minibatch_size={minibatch_size} (one minibatch of {size}) take one "
        f"step per rollout, and {old}, so the policy equals the old policy at every step, "
        f"{acts} never acts and the update is a plain policy gradient. For off-policy steps set "
        + ", ".join(fixes[:-1])
        + f", or {fixes[-1]}"
    )


def idle_proximal(
    anchor: str, every_n_rollouts: int, max_staleness: int, snapshot: Any = None
) -> str | None:
    """The warning for ``model.corrections.anchor: proximal`` where the sampler always holds the current
    weights, else None: a shared snapshot (the policy itself), or a copy in the policy's dtype
    refreshed after every rollout with no staleness. The proximal policy is then the sampler, its
    weight is 1 (up to rounding) and its forward pass per rollout buys nothing. A snapshot in
    another dtype differs from the policy by its rounding, which the anchor does correct."""
    if anchor != "proximal":
        return None
    mode, dtype = (field_of(snapshot, SnapshotConfig, f) for f in ("mode", "dtype"))
    if mode == "shared":
        why = "model.snapshot.mode='shared' makes the sampler the policy itself"
    elif every_n_rollouts == 1 and not max_staleness and dtype == "same":
        why = (
            "old_policy.max_staleness=0 and old_policy.every_n_rollouts=1 refresh the sampler "
            "with the current weights after every rollout"
        )
    else:
        return None
    return (
        f"model.corrections.anchor='proximal' has nothing to correct: {why}, so the proximal policy is "
        "the sampler, the proximal-over-behaviour weight is 1 and the anchor's extra forward "
        "pass per rollout buys nothing; for stale data set old_policy.max_staleness (with "
        "model.snapshot.mode 'copy'), or use model.corrections.anchor 'behaviour'"
    )


def check_versions_fit(
    max_staleness: int,
    version_bytes: int,
    available: int | None,
    run_rollouts: int | None,
) -> str:
    """What ``max_staleness`` kept versions of ``version_bytes`` each cost, as a line to print at
    a fit's start (with a warning's words where the run's ``run_rollouts`` never reach the lag:
    the sampler then stays at the starting weights throughout); refuses, in one line, a lag the
    host's ``available`` memory cannot hold."""
    held = max_staleness * version_bytes
    if available is not None and held > available:
        raise ValueError(
            f"old_policy.max_staleness={max_staleness} keeps {max_staleness} versions of the "
            f"weights on the CPU ({max_staleness} x {_size(version_bytes)} = {_size(held)}), more "
            f"than the {_size(available)} this host has free; lower it to at most "
            f"{available // max(version_bytes, 1)}"
        )
    outlasts = ""
    if run_rollouts is not None and max_staleness >= run_rollouts:
        outlasts = (
            f"; it is not below the run's {run_rollouts} rollouts, so the starting weights sample "
            "every rollout of this run"
        )
    return (
        f"old_policy.max_staleness={max_staleness} keeps {max_staleness} past "
        f"version{'s' if max_staleness != 1 else ''} of the weights on the CPU and in every "
        f"checkpoint: {max_staleness} x {_size(version_bytes)} = "
        f"{_size(held)}{outlasts}"
    )


def rollouts_of_run(max_steps: int, epochs: int, minibatch: int | None, sequences: int | None):
    """Rollouts a run of ``max_steps`` optimiser steps trains (None where not known): each rollout
    of ``sequences`` takes ``epochs`` passes of minibatches of ``minibatch`` sequences."""
    if max_steps is None or max_steps < 1 or sequences is None:
        return None
    per_rollout = epochs * (1 if minibatch is None else math.ceil(sequences / minibatch))
    return math.ceil(max_steps / per_rollout)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
