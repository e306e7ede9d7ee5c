"""Lightning callbacks of lightning_troll (installed as ``lightning_troll.callbacks``).

- :class:`RolloutGeneration`: samples, scores and caches a rollout before each training step.
- :class:`OldPolicyRefresh`: copies the policy into the frozen snapshot every N rollouts.
- :class:`TrustRegionMonitor`: per-token KL before/after projection, eta, infeasible tokens,
  clipping statistics, and (``kl_end``) the KL to the behaviour policy at a rollout's end.
- :class:`SparsityCoverageMonitor`: coverage of the sparse supports and their sizes.
- :class:`ConstraintMonitor`: the share of tokens each constraint acts on, by the behaviour
  policy's confidence in the sampled token and by the sign of its advantage (both objectives).
- :class:`RolloutCheckpoint`: ``last.ckpt`` every N rollouts, at the end and on Ctrl-C or SIGTERM.
- :class:`RolloutProgressBar`: progress in rollouts, seconds per rollout and time left.
- :class:`ReleaseFreedMemory`: gives the host memory each iteration freed back to the system.
"""

from lightning_troll.callbacks.checkpoint import RolloutCheckpoint
from lightning_troll.callbacks.constraints import ConstraintMonitor
from lightning_troll.callbacks.memory import ReleaseFreedMemory
from lightning_troll.callbacks.monitors import SparsityCoverageMonitor, TrustRegionMonitor
from lightning_troll.callbacks.old_policy import OldPolicyRefresh
from lightning_troll.callbacks.progress import RolloutProgressBar
from lightning_troll.callbacks.rollout import RolloutGeneration

__all__ = [
    "ConstraintMonitor",
    "OldPolicyRefresh",
    "ReleaseFreedMemory",
    "RolloutCheckpoint",
    "RolloutGeneration",
    "RolloutProgressBar",
    "SparsityCoverageMonitor",
    "TrustRegionMonitor",
]
