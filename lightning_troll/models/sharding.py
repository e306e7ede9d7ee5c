"""FSDP2 sharding of the policy and its snapshots, and generation that gathers weights once.

:func:`shard_model` applies ``fully_shard`` to each decoder layer and then to the root, the
layout transformers' models are built for (their ``_no_split_modules`` names the layer class).
:func:`gathered` keeps a sharded model's weights gathered for a block of forwards, such as the
one forward per generated token of ``generate``, and shards them again afterwards.
:func:`data_parallel_mesh` and :func:`check_shardable` refuse the layouts and memory options
sharding does not support. Nothing here imports Lightning.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

if TYPE_CHECKING:
    from lightning_troll.models.lora import LoraConfig
    from lightning_troll.models.snapshots import SnapshotConfig

__all__ = [
    "check_strategy",
    "check_shardable",
    "data_parallel_mesh",
    "decoder_layers",
    "gathered",
    "is_sharded",
    "shard_model",
]


def is_sharded(model: nn.Module) -> bool:
    """True if ``fully_shard`` has been applied to ``model``."""
    return isinstance(model, FSDPModule)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: modules whose class the model names in ``_no_split_modules``.

    Raises ``ValueError`` for a model that names none, since sharding only its root would
    gather every weight at once and save nothing.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"cannot shard {type(model).__name__}: it names no decoder-layer class in "
            f"_no_split_modules (got {sorted(names)}); FSDP2 sharding needs one"
        )
    return layers


def shard_model(
    model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None
) -> nn.Module:
    """``fully_shard`` each decoder layer, then the root, over ``mesh``; a no-op when sharded."""
    if is_sharded(model):
        return model
    options = {"mesh": mesh}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel part of ``ModelParallelStrategy``'s mesh; refuses tensor parallelism."""
    names = mesh.mesh_dim_names or ()
    if "tensor_parallel" in names and mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            "trainer.strategy: ModelParallelStrategy with tensor_parallel_size="
            f"{mesh['tensor_parallel'].size()} is not supported; lightning-troll shards with "
            "FSDP2 only: set tensor_parallel_size: 1 and data_parallel_size: <processes>"
        )
    return mesh["data_parallel"] if "data_parallel" in names else mesh


def check_shardable(snapshot: SnapshotConfig, lora: LoraConfig | None) -> None:
    """Refuses the memory options that FSDP2 sharding does not support (yet)."""
    if lora is not None:
        raise ValueError(
            "model.lora is not supported with FSDP2 sharding (ModelParallelStrategy): adapters "
            "are small, so train them with the ddp strategy, or set model.lora: null"
        )
    if snapshot.dtype == "int8":
        raise ValueError(
            "model.snapshot.dtype='int8' is not supported with FSDP2 sharding "
            "(ModelParallelStrategy); use 'bfloat16' or 'same', or snapshot.mode: shared"
        )


def _param_groups(state) -> list:
    """An FSDP2 state's parameter groups: a list in newer torch, one group (or None) in torch 2.11,
    which the GPU image holds."""
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    if hasattr(state, "_fsdp_param_group"):
        return [] if state._fsdp_param_group is None else [state._fsdp_param_group]
    raise AttributeError(
        f"this torch's FSDP2 state ({type(state).__name__}) has neither _fsdp_param_groups nor "
        f"_fsdp_param_group; lightning_troll.models.sharding.gathered needs updating for it"
    )


def _groups_reshard_after_forward(module: FSDPModule) -> bool:
    state = module._get_fsdp_state()
    return any(g.post_forward_mesh_info is not None for g in _param_groups(state))


@contextmanager
def gathered(model: nn.Module) -> Iterator[nn.Module]:
    """Keeps a sharded model's weights gathered inside the block (for inference only).

    Without it, every forward all-gathers each layer's weights and frees them again, which for
    ``generate`` means once per generated token. Inside the block the first forward gathers them
    and later forwards reuse them; on exit they are sharded again and each FSDP module gets back
    its own reshard-after-forward setting. Unsharded models pass through unchanged.
    """
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        yield model
        return
    if isinstance(model, FSDPModule):
        # FSDP2 settles which module is the root (and that the root keeps its weights gathered
        # after forward) at the first forward; settle it now so the settings read are final.
        model._get_fsdp_state()._lazy_init()
    before = [_groups_reshard_after_forward(m) for m in modules]
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield model
    finally:
        for m, setting in zip(modules, before, strict=True):
            m.set_reshard_after_forward(setting, recurse=False)
            m.reshard()


def check_strategy(strategy) -> None:
    """Refuses Lightning's FSDPStrategy (FSDP1), whose root wrapper gathers the weights outside
    the decoder layers only inside the module's own forward: rollouts sample outside it."""
    from lightning.pytorch.strategies import FSDPStrategy  # the maths here needs no Lightning

    if isinstance(strategy, FSDPStrategy):
        raise ValueError(
            "trainer.strategy: FSDPStrategy (FSDP1) is not supported; shard with FSDP2 instead: "
            "lightning.pytorch.strategies.ModelParallelStrategy with tensor_parallel_size: 1 and "
            "data_parallel_size: <processes> (see configs/fsdp2.yaml), or use ddp"
        )
