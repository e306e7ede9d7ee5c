"""A rollout engine in a process of its own, so that sampling can overlap training.

``model.engine.options: {process: true, ...}`` runs the engine of ``model.engine.name``
(``hf``, ``vllm`` or a user's own) in a child process that holds its own copy of the model, and
:class:`ProcessEngine` stands in for it in the trainer:

- **Weights by version.** :meth:`ProcessEngine.load_weights` sends the behaviour policy's
  weights (:func:`~lightning_troll.models.weights.full_weights`, as CPU tensors in shared memory)
  under a version number; the child loads them into its model and hands that to its engine.
- **Sampling requests.** :meth:`ProcessEngine.submit` sends a
  :class:`~lightning_troll.engines.base.SampleRequest` and a seed and returns at once; the child
  samples while the trainer goes on, and the next :meth:`ProcessEngine.generate` of an equal
  request and the same version takes the result. A ``generate`` that
  matches no request sends one and waits, as an engine in the trainer's process would.
- **Who submits.** With ``old_policy.max_staleness: s >= 1`` the rollout k + 1 is sampled by
  the policy of s versions before the trainer's (:class:`~lightning_troll.callbacks.old_policy.
  OldPolicyRefresh`); those weights exist as soon as rollout k's training starts, so the
  refresh callback submits rollout k + 1's prompts then, and the child samples them while the
  trainer trains on rollout k. With ``max_staleness: 0`` nothing is submitted ahead: the
  engine still runs apart, and the loop is sequential.

The child draws from a torch generator seeded per request, so an overlapped run is the same
distribution as the sequential one with the same staleness, not the same random numbers. A
request's seed is drawn from the trainer's global torch RNG when it is sent; the seed of a request
sampled ahead travels in the checkpoint, so that a resumed run asks again with it. The
behaviour log-probs and TROLL's old distributions still come from the trainer's snapshot
(a teacher-forced pass after sampling); an engine apart never records them while sampling.
Figures: ``engine/process_wait_s`` (seconds the trainer waited for a sample it asked for),
``engine/process_prefetched`` (1 when the rollout was sampled ahead) and
``engine/weight_push_s``. One trainer process only. No Lightning here.
"""

from __future__ import annotations

import contextlib
import signal
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from lightning_troll.engines.base import (
    EngineContext,
    Generation,
    RolloutEngine,
    SampleRequest,
    build_engine,
    check_option,
    is_count,
)
from lightning_troll.engines.behaviour import BehaviourRecorder
from lightning_troll.models.weights import full_weights
from lightning_troll.tasks.rewards.workers import leave_stop_signals_to_the_trainer

__all__ = ["EngineDied", "ProcessEngine", "Request", "check_threads", "fingerprint"]

_START_TIMEOUT_S = 600.0
"""How long the child may take to load its model and engine before the trainer gives up."""


class EngineDied(RuntimeError):
    """The engine's process ended while a rollout was sampled (killed, or out of memory): the
    rollout is lost, but nothing of it trained, so a run saves its checkpoint and stops."""


@dataclass(frozen=True)
class Request:
    """A sample asked of the weights of one version: the same request gives the same answer."""

    asked: SampleRequest
    """The prompts and options sampled."""
    version: int
    """The weights' version that samples them (how many pushes the engine had)."""


def fingerprint(weights: dict[str, torch.Tensor]) -> float:
    """A number that changes with any weight (their float64 sum, each weighted by its position):
    what the child reports with every sample, so that a test can tell which weights sampled."""
    total = 0.0
    for i, name in enumerate(sorted(weights)):
        total += (i + 1) * float(weights[name].double().sum())
    return total


def check_threads(threads: Any) -> None:
    """``model.engine.options.threads`` with ``process: true``: null or an integer >= 1."""
    check_option("threads", threads, threads is None or is_count(threads, 1),
                 "null or an integer >= 1")  # fmt: skip


