"""Faults that stop a run cleanly: one line for the user, a documented exit status, nothing lost.

A :class:`RunFault` raised during training (a checkpoint that found no room) ends the fit; the
``lightning-troll`` command prints its message on one line and exits with
:data:`FAULT_EXIT_CODE`. What the run trained up to its last checkpoint is in that checkpoint,
which the message names. Nothing here imports Lightning.
"""

from __future__ import annotations

__all__ = ["FAULT_EXIT_CODE", "RunFault"]

FAULT_EXIT_CODE = 3
"""The exit status of a run stopped by a :class:`RunFault` (2 is bad input found before
training; 128 + N a stop by signal N)."""


class RunFault(RuntimeError):
    """A fault during training that stops the run, told in one line (its message)."""
