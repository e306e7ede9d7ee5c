"""Sampling with the HF decoding loop: :class:`SamplingConfig` (``model.sampling``) and
:func:`sample`, G completions per prompt from a transformers model, KV-cached.

:func:`sample` runs :func:`~lightning_troll.engines.graph_decode.graph_decode` on a CUDA device
(as ``sampling.decode`` says), else :func:`~lightning_troll.engines.decode.decode`, else
transformers' ``generate``; :func:`left_pad`, :func:`response_mask_of` and :func:`own_budgets`
lay prompts and completions out as every engine returns them. Nothing here imports Lightning.

Notation: P prompts, G samples per prompt, B = P * G sequences, S prompt length (left padded),
T response length (right padded).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn
from transformers import GenerationConfig, LogitsProcessorList

from lightning_troll.engines.behaviour import BehaviourRecorder
from lightning_troll.engines.decode import decode
from lightning_troll.engines.graph_decode import DECODE_MODES, graph_decode
from lightning_troll.engines.step_attention import decoding_attention

__all__ = [
    "SamplingConfig",
    "check_budgets",
    "is_count",
    "is_number",
    "left_pad",
    "own_budgets",
    "response_mask_of",
    "sample",
]


@dataclass(frozen=True)
class SamplingConfig:
    """How the behaviour policy samples completions."""

    temperature: float = 1.0
    """Sampling temperature, > 0; the loss and the cached old distributions use it too."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; below 1 the importance ratios ignore the truncation."""
    top_k: int = 0
    """Sample among the k most probable tokens; 0 switches it off."""
    max_new_tokens: int = 8
    """Completion budget in tokens; a completion without EOS by then counts as truncated."""
    decode: Literal["auto", "dynamic", "graphs"] = "auto"
    """How the ``hf`` engine decodes: ``dynamic`` launches each step from the host and drops
    finished sequences from the batch; ``graphs`` replays each step as a CUDA graph over a
    static KV cache (the dynamic loop where it cannot, warned); ``auto`` is ``graphs`` on a
    CUDA device and ``dynamic`` elsewhere. The completions' distribution is the same."""
    check_every: int = 1
    """How many steps the CUDA-graph path decodes between reads of which sequences stopped
    (the dynamic loop reads at every step). At 1 the host waits on the device at every step,
    and a seed draws the dynamic loop's completions; above 1 the graph holds the whole step
    (the draw and the records too), the host queues that many steps ahead of the device, a
    stopped sequence samples on (its tokens cut, as past its stop) until the next read, and a
    seed draws other completions from the same distribution."""
    compile_step: bool = False
    """Whether the CUDA-graph path compiles the model's decoding step with ``torch.compile``
    before it captures it: fewer, fused kernels a step, for a compilation at the first step
    (tens of seconds at a real model's depth) and at most a few more as shapes change (its
    dimensions become dynamic). Where compiling fails, warned once, the steps run uncompiled."""

    def __post_init__(self) -> None:
        if not is_number(self.temperature) or not self.temperature > 0:
            raise ValueError(
                f"model.sampling.temperature must be a finite number > 0; got {self.temperature!r}"
            )
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"model.sampling.top_p must be in (0, 1]; got {self.top_p!r}")
        if not is_count(self.top_k, 0):
            raise ValueError(
                f"model.sampling.top_k must be an integer >= 0 (0 = off); got {self.top_k!r}"
            )
        if not is_count(self.max_new_tokens, 1):
            raise ValueError(
                f"model.sampling.max_new_tokens must be an integer >= 1; got "
                f"{self.max_new_tokens!r}"
            )
        if not is_count(self.check_every, 1):
            raise ValueError(
                f"model.sampling.check_every must be an integer >= 1 (1 = every step); got "
                f"{self.check_every!r}"
            )
        if not isinstance(self.compile_step, bool):
            raise ValueError(
                f"model.sampling.compile_step must be true or false; got {self.compile_step!r}"
            )
        if self.decode not in DECODE_MODES:
            raise ValueError(
                f"model.sampling.decode must be one of {', '.join(DECODE_MODES)}; got "
                f"{self.decode!r}"
            )


