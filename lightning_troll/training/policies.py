"""TrollModule's policies: the policy, its behaviour snapshot and the reference policy, in the
mode and shards each needs, and the loss of a rollout under the policy's current weights.

:class:`Policies` is a part that :class:`~lightning_troll.training.module.TrollModule` owns (its
``policies``): it loads the policy and its tokenizer, adds adapters, builds the snapshot and the
reference policy, says which module samples and which one is the reference, keeps the frozen
copies in eval mode, shards all three with FSDP2 and turns response tokens into text. The module
registers the modules it holds as its own children (``policy``, ``old_policy``, ``ref_policy``),
so that checkpoints keep their keys. :func:`policy_loss` is the objective on a (part of a)
rollout, the snapshot's own pass included for the dense projection.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_troll.models.loading import load_policy, load_tokenizer, stop_token_ids
from lightning_troll.models.lora import LoraConfig, adapters_disabled, apply_lora
from lightning_troll.models.sharding import check_shardable, is_sharded, shard_model
from lightning_troll.models.snapshots import Snapshot, SnapshotConfig, build_snapshot, frozen_copy
from lightning_troll.objectives import ObjectiveStats, PolicyObjective
from lightning_troll.rollouts.forward import (
    linear_head,
    old_logit_rows,
    response_hidden,
    response_logits,
)
from lightning_troll.rollouts.rollout import Rollout

__all__ = ["Policies", "policy_loss"]


class Policies:
    """The policy being trained, its behaviour snapshot and the reference policy.

    Args:
        model: hub name, local directory, or ``tinymath``.
        dtype: the policy's weight dtype.
        lora: adapters instead of full fine-tuning (the snapshot is then a second adapter and
            the reference policy the base model), or None.
        snapshot: how the behaviour snapshot is held.
        in_loss: the snapshot also runs in the loss pass (the dense projection).
        with_reference: keep a frozen reference policy (``loss.ref_kl_coef > 0``).
        gradient_checkpointing: recompute the policy's activations in the backward pass.
        check_tokenizer: called with the tokenizer before the weights load (a refusal of what
            the run needs of it, such as a chat template, then costs no load).
    """

    def __init__(
        self,
        model: str,
        dtype: str,
        lora: LoraConfig | None,
        snapshot: SnapshotConfig,
        in_loss: bool,
        with_reference: bool,
        gradient_checkpointing: bool,
        check_tokenizer: Callable[[Any], None] | None = None,
    ) -> None:
        self.tokenizer = load_tokenizer(model)
        if check_tokenizer is not None:  # what the run needs of it, before the weights load
            check_tokenizer(self.tokenizer)
        policy = load_policy(model, dtype=dtype, load_in_4bit=bool(lora and lora.load_in_4bit))
        vocab = policy.get_output_embeddings().weight.shape[0]
        if vocab < len(self.tokenizer):
            raise ValueError(
                f"model: the policy {model!r} has {vocab} output tokens but its tokenizer has "
                f"{len(self.tokenizer)}; they must come from the same model (the policy may have "
                "more rows, never fewer)"
            )
        self.stop_ids = stop_token_ids(self.tokenizer, policy)
        """Token ids that end a completion (the tokenizer's eos first; see ``stop_token_ids``)."""
        if lora is not None:
            policy = apply_lora(policy, lora)
        policy.train()  # from_pretrained returns eval mode; snapshots stay in eval mode
        self.policy: nn.Module = policy
        self.lora = lora
        self.snapshot_config = snapshot
        self.snapshot: Snapshot = build_snapshot(policy, snapshot, lora is not None, in_loss)
        self.ref_policy = frozen_copy(policy) if with_reference and lora is None else None
        """A frozen copy of the initial policy (None with adapters: the base model is it)."""
        self.with_reference = with_reference
        if gradient_checkpointing:
            policy.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )

    @property
    def old_policy(self) -> nn.Module:
        """The snapshot's module: a separate frozen copy, or the policy itself when the snapshot
        shares it (``shared``, LoRA). Sample through :meth:`behaviour`."""
        return self.snapshot.model

    def behaviour(self) -> AbstractContextManager[nn.Module]:
        """Context manager: the module that samples and caches old log-probs, ready for it."""
        return self.snapshot.behaviour()

    @contextmanager
    def reference(self) -> Iterator[nn.Module | None]:
        """Context manager: the reference policy for ``ref_kl_coef``, or None when it is off."""
        if self.lora is not None and self.with_reference:
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

    @property
    def frozen(self) -> list[nn.Module]:
        """The frozen copies: the snapshot's, unless it shares the policy, and the reference."""
        separate = None if self.snapshot.shares_policy else self.old_policy
        return [model for model in (separate, self.ref_policy) if model is not None]

    def keep_frozen_in_eval(self) -> None:
        """Frozen snapshots stay in eval mode whatever the trainer sets."""
        for model in self.frozen:
            model.eval()

    def expect_frozen_in_eval(self, module: nn.Module) -> None:
        """Lightning warns at the start of a fit about the modules of ``module`` in eval mode.
        The frozen copies are in eval mode on purpose: when they hold every such module, that
        notice (with its exact count) is dropped; a policy module left in eval mode keeps it."""
        frozen = {id(part) for model in self.frozen for part in model.modules()}
        in_eval = [part for part in module.modules() if not part.training]
        if in_eval and all(id(part) in frozen for part in in_eval):
            notice = rf"Found {len(in_eval)} module\(s\) in eval mode at the start of training"
            warnings.filterwarnings("ignore", message=notice)

    def shard(self, mesh) -> None:
        """Shards the policy and its snapshots over the data-parallel ``mesh`` with FSDP2: each
        decoder layer, then the root (idempotent)."""
        check_shardable(self.snapshot_config, self.lora)
        for model in (self.policy, *self.frozen):
            shard_model(model, mesh)

    def decode(self, responses: Tensor, response_mask: Tensor) -> list[str]:
        """Response tokens -> text, without EOS and padding."""
        stops = torch.as_tensor(self.stop_ids, device=responses.device)
        keep = response_mask & ~torch.isin(responses, stops)
        return [
            self.tokenizer.decode(row[m].tolist(), skip_special_tokens=True)
            for row, m in zip(responses, keep, strict=True)
        ]


