"""Rollouts: the pipeline from a batch of prompts to a :class:`Rollout` (the engines of
:mod:`lightning_troll.engines` sample it), teacher-forced passes, dynamic sampling, episodes, and
how far the policy drifts from the behaviour policy.

- :mod:`~lightning_troll.rollouts.collector`: the rollout pipeline, :class:`RolloutCollector`
  (from a batch of prompts to a :class:`Rollout`), and :mod:`~lightning_troll.rollouts.samples`,
  what it sampled;
- :mod:`~lightning_troll.rollouts.rollout`: the :class:`Rollout` record;
- :mod:`~lightning_troll.rollouts.forward`: teacher-forced passes (hidden states, logits, shared
  prompts), in micro-batches (:mod:`~lightning_troll.rollouts.micro_batches`), packed or not;
- :mod:`~lightning_troll.rollouts.episodes`, :mod:`~lightning_troll.rollouts.multiturn`:
  multi-turn episodes at token level (the model's turns, an environment's replies;
  :mod:`lightning_troll.tasks.environments`);
- :mod:`~lightning_troll.rollouts.dynamic_sampling`, :mod:`~lightning_troll.rollouts.drift`,
  :mod:`~lightning_troll.rollouts.timing`: DAPO's dynamic sampling, the drift at a rollout's end,
  wall-clock readings.

No Lightning here.
"""

from lightning_troll.engines.sampling import SamplingConfig
from lightning_troll.rollouts.collector import RolloutCollector
from lightning_troll.rollouts.rollout import Rollout

__all__ = ["Rollout", "RolloutCollector", "SamplingConfig"]
