"""TrollModule's policies: the policy, its behaviour snapshot and the reference policy, in the
mode and shards each needs.

:class:`PolicyHooks` is a mixin of :class:`~lightning_troll.training.module.TrollModule` (as
Lightning builds its LightningModule from hook mixins): which module samples, which one is the
reference, the frozen copies kept in eval mode, FSDP2 sharding, and turning response tokens into
text. The attributes it reads (``policy``, ``snapshot``, ``ref_policy``, ``lora``,
``loss_config``, ``tokenizer``, ``stop_ids``, ``snapshot_config``) are set by the module.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from lightning_troll.models.lora import adapters_disabled
from lightning_troll.models.sharding import (
    check_shardable,
    check_strategy,
    data_parallel_mesh,
    shard_model,
)

__all__ = ["PolicyHooks"]


class PolicyHooks:
    """The policies' hooks of :class:`~lightning_troll.training.module.TrollModule`."""

    @property
    def old_policy(self) -> torch.nn.Module:
        """The snapshot's module: a separate frozen copy, or the policy itself when the snapshot
        shares it (``shared``, LoRA). Sample through :meth:`behaviour_policy`."""
        separate = self._modules.get("old_policy")
        return self.policy if separate is None else separate

    def behaviour_policy(self):
        """Context manager: the module that samples and caches old log-probs, ready for it."""
        return self.snapshot.behaviour()

    @contextmanager
    def reference_policy(self) -> Iterator[torch.nn.Module | None]:
        """Context manager: the reference policy for ref_kl_coef, or None when it is off."""
        if self.lora is not None and self.loss_config.ref_kl_coef > 0:
            with adapters_disabled(self.policy) as base:  # the base model is the initial policy
                yield base
        else:
            yield self.ref_policy

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    def train(self, mode: bool = True):
        """Frozen snapshots stay in eval mode whatever the trainer sets."""
        super().train(mode)
        if not self.snapshot.shares_policy:
            self.old_policy.eval()
        if self.ref_policy is not None:
            self.ref_policy.eval()
        return self

    def configure_model(self) -> None:
        """Shards the policy and its snapshots with FSDP2 under ``ModelParallelStrategy``.

        Each decoder layer, then the root, is sharded over the data-parallel mesh; the call is
        idempotent. Other strategies (single device, DDP, FSDPStrategy) wrap the module
        themselves and need nothing here.
        """
        if self._trainer is not None:  # load_from_checkpoint calls this without a trainer
            check_strategy(self.trainer.strategy)
        mesh = self._device_mesh
        if mesh is None:
            return
        data_parallel = data_parallel_mesh(mesh)
        check_shardable(self.snapshot_config, self.lora)
        for model in (self.policy, self.old_policy, self.ref_policy):
            if model is not None:
                shard_model(model, data_parallel)

    def decode(self, responses: Tensor, response_mask: Tensor) -> list[str]:
        """Response tokens -> text, without EOS and padding."""
        stops = torch.as_tensor(self.stop_ids, device=responses.device)
        keep = response_mask & ~torch.isin(responses, stops)
        return [
            self.tokenizer.decode(row[m].tolist(), skip_special_tokens=True)
            for row, m in zip(responses, keep, strict=True)
        ]
