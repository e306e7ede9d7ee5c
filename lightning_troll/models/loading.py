"""Policy loading: tokenizers and causal LMs through the ``transformers`` Auto classes.

Everything loads with ``AutoTokenizer.from_pretrained`` / ``AutoModelForCausalLM.from_pretrained``,
from a local directory or a hub id alike; a path to a ``.gguf`` file loads (dequantised) through
:mod:`lightning_troll.models.gguf`; the special name ``"tinymath"`` means the shipped TinyMath demo
policy (:data:`lightning_troll.models.tinymath.TINYMATH_DIR`). No Lightning here.
"""

from __future__ import annotations

import re
import socket
import warnings
from pathlib import Path
from urllib.parse import urlsplit

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from lightning_troll.models.gguf import is_gguf, load_gguf_policy, load_gguf_tokenizer
from lightning_troll.models.tinymath import TINYMATH_DIR

__all__ = [
    "DTYPES",
    "check_reachable",
    "is_checkpointed",
    "TINYMATH",
    "load_policy",
    "load_tokenizer",
    "stop_token_ids",
    "resolve_model_path",
    "tiny_causal_lm",
]

TINYMATH = "tinymath"
"""The name that stands for the shipped demo policy directory."""

DTYPES: dict[str, torch.dtype | str] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "auto": "auto",  # the dtype recorded in config.json (else the weights' dtype)
}
PADDING_SIDES = ("left", "right")

# "name" or "org/name": letters, digits, "-", "_", "."; no leading "." or "-".
_HUB_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*(/[A-Za-z0-9_][A-Za-z0-9_.\-]*)?$")


def _resolve(name_or_path: str | Path) -> str:
    """``"tinymath"`` -> the shipped directory; an existing path or a hub id passes through.

    Raises ``FileNotFoundError`` for a path that does not exist and cannot be a hub id
    (absolute, ``./x``, ``~/x``, ``a/b/c``, a ``Path`` object), instead of a hub lookup error.
    """
    if isinstance(name_or_path, str) and name_or_path == TINYMATH:
        if not (TINYMATH_DIR / "config.json").is_file():
            raise FileNotFoundError(
                f"the TinyMath assets are missing from {TINYMATH_DIR}; "
                "regenerate them with `python examples/make_tinymath.py`"
            )
        return str(TINYMATH_DIR)
    path = Path(name_or_path).expanduser()
    if path.exists():
        return str(path)
    # imported here: `python -m lightning_troll.models.smollm2` must not find it imported already
    from lightning_troll.models.smollm2 import DEFAULT_DIR as SMOLLM2_DIR

    if path.parts[-2:] == SMOLLM2_DIR.parts:
        raise FileNotFoundError(
            f"model: the folder {str(name_or_path)!r} does not exist; run `make smollm2` (or "
            "`python -m lightning_troll.models.smollm2`) in the repository to fetch and convert "
            "SmolLM2-135M-Instruct"
        )
    if is_gguf(path):
        raise FileNotFoundError(f"model: the GGUF file {str(name_or_path)!r} does not exist")
    if isinstance(name_or_path, Path) or not _HUB_ID.match(name_or_path):
        raise FileNotFoundError(
            f"model.model={str(name_or_path)!r}: {str(Path(name_or_path).absolute())!r} is "
            "neither an existing local directory nor a "
            f"hub id ('name' or 'org/name'); give a directory holding config.json, "
            f"a hub id, or {TINYMATH!r} for the shipped demo policy"
        )
    return str(name_or_path)


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the Hugging Face hub cannot be reached from here (``HF_HUB_OFFLINE`` is set, or its
    host does not answer within ``timeout`` seconds), or None where it can."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    endpoint = constants.ENDPOINT
    parts = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
    port = parts.port or (80 if parts.scheme == "http" else 443)  # a mirror's own port, if any
    try:
        socket.create_connection((parts.hostname or "", port), timeout=timeout).close()
    except (OSError, ValueError) as error:
        return f"{endpoint} cannot be reached ({type(error).__name__}: {error})"
    return None


def check_reachable(name_or_path: str | Path, timeout: float = 3.0) -> None:
    """Refuses at once a hub id that can be neither found in the local Hugging Face cache nor
    fetched: ``HF_HUB_OFFLINE`` is set, or the hub's host does not answer within ``timeout``
    seconds (instead of a minute of retries and a long traceback). Local paths, ``tinymath`` and
    cached models pass."""
    name = str(name_or_path)
    path = _resolve(name_or_path)
    if Path(path).exists():
        return
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    why = hub_unreachable(timeout)
    if why is None:
        return
    raise ValueError(
        f"model.model={name!r} is neither a local folder nor in the Hugging Face cache, and "
        f"{why}; give a local model folder (what save_pretrained writes), or run where the hub "
        "can be reached once to cache it"
    )


