"""The ``vllm_server`` engine: completions sampled by running ``vllm serve`` processes, on GPUs or
machines of their own, over vLLM's OpenAI-compatible HTTP API (docs/engines.md).

- **Servers.** ``model.engine.options.servers`` gives their addresses, or ``launch: n`` starts
  ``n`` of them on free loopback ports (:class:`~lightning_troll.engines.server_http.Launched`,
  the command :func:`~lightning_troll.engines.server_http.serve_command`), stopped at the
  engine's close. Servers given by address are checked when the engine is built, before the
  model loads: one serving another model or tokenizer is refused in one line.
- **Sampling.** A rollout's prompts are split evenly among the servers (contiguous shares, in
  order); each prompt goes as token ids in a request of its own to ``/v1/completions`` with
  ``n = G``, the run's sampling options, its stop tokens, a seed of its own drawn from the
  trainer's generator (:func:`~lightning_troll.engines.vllm.request_seeds`) and ``logprobs: 0``;
  the answers' token ids and log-probs (after temperature: servers run with ``--logprobs-mode
  processed_logprobs``) are laid out as every engine's.
- **Versions.** Each push is the next weight version; every server is told it
  (``/update_weight_version``) and asked it back (``/weight_info``) before it samples, so every
  completion is tagged with the version that sampled it (:attr:`ServerEngine.last_versions`) and
  a server that holds another one (it restarted) is given the current version again from its
  folder (``push: folder``, counted in ``engine/server_repushes``) or stops the run
  (``push: nccl``). As the engine in a process of its
  own, it takes the stale versions ``old_policy.max_staleness`` asks for (:meth:`push`) and
  samples the next rollout while the trainer trains (:meth:`submit`, in a thread), so the
  staleness machinery drives it unchanged.
- **Weights** go by :mod:`~lightning_troll.engines.server_weights` (``push: folder`` or
  ``nccl``), from the trainer's rank 0; under DDP or FSDP2 every process gathers, rank 0 pushes,
  the others wait, and each samples its own prompts. With ``model.lora`` and the folder push
  the behaviour policy's adapter goes as an adapter (``lora_push: adapter``, the default there),
  loaded by every server by path and named in every completion request; ``lora_push: merged``
  pushes the merged weights instead.
- **Faults.** A server that does not answer (after ``wait_s``), answers with an error, or whose
  process ended raises :class:`~lightning_troll.engines.server_http.ServerDown` naming its
  address, which the rollout callback turns into a fault after a checkpoint.

No Lightning here.
"""

from __future__ import annotations

import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_troll.engines.base import (
    EngineContext,
    Generation,
    RolloutEngine,
    SampleRequest,
)
from lightning_troll.engines.behaviour import BehaviourRecorder
from lightning_troll.engines.process import Request, fingerprint
from lightning_troll.engines.sampling import is_number
from lightning_troll.engines.server_http import (
    Launched,
    Server,
    ServerDown,
    check_dtype,
    check_lora,
    check_serves,
    check_weight_routes,
    server_info,
)
from lightning_troll.engines.server_options import (
    check_server_options,
    is_address,
    sends_adapters,
)
from lightning_troll.engines.server_weights import adapter_name, build_push
from lightning_troll.engines.vllm import laid_out, request_seeds
from lightning_troll.models.loading import resolve_model_path
from lightning_troll.models.lora import adapter_files
from lightning_troll.models.weights import full_weights

__all__ = ["ServerEngine", "check_servers_answer", "split_evenly"]


def check_servers_answer(options: Any) -> None:
    """Refuses, naming its address, a server of ``model.engine.options.servers`` that does not
    answer ``GET /v1/models`` (waiting ``wait_s`` for it): the command line asks before the model
    loads, where the engine reaches its servers only when it is built. Options it cannot read are
    left to :meth:`ServerEngine.check_options`, and ``launch`` to the engine's start."""
    try:
        given = ServerEngine.given_options(options)  # every option, over the defaults
    except TypeError:
        return
    servers, wait = given["servers"], given["wait_s"]
    if not isinstance(servers, list) or not all(map(is_address, servers)):
        return
    if not (is_number(wait) and wait >= 0):
        return
    for address in servers:
        try:
            Server(address, wait).get("/v1/models")
        except ServerDown as error:
            raise ValueError(f"model.engine.options.servers: {error}") from None


