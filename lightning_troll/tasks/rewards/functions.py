"""The built-in reward functions ``tinymath``, ``gsm8k``, ``boxed``, ``last_number`` and
``math_verify``, and the answer parsing they share.

Each is a reward function ``fn(prompt, completion, row) -> float``, registered under its name
in :mod:`lightning_troll.tasks.rewards.registry` (whose docstring lists what each scores). The fifth built-in,
``overlong``, scores a completion's length, not its answer; it lives with the reward options it
takes (:mod:`lightning_troll.tasks.rewards.options`). ``gsm8k``, ``boxed`` and ``last_number`` compare
numbers exactly, as fractions: ``"1,000"`` and ``"1000.0"`` are one number. ``math_verify``
hands both answers to Hugging Face's ``math-verify`` package (the ``math`` extra), which parses
LaTeX and plain expressions into SymPy and compares them symbolically.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

__all__ = ["boxed", "extract_boxed", "gsm8k", "last_number", "math_verify", "tinymath"]


# ----------------------------------------------------------------------------- answer parsing

_NUMBER = re.compile(r"-?(?:\d[\d,]*(?:\.\d*)?|\.\d+)")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d*)?")
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}$")


def _to_number(text: str) -> Fraction | None:
    """``"1,234"``, ``"-3.50"``, ``"1/2"``, ``"\\frac{1}{2}"`` -> exact Fraction; else None."""
    text = text.strip()
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    if frac := _FRAC.match(text):
        sign, num, den = frac.groups()
        text = f"{sign}{num}/{den}" if "." not in num + den else f"{sign}{float(num) / float(den)}"
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def _after_hashes(text: str) -> str | None:
    """The text after the last ``####``, or None when there is none."""
    head, sep, tail = text.rpartition("####")
    return tail if sep else None


def _last_number(text: str) -> Fraction | None:
    """The last number in ``text`` (commas and ``$`` ignored): ``"3 + 4 = 7."`` -> 7."""
    matches = _NUMBER.findall(text.replace("$", ""))
    return None if not matches else _to_number(matches[-1].replace(",", "").rstrip("."))


def _first_number(text: str) -> Fraction | None:
    """The first number in ``text`` (commas and ``$`` ignored), e.g. ``" $1,200.50 total"``."""
    match = _NUMBER.search(text.replace("$", ""))
    return None if match is None else _to_number(match.group().replace(",", "").rstrip("."))


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None  # unclosed: the completion was cut off inside the box


def _normalise(answer: str) -> str:
    """Strip spaces, ``$`` and a trailing full stop: ``" $1/2$. "`` -> ``"1/2"``."""
    return re.sub(r"\s+", "", str(answer)).replace("$", "").rstrip(".")


# ----------------------------------------------------------------------------- built-ins


