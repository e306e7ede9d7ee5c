"""Rollout engines: what samples a rollout's completions from the behaviour policy.

An engine turns prompts into G sampled completions each. It does not score them, does not
compute advantages and does not hold the old distributions TROLL projects onto: those come from
the trainer's own snapshot, whatever the engine (``callbacks/rollout.py``). The interface is
small:

- :meth:`RolloutEngine.generate`: a :class:`SampleRequest` in (the prompts' token ids, G, the
  sampling options, the pad and stop ids, each prompt's own budget), :class:`Generation` out
  (the sequences, which positions are response tokens, and the sampled tokens' log-probs where
  the engine has them);
- :meth:`RolloutEngine.load_weights`: takes the behaviour policy's current weights, called
  before the first generation and after every snapshot refresh (:attr:`RolloutEngine.stale`);
- :meth:`RolloutEngine.figures`: the engine's own figures, logged as ``engine/<name>``;
- :meth:`RolloutEngine.close`: frees what the engine holds.

``model.engine.name`` names one: ``hf`` (:class:`~lightning_troll.engines.hf.HFEngine`, the
default: transformers' model, KV-cached, in the trainer's own process; it needs nothing more),
``vllm`` (:class:`~lightning_troll.engines.vllm.VLLMEngine`, after ``make setup-vllm``), or the
import path ``package.module:Class`` (or ``package.module.Class``) of a user's own subclass. No
Lightning here.

Notation: P prompts, G completions per prompt, B = P * G sequences (prompt-major), S prompt
length (left padded), T response length (right padded).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor, nn

from lightning_troll.engines.behaviour import BehaviourRecorder
from lightning_troll.engines.sampling import SamplingConfig, check_budgets, is_count, is_number

__all__ = [
    "ENGINES",
    "EngineContext",
    "Generation",
    "RolloutEngine",
    "SampleRequest",
    "build_engine",
    "check_option",
    "is_count",
    "is_number",
]


@dataclass(frozen=True)
class SampleRequest:
    """What an engine is asked to sample: ``group_size`` completions of each prompt.

    Checked when built (``ValueError`` naming the field). The prompts, stop ids and budgets are
    kept as tuples, whatever sequences they were given as, so that two requests for the same
    sample are equal: an engine that samples ahead (:meth:`ProcessEngine.submit
    <lightning_troll.engines.process.ProcessEngine.submit>`) knows the request it is then asked
    for by equality.
    """

    prompt_ids: tuple[tuple[int, ...], ...]
    """(P,) each prompt's token ids, unpadded."""
    group_size: int
    """G, completions per prompt (at least 1)."""
    sampling: SamplingConfig
    """``model.sampling``: temperature, top-k, top-p and ``max_new_tokens``."""
    pad_id: int
    """The id written after a completion's end (the response's right padding)."""
    stop_ids: tuple[int, ...]
    """The tokens that end a completion (any of them)."""
    budgets: tuple[int, ...] | None = None
    """(P,) each prompt's own most tokens, each from 1 to ``sampling.max_new_tokens`` (an
    episode's turn has the room its episode has left), or None: ``sampling.max_new_tokens`` for
    every prompt. A completion that reaches its own budget ends there, truncated. An engine that
    ignores them samples every prompt up to ``sampling.max_new_tokens``, which a multi-turn
    rollout sets to the largest budget of the turn; the episode then cuts each completion to its
    own budget, so only the tokens sampled past it are wasted."""

    def __post_init__(self) -> None:
        keep = object.__setattr__  # frozen: the normalised fields are set once, here
        keep(self, "prompt_ids", tuple(tuple(ids) for ids in self.prompt_ids))
        keep(self, "stop_ids", tuple(self.stop_ids))
        group = self.group_size
        if isinstance(group, bool) or not isinstance(group, int) or group < 1:
            raise ValueError(f"group_size must be an integer >= 1; got {group!r}")
        if self.budgets is not None:
            largest = self.sampling.max_new_tokens
            keep(self, "budgets", check_budgets(self.budgets, len(self.prompt_ids), largest))

    @property
    def each_budget(self) -> tuple[int, ...]:
        """(P,) each prompt's most tokens: its own budget, or ``sampling.max_new_tokens``."""
        if self.budgets is not None:
            return self.budgets
        return (self.sampling.max_new_tokens,) * len(self.prompt_ids)


