"""Random decoder-only models and one training step, for the phases of ``examples/gpu_check.py``
(:mod:`gpu_phases`). No weights are loaded from anywhere.

Language-model shapes (random initialisation):

- Qwen3-0.6B: hidden 1024, 28 layers, 16 query and 8 key/value heads of 128, MLP 3072;
- Qwen3-1.7B: hidden 2048, 28 layers, 16 / 8 heads of 128, MLP 6144;
- Qwen3-4B: hidden 2560, 36 layers, 32 / 8 heads of 128, MLP 9728;
  all with V = 151,936 and tied embeddings, in bfloat16 on a GPU;
- SmolLM2-135M: LlamaForCausalLM, hidden 576, 30 layers, 9 / 3 heads of 64, MLP 1536,
  V = 49,152, tied embeddings.

``TINY_*`` shrink every shape so that a phase runs on a CPU in seconds.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import time
from dataclasses import dataclass
from typing import Any

LOGIT_STD = 2.0  # standard deviation of the initial logits, as in benchmark_overhead.py
PAD, EOS = 0, 1  # token ids of the random models


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's sizes."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int

    def parameters(self) -> int:
        """Weights of the decoder layers and the (tied) embedding; norms left out."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attention + 3 * self.hidden * self.mlp) + self.vocab * self.hidden


QWEN3 = {
    "qwen3-0.6b": Shape(1024, 28, 16, 8, 128, 3072, 151_936),
    "qwen3-1.7b": Shape(2048, 28, 16, 8, 128, 6144, 151_936),
    "qwen3-4b": Shape(2560, 36, 32, 8, 128, 9728, 151_936),
}
TINY_QWEN3 = {
    "qwen3-0.6b": Shape(32, 2, 2, 1, 16, 64, 512),
    "qwen3-1.7b": Shape(48, 2, 2, 1, 24, 96, 512),
    "qwen3-4b": Shape(64, 2, 4, 2, 16, 128, 512),
}
SMOLLM2 = Shape(576, 30, 9, 3, 64, 1536, 49_152)
TINY_SMOLLM2 = Shape(32, 2, 2, 1, 16, 64, 512)


def shape_figures(name: str, shape: Shape) -> dict[str, Any]:
    return {"shape": name, "parameters_m": round(shape.parameters() / 1e6, 1)}


def shape_table(shapes: dict[str, Shape]) -> dict[str, str]:
    """Each shape in words, for the report."""
    return {
        name: f"hidden {s.hidden}, {s.layers} layers, {s.heads}/{s.kv_heads} heads of "
        f"{s.head_dim}, MLP {s.mlp}, V {s.vocab}"
        for name, s in shapes.items()
    }


# -- devices, time and memory ------------------------------------------------------------------
def device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def clock() -> float:
    """Seconds, after the GPU's queued work has finished."""
    synchronize()
    return time.perf_counter()


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def out_of_memory(error: BaseException) -> bool:
    import torch

    return isinstance(error, torch.cuda.OutOfMemoryError)


# -- models and rollouts ------------------------------------------------------------------------
@contextlib.contextmanager
def default_dtype(dtype):
    import torch

    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def model_dtype():
    import torch

    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def qwen3(shape: Shape, seed: int = 0):
    """A randomly initialised Qwen3 model of ``shape`` on the device, in eval mode; the tied
    embedding is redrawn so that logits have a standard deviation of about ``LOGIT_STD``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.mlp,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=PAD,
        bos_token_id=PAD,
        eos_token_id=EOS,
    )
    torch.manual_seed(seed)
    with torch.device(device()), default_dtype(model_dtype()):
        model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight  # (V, H), tied to the output layer
        embedding.normal_(0.0, LOGIT_STD / math.sqrt(shape.hidden))
    return model.eval()


def snapshot_and_policy(shape: Shape, perturb: float = 0.0):
    """The frozen snapshot and a trainable copy moved away from it by ``perturb`` x each weight
    tensor's standard deviation of normal noise (so that TROLL projects some tokens)."""
    import torch

    snapshot = qwen3(shape).requires_grad_(False)
    policy = copy.deepcopy(snapshot).train().requires_grad_(True)
    if perturb:
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(perturb * p.float().std().to(p.dtype) * torch.randn_like(p))
    return snapshot, policy


def sparsify_for(objective):
    """The old policy's sparse rows for TROLL (None for clipping), as the module caches them."""
    from lightning_troll.trust_region.sparse import sparsify

    projection = getattr(objective, "projection", None)
    if projection is None:
        return None
    return lambda rows, tokens: sparsify(
        rows, projection.max_tokens, projection.mass_delta, keep=tokens
    )


def make_rollout(snapshot, objective, ids, attention, response, rewards, group, chunk):
    """A :class:`~lightning_troll.rollouts.rollout.Rollout` with the snapshot's cached outputs."""
    from lightning_troll.objectives.advantages import compute_advantages
    from lightning_troll.rollouts.rollout import Rollout, behaviour_outputs

    old_logprobs, old = behaviour_outputs(
        snapshot, ids, attention, response, 1.0, sparsify_for(objective), chunk
    )
    return Rollout(
        input_ids=ids,
        attention_mask=attention,
        response_mask=response,
        old_logprobs=old_logprobs,
        old=old,
        rewards=rewards,
        advantages=compute_advantages("grpo", rewards, group),
        truncated=response.all(-1),  # no EOS within the budget
        temperature=1.0,
        group_size=group,
    )


def train_step(policy, objective, optimizer, rollout, micro_batch: int | None, chunk: int):
    """One optimiser step on ``rollout``, as ``TrollModule`` takes it: micro-batches weighted by
    their share of the sequences, gradient norm clipped to 1, AdamW; returns the last part's
    statistics."""
    import torch

    from lightning_troll.rollouts.rollout import linear_head, response_hidden

    stats = None
    for part in rollout.chunks(micro_batch):
        length = part.response_mask.shape[1]
        hidden = response_hidden(policy, part.input_ids, part.attention_mask, length)  # (b, T, H)
        loss, stats = objective.forward_hidden(
            hidden, linear_head(policy), 1.0, part.loss_inputs(), chunk_size=chunk
        )
        (loss * part.num_sequences / rollout.num_sequences).backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return stats
