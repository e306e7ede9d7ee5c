"""Rollouts: sampling, the behaviour policy's log-probs and sparse rows, teacher-forced passes,
dynamic sampling, and how far the policy drifts from the behaviour policy.

- :mod:`~lightning_troll.rollouts.collector`: the rollout pipeline, :class:`RolloutCollector`
  (from a batch of prompts to a :class:`Rollout`), and :mod:`~lightning_troll.rollouts.samples`,
  what it sampled;
- :mod:`~lightning_troll.rollouts.rollout`: the :class:`Rollout` record and sampling
  (``model.sampling``);
- :mod:`~lightning_troll.rollouts.decode`: the KV-cached decoding loop sampling uses (each
  prompt prefilled once, finished sequences dropped);
- :mod:`~lightning_troll.rollouts.behaviour`: the behaviour policy's log-probs and sparse rows
  recorded while sampling (``model.behaviour_logprobs``);
- :mod:`~lightning_troll.rollouts.forward`: teacher-forced passes (hidden states, logits, shared
  prompts);
- :mod:`~lightning_troll.rollouts.episodes`: multi-turn episodes at token level (the model's
  turns, an environment's replies; :mod:`lightning_troll.environments`);
- :mod:`~lightning_troll.rollouts.dynamic_sampling`, :mod:`~lightning_troll.rollouts.drift`,
  :mod:`~lightning_troll.rollouts.timing`: DAPO's dynamic sampling, the drift at a rollout's end,
  wall-clock readings.

No Lightning here.
"""

from lightning_troll.rollouts.collector import RolloutCollector
from lightning_troll.rollouts.rollout import Rollout, SamplingConfig

__all__ = ["Rollout", "RolloutCollector", "SamplingConfig"]
