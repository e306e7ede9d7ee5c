"""The behaviour-policy snapshot: a frozen copy, a low-precision copy, the policy itself, or an
adapter.

The snapshot samples every rollout and gives the cached "old" log-probs and sparse distributions;
``OldPolicyRefresh`` refreshes it from the policy. The kinds trade memory against exactness:

- ``copy`` / ``same``: a full copy in the policy's dtype (exact; one more model in memory).
- ``copy`` / ``bfloat16``: a full copy with bfloat16 weights (half of a float32 copy).
- ``copy`` / ``int8``: a full copy whose linear and embedding weights are int8 with a float32
  scale per output row (:mod:`lightning_troll.models.quantize`; about a quarter of a float32 copy).
- ``shared``: the policy itself, no copy. Correct only when the snapshot is refreshed after every
  rollout, because the snapshot is used only at the start of a rollout, when the policy still
  equals it.
- with LoRA: a second adapter, ``snapshot``, on the policy's own base model (adapter-sized).

The lower precisions make the first minibatch of a rollout slightly off-policy: the cached old
distributions come from the rounded weights. Logits are always turned into float32 log-probs.

Checkpoints: a separate snapshot is a child module of the LightningModule, so its own weights (in
its own precision) are saved and restored exactly; they are not re-derived from the policy, since
a snapshot refreshed every N > 1 rollouts lags behind it. A shared snapshot adds nothing. The
adapter snapshot is part of the policy's state dict. No Lightning here.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from lightning_troll.models.quantize import quantize_int8_, requantize_int8_

__all__ = [
    "AdapterSnapshot",
    "CopySnapshot",
    "Int8Snapshot",
    "SharedSnapshot",
    "Snapshot",
    "SnapshotConfig",
    "build_snapshot",
    "evaluating",
    "frozen_copy",
    "module_bytes",
]

SNAPSHOT_MODES = ("copy", "shared")
SNAPSHOT_DTYPES = ("same", "bfloat16", "int8")
ADAPTER = "default"
"""The trainable LoRA adapter's name (peft's default)."""
SNAPSHOT_ADAPTER = "snapshot"
"""The frozen LoRA adapter that samples."""


@contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode (no dropout) and without gradients; its mode comes back after."""
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        model.train(training)


@dataclass(frozen=True)
class SnapshotConfig:
    """How the behaviour-policy snapshot is held."""

    mode: Literal["copy", "shared"] = "copy"
    """copy: a separate frozen copy; shared: the policy itself (needs old_policy.every_n_rollouts
    = 1)."""
    dtype: Literal["same", "bfloat16", "int8"] = "same"
    """Weights of a copy: same (the policy's dtype), bfloat16, or int8 (per-row absmax)."""

    def __post_init__(self) -> None:
        if self.mode not in SNAPSHOT_MODES:
            raise ValueError(
                f"snapshot.mode must be one of {list(SNAPSHOT_MODES)}; got {self.mode!r}"
            )
        if self.dtype not in SNAPSHOT_DTYPES:
            raise ValueError(
                f"snapshot.dtype must be one of {list(SNAPSHOT_DTYPES)}; got {self.dtype!r}"
            )
        if self.mode == "shared" and self.dtype != "same":
            raise ValueError(
                f"snapshot.dtype={self.dtype!r} needs snapshot.mode='copy': a shared snapshot is "
                "the policy itself, in the policy's dtype; use dtype='same'"
            )


def module_bytes(tensors: Iterator[torch.Tensor]) -> int:
    """Bytes held by ``tensors``, each distinct storage counted once."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _state_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()


def _frozen(model: nn.Module) -> nn.Module:
    model.eval()
    model.requires_grad_(False)
    return model


def frozen_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` in eval mode with no trainable parameters."""
    return _frozen(copy.deepcopy(model))


class Snapshot:
    """The behaviour policy: ``model`` samples; :meth:`refresh` catches it up with the policy."""

    model: nn.Module
    """The module that samples (the policy itself for shared and adapter snapshots)."""
    shares_policy: bool = False
    """True where ``model`` is the policy, so no separate module holds the snapshot."""
    can_lag: bool = True
    """False where the snapshot always equals the policy (it cannot be refreshed every N > 1)."""

    def refresh(self, policy: nn.Module) -> None:
        """Makes the snapshot equal ``policy`` (up to its precision)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes the snapshot holds beyond the policy."""
        return module_bytes(_state_tensors(self.model))

    @contextmanager
    def behaviour(self) -> Iterator[nn.Module]:
        """The module that samples, ready for inference (eval mode), for the ``with`` block."""
        yield self.model