def is_number(value: object) -> bool:
    """Whether ``value`` is a finite real number (not a bool)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def is_count(value: object, minimum: int) -> bool:
    """Whether ``value`` is an integer (not a bool) >= ``minimum``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum


def left_pad(sequences: list[list[int]], pad_id: int, device=None) -> tuple[Tensor, Tensor]:
    """Token id lists -> (B, S) ids, left padded, and the (B, S) attention mask."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(sequences), width), dtype=torch.long, device=device)
    for i, seq in enumerate(sequences):
        if seq:
            ids[i, width - len(seq) :] = torch.as_tensor(seq, dtype=torch.long)
            mask[i, width - len(seq) :] = 1
    return ids, mask


def response_mask_of(
    responses: Tensor, eos_id: int | Sequence[int], lengths: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(B, T) generated tokens -> response mask (up to and including the first EOS) and
    truncated (B,) (no EOS at all). ``eos_id`` is one id or several (any of them ends a
    completion, as a chat model's end-of-turn and end-of-text tokens do). Padding after EOS may
    equal EOS; it is excluded. ``lengths`` (B,), where given, is how many tokens each row
    generated at most: what lies past it is padding, whatever its id."""
    ids = torch.as_tensor([eos_id] if isinstance(eos_id, int) else list(eos_id))
    is_eos = torch.isin(responses, ids.to(responses.device))  # (B, T)
    within = torch.ones_like(is_eos)
    if lengths is not None:
        positions = torch.arange(responses.shape[1], device=responses.device)  # (T,)
        within = positions < lengths.to(responses.device).unsqueeze(-1)  # (B, T)
        is_eos = is_eos & within
    seen = is_eos.long().cumsum(-1)  # (B, T) EOS count so far, inclusive
    mask = ((seen == 0) & within) | (is_eos & (seen == 1))
    return mask, ~is_eos.any(-1)


@torch.no_grad()
def sample(
    model: nn.Module,
    prompt_ids: list[list[int]],
    group_size: int,
    sampling: SamplingConfig,
    pad_id: int,
    eos_id: int | Sequence[int],
    do_sample: bool = True,
    recorder: BehaviourRecorder | None = None,
    budgets: Sequence[int] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """G completions per prompt, KV-cached.

    A completion ends at the first of the ``eos_id`` tokens (one id or several), or after
    ``sampling.max_new_tokens``, or after its prompt's own budget where ``budgets`` (P,) gives
    one (each at most ``sampling.max_new_tokens``; an episode's turn has the room its episode
    has left). A ``recorder`` sees the raw logits of every step (before temperature, top-k and
    top-p); call its ``finish`` with the generated tokens afterwards.

    :func:`~lightning_troll.engines.decode.decode` samples (each prompt prefilled once,
    finished sequences dropped), with a ``recorder`` through its ``record_rows``; on a CUDA
    device :func:`~lightning_troll.engines.graph_decode.graph_decode` first, as
    ``sampling.decode`` says. Where it cannot
    serve the model (see its module), or the recorder is a plain logits processor without
    ``record_rows``, transformers' ``generate`` samples instead, with the recorder as its first
    logits processor.

    Returns input_ids (B, S + T), attention_mask (B, S + T), response_mask (B, T) and
    truncated (B,), with B = len(prompt_ids) * group_size, prompt-major.
    """
    device = next(model.parameters()).device
    prompts, prompt_mask = left_pad(prompt_ids, pad_id, device)  # (P, S)
    stops = [eos_id] if isinstance(eos_id, int) else list(eos_id)
    lengths = None  # (B,) each completion's own budget
    if budgets is not None:
        lengths = own_budgets(budgets, len(prompt_ids), sampling.max_new_tokens, device)
        lengths = lengths.repeat_interleave(group_size)
    args = (model, prompts, prompt_mask, group_size, sampling, pad_id, stops, do_sample, recorder)
    try:
        responses = None  # (B, T)
        if recorder is None or hasattr(recorder, "record_rows"):
            with decoding_attention(model, device):  # grouped heads uncopied, cuDNN last
                responses = graph_decode(*args, budgets=lengths)  # None: not on CUDA graphs
                if responses is None:
                    responses = decode(*args, budgets=lengths)
        if responses is None:
            responses = _generate(*args)
    except RuntimeError as error:  # NaN weights surface as torch.multinomial's complaint
        _raise_if_not_finite(model, error)
        raise
    prompts = prompts.repeat_interleave(group_size, dim=0)  # (B, S)
    prompt_mask = prompt_mask.repeat_interleave(group_size, dim=0)
    response_mask, truncated = response_mask_of(responses, eos_id, lengths)
    responses = responses.masked_fill(~response_mask, pad_id)
    attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=-1)
    return torch.cat([prompts, responses], dim=-1), attention_mask, response_mask, truncated


