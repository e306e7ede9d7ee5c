"""The memory a run needs, estimated before its first rollout, against what its device has: a
start that cannot fit stops in one line, before any sampling, instead of being killed later by
the system (or by CUDA) with no word of why.

What a run holds for certain, and is counted as its floor:

- the weights it has loaded: the policy, its snapshot and the reference policy where they are
  copies (their bytes as they are now);
- the policy's gradients (one per trainable weight) and an Adam-like optimiser's two states each;
- the sampling KV cache at its largest: every sequence of a rollout (``data.batch_size`` x
  ``model.group_size``) at ``data.max_prompt_tokens`` + ``model.sampling.max_new_tokens``
  positions, keys and values of every layer.

Beside the floor, two parts are estimated, at most what they take: one training micro-batch's
activations, ``micro_batch_tokens`` times the model's
:func:`~lightning_troll.rollouts.micro_batches.activation_bytes` a token; and, where the rollout
keeps the behaviour policy's sparse rows (TROLL, or clipping with a monitor that reads them), those
rows for every response token at their widest, ``model.trust_region.max_tokens`` (+1 for the
sampled token) columns of an int64 index and a float32 log-prob, and a float32 tail mass (a
rollout holds them from its sampling to the end of its training). A floor over the memory
available stops the start (``ValueError``, one line naming the options to change); a floor plus
the estimated parts over it warns once. Nothing here runs on a model that is not a transformers
one.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_troll.rollouts.micro_batches import activation_bytes, resolve_tokens

__all__ = ["available_bytes", "check_fits", "estimate"]

GIB = 2**30
_ESTIMATED = ("activations", "sparse_rows")  # the parts beside the floor


def available_bytes(device: torch.device) -> int | None:
    """Memory this process may still take on ``device`` plus what it holds now: free CUDA memory
    and the process's allocations, or ``MemAvailable`` and the resident set on a CPU (Linux);
    None where neither can be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free) + int(torch.cuda.memory_allocated(device))
    fields = {}
    try:
        for name in ("/proc/meminfo", "/proc/self/status"):
            with open(name) as f:
                fields.update(line.split(":", 1) for line in f if ":" in line)
        return (int(fields["MemAvailable"].split()[0]) + int(fields["VmRSS"].split()[0])) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _bytes(tensors) -> int:
    """The bytes of ``tensors`` (each once) that this process holds (a shard's own part)."""
    seen, total = set(), 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            local = t.to_local() if isinstance(t, DTensor) else t
            total += local.numel() * local.element_size()
    return total


def estimate(
    module: nn.Module, policy: nn.Module, sequences: int, positions: int, micro_tokens: int,
    optimizers: list[Any], response_tokens: int = 0, sparse_columns: int = 0,
) -> dict[str, int] | None:  # fmt: skip
    """Bytes per part of what a run needs (see the module's docstring): ``weights``,
    ``gradients``, ``optimiser``, ``kv_cache``, ``activations`` and ``sparse_rows`` (for
    ``response_tokens`` in all, ``sparse_columns`` wide; 0 columns: none kept); None for a model
    without a decoder config (layers, heads, hidden size)."""
    config = getattr(policy, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(config, "num_hidden_layers", None)
    hidden = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", None)
    if not (layers and hidden and heads):
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    trainable = [p for p in policy.parameters() if p.requires_grad]
    size = trainable[0].element_size() if trainable else 4
    adam = any("adam" in type(opt).__name__.lower() for opt in optimizers)
    return {
        "weights": _bytes([*module.parameters(), *module.buffers()]),
        "gradients": _bytes(trainable),
        "optimiser": 2 * _bytes(trainable) if adam else 0,
        "kv_cache": sequences * positions * layers * 2 * kv_heads * head_dim * size,
        "activations": micro_tokens * (activation_bytes(policy) or 0),
        "sparse_rows": response_tokens * (sparse_columns * (8 + 4) + 4) if sparse_columns else 0,
    }


def check_fits(module: Any, prompts: int, prompt_tokens: int) -> None:
    """Stops a start whose floor does not fit (``ValueError``) and warns where the floor and one
    micro-batch's activations may not; ``prompts`` is ``data.batch_size``, ``prompt_tokens``
    ``data.max_prompt_tokens``."""
    device = next(module.parameters()).device
    available = available_bytes(device)
    sampling, optimization = module.sampling, module.optimization
    sequences = prompts * module.group_size
    positions = prompt_tokens + sampling.max_new_tokens
    micro = resolve_tokens(optimization.micro_batch_tokens, module.policy) or (
        (optimization.micro_batch_size or optimization.minibatch_size or sequences) * positions
    )
    optimizers = module.trainer.optimizers if module._trainer is not None else []
    lower = f"model.optimization.micro_batch_tokens ({micro})"
    columns = 0
    if module.cache_old_distributions:
        rule = module.old_rows.rule
        columns = rule.max_tokens + int(rule.keep_token)
        lower += f" or model.trust_region.max_tokens ({rule.max_tokens})"
    response = sequences * sampling.max_new_tokens
    parts = estimate(
        module, module.policy, sequences, positions, micro, optimizers, response, columns
    )
    if available is None or parts is None:
        return
    floor = sum(v for k, v in parts.items() if k not in _ESTIMATED)
    most = floor + sum(parts[k] for k in _ESTIMATED)
    said = ", ".join(f"{k.replace('_', ' ')} {v / GIB:.1f}" for k, v in parts.items() if v)
    where = f"{device.type} has {available / GIB:.1f} GiB"
    if floor > available:
        raise ValueError(
            f"this run needs at least {floor / GIB:.1f} GiB before any activation ({said} GiB; "
            f"the KV cache holds {sequences} sequences x {positions} positions) and {where}: "
            "lower model.sampling.max_new_tokens, data.batch_size or model.group_size, or hold "
            "the snapshot in bfloat16 or int8 (model.snapshot)"
        )
    if most > available:
        warnings.warn(
            f"this run may not fit: about {most / GIB:.1f} GiB ({said} GiB) and {where}; lower "
            f"{lower} or set model.optimization.gradient_checkpointing",
            UserWarning,
            stacklevel=2,
        )
