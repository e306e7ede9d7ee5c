"""LoRA through peft (the optional extra ``lora``): the policy trains low-rank adapters only.

With LoRA the base weights never change, so the snapshot is a second adapter on the same base
model (:class:`~lightning_troll.models.snapshots.AdapterSnapshot`) and the reference policy is the base
model with the adapters switched off (:func:`adapters_disabled`): no second model in memory.
QLoRA keeps the frozen base model in 4-bit NF4 through bitsandbytes (CUDA only). An engine that
loads adapters by path (vLLM servers) takes the active adapter as peft saves it
(:func:`adapter_files`). No Lightning here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["LoraConfig", "adapter_files", "adapters_disabled", "apply_lora"]


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the policy's linear layers (needs ``pip install lightning-troll[lora]``)."""

    r: int = 8
    """Rank of each adapter, >= 1."""
    alpha: float = 16.0
    """Scaling numerator: the adapter's output is multiplied by alpha / r; > 0."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training, in [0, 1)."""
    target_modules: str | list[str] = "all-linear"
    """Names of the layers that get adapters, or 'all-linear' (every linear layer but the output
    layer)."""
    load_in_4bit: bool = False
    """QLoRA: hold the frozen base model in 4-bit NF4 through bitsandbytes (needs CUDA)."""

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"lora.r must be an integer >= 1; got {self.r!r}")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha must be > 0; got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout must be in [0, 1); got {self.dropout!r}")
        if not self.target_modules:
            raise ValueError(
                "lora.target_modules must be 'all-linear' or a non-empty list of layer names; "
                f"got {self.target_modules!r}"
            )
        if self.load_in_4bit and not torch.cuda.is_available():
            raise ValueError(
                "lora.load_in_4bit=true (QLoRA) needs a CUDA device: bitsandbytes' 4-bit "
                "layers train on GPUs only; set it to false on this machine"
            )


def _peft():
    try:
        import peft
    except ImportError:
        raise ImportError("model.lora needs peft: pip install 'lightning-troll[lora]'") from None
    return peft


def apply_lora(policy: nn.Module, config: LoraConfig) -> nn.Module:
    """``policy`` wrapped as a peft model with one trainable adapter (``default``).

    Only the adapter's weights require gradients. A 4-bit base model (``load_in_4bit``) is
    prepared for training first (layer norms in float32, input gradients on).
    """
    peft = _peft()
    if config.load_in_4bit:
        policy = peft.prepare_model_for_kbit_training(policy, use_gradient_checkpointing=False)
    target = config.target_modules
    lora = peft.LoraConfig(
        r=config.r,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=target if isinstance(target, str) else list(target),
        task_type="CAUSAL_LM",
    )
    try:
        return peft.get_peft_model(policy, lora)
    except ValueError as error:
        raise ValueError(f"lora.target_modules={target!r}: {error}") from None


@contextmanager
def adapters_disabled(policy: nn.Module) -> Iterator[nn.Module]:
    """The peft ``policy`` as its base model (adapters off), in eval mode, without gradients."""
    training = policy.training
    policy.eval()
    try:
        with torch.no_grad(), policy.disable_adapter():
            yield policy
    finally:
        policy.train(training)


@torch.no_grad()
def adapter_files(policy: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The active adapter of the peft ``policy`` as ``save_pretrained`` writes it: its weights under
    the names of ``adapter_model.safetensors`` (``...q_proj.lora_A.weight``, the adapter's own
    name left out), on the CPU, and its ``adapter_config.json`` as a dict ready for ``json``
    (``inference_mode`` on). With the snapshot active, the behaviour policy's adapter."""
    import json  # noqa: PLC0415

    peft = _peft()
    name = policy.active_adapter
    name = name[0] if isinstance(name, list | tuple) else name
    state = peft.get_peft_model_state_dict(policy, adapter_name=name)
    tensors = {key: value.detach().to("cpu").contiguous() for key, value in state.items()}
    config = policy.peft_config[name].to_dict()
    config["inference_mode"] = True
    return tensors, json.loads(json.dumps(config, default=_plain))


def _plain(value: Any) -> Any:
    """What ``json`` cannot write of a peft config: sets as sorted lists, the rest as text."""
    return sorted(value) if isinstance(value, set | frozenset) else str(value)