@dataclass(frozen=True)
class Generation:
    """G completions per prompt, as an engine returns them."""

    input_ids: Tensor
    """(B, S + T) prompt (left padded) followed by the response (right padded with pad_id)."""
    attention_mask: Tensor
    """(B, S + T) 1 at prompt and response tokens, 0 at padding."""
    response_mask: Tensor
    """(B, T) bool, True at response tokens up to and including the first stop token."""
    truncated: Tensor
    """(B,) bool, True where the completion hit the token budget without a stop token."""
    logprobs: Tensor | None = None
    """(B, T) float32 log-probs the engine gave the sampled tokens at the sampling temperature
    (0 at padding), or None where the engine does not report them."""


@dataclass(frozen=True)
class EngineContext:
    """What an engine is built from: the model the run loads, and how it computes."""

    model: str
    """``model.model``: a hub name, a local directory, or ``tinymath``."""
    dtype: str
    """``model.dtype``: float32, bfloat16, float16 or auto."""
    tokenizer: Any
    """The run's tokenizer (its chat template has already been applied to the prompts)."""
    lora: Any = None
    """``model.lora`` (a ``LoraConfig``) when the policy trains LoRA adapters (engines then take
    merged weights), else None."""
    tied_embedding_adapter: bool = False
    """True when the policy's output layer is tied to an input embedding that carries a LoRA
    adapter (:func:`~lightning_troll.models.weights.ties_an_adapted_embedding`)."""


class RolloutEngine:
    """Samples completions from the behaviour policy; the base class of every engine.

    Args:
        context: the run's model, dtype and tokenizer.
        **options: the engine's own options (``model.engine.options``); an engine that
            takes none refuses any.
    """

    name = "custom"
    """The engine's name in logs and errors."""
    several_processes = False
    """True when the engine serves a run of several processes (DDP, FSDP2); otherwise such a run
    is refused before training."""
    records_behaviour = False
    """True when a :class:`BehaviourRecorder` can see the snapshot's own logits while it samples
    (then no teacher-forced pass is needed after sampling); otherwise the snapshot recomputes
    the behaviour log-probs after sampling."""

    def __init__(self, context: EngineContext, **options: Any) -> None:
        if options:
            raise ValueError(_takes_no_options(self.name, options))
        self.context = context
        self.stale = True
        """True until :meth:`load_weights` has given the engine the behaviour policy's weights
        (set again by every snapshot refresh)."""

    @classmethod
    def check_installed(cls) -> None:
        """Raises ``ImportError`` saying how to install what the engine needs, if it is missing
        (called before the model loads)."""

    @classmethod
    def check_options(cls, options: dict[str, Any], lora: Any = None) -> None:
        """Refuses, from ``model.engine.options`` alone (before the model loads), options this
        engine cannot take: here, any its constructor does not name (an engine whose
        constructor is this class's takes none). An engine with bounds on its options checks
        them in its override; ``lora`` is ``model.lora`` (or None)."""
        if cls.__init__ is RolloutEngine.__init__:
            if options:
                raise ValueError(_takes_no_options(cls.name, options))
            return
        try:
            inspect.signature(cls.__init__).bind(None, None, **options)
        except TypeError as error:
            raise ValueError(f"model.engine.options for {cls.name!r}: {error}") from None

    @classmethod
    def given_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        """Every option of the constructor, ``options`` over its defaults (after
        :meth:`check_options`): what an override checks."""
        bound = inspect.signature(cls.__init__).bind(None, None, **options)
        bound.apply_defaults()
        return {k: v for k, v in list(bound.arguments.items())[2:]}

    def generate(
        self, snapshot: nn.Module, request: SampleRequest, recorder: BehaviourRecorder | None = None
    ) -> Generation:
        """``request.group_size`` completions of each prompt of ``request``, sampled by the
        behaviour policy (``snapshot`` is it, weights gathered, for engines that sample with it).

        ``request.budgets``, where given, is each prompt's own most tokens (an episode's turn may
        use the room its episode has left only); a completion that reaches its own is truncated
        there. An engine that ignores them samples every prompt up to
        ``request.sampling.max_new_tokens`` (a turn's largest budget), and the episode cuts each
        completion to its own budget (:class:`SampleRequest`). A ``recorder``, where given, is
        fed the snapshot's raw logits while it samples (engines with :attr:`records_behaviour`
        only)."""
        raise NotImplementedError

    def load_weights(self, snapshot: nn.Module) -> None:
        """Takes the behaviour policy's current weights from ``snapshot`` (every process calls
        it alike; a sharded snapshot's weights are gathered)."""
        self.stale = False

    def figures(self) -> dict[str, float]:
        """The engine's own figures since the last call (e.g. seconds spent taking weights)."""
        return {}

    def close(self) -> None:
        """Frees the engine's resources; a later :meth:`generate` may start them again."""