class ProcessEngine(RolloutEngine):
    """The engine ``inner`` (a name or import path, with its ``options``) run in a child
    process; see the module's docstring.

    Args:
        context: the run's model, dtype and tokenizer (the child loads the model from it).
        inner: the engine the child runs (``model.engine.name``).
        options: that engine's own options (``model.engine.options`` without ``process``
            and ``threads``).
        threads: torch's CPU threads in the child (``model.engine.options.threads``);
            None: torch's default. On a CPU the trainer and the child share the cores.
    """

    name = "process"
    several_processes = False
    records_behaviour = False

    def __init__(
        self,
        context: EngineContext,
        inner: str = "hf",
        options: dict[str, Any] | None = None,
        threads: int | None = None,
    ) -> None:
        super().__init__(context)
        check_threads(threads)
        self.inner, self.options, self.threads = inner, dict(options or {}), threads
        probe = build_engine(inner, replace(context, tokenizer=None), self.options)  # fails early
        self.inner_samples_with_snapshot = probe.records_behaviour
        """Whether the inner engine samples with the snapshot itself (``hf``), so that it
        reports no log-probs of its own and the sampler's mismatch has nothing to correct."""
        self.version = 0
        """How many times weights were sent: names what the child holds (0: none yet)."""
        self.policy_version: int | None = None
        """The policy version the child holds when one was sent ahead of a rollout (set by
        :class:`~lightning_troll.callbacks.old_policy.OldPolicyRefresh`); None otherwise."""
        self._child: Any = None
        self._conn: Any = None
        self._pending: Request | None = None
        self.pending_seed: int | None = None
        """The seed of the request in flight, if one is."""
        self.next_seed: int | None = None
        """The seed the next request takes instead of a fresh draw from the global torch RNG: a
        resumed run's, for the request its checkpoint had in flight (set by
        :class:`~lightning_troll.callbacks.old_policy.OldPolicyRefresh`), so that it samples as
        the uninterrupted run did."""
        self._figures: dict[str, float] = {}
        self.last_fingerprint: float | None = None
        """The fingerprint of the weights that sampled the last generation."""

    # -- the child --------------------------------------------------------------------------------
    def _start(self, device: torch.device) -> None:
        spawn = mp.get_context("spawn")
        self._conn, child_end = spawn.Pipe()
        context = replace(self.context, tokenizer=None)  # the engines sample from token ids
        self._child = spawn.Process(
            target=_serve,
            args=(child_end, context, self.inner, self.options, str(device), self.threads),
            daemon=True, name="lightning-troll-engine",
        )  # fmt: skip
        self._child.start()
        child_end.close()
        self._receive("started", _START_TIMEOUT_S)

    def _send(self, message: tuple) -> None:
        if self._child is None or not self._child.is_alive():
            raise EngineDied(self._death())
        try:
            self._conn.send(message)
        except OSError:  # the child died after the check: a broken pipe or a reset connection
            raise EngineDied(self._death()) from None

    def _death(self) -> str:
        """What ended the engine's process, in a sentence: the signal that killed it, or its exit
        code (an error of its own is printed above by the process itself)."""
        child = self._child
        if child is not None:
            child.join(timeout=5)
        code = None if child is None else child.exitcode
        if code is not None and code < 0:
            try:
                how = f"was killed by signal {-code} ({signal.Signals(-code).name})"
            except ValueError:
                how = f"was killed by signal {-code}"
        elif code is not None:
            how = f"exited with code {code} (its error, if any, is printed above)"
        else:
            how = "stopped answering"
        return f"the {self.inner!r} engine's process {how} while the rollout was sampled"

    def _receive(self, expected: str, timeout: float | None = None) -> Any:
        if timeout is not None and not self._conn.poll(timeout):
            raise RuntimeError(f"the {self.inner!r} engine's process did not answer in {timeout} s")
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):  # OSError: the connection was reset as the child died
            raise EngineDied(self._death()) from None
        if kind == "error":
            raise RuntimeError(f"the {self.inner!r} engine's process failed: {payload}")
        if kind != expected:
            raise RuntimeError(f"the {self.inner!r} engine's process answered {kind!r}")
        return payload

    # -- the interface ----------------------------------------------------------------------------
    def load_weights(self, snapshot: nn.Module) -> None:
        weights = {name: w.detach().to("cpu", copy=True) for name, w in full_weights(snapshot)}
        self.push(weights, next(snapshot.parameters()).device)
        self.policy_version = None
        super().load_weights(snapshot)

    def push(self, weights: dict[str, torch.Tensor], device: torch.device) -> int:
        """Sends ``weights`` (CPU tensors by transformers name) as the next version; returns it."""
        if self._child is None:
            self._start(device)
        start = time.perf_counter()
        if self._pending is not None:  # a request in flight was for older weights: dropped
            self._receive("generation")
            self._pending = self.pending_seed = None
        self.version += 1
        self._send(("weights", {k: v.share_memory_() for k, v in weights.items()}))
        self._receive("weights")
        self._figures["engine/weight_push_s"] = time.perf_counter() - start
        return self.version

    def submit(self, request: SampleRequest) -> None:
        """Asks the child for a sample of ``request`` by the weights it holds now, and returns at
        once."""
        if self._pending is not None:
            self._receive("generation")  # only one request in flight: the older one is dropped
        seed, self.next_seed = self.next_seed, None
        if seed is None:
            seed = int(torch.randint(0, 2**63 - 1, ()))
        pending = Request(request, self.version)
        self._send(("generate", (pending, seed)))
        self._pending, self.pending_seed = pending, seed

    def generate(
        self, snapshot: nn.Module, request: SampleRequest, recorder: BehaviourRecorder | None = None
    ) -> Generation:
        if recorder is not None:
            raise ValueError("an engine in its own process cannot record the snapshot's logits")
        if self.stale or self._child is None:
            self.load_weights(snapshot)
        prefetched = self._pending == Request(request, self.version)
        if not prefetched:
            self.submit(request)
        start = time.perf_counter()
        tensors, self.last_fingerprint = self._receive("generation")
        self._pending = self.pending_seed = None
        self._figures["engine/process_wait_s"] = time.perf_counter() - start
        self._figures["engine/process_prefetched"] = float(prefetched)
        device = next(snapshot.parameters()).device
        return Generation(*(None if t is None else t.to(device) for t in tensors))

    def figures(self) -> dict[str, float]:
        figures, self._figures = self._figures, {}
        return figures

    def close(self) -> None:
        if self._child is not None:
            if self._child.is_alive():
                with contextlib.suppress(OSError):  # OSError: the child's end is gone
                    self._conn.send(("stop", None))  # read once a sample in flight is done
                self._child.join(timeout=30)
            if self._child.is_alive():
                self._child.kill()
            self._conn.close()
        self._child, self._conn, self._pending, self.version = None, None, None, 0
        self.pending_seed = None
        self.policy_version, self.stale = None, True


