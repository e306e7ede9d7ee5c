"""TrollModule's rollout parts: the rollout engine, the old policy's sparse rows, and what a
rollout needs from the other processes (advantages over the global batch, a flag raised on any).

Each is a small object or function that :class:`~lightning_troll.training.module.TrollModule`
owns or calls; the module hands them to its
:class:`~lightning_troll.rollouts.collector.RolloutCollector`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import Strategy
from torch import Tensor, nn

from lightning_troll.engines.base import EngineContext, RolloutEngine, build_engine, engine_class
from lightning_troll.engines.hf import HFEngine
from lightning_troll.engines.process import ProcessEngine, check_threads
from lightning_troll.models.lora import LoraConfig
from lightning_troll.objectives import CorrectionsConfig
from lightning_troll.objectives.advantages import compute_advantages
from lightning_troll.rollouts.drift import support_rule
from lightning_troll.trust_region.projection import (
    SparseDistribution,
    TrustRegionProjection,
    sparsify,
)

__all__ = [
    "GlobalBatch",
    "OldRows",
    "build_rollout_engine",
    "check_engine",
    "check_engine_processes",
    "check_engine_world",
    "engine_warnings",
]


def check_engine(name: str, options: Any, lora: LoraConfig | None,
                 corrections: CorrectionsConfig) -> None:  # fmt: skip
    """Refuses, from the options alone (before the model loads), ``model.engine.options`` that
    the engine ``name`` cannot take (its :meth:`~RolloutEngine.check_options`, and ``process``
    and ``threads``), and choices that do not go together: ``model.lora.load_in_4bit`` with an
    engine other than ``hf``, and ``model.corrections.engine_is_cap`` with an engine that
    samples with the snapshot itself."""
    process, _, inner = engine_options(options)
    cls = engine_class(name)
    takes_threads = "threads" in inspect.signature(cls.__init__).parameters
    if not process and "threads" in inner and not takes_threads:
        raise ValueError(
            f"model.engine.options.threads={inner['threads']!r} sets the threads of the "
            "engine's own process: it needs model.engine.options.process: true"
        )
    cls.check_options(inner, lora)
    if name != "hf" and lora is not None and lora.load_in_4bit:
        raise ValueError(
            f"model.engine.name={name!r} takes the policy's weights with the adapters "
            "merged, which a 4-bit base rounds away (and vllm_server's adapters would sit on "
            "the servers' own full-precision base, not the trainer's 4-bit one); use "
            "engine.name 'hf' with lora.load_in_4bit, or a base in float32/bfloat16"
        )
    if corrections.engine_is_cap is not None and cls.records_behaviour:
        where = " (in a process of its own)" if process else ""
        raise ValueError(
            f"model.corrections.engine_is_cap={corrections.engine_is_cap} corrects for an engine that samples "
            f"apart from the snapshot, but the {name!r} engine{where} samples with the "
            "snapshot's weights and reports no log-probs of its own; set it to null, or use "
            "engine.name 'vllm' or 'vllm_server'"
        )


def build_rollout_engine(
    name: str, options: dict[str, Any] | None, context: EngineContext
) -> RolloutEngine:
    """The engine of ``model.engine.name`` (it starts on its first rollout); its options were
    checked by :func:`check_engine` before the model loaded."""
    process, _, inner = engine_options(options)
    if (name != "hf" or process) and context.tied_embedding_adapter:
        lora = context.lora
        where = f"the {name!r} engine" + (" in a process of its own" if process else "")
        raise ValueError(
            f"model.lora.target_modules={lora.target_modules!r} puts an adapter on the input "
            "embedding, which this model ties to its output layer: the policy's output layer "
            f"keeps the embedding's base weight, but {where} loads merged weights into a model "
            "whose output layer is the merged embedding, and would sample from another policy; "
            "leave the embedding out of model.lora.target_modules, or use engine.name 'hf' "
            "in the trainer's process"
        )
    return engine_in_a_process(name, context, options) or build_engine(name, context, inner)


def engine_options(options: Any) -> tuple[bool, int | None, dict[str, Any]]:
    """``model.engine.options`` split into ``process`` (whether the engine runs in a process of
    its own), that process's ``threads``, and the engine's own options; refuses options that
    are not a mapping, and a ``process`` that is not true or false."""
    if options is not None and not isinstance(options, dict):
        raise ValueError(
            f"model.engine.options must be null or a mapping of the engine's options; got "
            f"{options!r}"
        )
    inner = dict(options or {})
    process = inner.pop("process", False)
    if not isinstance(process, bool):
        raise ValueError(f"model.engine.options.process must be true or false; got {process!r}")
    threads = inner.pop("threads", None) if process else None
    check_threads(threads)
    return process, threads, inner


def engine_in_a_process(
    name: str, context: EngineContext, options: dict[str, Any] | None
) -> ProcessEngine | None:
    """With ``process: true`` in ``model.engine.options``, the engine ``name`` in a
    process of its own (its other options, but ``threads``, are the engine's); otherwise None."""
    process, threads, inner = engine_options(options)
    return ProcessEngine(context, name, inner, threads) if process else None


def engine_warnings(
    name: str,
    options: Any,
    decode: str,
    behaviour_logprobs: str,
    check_every: int = 1,
    compile_step: bool = False,
) -> list[str]:
    """What a fit warns of at its start where the engine ignores an option it was given:
    ``model.sampling.decode: graphs``, ``model.sampling.check_every`` above 1 and
    ``model.sampling.compile_step: true`` (read by the HF engine's CUDA-graph path only) and
    ``model.engine.behaviour_logprobs: sampling`` (recorded only by an engine that samples with
    the snapshot in the trainer's process; elsewhere a teacher-forced pass after sampling gives
    them, as ``forward`` does)."""
    process, _, _ = engine_options(options)
    cls, found = engine_class(name), []
    if decode == "graphs" and not issubclass(cls, HFEngine):
        found.append(
            f"model.sampling.decode='graphs' is the hf engine's; the {name!r} engine decodes its "
            "own way and ignores it"
        )
    reader = "the dynamic loop" if decode == "dynamic" else f"the {name!r} engine"
    graphless = decode == "dynamic" or not issubclass(cls, HFEngine)
    if check_every > 1 and graphless:
        found.append(
            f"model.sampling.check_every={check_every} is the hf engine's CUDA-graph path's; "
            f"{reader} ignores it"
        )
    if compile_step and graphless:
        found.append(
            f"model.sampling.compile_step=true is the hf engine's CUDA-graph path's; {reader} "
            "ignores it"
        )
    if behaviour_logprobs == "sampling" and (process or not cls.records_behaviour):
        where = " in a process of its own" if process else ""
        found.append(
            f"model.engine.behaviour_logprobs='sampling': the {name!r} engine{where} does not "
            "record the snapshot's log-probs while it samples, so a teacher-forced pass after "
            "sampling gives them, as 'forward' does; set it to 'forward' or 'auto'"
        )
    return found


def check_engine_processes(engine: RolloutEngine, world: int) -> None:
    """Refuses an engine that runs in one process for a run of ``world`` processes."""
    _check_world(repr(engine.name), engine.several_processes, world)


def check_engine_world(name: str, options: Any, world: int) -> None:
    """:func:`check_engine_processes` from the options alone, before the model loads: an engine
    in a process of its own, or one whose class does not set ``several_processes``, runs in one
    process."""
    process, _, _ = engine_options(options)
    several = not process and engine_class(name).several_processes
    engine = f"{name!r} with model.engine.options.process true" if process else repr(name)
    _check_world(engine, several, world)


def _check_world(engine: str, several_processes: bool, world: int) -> None:
    if world > 1 and not several_processes:
        raise ValueError(
            f"model.engine.name={engine} runs in a single process; this run has "
            f"{world} (trainer.devices x trainer.num_nodes): use engine.name 'hf' for DDP and "
            "FSDP2, or one device"
        )


@dataclass
class OldRows:
    """The behaviour policy's sparse distributions, cut by ``model.trust_region``'s rule."""

    objective: nn.Module
    trust_region: Any
    """The module's ``TrustRegionConfig`` (its rule also serves clipping's cached rows)."""

    @property
    def rule(self) -> TrustRegionProjection:
        """The sparse rows' rule (see :func:`lightning_troll.rollouts.drift.support_rule`)."""
        return support_rule(self.objective, self.trust_region)

    def sparsify(self, logits: Tensor, tokens: Tensor, reads: bool = True) -> SparseDistribution:
        """Sparse rows of ``logits`` (..., V) by the rule, the sampled ``tokens`` kept where
        the rule keeps them; ``reads`` as :func:`~lightning_troll.trust_region.sparse.sparsify`'s."""
        rule = self.rule
        keep = tokens if rule.keep_token else None
        return sparsify(logits, rule.max_tokens, rule.mass_delta, keep=keep, reads=reads)


def world_size(module: LightningModule) -> int:
    """Processes of the module's run (1 outside a trainer)."""
    return module.trainer.world_size if module._trainer is not None else 1


@dataclass
class GlobalBatch:
    """What a process's part of a rollout needs from all of them.

    ``advantages`` gathers the (few) rewards of every process first, so that an estimator that
    uses batch statistics (``reinforce_pp``'s std, ``scale_rewards: batch``, or a user's own)
    sees the same batch as a single-process run would; groups never straddle processes. The
    processes are the trainer's ``strategy``'s, which the module sets once it has a trainer
    (None: one process).
    """

    estimator: str
    group_size: int
    scale_rewards: str | None
    strategy: Strategy | None = None

    @property
    def world(self) -> int:
        return 1 if self.strategy is None else self.strategy.world_size

    def advantages(self, rewards: Tensor) -> Tensor:
        """Advantages (B,) of this process's rewards (B,), over the global batch."""
        if self.world == 1:
            return compute_advantages(self.estimator, rewards, self.group_size, self.scale_rewards)
        # rewards are scored on the CPU; NCCL gathers only tensors on the strategy's device
        everyone = self.strategy.all_gather(rewards.to(self.strategy.root_device))  # (world, B)
        advantages = compute_advantages(
            self.estimator, everyone.flatten(), self.group_size, self.scale_rewards
        )
        return advantages.view_as(everyone)[self.strategy.global_rank].to(rewards.device)

    def any_process(self, flag: bool) -> bool:
        """True if ``flag`` holds on any process (every process must call this alike)."""
        if self.world == 1:
            return flag
        value = torch.tensor(float(flag), device=self.strategy.root_device)
        return bool(self.strategy.reduce(value, reduce_op="sum") > 0)
