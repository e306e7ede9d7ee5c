"""How the ``vllm_server`` engine pushes the behaviour policy's weights to its servers, through
vLLM's own routes (``model.engine.options.push``):

- ``folder`` (any device, the CPU's only way): the weights are written as one safetensors file
  in a folder every server can read (``push_dir``: on one machine a temporary folder; across
  machines a shared file system), and each server reloads them in place
  (``POST /collective_rpc`` with vLLM's ``reload_weights`` and ``weights_path``), then drops the
  KV blocks its prefix cache kept of the old weights (``POST /reset_prefix_cache``);
- ``nccl`` (GPUs): vLLM's weight transfer (``vllm serve --weight-transfer-config
  '{"backend": "nccl"}'``): one NCCL group per server, the trainer's rank 0 the sender, driven by
  vLLM's trainer-side engine (``NCCLTrainerWeightTransferEngine``) over the server's
  ``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights`` and
  ``/finish_weight_update`` routes. Written to vLLM's documented API; **not run on this
  project's machines** (docs/engines.md).

Either way each server is then told the version it holds (``POST /update_weight_version``),
which the engine reads back (``GET /weight_info``) to tag the completions it samples. No
Lightning here.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from lightning_troll.engines.server_http import Server

__all__ = ["PUSHES", "FolderPush", "NCCLPush", "build_push"]


class FolderPush:
    """Weights written to ``<push_dir>/version-<k>/model.safetensors`` and reloaded by every
    server from there; the previous version's folder is removed once all have."""

    name = "folder"

    def __init__(self, push_dir: str | None = None) -> None:
        self.root = Path(push_dir or tempfile.mkdtemp(prefix="lightning-troll-push-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self._last: Path | None = None

    def push(self, servers: list[Server], weights: Iterable[tuple[str, torch.Tensor]],
             version: int) -> None:  # fmt: skip
        from safetensors.torch import save_file  # noqa: PLC0415

        folder = self.root / f"version-{version}"
        folder.mkdir(parents=True, exist_ok=True)
        tensors, seen = {}, set()
        for name, weight in weights:
            tensor = weight.detach().to("cpu").contiguous()
            if tensor.data_ptr() in seen:  # a tied head: safetensors keeps no shared storage
                tensor = tensor.clone()
            seen.add(tensor.data_ptr())
            tensors[name] = tensor
        save_file(tensors, str(folder / "model.safetensors.part"))
        (folder / "model.safetensors.part").rename(folder / "model.safetensors")
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
        _on_each(servers, lambda s: (s.post("/collective_rpc", body),
                                     s.post("/reset_prefix_cache")))  # fmt: skip
        if self._last is not None and self._last != folder:
            shutil.rmtree(self._last, ignore_errors=True)
        self._last = folder

    def close(self) -> None:
        if self._last is not None:
            shutil.rmtree(self._last, ignore_errors=True)
            self._last = None


class NCCLPush:
    """vLLM's NCCL weight transfer to every server, one group each (not run here: no GPU with
    vLLM on this project's machines).

    Args:
        master_address: the address the servers reach the trainer's rank 0 at.
        master_port: the first group's port; server ``i`` uses ``master_port + i``.
        server_workers: each server's GPU workers (its tensor x data parallel size).
        rank: the trainer's rank (0 sends; the others take part in gathering FSDP2 shards).
    """

    name = "nccl"

    def __init__(self, master_address: str = "127.0.0.1", master_port: int = 29600,
                 server_workers: int = 1, rank: int = 0) -> None:  # fmt: skip
        self.master_address, self.master_port = master_address, master_port
        self.server_workers, self.rank = server_workers, rank
        self._engines: list[Any] = []
        self._source: Any = None

    def _connect(self, servers: list[Server]) -> None:
        from vllm.distributed.weight_transfer.clients import (  # noqa: PLC0415
            HTTPVLLMWeightSyncClient,
        )
        from vllm.distributed.weight_transfer.factory import (  # noqa: PLC0415
            WeightTransferTrainerFactory,
        )
        from vllm.distributed.weight_transfer.nccl_engine import (  # noqa: PLC0415
            NCCLTrainerInitInfo,
        )

        self._source = _named_source()
        for i, server in enumerate(servers):
            info = NCCLTrainerInitInfo(
                master_address=self.master_address, master_port=self.master_port + i,
                world_size=1 + self.server_workers, rank=self.rank,
            )  # fmt: skip
            client = HTTPVLLMWeightSyncClient(server.address)
            self._engines.append(
                WeightTransferTrainerFactory.trainer_init(info, client=client, source=self._source)
            )

    def push(self, servers: list[Server], weights: Iterable[tuple[str, torch.Tensor]],
             version: int) -> None:  # fmt: skip
        if not self._engines:
            self._connect(servers)
        self._source.weights = [(name, w.detach().contiguous()) for name, w in weights]
        for engine in self._engines:  # each server's group in turn; the sender drives the routes
            engine.send_weights()
        self._source.weights = []

    def close(self) -> None:
        for engine in self._engines:
            engine.shutdown()
        self._engines = []


def _named_source() -> Any:
    """A vLLM ``WeightSource`` over the ``(name, tensor)`` pairs set before each round (the
    snapshot's :func:`~lightning_troll.models.weights.full_weights`, gathered already)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource  # noqa: PLC0415

    class NamedWeights(WeightSource):
        weights: list[tuple[str, torch.Tensor]] = []

        def metadata(self) -> list[Any]:
            return [ParamMeta(n, w.dtype, tuple(w.shape)) for n, w in self.weights]

        def __iter__(self):  # noqa: ANN204
            return iter(list(self.weights))

    return NamedWeights()


PUSHES = {"folder": FolderPush, "nccl": NCCLPush}
"""``model.engine.options.push``: how weights reach the servers."""


def build_push(push: str, options: dict[str, Any]) -> FolderPush | NCCLPush:
    """The push ``model.engine.options.push`` names, with ``model.engine.options.push_options``."""
    if push not in PUSHES:
        raise ValueError(f"model.engine.options.push must be one of {sorted(PUSHES)}; got {push!r}")
    try:
        return PUSHES[push](**options)
    except TypeError as error:
        raise ValueError(f"model.engine.options.push_options for push {push!r}: {error}") from None


def _on_each(servers: list[Server], call: Any) -> None:
    """``call(server)`` on every server at once; the first failure is raised."""
    with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
        for future in [pool.submit(call, s) for s in servers]:
            future.result()