# Files that hold a tokenizer's vocabulary (fast, sentencepiece, BPE, WordPiece, tiktoken), or
# the config that names them for a tokenizer class of its own.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_TOKENIZER_PATTERNS = ("*.model", "*.tiktoken", "vocab.txt")


def resolve_model_path(name_or_path: str | Path) -> str:
    """What ``model.model`` loads from: ``"tinymath"`` -> the shipped directory; an existing path
    or a hub id passes through (for engines that load the model's files themselves)."""
    return _resolve(name_or_path)


def _check_model_folder(path: str, given: str | Path, needs: str) -> None:
    """For a folder ``path``: raises ``FileNotFoundError`` naming it and all it lacks when it has
    no ``needs`` (``"config"``: config.json, for the model; ``"tokenizer"``: tokenizer files)."""
    folder = Path(path)
    if not folder.is_dir():
        return
    has = {
        "config": (folder / "config.json").is_file(),
        "tokenizer": any((folder / name).is_file() for name in _TOKENIZER_FILES)
        or any(any(folder.glob(pattern)) for pattern in _TOKENIZER_PATTERNS),
    }
    if has[needs]:
        return
    missing = [
        text
        for key, text in (
            ("config", "no config.json"),
            ("tokenizer", f"no tokenizer (none of {', '.join(_TOKENIZER_FILES)}, *.model)"),
        )
        if not has[key]
    ]
    raise FileNotFoundError(
        f"{str(given)!r} is not a model folder: {folder.resolve()} has {' and '.join(missing)}. "
        "A model folder holds what save_pretrained writes for a causal LM and its tokenizer: "
        "config.json, the weights (model.safetensors or pytorch_model.bin, or shards with their "
        "index) and the tokenizer files (tokenizer.json and tokenizer_config.json, or a "
        "tokenizer.model); give such a folder, a hub id, a .gguf file, or 'tinymath'"
    )


def load_tokenizer(name_or_path: str | Path, padding_side: str = "left") -> PreTrainedTokenizerBase:
    """The tokenizer of ``name_or_path`` (a directory, a hub id or ``"tinymath"``).

    ``padding_side`` defaults to ``"left"``, which batched generation needs. A tokenizer without
    a pad token gets its eos token as pad token, with a ``UserWarning``: masks of completions
    must then come from lengths or the first eos, never from ``ids != pad_token_id`` (that would
    drop the eos the policy has to learn). Without pad and eos tokens it raises ``ValueError``.
    """
    if padding_side not in PADDING_SIDES:
        raise ValueError(f"padding_side must be one of {list(PADDING_SIDES)}; got {padding_side!r}")
    path = _resolve(name_or_path)
    if is_gguf(path):
        tokenizer = load_gguf_tokenizer(path)
    else:
        _check_model_folder(path, name_or_path, needs="tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = padding_side
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"the tokenizer at {path!r} has neither a pad token nor an eos token; add one, "
                "e.g. tokenizer.add_special_tokens({'pad_token': '<pad>'}) and "
                "model.resize_token_embeddings(len(tokenizer)), then save it and load that"
            )
        warnings.warn(
            f"the tokenizer at {path!r} has no pad token; using its eos token "
            f"{tokenizer.eos_token!r} (id {tokenizer.eos_token_id}) for padding",
            UserWarning,
            stacklevel=2,
        )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(
    name_or_path: str | Path,
    dtype: str = "float32",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    load_in_4bit: bool = False,
) -> PreTrainedModel:
    """The causal LM of ``name_or_path`` (a directory, a hub id, a ``.gguf`` file or
    ``"tinymath"``), in eval mode.

    ``dtype`` is one of ``DTYPES`` (``"auto"`` keeps the checkpoint's dtype); weights stored in
    another dtype are cast. ``attn_implementation`` (``"eager"``, ``"sdpa"``, ...) is passed on
    when given. A model without a generation config gets one built from its model config; one
    that cannot ``generate`` is refused with ``ValueError``. ``load_in_4bit`` loads the weights
    in 4-bit NF4 through bitsandbytes (QLoRA's frozen base; CUDA only), computing in ``dtype``
    (bfloat16 when ``dtype`` is float32/auto). A GGUF file is dequantised to ``dtype`` (float32
    for ``"auto"``) and returned as an ordinary, unquantised model.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}; got {dtype!r}")
    path = _resolve(name_or_path)
    _check_model_folder(path, name_or_path, needs="config")
    kwargs: dict = {"dtype": DTYPES[dtype], "trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if is_gguf(path):
        if load_in_4bit:
            raise ValueError(
                f"model: {path!r} is a GGUF file; 4-bit loading (lora.load_in_4bit) needs a "
                "transformers folder: convert it first (lightning_troll.models.gguf.convert_gguf)"
            )
        return _ready_to_sample(load_gguf_policy(path, **kwargs), path)
    if load_in_4bit:
        kwargs.update(_four_bit(DTYPES[dtype]))
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except Exception as error:
        unreadable = _unreadable_weights(path, error)
        if unreadable is None:
            raise
        raise unreadable from None
    return _ready_to_sample(model, path)


def _unreadable_weights(path: str, error: Exception) -> ValueError | None:
    """A one-line error for a local folder whose weights file cannot be read (truncated or
    overwritten), naming the file; None for any other failure."""
    folder = Path(path)
    if not folder.is_dir() or type(error).__name__ not in ("SafetensorError", "UnpicklingError"):
        return None
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    named = ", ".join(str(f) for f in files[:2]) or str(folder)
    return ValueError(
        f"model: the weights in {named} cannot be read ({type(error).__name__}: "
        f"{str(error).splitlines()[0] if str(error) else ''}); the file is truncated or corrupt: "
        "copy or download it again"
    )


def _ready_to_sample(model: PreTrainedModel, path: str) -> PreTrainedModel:
    """Refuses a model that cannot ``generate``; one without a generation config gets the
    defaults of its model config (pad, bos and eos ids; everything else the library's)."""
    if not callable(getattr(model, "generate", None)):
        raise ValueError(
            f"name_or_path {path!r} loads as {type(model).__name__}, which has no generate(); "
            "give a causal language model"
        )
    if getattr(model, "generation_config", None) is None:
        model.generation_config = GenerationConfig.from_model_config(model.config)
    return model


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> tuple[int, ...]:
    """The tokens that end a completion: the tokenizer's eos token (if it has one), then every
    eos id of the model's generation config (chat models often list their end-of-turn token there
    beside the end-of-text one, e.g. ``[<|im_end|>, <|endoftext|>]``), without repeats.

    Ids outside the model's vocabulary, or no id at all, are refused with ``ValueError``.
    """
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    config = getattr(model, "generation_config", None)
    extra = getattr(config, "eos_token_id", None)
    ids += [int(i) for i in ([extra] if isinstance(extra, int) else (extra or []))]
    if not ids:
        raise ValueError(
            "model: neither the tokenizer nor generation_config.json names an end-of-sequence "
            "token, so no completion could end before the budget; give the model folder's "
            "tokenizer an eos_token"
        )
    vocab = model.get_output_embeddings().weight.shape[0]
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(
            f"model: the end-of-sequence ids {bad} (tokenizer and generation_config.json) lie "
            f"outside the policy's {vocab}-token vocabulary"
        )
    return tuple(dict.fromkeys(ids))


def _four_bit(dtype: torch.dtype | str) -> dict:
    """from_pretrained arguments for a 4-bit NF4 model on the current CUDA device."""
    if not torch.cuda.is_available():
        raise ValueError("load_in_4bit=True needs a CUDA device (bitsandbytes 4-bit layers)")
    from transformers import BitsAndBytesConfig

    compute = dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute,
    )
    return {"quantization_config": config, "device_map": {"": torch.cuda.current_device()}}