def policy_loss(
    policies: Policies,
    objective: PolicyObjective,
    rollout: Rollout,
    chunk_size: int | None,
    share_prompts: bool,
    packed: bool = False,
) -> tuple[Tensor, ObjectiveStats]:
    """The objective on a (part of a) rollout, with the policy's current weights: logits in
    chunks of ``chunk_size`` response tokens (None: all at once), prompts shared by a group run
    once where ``share_prompts`` allows it, or the sequences packed into one row without padding
    where ``packed`` asks for it and the model allows it (``share_prompts`` then does not
    apply)."""
    policy = policies.policy
    ids, attention = rollout.input_ids, rollout.attention_mask
    length, temperature = rollout.response_mask.shape[1], rollout.temperature
    inputs = rollout.loss_inputs()
    head = None if chunk_size is None and not packed else linear_head(policy)
    share = share_prompts and not is_sharded(policy)
    if objective.needs_old_logits:  # support: dense, from the snapshot's own pass
        with policies.behaviour() as old:
            rows = old_logit_rows(old, ids, attention, rollout.response_mask, temperature,
                                  head is not None, share, packed)  # fmt: skip
        inputs = dataclasses.replace(inputs, old=rows)
    if head is None:
        logits = response_logits(policy, ids, attention, length, temperature)  # (B, T, V)
        return objective(logits, inputs)
    hidden = response_hidden(policy, ids, attention, length, share, packed)  # (B, T, H)
    return objective.forward_hidden(hidden, head, temperature, inputs, chunk_size=chunk_size)