def tinymath(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """1.0 if the TinyMath answer in ``completion`` equals ``row["answer"]``, else 0.0.

    Use it with the shipped TinyMath policy and task only: it reads that task's answer format.
    """
    from lightning_troll.models.tinymath import answer_of

    return float(answer_of(completion) == str(row["answer"]).strip())


def gsm8k(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """1.0 if the number after the last ``####`` in ``completion`` equals the gold answer.

    The gold answer is ``row["answer"]`` after its last ``####`` (GSM8K's answer field is a worked
    solution ending in ``#### 42``) or, without ``####``, the whole field. Both are compared as
    exact numbers, commas and ``$`` removed: ``"#### 1,000"`` matches ``1000`` and ``"1000.0"``.
    A completion without ``####`` scores 0.0.

    Use it for GSM8K-style data, where the policy is taught (or prompted) to end with
    ``#### <number>``; it is exact and fast, and never credits a number elsewhere in the text.
    """
    given = _after_hashes(completion)
    if given is None:
        return 0.0
    gold_text = str(row["answer"])
    gold = _first_number(_after_hashes(gold_text) or gold_text)
    if gold is None:
        raise ValueError(f"gold answer {gold_text[-80:]!r} holds no number")
    return float(_first_number(given) == gold)


def boxed(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """1.0 if the last ``\\boxed{...}`` in ``completion`` matches ``row["answer"]``, else 0.0.

    Both sides are normalised (spaces, ``$`` and a trailing ``.`` removed); when both parse as
    numbers (``"0.5"``, ``"1/2"``, ``"\\frac{1}{2}"``, ``"1,000"``) they are compared exactly as
    numbers, otherwise as strings. A completion without a closed ``\\boxed{`` scores 0.0.

    Use it for MATH-style data with simple answers (integers, decimals, plain fractions) when
    speed matters; for sets, intervals, radicals or equivalent expressions use ``math_verify``.
    """
    content = extract_boxed(completion)
    if content is None:
        return 0.0
    given, gold = _normalise(content), _normalise(row["answer"])
    given_num, gold_num = _to_number(given), _to_number(gold)
    if given_num is not None and gold_num is not None:
        return float(given_num == gold_num)
    return float(given == gold)


def last_number(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """1.0 if the last number in ``completion`` equals ``row["answer"]`` as a number, else 0.0.

    For short answers from chat models, which wrap the number in prose: ``"3 + 4 = 7."`` and
    ``"The answer is 7"`` both score 1.0 for the gold answer ``7``; ``"7, not 8"`` scores 0.0.
    Numbers are compared exactly (commas and ``$`` removed: ``"1,000"`` matches ``1000.0``). A
    completion without a number scores 0.0.

    Use it for numeric answers from chat models that answer in prose; it misreads a completion
    that ends with another number (a check, a unit, a footnote).
    """
    gold = _first_number(str(row["answer"]))
    if gold is None:
        raise ValueError(f"gold answer {str(row['answer'])[-80:]!r} holds no number")
    return float(_last_number(completion) == gold)


_MATH_VERIFY_MISSING = (
    "the reward 'math_verify' needs the math-verify package: pip install 'lightning-troll[math]'"
)


def _math_verify_api() -> tuple[Any, Any]:
    """``math_verify.parse`` and ``math_verify.verify``, or an ImportError that names the extra."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ImportError(_MATH_VERIFY_MISSING) from None
    return parse, verify


def _as_latex(gold: str) -> str:
    """The gold answer in a form ``math_verify.parse`` reads: a bare answer (``\\{1,2\\}``,
    ``\\frac{1}{2}``) is wrapped in ``$...$``; one already in ``$`` or ``\\boxed`` is kept."""
    return gold if "$" in gold or "\\boxed" in gold else f"${gold}$"


def math_verify(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """1.0 if ``completion``'s answer is mathematically equal to ``row["answer"]``, else 0.0.

    Both sides are parsed by Hugging Face's ``math-verify`` (``math_verify.parse``): LaTeX in
    ``\\boxed{}``, ``$...$`` or plain text and bare expressions become SymPy objects, compared by
    ``math_verify.verify``: ``\\frac{2}{4}`` equals ``1/2`` and ``0.5``, ``\\{2,1\\}`` equals
    ``\\{1,2\\}``, intervals and matrices compare as such. A completion with nothing to parse scores
    0.0; a gold answer with nothing to parse is an error (``model.reward_options.on_error``
    decides).

    Use it for MATH, AIME and other competition data whose answers are expressions, not only
    numbers; it is slower than ``boxed`` (milliseconds a call, SymPy), so give it reward workers
    (``model.reward_options.workers``) for large rollouts. Needs the ``math`` extra
    (``pip install 'lightning-troll[math]'``). Parsing and verification are bounded by the
    package's own timeouts in a process's main thread (a reward worker's, or the trainer's).
    """
    parse, verify = _math_verify_api()
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold_text = str(row["answer"]).strip()
    gold = parse(_as_latex(gold_text), parsing_timeout=limit) or parse(
        gold_text, parsing_timeout=limit
    )
    if not gold:
        raise ValueError(f"math_verify cannot parse the gold answer {gold_text[-80:]!r}")
    given = parse(completion, parsing_timeout=limit)
    if not given:
        return 0.0
    return float(verify(gold, given, timeout_seconds=limit))


def _require_math_verify() -> None:
    _math_verify_api()


math_verify.require = _require_math_verify  # type: ignore[attr-defined]
"""Called when a scorer is built, so that a missing package stops the run before it starts."""
