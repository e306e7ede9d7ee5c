"""Engines: what samples a rollout's completions from the behaviour policy.

- :mod:`~lightning_troll.engines.base`: the engine interface (:class:`RolloutEngine`,
  :class:`SampleRequest`, :class:`Generation`, :class:`EngineContext`) and ``model.engine.name`` resolved by name or
  import path;
- :mod:`~lightning_troll.engines.hf`: the ``hf`` engine, the snapshot sampling in the trainer's
  process;
- :mod:`~lightning_troll.engines.sampling`: ``model.sampling`` and the HF sampling call,
  :func:`~lightning_troll.engines.sampling.sample`, over the decoding loops
  :mod:`~lightning_troll.engines.decode` and :mod:`~lightning_troll.engines.graph_decode`;
- :mod:`~lightning_troll.engines.behaviour`: the behaviour policy's log-probs and sparse rows
  recorded while sampling (``model.engine.behaviour_logprobs``);
- :mod:`~lightning_troll.engines.process`: an engine in a process of its own;
- :mod:`~lightning_troll.engines.vllm`: the vLLM engine (an extra, imported on use).

Engines sit below the rollout pipeline (:mod:`lightning_troll.rollouts`): the collector calls an
engine, an engine never reads the collector. No Lightning here.
"""

from lightning_troll.engines.base import (
    EngineContext,
    Generation,
    RolloutEngine,
    SampleRequest,
    build_engine,
)
from lightning_troll.engines.hf import HFEngine
from lightning_troll.engines.sampling import SamplingConfig, sample

__all__ = [
    "EngineContext",
    "Generation",
    "HFEngine",
    "RolloutEngine",
    "SampleRequest",
    "SamplingConfig",
    "build_engine",
    "sample",
]
