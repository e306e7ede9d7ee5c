"""TrollModule's policies: the policy, its behaviour snapshot and the reference policy, in the
mode and shards each needs.

:class:`PolicyHooks` is a mixin of :class:`~lightning_troll.training.module.TrollModule` (as
Lightning builds its LightningModule from hook mixins): which module samples, which one is the
reference, the frozen copies kept in eval mode, FSDP2 sharding, and turning response tokens into
text, and the loss of a rollout under the policy's current weights (the snapshot's own pass
included, for the dense projection). The attributes it reads (``policy``, ``snapshot``, ``ref_policy``, ``lora``,
``loss_config``, ``tokenizer``, ``stop_ids``, ``snapshot_config``, ``objective``,
``logits_chunk_size``, ``share_prompts``) are set by the module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from lightning_troll.models.lora import adapters_disabled
from lightning_troll.models.sharding import (
    check_shardable,
    check_strategy,
    data_parallel_mesh,
    is_sharded,
    shard_model,
)
from lightning_troll.objectives import ObjectiveStats
from lightning_troll.rollouts.forward import (
    linear_head,
    old_logit_rows,
    response_hidden,
    response_logits,
)
from lightning_troll.rollouts.rollout import Rollout

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

    def loss_of(self, rollout: Rollout) -> tuple[Tensor, ObjectiveStats]:
        """The objective on a (part of a) rollout, with the policy's current weights."""
        ids, attention = rollout.input_ids, rollout.attention_mask
        length, temperature = rollout.response_mask.shape[1], rollout.temperature
        inputs = rollout.loss_inputs()
        head = None if self.logits_chunk_size is None else linear_head(self.policy)
        share = self.share_prompts and not is_sharded(self.policy)
        if self.objective.needs_old_logits:  # support: dense, from the snapshot's own pass
            chunked = self.logits_chunk_size is not None
            with self.behaviour_policy() as old:
                rows = old_logit_rows(
                    old, ids, attention, rollout.response_mask, temperature, chunked, share
                )
            inputs = dataclasses.replace(inputs, old=rows)
        if head is None:
            logits = response_logits(self.policy, ids, attention, length, temperature)  # (B, T, V)
            return self.objective(logits, inputs)
        hidden = response_hidden(self.policy, ids, attention, length, share)  # (B, T, H)
        return self.objective.forward_hidden(
            hidden, head, temperature, inputs, chunk_size=self.logits_chunk_size
        )
