"""How the ``vllm_server`` engine pushes the behaviour policy's weights to its servers, through
vLLM's own routes (``model.engine.options.push``):

- ``folder`` (any device, the CPU's only way): the weights are written as one safetensors file
  in a folder every server can read (``push_dir``: on one machine a temporary folder; across
  machines a shared file system), and each server reloads them in place
  (``POST /collective_rpc`` with vLLM's ``reload_weights`` and ``weights_path``), then drops the
  KV blocks its prefix cache kept of the old weights (``POST /reset_prefix_cache``); with LoRA
  adapters (``lora_push: adapter``) the folder holds the behaviour policy's adapter as peft
  saves it, and each server loads it by path under a name of its own per version
  (``POST /v1/load_lora_adapter``), then forgets the previous version's
  (``/v1/unload_lora_adapter``); a new adapter has a new id, under which vLLM keys its prefix
  cache, so none is reset. The current version's folder is kept until the next push, so a
  server that restarted can be given it again (:meth:`FolderPush.repush`);
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

import inspect
import json
import shutil
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from lightning_troll.engines.server_http import Server, ServerDown

__all__ = ["PUSHES", "FolderPush", "NCCLPush", "adapter_name", "build_push"]


def adapter_name(version: int) -> str:
    """The name weight version ``version``'s LoRA adapter is served under (the completions'
    ``model``)."""
    return f"lightning-troll-v{version}"


class FolderPush:
    """Weights written to ``<push_dir>/version-<k>/model.safetensors`` and reloaded by every
    server from there, or a LoRA adapter written to ``<push_dir>/version-<k>/`` as peft saves it
    and loaded by every server under :func:`adapter_name`; the previous version's folder is
    removed once all have."""

    name = "folder"

    def __init__(self, push_dir: str | None = None) -> None:
        self.root = Path(push_dir or tempfile.mkdtemp(prefix="lightning-troll-push-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self._owned = push_dir is None  # a temporary folder of its own: removed at close
        self.last: Path | None = None
        """The folder of the version the servers hold (None before the first push)."""
        self.adapter: str | None = None
        """The name that version's adapter is served under; None for full weights."""

    def push(self, servers: list[Server], weights: Iterable[tuple[str, torch.Tensor]],
             version: int) -> None:  # fmt: skip
        folder = self._folder(version)
        tensors, seen = {}, set()
        for name, weight in weights:
            tensor = weight.detach().to("cpu").contiguous()
            if tensor.data_ptr() in seen:  # a tied head: safetensors keeps no shared storage
                tensor = tensor.clone()
            seen.add(tensor.data_ptr())
            tensors[name] = tensor
        _save(tensors, folder / "model.safetensors")
        _on_each(servers, lambda s: _reload(s, folder))
        self._keep(folder, None)

    def push_adapter(self, servers: list[Server], tensors: dict[str, torch.Tensor],
                     config: dict[str, Any], version: int) -> str:  # fmt: skip
        """Writes the adapter (``tensors`` and ``config``: :func:`~lightning_troll.models.lora.
        adapter_files`) as version ``version`` and loads it on every server, which then forgets
        the previous version's; returns the name it is served under."""
        folder, name, previous = self._folder(version), adapter_name(version), self.adapter
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=1) + "\n")
        _save(tensors, folder / "adapter_model.safetensors")

        def load(server: Server) -> None:
            server.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
            if previous is not None and previous != name:
                _unload(server, previous)

        _on_each(servers, load)
        self._keep(folder, name)
        return name

    def repush(self, server: Server) -> None:
        """Gives ``server`` the version the others hold again, from its folder (a server that
        restarted holds the weights it started with)."""
        if self.last is None:
            raise ServerDown(f"the vLLM server at {server.address} holds other weights than "
                             "pushed, and this process pushed none to give it again")  # fmt: skip
        if self.adapter is None:
            _reload(server, self.last)
        else:  # in place: the name may still be loaded where the server did not restart
            server.post("/v1/load_lora_adapter", {"lora_name": self.adapter,
                                                  "lora_path": str(self.last),
                                                  "load_inplace": True})  # fmt: skip

    def _folder(self, version: int) -> Path:
        folder = self.root / f"version-{version}"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _keep(self, folder: Path, adapter: str | None) -> None:
        if self.last is not None and self.last != folder:
            shutil.rmtree(self.last, ignore_errors=True)
        self.last, self.adapter = folder, adapter

    def close(self) -> None:
        if self.last is not None:
            shutil.rmtree(self.last, ignore_errors=True)
            self.last = self.adapter = None
        if self._owned:
            shutil.rmtree(self.root, ignore_errors=True)


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``tensors`` as one safetensors file at ``path``, written beside it and renamed into place."""
    from safetensors.torch import save_file  # noqa: PLC0415

    part = path.with_name(path.name + ".part")
    save_file(tensors, str(part))
    part.rename(path)


def _reload(server: Server, folder: Path) -> None:
    """``server`` reloads its weights from ``folder`` and drops its prefix cache."""
    server.post("/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}})  # fmt: skip
    server.post("/reset_prefix_cache")


def _unload(server: Server, name: str) -> None:
    """``server`` forgets the adapter ``name``; one it does not know (it restarted since) is
    no error."""
    try:
        server.post("/v1/unload_lora_adapter", {"lora_name": name})
    except ServerDown as error:
        if error.code != 404:
            raise


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

NCCL_OPTIONS = tuple(p for p in inspect.signature(NCCLPush.__init__).parameters
                     if p not in ("self", "rank"))  # fmt: skip
"""The keys of ``model.engine.options.nccl``: the NCCL push's arguments but the trainer's rank."""


def build_push(push: str, options: dict[str, Any]) -> FolderPush | NCCLPush:
    """The push ``model.engine.options.push`` names, with its options (``push_dir``, or the
    ``nccl`` mapping's keys)."""
    if push not in PUSHES:
        raise ValueError(f"model.engine.options.push must be one of {sorted(PUSHES)}; got {push!r}")
    try:
        return PUSHES[push](**options)
    except TypeError as error:
        raise ValueError(f"model.engine.options for push {push!r}: {error}") from None


def _on_each(servers: list[Server], call: Any) -> None:
    """``call(server)`` on every server at once; the first failure is raised."""
    with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
        for future in [pool.submit(call, s) for s in servers]:
            future.result()
