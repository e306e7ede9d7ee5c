"""How a rollout becomes optimiser steps: TrollModule's minibatch loop.

Per rollout, ``epochs_per_rollout`` passes over shuffled minibatches of ``minibatch_size``
sequences, each minibatch one optimiser step whose gradient is accumulated over parts of
``micro_batch_size`` sequences. Every part's loss is weighted by its share of the minibatch's
aggregation size (tokens or sequences, summed over all processes), so the accumulated gradient
equals that of one pass over the whole minibatch, and with several processes that of a single
process holding the union. A step whose loss or gradient is not finite is skipped on every
process (``max_bad_steps`` in a row stop the run).

:class:`MinibatchLoop` holds what the loop carries from rollout to rollout: the shuffle
generator and the count of bad steps in a row (both go into checkpoints) and the statistics of
the last rollout's steps. Its owner hands it a :class:`StepParts` for each rollout (the trainer,
the policy, the optimiser and scheduler, the loss of a part, the backward pass, the logger): the
loop reads nothing else of the module and only decides how the gradients become steps.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.pytorch import Trainer
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_troll.models.sharding import is_sharded
from lightning_troll.objectives.aggregation import AGGREGATION_SIZES
from lightning_troll.objectives.chunking import DEFAULT_CHUNK_SIZE, check_chunk_size
from lightning_troll.objectives.stats import ObjectiveStats
from lightning_troll.rollouts.micro_batches import (
    lengths_of,
    part_cost,
    resolve_tokens,
    split_to,
    token_parts,
)
from lightning_troll.rollouts.rollout import Rollout
from lightning_troll.training.faults import NonFiniteSteps

__all__ = ["MinibatchLoop", "OptimizationConfig", "StepParts", "optimizers"]


@dataclass(frozen=True)
class OptimizationConfig:
    """How each rollout becomes optimiser steps, and what its forward passes hold at once."""

    epochs_per_rollout: int = 1
    """Passes (mu) over each rollout."""
    minibatch_size: int | None = None
    """Sequences per optimiser step; null uses the whole rollout."""
    micro_batch_size: int | None = None
    """The most sequences per forward pass (gradient accumulation); null: as many as
    ``micro_batch_tokens`` allows."""
    micro_batch_tokens: int | Literal["auto"] | None = "auto"
    """The most tokens per forward pass: sequences of like length share a micro-batch, each
    costing its padded width (its real tokens with ``pack_sequences``), so training memory does
    not grow with completion length; a longer sequence goes alone. The teacher-forced passes
    over a rollout use it too. ``auto``: the tokens whose activations fill 2 GiB on a CPU, 8 GiB on
    a GPU, by the model's size (1,165 tokens of SmolLM2-135M in float32). Null:
    ``micro_batch_size`` alone decides."""
    pack_sequences: bool = False
    """Pack a micro-batch's sequences into one row without padding, each with its own
    positions (transformers' packed attention), in the loss and the teacher-forced passes;
    models whose attention cannot tell packed sequences apart are run padded."""
    gradient_clip_norm: float | None = 1.0
    """Clip the gradient norm to this value; null switches clipping off."""
    max_bad_steps: int = 3
    """Stop the run after this many optimiser steps in a row with a non-finite loss or gradient."""
    seed: int | None = None
    """Seed of the minibatch shuffling; null follows the run's seed (seed_everything)."""
    gradient_checkpointing: bool = False
    """Recompute the policy's activations in the backward pass (less memory, about a third more
    compute)."""
    logits_chunk_size: int | None = DEFAULT_CHUNK_SIZE
    """Response tokens whose logits exist at once in the loss and the cached old distributions
    (recomputed in the backward pass); null: all at once."""
    share_prompts: bool = True
    """Run each distinct prompt of a micro-batch once and its group's completions against its
    cached keys and values (same results up to rounding; off with gradient checkpointing or
    FSDP2)."""

    @property
    def parts(self) -> tuple[int | str | None, bool]:
        """How a pass over a rollout splits and packs it: ``micro_batch_tokens, pack_sequences``."""
        return self.micro_batch_tokens, self.pack_sequences

    def __post_init__(self) -> None:
        for name in ("epochs_per_rollout", "max_bad_steps"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"model.optimization.{name} must be >= 1; got {getattr(self, name)!r}"
                )
        for name in ("minibatch_size", "micro_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"model.optimization.{name} must be null or >= 1; got {value!r}")
        tokens = self.micro_batch_tokens
        if tokens not in (None, "auto") and not (
            isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 1
        ):
            raise ValueError(
                f"model.optimization.micro_batch_tokens must be auto, null or an integer >= 1; got "
                f"{tokens!r}"
            )
        clip = self.gradient_clip_norm
        if clip is not None and not clip > 0:
            raise ValueError(
                f"model.optimization.gradient_clip_norm must be null or > 0; got {clip!r}"
            )
        check_chunk_size(self.logits_chunk_size, "model.optimization.logits_chunk_size")


@dataclass(frozen=True)
class StepParts:
    """What the minibatch loop needs from its owner for one rollout's steps, handed over whole:
    the loop reads nothing else of the module that owns it."""

    trainer: Trainer
    policy: nn.Module
    aggregation: str
    """The objective's aggregation, which sets each micro-batch's weight in the step."""
    optimizer: Any
    scheduler: Any
    """Stepped after every optimiser step; None: no schedule."""
    loss_of: Callable[[Rollout], tuple[Tensor, ObjectiveStats]]
    """The objective on a (part of a) rollout with the policy's current weights."""
    backward: Callable[[Tensor], None]
    """The strategy's backward pass (``manual_backward``)."""
    log: Callable[..., None]
    """``log_dict`` of the step's figures."""


class MinibatchLoop:
    """The optimiser steps of one rollout after another (manual optimisation).

    Args:
        config: epochs, minibatch and micro-batch sizes, clipping, the bad-step limit, the
            shuffle's seed.
    """

    def __init__(self, config: OptimizationConfig) -> None:
        self.config = config
        seed = config.seed
        if seed is None:  # the run's seed, as Lightning's seed_everything recorded it
            seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        self.shuffle = torch.Generator().manual_seed(seed)
        """Draws each epoch's minibatch order; saved in checkpoints."""
        self.bad_steps = 0
        """Optimiser steps skipped in a row (non-finite loss or gradient); saved in checkpoints."""
        self.last_stats: list[ObjectiveStats] = []
        """The detached statistics of every part of every optimiser step of the last rollout."""
        self.last_minibatch: Rollout | None = None
        """The minibatch of the last rollout's last optimiser step (None before one is taken)."""
        self.current_minibatch: Rollout | None = None
        """The minibatch of the optimiser step being taken (what ``on_before_optimizer_step``
        hooks see; with ``last_minibatch`` None, the rollout's first step)."""

    def run(self, parts: StepParts, rollout: Rollout) -> None:
        """``epochs_per_rollout`` passes over shuffled minibatches, one optimiser step each."""
        self.last_stats = []
        self.last_minibatch = None
        for _ in range(self.config.epochs_per_rollout):
            for minibatch in rollout.minibatches(self.config.minibatch_size, self.shuffle):
                self.step(parts, minibatch)

    def step(self, step: StepParts, minibatch: Rollout) -> None:
        """One optimiser step on ``minibatch``, accumulated over its micro-batches."""
        self.current_minibatch = minibatch
        trainer, policy, opt = step.trainer, step.policy, step.optimizer
        size = AGGREGATION_SIZES[step.aggregation]
        # Each process weighs its part by the global total, times the world size because
        # DDP and FSDP average gradients: the step equals a single-process step on the union.
        world = trainer.world_size
        total = sum_over_processes(trainer, size(minibatch.response_mask).float()).clamp_min(1)
        parts = self.micro_batches(trainer, minibatch, policy)
        losses, step_stats = [], []
        for i, part in enumerate(parts):
            loss, stats = step.loss_of(part)
            weighted = loss * (size(part.response_mask) * world / total)
            with gradient_sync(trainer, policy, i == len(parts) - 1):
                step.backward(weighted)
            losses.append(weighted.detach())
            step_stats.append(stats)
        loss = torch.stack(losses).sum()
        norm = grad_norm(policy, self.config.gradient_clip_norm)
        # One decision for all processes: a step is skipped everywhere or nowhere.
        bad_loss = sum_over_processes(trainer, (~torch.isfinite(loss)).float()) > 0
        if bad_loss or not torch.isfinite(norm):
            self._skip_step(trainer.global_step, opt, "loss" if bad_loss else "gradient")
            return
        self.bad_steps = 0
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step.scheduler is not None:
            step.scheduler.step()
        self.last_stats.extend(step_stats)
        self.last_minibatch = minibatch
        log_step(step.log, loss, step_stats, norm)

    def micro_batches(
        self, trainer: Trainer, minibatch: Rollout, policy: nn.Module
    ) -> list[Rollout]:
        """The minibatch's parts of at most ``micro_batch_tokens`` tokens (and
        ``micro_batch_size`` sequences), each without the columns it does not use; every process
        makes as many parts as the one that needs most (a sharded forward gathers weights with
        every other process)."""
        config = self.config
        mask, prompt_length = minibatch.attention_mask, minibatch.prompt_length
        packed, tokens = config.pack_sequences, resolve_tokens(config.micro_batch_tokens, policy)
        parts = token_parts(mask, prompt_length, tokens, config.micro_batch_size, packed)
        if trainer.world_size > 1:
            counts = trainer.strategy.all_gather(torch.tensor(len(parts), device=mask.device))
            if int(counts.max()) > len(parts):
                prompt, response = lengths_of(mask, prompt_length)
                costs = [part_cost(prompt[p], response[p], packed) for p in parts]
                parts = split_to(parts, int(counts.max()), costs)
        if len(parts) == 1:
            return [minibatch.trimmed()]
        return [minibatch.select(part).trimmed() for part in parts]

    def _skip_step(self, global_step: int, opt, what: str) -> None:
        opt.zero_grad(set_to_none=True)
        self.bad_steps += 1
        limit = self.config.max_bad_steps
        if self.bad_steps >= limit:
            raise NonFiniteSteps(
                f"{self.bad_steps} optimiser steps in a row had a non-finite {what} "
                f"(model.optimization.max_bad_steps={limit}), the last at global step "
                f"{global_step}; the weights are those of the last finite step: lower "
                "the learning rate or look for rewards or data that overflow"
            )
        warnings.warn(
            f"non-finite {what} at global step {global_step}: optimiser step skipped, "
            f"weights untouched ({self.bad_steps} of {limit} allowed in a row)",
            RuntimeWarning,
            stacklevel=2,
        )

    def state_dict(self) -> dict[str, Any]:
        """The shuffle generator's state and the bad-step count, for a checkpoint."""
        return {"shuffle_rng": self.shuffle.get_state(), "bad_steps": self.bad_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s entries; a state without them changes nothing."""
        if "shuffle_rng" in state:
            self.shuffle.set_state(state["shuffle_rng"])
            self.bad_steps = state["bad_steps"]


def sum_over_processes(trainer: Trainer, value: Tensor) -> Tensor:
    """``value`` summed over all processes (``value`` itself with one)."""
    if trainer.world_size == 1:
        return value
    return trainer.strategy.reduce(value.clone(), reduce_op="sum")


@contextmanager
def gradient_sync(trainer: Trainer, policy: nn.Module, sync: bool) -> Iterator[None]:
    """Gradients are reduced across processes only at the last micro-batch of a step."""
    if sync or trainer.world_size == 1:
        yield
    elif is_sharded(policy):
        policy.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            policy.set_requires_gradient_sync(True)
    else:
        block = getattr(trainer.strategy, "block_backward_sync", nullcontext)
        with block():
            yield


def grad_norm(policy: nn.Module, clip: float | None) -> Tensor:
    """The policy's total gradient norm, clipped to ``clip`` in place (not clipped when None)."""
    params = [p for p in policy.parameters() if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    norm = torch.nn.utils.clip_grad_norm_(params, clip if clip is not None else math.inf)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def log_step(
    log: Callable[..., None], loss: Tensor, stats: list[ObjectiveStats], grad_norm: Tensor
) -> None:
    """Logs the step's loss, the mean of its parts' statistics and the gradient norm. Called
    once per optimiser step; a logger keeps the last value of a name in a training batch, so
    what it records is the rollout's last optimiser step."""

    def mean(name: str) -> Tensor:
        return torch.stack([getattr(s, name) for s in stats]).mean()

    log(
        {
            "loss/total": loss,
            "loss/policy": mean("policy_loss"),
            "loss/regression": mean("regression_loss"),
            "entropy": mean("entropy"),
            "grad_norm": grad_norm,
        },
        on_step=True,
        on_epoch=False,
        sync_dist=True,  # the mean over processes of their weighted parts is the global loss
    )


def optimizers(policy: nn.Module, optimizer_factory, scheduler_factory=None):
    """What ``configure_optimizers`` returns: the optimiser over the policy's trainable
    parameters and, with a scheduler, the scheduler stepped after every optimiser step."""
    optimizer = optimizer_factory([p for p in policy.parameters() if p.requires_grad])
    if scheduler_factory is None:
        return optimizer
    scheduler = scheduler_factory(optimizer)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