def _serve(
    conn: Any, context: EngineContext, inner: str, options: dict, device: str, threads: int | None
) -> None:
    """The child: loads the model, builds the engine, then answers the trainer's messages. The
    stop signals are the trainer's to answer (it stops this child itself)."""
    leave_stop_signals_to_the_trainer()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        from lightning_troll.models.loading import load_policy  # noqa: PLC0415

        model = load_policy(context.model, context.dtype).to(device)
        engine = build_engine(inner, context, options)
        fingerprinted = 0.0
        conn.send(("started", None))
    except Exception as error:  # noqa: BLE001 (reported to the trainer, which raises it)
        conn.send(("error", f"{type(error).__name__}: {error}"))
        return
    while True:
        kind, payload = conn.recv()
        try:
            if kind == "stop":
                engine.close()
                return
            if kind == "weights":
                weights = payload
                missing, unexpected = model.load_state_dict(weights, strict=False)
                if unexpected or any(not _tied(model, name) for name in missing):
                    raise ValueError(
                        f"weights do not fit the model: {missing[:3]}, {unexpected[:3]}"
                    )
                fingerprinted = fingerprint(weights)
                engine.stale = True
                conn.send(("weights", None))
            elif kind == "generate":
                request, seed = payload
                torch.manual_seed(seed)
                out = engine.generate(model, request.asked)
                fields = (out.input_ids, out.attention_mask, out.response_mask, out.truncated,
                          out.logprobs)  # fmt: skip
                cpu = tuple(None if t is None else t.cpu() for t in fields)
                conn.send(("generation", (cpu, fingerprinted)))
        except Exception as error:  # noqa: BLE001
            conn.send(("error", f"{type(error).__name__}: {error}"))


def _tied(model: nn.Module, name: str) -> bool:
    """Whether a weight missing from a push is the output layer tied to the embeddings."""
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    return bool(tied) and name.endswith("lm_head.weight")