class CopySnapshot(Snapshot):
    """A frozen deep copy of the policy; ``dtype`` None keeps the policy's dtype.

    A lower ``dtype`` casts the floating-point parameters only: buffers (rotary frequencies)
    keep their precision.
    """

    def __init__(self, policy: nn.Module, dtype: torch.dtype | None = None) -> None:
        self.model = frozen_copy(policy)
        if dtype is not None:
            for param in self.model.parameters():
                if param.is_floating_point():
                    param.data = param.data.to(dtype)

    @torch.no_grad()
    def refresh(self, policy: nn.Module) -> None:
        self.model.load_state_dict(policy.state_dict())  # copy_ casts to the snapshot's dtype


class Int8Snapshot(Snapshot):
    """A frozen copy whose linear and embedding weights are int8 (dequantised in forward)."""

    def __init__(self, policy: nn.Module) -> None:
        self.model = _frozen(quantize_int8_(copy.deepcopy(policy)))

    def refresh(self, policy: nn.Module) -> None:
        requantize_int8_(self.model, policy)


class SharedSnapshot(Snapshot):
    """The policy itself: nothing to copy, nothing to refresh; samples in eval mode."""

    shares_policy = True
    can_lag = False

    def __init__(self, policy: nn.Module) -> None:
        self.model = policy

    def refresh(self, policy: nn.Module) -> None:
        """Nothing to do: the snapshot is the policy."""

    @property
    def nbytes(self) -> int:
        return 0

    def behaviour(self) -> AbstractContextManager[nn.Module]:
        return evaluating(self.model)


class AdapterSnapshot(Snapshot):
    """A frozen second LoRA adapter on the policy's own base model (a peft model).

    ``behaviour`` activates it (eval mode, no grad) and switches back to the trainable adapter
    afterwards; :meth:`refresh` copies the trainable adapter's weights into it.
    """

    shares_policy = True

    def __init__(self, policy: nn.Module) -> None:
        self.model = policy
        policy.add_adapter(SNAPSHOT_ADAPTER, copy.deepcopy(policy.peft_config[ADAPTER]))
        policy.set_adapter(ADAPTER)  # keeps the trainable adapter active and trainable
        self.refresh(policy)

    def _pairs(self, policy: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(snapshot adapter tensor, trainable adapter tensor) pairs. The adapter's name is one
        part of a parameter's dotted name: inside it for a linear layer's
        (``q_proj.lora_A.snapshot.weight``), at its end for an embedding's
        (``embed_tokens.lora_embedding_A.snapshot``)."""
        params = dict(policy.named_parameters())
        pairs = []
        for name, tensor in params.items():
            parts = name.split(".")
            if SNAPSHOT_ADAPTER in parts:
                parts[parts.index(SNAPSHOT_ADAPTER)] = ADAPTER
                pairs.append((tensor, params[".".join(parts)]))
        return pairs

    @torch.no_grad()
    def refresh(self, policy: nn.Module) -> None:
        for target, source in self._pairs(policy):
            target.copy_(source)

    @property
    def nbytes(self) -> int:
        return module_bytes(t for t, _ in self._pairs(self.model))

    @contextmanager
    def behaviour(self) -> Iterator[nn.Module]:
        with evaluating(self.model) as model:
            model.set_adapter(SNAPSHOT_ADAPTER, inference_mode=True)
            try:
                yield model
            finally:
                model.set_adapter(ADAPTER)  # the trainable adapter, trainable again


def build_snapshot(
    policy: nn.Module, config: SnapshotConfig, adapters: bool = False, in_loss: bool = False
) -> Snapshot:
    """The snapshot ``config`` asks for; ``adapters`` says ``policy`` is a LoRA peft model,
    ``in_loss`` that the snapshot also runs in the loss pass (the dense projection), which a
    shared snapshot cannot: it is the policy being trained."""
    if config.mode == "shared" and in_loss:
        raise ValueError(
            "model.trust_region.support='dense' recomputes the snapshot's logits in every loss "
            "pass, and a shared snapshot is the policy being trained: set model.snapshot.mode to "
            "'copy' (or choose support 'union' or 'official')"
        )
    if config.mode == "shared":
        return SharedSnapshot(policy)
    if adapters:
        if config.dtype != "same":
            raise ValueError(
                f"snapshot.dtype={config.dtype!r} applies to full copies; with model.lora the "
                "snapshot is a copy of the adapter weights only: use dtype='same'"
            )
        return AdapterSnapshot(policy)
    if config.dtype == "int8":
        return Int8Snapshot(policy)
    return CopySnapshot(policy, torch.bfloat16 if config.dtype == "bfloat16" else None)