def tiny_causal_lm(
    vocab_size: int,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 2,
    seed: int = 0,
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    intermediate_size: int | None = None,
) -> PreTrainedModel:
    """A randomly initialised tiny ``LlamaForCausalLM`` for tests, built from a config.

    MLP width ``intermediate_size`` (``4 * hidden_size`` when None), 64 positions, tied
    embeddings; the initialisation depends on ``seed`` only (the global RNG is left untouched).
    Its ``generation_config`` carries the pad/bos/eos ids. Returned in eval mode, like
    :func:`load_policy`.
    """
    mlp = 4 * hidden_size if intermediate_size is None else intermediate_size
    for option, value, low in (
        ("vocab_size", vocab_size, 1),
        ("hidden_size", hidden_size, 1),
        ("num_layers", num_layers, 1),
        ("num_heads", num_heads, 1),
        ("intermediate_size", mlp, 1),
    ):
        if value < low:
            raise ValueError(f"{option} must be >= {low}; got {value}")
    if hidden_size % num_heads or (hidden_size // num_heads) % 2:
        raise ValueError(
            f"hidden_size must be a multiple of 2 * num_heads (an even head size, for rotary "
            f"embeddings); got hidden_size={hidden_size}, num_heads={num_heads}"
        )
    for option, value in (("pad_token_id", pad_token_id), ("bos_token_id", bos_token_id)):
        if value is not None and not 0 <= value < vocab_size:
            raise ValueError(f"{option} must be in [0, {vocab_size}); got {value}")
    if eos_token_id is not None and not 0 <= eos_token_id < vocab_size:
        raise ValueError(f"eos_token_id must be in [0, {vocab_size}); got {eos_token_id}")
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=mlp,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id
    )
    return model.eval()


def is_checkpointed(model: torch.nn.Module) -> bool:
    """True if the model recomputes its layers in the backward pass (transformers' flag)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # new name first
        value = getattr(model, name, None)
        if value is not None:
            return bool(value)
    return False
