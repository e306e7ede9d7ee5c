"""TinyMath: the procedurally generated arithmetic task of the shipped demo policy.

A problem is ``"{a}{op}{b}="`` with integer operands ``0 <= a, b <= 99`` and ``op`` in ``+``,
``-``; its answer is the decimal result, negative for ``a < b`` (``"17-58="`` -> ``"-41"``). The
20,000 problems are split once and for all by a stable hash (BLAKE2b, not Python's randomised
``hash``) of the prompt: 80 % train, 10 % validation, 10 % test, so the splits are disjoint
whatever the seed. A completion is the answer characters followed by ``<eos>``.

The tokenizer is character-level over exactly the 13 characters the task uses plus ``<pad>``,
``<bos>``, ``<eos>`` and ``<unk>``. It prepends ``<bos>`` (``"23+58="`` -> ``<bos> 2 3 + 5 8 =``)
and never appends ``<eos>``, so generated tokens concatenate directly onto an encoded prompt.
"""

from __future__ import annotations

import functools
import hashlib
import random
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

__all__ = [
    "CHARACTERS",
    "DEFAULT_MAX_NEW_TOKENS",
    "MAX_OPERAND",
    "OPERATORS",
    "SPECIAL_TOKENS",
    "SPLITS",
    "TINYMATH_DIR",
    "answer_of",
    "build_tokenizer",
    "char_tokenizer",
    "generate_problems",
    "split_of",
]

TINYMATH_DIR: Path = Path(__file__).parent / "assets" / "tinymath"
"""The shipped TinyMath model directory (``from_pretrained`` loads it like a hub model)."""

MAX_OPERAND = 99
OPERATORS = ("+", "-")
CHARACTERS = "0123456789+-="
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
# Share of the hash buckets 0..9 that each split owns.
SPLITS: dict[str, range] = {"train": range(0, 8), "validation": range(8, 9), "test": range(9, 10)}

DEFAULT_MAX_NEW_TOKENS = 4
"""The answer budget: the longest answer (``"198"``, ``"-99"``) is 3 characters, plus ``<eos>``."""

# Padding prompts and completions never exceeds this: <bos> + "99+99=" + "198" + <eos> = 11.
MODEL_MAX_LENGTH = 32


def _evaluate(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def split_of(prompt: str) -> str:
    """The split that owns ``prompt``: a stable BLAKE2b hash, identical on every machine."""
    digest = hashlib.blake2b(prompt.encode("ascii"), digest_size=8).digest()
    bucket = int.from_bytes(digest, "little") % 10
    return next(name for name, buckets in SPLITS.items() if bucket in buckets)


@functools.lru_cache(maxsize=len(SPLITS))
def _problems_of(split: str) -> tuple[tuple[str, str], ...]:
    """Every ``(prompt, answer)`` of ``split``, in a fixed enumeration order."""
    rows = []
    for op in OPERATORS:
        for a in range(MAX_OPERAND + 1):
            for b in range(MAX_OPERAND + 1):
                prompt = f"{a}{op}{b}="
                if split_of(prompt) == split:
                    rows.append((prompt, str(_evaluate(a, op, b))))
    return tuple(rows)


def generate_problems(n: int, seed: int = 0, split: str = "train") -> list[dict[str, str]]:
    """``n`` rows ``{"prompt": "23+58=", "answer": "81"}`` of ``split``, deterministic in ``seed``.

    The rows are the split's problems in an order shuffled by ``seed``: the first
    ``len(split)`` rows are distinct (about 16,000 train, 2,000 validation, 2,000 test
    problems), and a larger ``n`` continues with freshly shuffled passes. A smaller ``n`` with the
    same seed gives a prefix of a larger one.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}; got {split!r}")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an integer >= 0; got {n!r}")
    pool = list(_problems_of(split))
    rng = random.Random(f"tinymath-{split}-{seed}")
    rows: list[dict[str, str]] = []
    while len(rows) < n:
        order = pool[:]
        rng.shuffle(order)
        rows.extend({"prompt": p, "answer": a} for p, a in order[: n - len(rows)])
    return rows


def answer_of(completion: str) -> str | None:
    """The answer a decoded completion gives, or ``None`` if it gives none.

    The answer is the text before the first ``<eos>`` (when special tokens were kept) or the
    first whitespace, stripped: ``"81<eos>7"`` -> ``"81"``, ``" 81\\n9"`` -> ``"81"``,
    ``"<eos>"`` -> ``None``.
    """
    text = completion.split("<eos>", 1)[0].strip()
    parts = text.split(maxsplit=1)
    return parts[0] if parts else None


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level TinyMath tokenizer (ids: specials 0-3, then ``CHARACTERS``).

    ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2, ``<unk>`` = 3; padding on the left, for
    generation. Encoding prepends ``<bos>``; ``decode(ids, skip_special_tokens=True)`` gives
    back the plain text. Characters outside the task (spaces included) encode to ``<unk>``.
    """
    return char_tokenizer(CHARACTERS, model_max_length=MODEL_MAX_LENGTH)


def char_tokenizer(
    characters: str, model_max_length: int = MODEL_MAX_LENGTH
) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over ``characters`` after ``SPECIAL_TOKENS`` (ids 0-3),
    prepending ``<bos>`` and padding on the left."""
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *characters))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A",
        pair="<bos> $A $B",
        special_tokens=[("<bos>", vocab["<bos>"])],
    )
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=model_max_length,
    )