def split_evenly(count: int, servers: int) -> list[int]:
    """The server of each of ``count`` prompts: contiguous shares whose sizes differ by at most
    one, the larger first (10 prompts on 3 servers: 4, 3, 3)."""
    share, extra = divmod(count, servers)
    owners: list[int] = []
    for s in range(servers):
        owners += [s] * (share + (s < extra))
    return owners


class ServerEngine(RolloutEngine):
    """Samples from ``vllm serve`` processes over HTTP; see the module's docstring.

    Args (``model.engine.options``):
        servers: the servers' addresses (``http://host:port``); or
        launch: how many servers to start on this machine (``vllm serve`` on loopback).
        serve_args: further ``vllm serve`` arguments for started servers.
        gpus: per started server, the GPUs it sees (``CUDA_VISIBLE_DEVICES``, e.g. ``["0", "1"]``).
        kv_cache_gib: on a CPU, each started server's KV cache in GiB (whole: rounded up).
        threads: on a CPU, each started server's OpenMP threads (null: its default).
        start_timeout_s: seconds started servers may take to become healthy.
        log_dir: where started servers write their output (null: a temporary folder).
        wait_s: seconds to wait for a server that does not answer to come back (0: fail at once).
        push: how weights reach the servers, ``folder`` or ``nccl``.
        push_dir: with ``folder``, a folder every server can read (null: a temporary folder).
        nccl: with ``nccl``, ``{master_address, master_port, server_workers}``.
        model_name: the name the servers serve the model under (null: the model's own name).
        concurrency: requests in flight at once, over all servers.
        lora_push: with ``model.lora``, ``adapter`` (the behaviour policy's adapter, loaded by
            every server by path) or ``merged`` (the weights with it merged in); null:
            ``adapter`` with ``push: folder``, ``merged`` with ``nccl``.
    """

    name = "vllm_server"
    several_processes = True
    records_behaviour = False

    def __init__(
        self,
        context: EngineContext,
        servers: list[str] | None = None,
        launch: int = 0,
        serve_args: list[str] | None = None,
        gpus: list[str] | None = None,
        kv_cache_gib: float = 1.0,
        threads: int | None = None,
        start_timeout_s: float = 900.0,
        log_dir: str | None = None,
        wait_s: float = 0.0,
        push: str = "folder",
        push_dir: str | None = None,
        nccl: dict[str, Any] | None = None,
        model_name: str | None = None,
        concurrency: int = 64,
        lora_push: str | None = None,
    ) -> None:
        super().__init__(context)
        self.adapters = sends_adapters(lora_push, push, context.lora)
        """True where the LoRA adapter goes as an adapter (``lora_push: adapter``)."""
        self.served: str | None = None
        """The name the version the servers hold is served under: its adapter's, or None (the
        model's own)."""
        self.addresses = list(servers or [])
        self.launch, self.serve_args, self.gpus = launch, list(serve_args or []), gpus
        self.kv_cache_gib, self.threads, self.log_dir = kv_cache_gib, threads, log_dir
        self.start_timeout_s, self.wait_s, self.model_name = start_timeout_s, wait_s, model_name
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = rank
        self.servers: list[Server] = []
        if self.addresses:  # refused before the push makes its temporary folder
            self._connect(self.addresses)
        extra = {"push_dir": push_dir} if push == "folder" else {**(nccl or {}), "rank": rank}
        self._push = build_push(push, extra)
        self._launched: Launched | None = None
        self._pool = ThreadPoolExecutor(max_workers=concurrency)
        self._ahead = ThreadPoolExecutor(max_workers=1)
        self._future: Future | None = None
        self._pending: Request | None = None
        self.version = 0
        """How many weight pushes: the version the servers hold (0: none yet)."""
        self.policy_version: int | None = None
        """The trainer's policy version the servers hold when one was pushed ahead of a rollout
        (set by the staleness schedule); None otherwise."""
        self.pending_seed: int | None = None
        self.next_seed: int | None = None
        self.last_versions: list[int] = []
        """The weight version that sampled each completion of the last generation (B,)."""
        self.last_fingerprint: float | None = None
        """The fingerprint of the weights of that version (:func:`fingerprint`)."""
        self._fingerprints: dict[int, float] = {}
        self._figures: dict[str, float] = {}
        self._repushes = 0

    @classmethod
    def check_options(cls, options: dict[str, Any], lora: Any = None) -> None:
        super().check_options(options, lora)
        check_server_options(cls.given_options(options), lora)

    # -- servers ----------------------------------------------------------------------------------
    def _connect(self, addresses: list[str]) -> None:
        self.servers = [Server(a, self.wait_s) for a in addresses]
        for server in self.servers:
            check_serves(server, self.context.model, self.context.tokenizer, self.model_name)
            check_weight_routes(server)
            if self.adapters or self.context.dtype != "auto":
                info = server_info(server)
                if self.adapters:
                    check_lora(server, info, self.context.lora.r)
                check_dtype(server, info, self.context.dtype)

    def _ensure_started(self) -> None:
        if self.servers:
            return
        start = time.perf_counter()
        model = resolve_model_path(self.context.model)
        rank = self.context.lora.r if self.adapters else None
        cpu = self.gpus is None and not torch.cuda.is_available()
        self._launched = Launched(self.launch, model, self.context.dtype, self.serve_args,
                                  self.gpus, self.kv_cache_gib, self.threads, self.log_dir,
                                  rank, cpu)  # fmt: skip
        self._launched.wait_healthy(self.start_timeout_s)
        self._connect(self._launched.addresses)
        self._figures["engine/startup_s"] = time.perf_counter() - start

    # -- weights ----------------------------------------------------------------------------------
    def load_weights(self, snapshot: nn.Module) -> None:
        device = next(snapshot.parameters()).device
        if self.adapters:  # the behaviour policy's adapter, as peft saves it
            tensors, config = adapter_files(snapshot)
            self._send(lambda: self._push.push_adapter(self.servers, tensors, config,
                                                       self.version),
                       fingerprint(tensors))  # fmt: skip
            self.served = adapter_name(self.version)
        else:
            self.push(dict(full_weights(snapshot)), device)
        self.policy_version = None
        super().load_weights(snapshot)

    def push(self, weights: dict[str, torch.Tensor], device: torch.device) -> int:
        """Pushes ``weights`` (by transformers name, gathered) to every server as the next
        version, from rank 0 (the others wait); returns the version."""
        every = self._push.name == "nccl"  # NCCL: every rank joins the gather
        version = self._send(lambda: self._push.push(self.servers, weights.items(), self.version),
                             fingerprint(weights), every)  # fmt: skip
        self.served = None
        return version

    def _send(self, send: Any, mark: float, every_rank: bool = False) -> int:
        """Makes the next version: ``send()`` (from rank 0, or ``every_rank``) gives the servers
        its weights, each is told the version, the other ranks wait; ``mark``: its fingerprint."""
        self._ensure_started()
        if self._future is not None:  # a rollout asked for older weights: dropped
            self._collect()
        start = time.perf_counter()
        self.version += 1
        if self.rank == 0 or every_rank:
            send()
        if self.rank == 0:
            for server in self.servers:
                server.post("/update_weight_version", {"new_version": str(self.version)})
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        self._fingerprints = {self.version: mark}
        self._figures["engine/weight_push_s"] = time.perf_counter() - start
        return self.version

    # -- sampling ---------------------------------------------------------------------------------
    def submit(self, request: SampleRequest) -> None:
        """Sends the requests of ``request``'s prompts now, in a thread, and returns at once."""
        if self._future is not None:
            self._collect()  # one rollout in flight: the older one is dropped
        seed, self.next_seed = self.next_seed, None
        if seed is None:
            seed = int(torch.randint(0, 2**31 - 1, ()))
        self._future = self._ahead.submit(self._sample, request, seed)
        self._pending, self.pending_seed = Request(request, self.version), seed

    def generate(
        self, snapshot: nn.Module, request: SampleRequest, recorder: BehaviourRecorder | None = None
    ) -> Generation:
        if recorder is not None:
            raise ValueError("the vllm_server engine cannot record the snapshot's logits")
        if self.stale or not self.servers:
            self.load_weights(snapshot)
        prefetched = self._future is not None and self._pending == Request(request, self.version)
        if not prefetched:
            self.submit(request)
        start = time.perf_counter()
        completions, logprobs, versions = self._collect()
        self._figures["engine/server_wait_s"] = time.perf_counter() - start
        self._figures["engine/server_prefetched"] = float(prefetched)
        self._figures["engine/server_repushes"], self._repushes = float(self._repushes), 0
        self.last_versions = [v for v in versions for _ in range(request.group_size)]
        self.last_fingerprint = self._fingerprints.get(versions[0]) if versions else None
        device = next(snapshot.parameters()).device
        return laid_out(request, completions, logprobs, device)

    def _collect(self) -> tuple[list, list, list[int]]:
        future, self._future, self._pending, self.pending_seed = self._future, None, None, None
        return future.result()

    def _sample(self, request: SampleRequest, seed: int) -> tuple[list, list, list[int]]:
        """Every prompt's G completions and log-probs (prompt-major) and the weight version of the
        server that sampled each prompt."""
        prompts = [list(p) for p in request.prompt_ids]
        owners = split_evenly(len(prompts), len(self.servers))
        held = [self._held_version(s) for s in self.servers]
        seeds = request_seeds(seed, len(prompts), request.group_size)
        futures = [
            self._pool.submit(_complete, self.servers[owner], self.served, ids, request, budget, s)
            for ids, owner, budget, s in zip(
                prompts, owners, request.each_budget, seeds, strict=True
            )
        ]
        answers = [f.result() for f in futures]
        completions = [tokens for answer in answers for tokens, _ in answer]
        logprobs = [values for answer in answers for _, values in answer]
        return completions, logprobs, [held[o] for o in owners]

    def _held_version(self, server: Server) -> int:
        """The version ``server`` holds, which must be the one pushed: one that restarted is
        given it again from its folder (``push: folder``, where this process pushed it), with a
        warning; otherwise :class:`ServerDown`."""
        held = (server.get("/weight_info") or {}).get("weight_version")
        if held is not None and str(held) == str(self.version):
            return self.version
        where = f"the vLLM server at {server.address} holds weight version {held!r}, not the "
        where += f"version {self.version} pushed to it (it restarted?)"
        last = getattr(self._push, "last", None)
        if last is None:  # NCCL, or a rank that did not write the folder
            raise ServerDown(f"{where}: its samples would come from other weights, and "
                             f"model.engine.options.push {self._push.name!r} cannot give "
                             "them to it again here")  # fmt: skip
        warnings.warn(f"{where}: pushing it the version's folder {last} again", stacklevel=2)
        self._push.repush(server)
        server.post("/update_weight_version", {"new_version": str(self.version)})
        self._repushes += 1
        held = (server.get("/weight_info") or {}).get("weight_version")
        if str(held) != str(self.version):
            raise ServerDown(f"{where}, and still holds {held!r} after it was pushed again")
        return self.version

    # -- the rest ---------------------------------------------------------------------------------
    def figures(self) -> dict[str, float]:
        figures, self._figures = self._figures, {}
        return figures

    def close(self) -> None:
        if self._future is not None:
            self._future.cancel()
            self._future = self._pending = self.pending_seed = None
        if self._launched is not None:
            self._launched.stop()
            self._launched = None
            self.servers = []
        self._push.close()
        self.version, self.policy_version, self.stale, self.served = 0, None, True, None


