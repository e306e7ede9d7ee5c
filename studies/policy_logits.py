"""Old and new policy logits of a real model's rollout, for ``studies/sparse_support.py`` and
``studies/support_accuracy.py``.

:func:`rollout_logits` samples a rollout with a clipped-GRPO :class:`TrollModule`
(:func:`build_module`) on prompts drawn as the run's data module draws them
(:func:`prompt_batch`), keeps the policy's logits at every response token as the old (behaviour)
policy, takes some AdamW steps on the rollout's minibatches, and returns the old and new logits
at the same tokens (:class:`Logits`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class Logits:
    """Old and new policy at the response tokens of one rollout, float32 (N, V) each."""

    old: Tensor
    new: Tensor
    tokens: Tensor
    """(N,) sampled tokens."""
    advantages: Tensor
    """(N,) the advantage of each token's sequence."""
    temperature: float
    sequences: int
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time of sampling (with the old logits) and of the optimiser steps."""


def build_module(model: str, config: dict, temperature: float, max_new_tokens: int, group: int):
    """A clipped-GRPO TrollModule with ``config``'s reward and loss settings at ``temperature``."""
    from lightning_troll.engines.sampling import SamplingConfig
    from lightning_troll.models.snapshots import SnapshotConfig
    from lightning_troll.training.module import AdvantageConfig, LossConfig, TrollModule

    cfg = config["model"]
    return TrollModule(
        model=model,
        objective="clip",
        advantages=AdvantageConfig(**cfg.get("advantages", {})),
        group_size=group,
        sampling=SamplingConfig(temperature=temperature, max_new_tokens=max_new_tokens),
        rewards=cfg["rewards"],
        loss=LossConfig(**cfg.get("loss", {})),
        snapshot=SnapshotConfig(mode="shared"),
    )


def prompt_batch(model: str, config: dict, count: int, seed: int):
    from lightning_troll.tasks.data import PromptDataModule
    from lightning_troll.tasks.data.prompts import draw_prompts

    data = PromptDataModule(**{**config["data"], "tokenizer": model})
    data.setup("fit")
    return draw_prompts(data.train_items, count, seed, "sparse-support")


def response_rows(module, rollout) -> Tensor:
    """(N, V) float32 logits of the policy at the rollout's response tokens, temperature applied."""
    from lightning_troll.rollouts.rollout import response_logits

    module.policy.eval()
    with torch.no_grad():
        length = rollout.response_mask.shape[1]
        logits = response_logits(
            module.policy, rollout.input_ids, rollout.attention_mask, length, rollout.temperature
        )
    return logits[rollout.response_mask].float()


def rollout_logits(module, batch, steps: int, lr: float, minibatch: int, seed: int) -> Logits:
    """Samples a rollout, keeps the old logits, takes ``steps`` clipped-GRPO AdamW steps on its
    minibatches and returns the old and new logits at its response tokens."""

    torch.manual_seed(seed)
    module.policy.eval()
    start = time.perf_counter()
    rollout, _ = module.collector.collect(batch)
    old = response_rows(module, rollout)
    sampled = time.perf_counter()
    optimizer = torch.optim.AdamW(module.policy.parameters(), lr=lr, weight_decay=0.0)
    shuffle = torch.Generator().manual_seed(seed)
    module.policy.train()
    done = 0
    while done < steps:
        for part in rollout.minibatches(minibatch, shuffle):
            if done == steps:
                break
            loss, _ = module.loss_of(part)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.policy.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done += 1
    stepped = time.perf_counter()
    new = response_rows(module, rollout)
    seq = torch.arange(rollout.num_sequences).unsqueeze(-1).expand_as(rollout.response_mask)
    advantages = rollout.advantages[seq[rollout.response_mask]].float()
    return Logits(
        old=old,
        new=new,
        tokens=rollout.tokens[rollout.response_mask],
        advantages=advantages,
        temperature=rollout.temperature,
        sequences=rollout.num_sequences,
        seconds={"sample": sampled - start, "steps": stepped - sampled},
    )
