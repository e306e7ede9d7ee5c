"""The ``hf`` engine (``model.engine.name: hf``, the default): the snapshot itself samples,
with the KV-cached loop of :func:`~lightning_troll.engines.sampling.sample`, in the trainer's
process. No Lightning here.
"""

from __future__ import annotations

from torch import nn

from lightning_troll.engines.base import Generation, RolloutEngine, SampleRequest
from lightning_troll.engines.behaviour import BehaviourRecorder
from lightning_troll.engines.sampling import sample

__all__ = ["HFEngine"]


class HFEngine(RolloutEngine):
    """The snapshot itself samples, with the KV-cached loop of
    :func:`~lightning_troll.engines.sampling.sample`, in the trainer's process.

    It needs no weights of its own (the snapshot is the behaviour policy) and records the
    behaviour log-probs and TROLL's sparse rows while it samples.
    """

    name = "hf"
    records_behaviour = True
    several_processes = True

    def generate(
        self, snapshot: nn.Module, request: SampleRequest, recorder: BehaviourRecorder | None = None
    ) -> Generation:
        ids, attention, response, truncated = sample(
            snapshot, request.prompt_ids, request.group_size, request.sampling, request.pad_id,
            list(request.stop_ids), recorder=recorder, budgets=request.budgets,
        )  # fmt: skip
        return Generation(ids, attention, response, truncated)