def _complete(server: Server, model: str | None, ids: list[int], request: SampleRequest,
              budget: int, seed: int) -> list[tuple[list[int], list[float]]]:  # fmt: skip
    """One prompt's ``n = G`` completions from ``server`` (``model``: the adapter to sample with,
    or None: its model): (token ids, log-probs) each."""
    sampling = request.sampling
    body = {
        "model": model or server.model, "prompt": ids, "n": request.group_size, "max_tokens": budget,
        "temperature": sampling.temperature, "top_p": sampling.top_p,
        "top_k": sampling.top_k or -1, "min_p": 0.0, "repetition_penalty": 1.0,
        "seed": seed, "stop_token_ids": list(request.stop_ids), "logprobs": 0,
        "return_token_ids": True, "skip_special_tokens": False,
    }  # fmt: skip
    answer = server.post("/v1/completions", body)
    choices = sorted((answer or {}).get("choices") or [], key=lambda c: c["index"])
    if len(choices) != request.group_size:
        raise ServerDown(f"the vLLM server at {server.address} answered {len(choices)} "
                         f"completions for a prompt; asked {request.group_size}")  # fmt: skip
    out = []
    for choice in choices:
        tokens = list(choice.get("token_ids") or [])
        values = (choice.get("logprobs") or {}).get("token_logprobs") or []
        if len(values) != len(tokens):
            raise ServerDown(f"the vLLM server at {server.address} answered {len(tokens)} "
                             f"tokens with {len(values)} log-probs")  # fmt: skip
        out.append((tokens, [float(v) for v in values]))
    return out