ENGINES = {"hf": "lightning_troll.engines.hf:HFEngine",
           "vllm": "lightning_troll.engines.vllm:VLLMEngine",
           "vllm_server": "lightning_troll.engines.servers:ServerEngine"}  # fmt: skip
"""Built-in engines by name; their classes are imported on use (vLLM is an extra)."""


def engine_class(name: str) -> type[RolloutEngine]:
    """The engine class named by ``model.engine.name``: a built-in name or an import path
    ``package.module:Class`` / ``package.module.Class``. Raises ``ValueError`` naming the option,
    also for an engine whose ``generate`` takes 0.1's arguments (:func:`_check_generate`)."""
    path = ENGINES.get(name, name)
    module_name, _, attribute = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attribute:
        raise ValueError(
            f"model.engine.name must be one of {sorted(ENGINES)} or an import path "
            f"'package.module:Class'; got {name!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"model.engine.name={name!r}: cannot import module {module_name!r} ({error})"
        ) from None
    cls = getattr(module, attribute, None)
    if not (isinstance(cls, type) and issubclass(cls, RolloutEngine)):
        raise ValueError(
            f"model.engine.name={name!r}: {module_name}.{attribute} is "
            f"{'missing' if cls is None else 'not a RolloutEngine subclass'}; an engine "
            "subclasses lightning_troll.engines.base.RolloutEngine"
        )
    _check_generate(cls, name)
    cls.check_installed()
    return cls


def _check_generate(cls: type[RolloutEngine], name: str) -> None:
    """Refuses an engine whose ``generate`` takes 0.1's arguments (``prompt_ids``, ``group_size``,
    ... one by one) instead of one :class:`SampleRequest`."""
    if "prompt_ids" in inspect.signature(cls.generate).parameters:
        raise ValueError(
            f"model.engine.name={name!r}: {cls.__module__}.{cls.__qualname__}.generate takes "
            "prompt_ids, group_size, ... one by one, as before 0.2.0; write it as "
            "generate(self, snapshot, request, recorder=None), reading them from request, a "
            "lightning_troll.engines.base.SampleRequest (CHANGELOG.md)"
        )


@dataclass(frozen=True)
class EngineConfig:
    """What samples the rollouts (``model.engine``)."""

    name: str = "hf"
    """``hf`` (the snapshot, in this process), ``vllm`` (after ``make setup-vllm``), or a
    ``RolloutEngine`` subclass's import path."""
    options: dict[str, Any] | None = None
    """The engine's own options (docs/engines.md); ``process: true`` runs it in a process of its
    own."""
    behaviour_logprobs: Literal["auto", "sampling", "forward"] = "auto"
    """Where the behaviour log-probs come from: ``sampling`` (recorded while sampling),
    ``forward`` (a teacher-forced pass after it) or ``auto`` (sampling in float32, forward in
    bfloat16/float16; docs/configuration.md)."""


def check_option(name: str, value: Any, good: bool, allowed: str) -> None:
    """Refuses ``model.engine.options.<name>``'s ``value`` unless ``good``, saying what is
    ``allowed``."""
    if not good:
        raise ValueError(f"model.engine.options.{name} must be {allowed}; got {value!r}")


def _takes_no_options(name: str, options: dict[str, Any]) -> str:
    return f"model.engine.options: the {name} engine takes no options; got {sorted(options)}"


def build_engine(
    name: str, context: EngineContext, options: dict[str, Any] | None = None
) -> RolloutEngine:
    """The engine ``model.engine.name: name`` with ``model.engine.options``."""
    cls = engine_class(name)
    cls.check_options(options or {}, context.lora)
    try:
        return cls(context, **(options or {}))
    except TypeError as error:
        raise ValueError(f"model.engine.options for {name!r}: {error}") from None
