"""GGUF files as policies: load one through transformers, or convert it to a standard folder.

A ``.gguf`` file (llama.cpp's format) holds the weights, often quantised, the tokenizer and the
chat template. transformers reads it (``from_pretrained(folder, gguf_file=name)``, which needs
the ``gguf`` package) and dequantises every tensor. The model it returns is marked "quantised
with gguf" and refuses ``save_pretrained``; :func:`load_gguf_policy` therefore rebuilds the
model from its configuration and loads the dequantised weights into it, so the result is an
ordinary model that trains, checkpoints and saves like any other. Dequantised weights are only as
good as the quantisation: a Q4 file is below the original release.

No Lightning here.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from lightning_troll.models.folders import replace_folder, sync_tree

__all__ = [
    "GGUF_SUFFIX",
    "check_gguf_available",
    "convert_gguf",
    "is_gguf",
    "load_gguf_policy",
    "load_gguf_tokenizer",
]

GGUF_SUFFIX = ".gguf"


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix; the file need not exist)."""
    return str(path).lower().endswith(GGUF_SUFFIX)


def check_gguf_available(path: str | Path) -> None:
    """Raises ``ImportError`` naming the extra to install when the ``gguf`` package is missing."""
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(
            f"model: {str(path)!r} is a GGUF file, and reading GGUF files needs the 'gguf' "
            'package: pip install -e ".[gguf]" (or pip install gguf)'
        )


def _split(path: str | Path) -> tuple[str, str]:
    """``dir/name.gguf`` -> (``dir``, ``name.gguf``), after checking the file exists."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"model: the GGUF file {str(path)!r} does not exist")
    check_gguf_available(file)
    return str(file.parent), file.name


def load_gguf_tokenizer(path: str | Path):
    """The tokenizer (with its chat template and special tokens) stored in a GGUF file."""
    folder, name = _split(path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def load_gguf_policy(
    path: str | Path, dtype: torch.dtype | str = torch.float32, **kwargs
) -> PreTrainedModel:
    """The causal LM of a GGUF file, dequantised, as an ordinary (unquantised) model.

    ``dtype`` is the weights' dtype (``"auto"`` keeps the one transformers dequantises to,
    float32); further keyword arguments (``attn_implementation``, ``trust_remote_code``) go to
    ``from_pretrained``. The returned model carries no quantisation config, so it trains and
    saves like any other.
    """
    folder, name = _split(path)
    target = torch.float32 if dtype == "auto" else dtype
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=target, **kwargs)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.random.fork_rng(devices=[]):  # the throw-away initialisation draws nothing
        model = AutoModelForCausalLM.from_config(config, dtype=target, **kwargs)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    return model.eval()


def convert_gguf(
    path: str | Path,
    out_dir: str | Path,
    card: str | None = None,
    extra_files: dict[str, str] | None = None,
    overwrite: bool = False,
) -> Path:
    """Writes the model and tokenizer of a GGUF file as a standard transformers folder.

    ``out_dir`` gets ``config.json``, ``generation_config.json``, ``model.safetensors`` (float32,
    dequantised), the tokenizer files with the chat template, ``README.md`` with ``card`` when
    given, and ``extra_files`` (name -> text). The folder is written beside ``out_dir`` first
    and swapped into place (:func:`~lightning_troll.models.folders.replace_folder`), so an
    interrupted conversion leaves no half-written model behind (a write that fails removes it)
    and an existing ``out_dir`` stays whole until the new one is in place.
    An existing ``out_dir`` is replaced only with ``overwrite``; otherwise ``FileExistsError``.
    Returns ``out_dir``.
    """
    out = Path(out_dir).expanduser()
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True to replace it")
    tokenizer = load_gguf_tokenizer(path)
    model = load_gguf_policy(path, torch.float32)
    staging = out.with_name(out.name + ".partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if card is not None:
            (staging / "README.md").write_text(card, encoding="utf-8")
        for name, text in (extra_files or {}).items():
            (staging / name).write_text(text, encoding="utf-8")
        sync_tree(staging)
        replace_folder(out, staging)
    except BaseException:  # a full disk: the half-written copy would keep its space taken
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
