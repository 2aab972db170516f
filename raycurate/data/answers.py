"""Final answers in GSM8K style: the value after the last ``####`` marker.

Used to label the embedded benchmark corpus and to score generations (final-answer coverage, BMO rewards).
Answers are compared after normalisation, so ``"1,234."``, ``" 1234 "`` and ``"1234.0"`` all match ``"1234"``.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

ANSWER_MARKER = "####"


def normalize_answer(value: str) -> str:
    """Canonical text form of an answer.

    Strips whitespace, a leading ``$``, thousands separators and trailing periods; numbers are written without
    exponent or trailing zeros (``"7.0"`` -> ``"7"``, ``"2.50"`` -> ``"2.5"``, ``"-0"`` -> ``"0"``). Text that is
    not a number is returned stripped, otherwise unchanged.

    Args:
        value: Raw answer text.

    Returns:
        The normalised answer; ``""`` when nothing is left.
    """
    text = value.strip().replace(",", "").rstrip(".").strip()
    if text.startswith("$"):
        text = text[1:].strip()
    number = _as_number(text)
    if number is None:
        return text
    if number == number.to_integral_value():
        return str(int(number))
    return format(number.normalize(), "f")


def extract_final_answer(text: str) -> str | None:
    """The normalised value written after the last ``####`` in ``text``.

    Only the rest of that line counts (``"#### 12\\nmore text"`` -> ``"12"``).

    Args:
        text: A response or generation.

    Returns:
        The normalised answer, or ``None`` when there is no ``####`` or nothing follows it.
    """
    position = text.rfind(ANSWER_MARKER)
    if position < 0:
        return None
    rest = text[position + len(ANSWER_MARKER) :].split("\n", 1)[0]
    answer = normalize_answer(rest)
    return answer or None


def answers_match(pred: str | None, gold: str | None) -> bool:
    """Whether a predicted final answer equals the gold one after normalisation.

    Numbers compare by value (``"7.0"`` matches ``"7"``); other text compares exactly after stripping.

    Args:
        pred: Predicted answer (e.g. from :func:`extract_final_answer`); ``None`` never matches.
        gold: Gold answer; ``None`` or empty never matches.

    Returns:
        True when both are present and equal.
    """
    if pred is None or gold is None:
        return False
    pred_norm, gold_norm = normalize_answer(pred), normalize_answer(gold)
    if not pred_norm or not gold_norm:
        return False
    pred_number, gold_number = _as_number(pred_norm), _as_number(gold_norm)
    if pred_number is not None and gold_number is not None:
        return pred_number == gold_number
    return pred_norm == gold_norm


def _as_number(text: str) -> Decimal | None:
    try:
        number = Decimal(text)
    except InvalidOperation:
        return None
    return number if number.is_finite() else None


_EQUATION = re.compile(r"(-?\d+(?:\.\d+)?)\s*([-+*/x×])\s*(-?\d+(?:\.\d+)?)\s*=\s*(-?\d+(?:\.\d+)?)")


def equation_counts(text: str) -> tuple[int, int]:
    """Count the ``a op b = c`` equations in ``text`` and how many of them are arithmetically right.

    Args:
        text: A worked solution, e.g. ``"3 * 4 = 12 apples."``.

    Returns:
        ``(correct, total)``.
    """
    correct = total = 0
    for a, op, b, c in _EQUATION.findall(text):
        x, y, z = Decimal(a), Decimal(b), Decimal(c)
        value: Decimal | None
        if op in "x×*":
            value = x * y
        elif op == "/":
            value = x / y if y != 0 else None
        elif op == "+":
            value = x + y
        else:
            value = x - y
        total += 1
        correct += int(value is not None and value == z)
    return correct, total