def own_budgets(
    budgets: Sequence[int], prompts: int, largest: int, device: torch.device | None = None
) -> Tensor:
    """(P,) int64: ``budgets``, one per prompt, each from 1 to ``largest`` (the
    ``max_new_tokens`` they are sampled with); raises ``ValueError`` otherwise
    (:func:`check_budgets`)."""
    return torch.tensor(check_budgets(budgets, prompts, largest), dtype=torch.long, device=device)


def check_budgets(budgets: Sequence[int], prompts: int, largest: int) -> tuple[int, ...]:
    """``budgets`` as a tuple, where they are ``prompts`` integers (one per prompt) each from 1 to
    ``largest`` (the ``max_new_tokens`` they are sampled with); raises ``ValueError`` naming
    them otherwise."""
    values = tuple(budgets)
    if len(values) != prompts or any(
        isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= largest for b in values
    ):
        raise ValueError(
            f"budgets must be {prompts} integers (one per prompt) from 1 to max_new_tokens "
            f"{largest}; got {list(values[:8])}{' ...' if len(values) > 8 else ''}"
        )
    return values


def _generate(
    model: nn.Module,
    prompts: Tensor,
    prompt_mask: Tensor,
    group_size: int,
    sampling: SamplingConfig,
    pad_id: int,
    stops: list[int],
    do_sample: bool,
    recorder: BehaviourRecorder | None,
) -> Tensor:
    """The generated tokens (B, T) of transformers' ``generate`` on the (P, S) prompts, each
    repeated ``group_size`` times; padding after a completion's end."""
    prompts = prompts.repeat_interleave(group_size, dim=0)  # (B, S)
    prompt_mask = prompt_mask.repeat_interleave(group_size, dim=0)
    options = {"do_sample": do_sample, "max_new_tokens": sampling.max_new_tokens}
    if do_sample:
        options.update(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None
        )
    else:
        options.update(temperature=None, top_p=None, top_k=None)
    with _plain_generation_config(model):
        out = model.generate(
            input_ids=prompts,
            attention_mask=prompt_mask,
            pad_token_id=pad_id,
            eos_token_id=stops,
            use_cache=True,
            logits_processor=LogitsProcessorList([] if recorder is None else [recorder]),
            **options,
        )  # (B, S + T)
    return out[:, prompts.shape[1] :]


@contextmanager
def _plain_generation_config(model: nn.Module) -> Iterator[None]:
    """Generation with the model's own ``generation_config`` set aside.

    A hub model's config may carry a repetition penalty, banned n-grams, suppressed tokens or a
    minimum length; ``generate`` would apply them even over explicit arguments, and the
    completions would then come from another distribution than the one whose log-probs the
    rollout caches and the loss uses. Only :class:`SamplingConfig` shapes the distribution.
    """
    saved = getattr(model, "generation_config", None)
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


def _raise_if_not_finite(model: nn.Module, error: RuntimeError) -> None:
    """Raises ``FloatingPointError`` naming the first non-finite weight of ``model``, if any."""
    for name, weight in model.named_parameters():
        if not bool(weight.isfinite().all()):
            raise FloatingPointError(
                f"sampling failed ({str(error).splitlines()[0]}): the sampling model's weight "
                f"{name!r} holds NaN or inf at {int((~weight.isfinite()).sum())} entries; the "
                "snapshot's weights are not finite, so no rollout is sampled from them"
            ) from error
