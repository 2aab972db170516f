"""Code tasks: "Write a Python function ..." prompts answered by a correct function, one statement per line, and
the wrong ``return`` line of the code ``wrong_final_answer`` corruption."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Callable

from raycurate.data.corpus.rows import Task


@dataclass(frozen=True)
class CodeFamily:
    """A function-writing task family; ``lines``/``wrong_return``/``task`` are ``str.format`` templates.

    Placeholders: ``{f}`` function name, ``{v}`` argument name, plus the family's ``params``.
    ``reference(params)`` is the intended behaviour and ``examples(params)`` argument tuples that expose the
    wrong return line; both exist for the tests.
    """

    names: tuple[str, ...]
    args: tuple[str, ...]
    task: str
    lines: tuple[str, ...]
    wrong_return: str
    params: Callable[[random.Random], dict[str, Any]]
    reference: Callable[[dict[str, Any]], Callable[..., Any]]
    examples: Callable[[dict[str, Any]], list[tuple]]


@dataclass
class CodeTask:
    family: CodeFamily
    params: dict[str, Any]  # includes f and v
    lines: list[str]
    wrong_return: str


def _no_params(rng: random.Random) -> dict[str, Any]:
    return {}


CODE_FAMILIES: tuple[CodeFamily, ...] = (
    CodeFamily(
        names=("sum_above", "sum_greater_than", "total_above"), args=("values", "numbers"),
        task="returns the sum of the numbers in `{v}` that are greater than {k}",
        lines=("def {f}({v}):", "    total = 0", "    for x in {v}:", "        if x > {k}:", "            total += x",
               "    return total"),
        wrong_return="    return total + {k}",
        params=lambda r: {"k": r.randint(1, 10)},
        reference=lambda p: lambda values: sum(x for x in values if x > p["k"]),
        examples=lambda p: [([1, p["k"] + 1, p["k"] + 5, 0],), ([p["k"] + 2],)],
    ),
    CodeFamily(
        names=("count_starting_with", "count_prefixed", "words_starting_with"), args=("words", "items"),
        task='returns how many strings in `{v}` start with the letter "{c}"',
        lines=("def {f}({v}):", "    count = 0", "    for word in {v}:", '        if word.startswith("{c}"):',
               "            count += 1", "    return count"),
        wrong_return="    return len({v})",
        params=lambda r: {"c": r.choice("abcdefghlmnprst")},
        reference=lambda p: lambda words: sum(1 for w in words if w.startswith(p["c"])),
        examples=lambda p: [([p["c"] + "at", "zoo", "yak"],), ([],)],
    ),
    CodeFamily(
        names=("scale", "multiply_all", "scaled"), args=("values", "numbers"),
        task="returns a new list with every number in `{v}` multiplied by {k}",
        lines=("def {f}({v}):", "    return [x * {k} for x in {v}]"),
        wrong_return="    return [x + {k} for x in {v}]",
        params=lambda r: {"k": r.randint(2, 9)},
        reference=lambda p: lambda values: [x * p["k"] for x in values],
        examples=lambda p: [([1, 3, 5],)],
    ),
    CodeFamily(
        names=("largest", "max_value", "find_max"), args=("values", "numbers"),
        task="returns the largest number in the non-empty list `{v}` without using max",
        lines=("def {f}({v}):", "    best = {v}[0]", "    for x in {v}[1:]:", "        if x > best:",
               "            best = x", "    return best"),
        wrong_return="    return {v}[0]",
        params=_no_params,
        reference=lambda p: lambda values: max(values),
        examples=lambda p: [([3, 9, 2],), ([5],)],
    ),
    CodeFamily(
        names=("reverse_words", "flip_words", "words_backwards"), args=("sentence", "text"),
        task="returns the words of `{v}` in reverse order, separated by single spaces",
        lines=("def {f}({v}):", "    words = {v}.split()", "    words.reverse()", '    return " ".join(words)'),
        wrong_return='    return "".join(words)',
        params=_no_params,
        reference=lambda p: lambda text: " ".join(reversed(text.split())),
        examples=lambda p: [("hello big world",)],
    ),
    CodeFamily(
        names=("is_multiple", "divisible", "is_divisible"), args=("n", "number"),
        task="returns True when the integer `{v}` is divisible by {k} and False otherwise",
        lines=("def {f}({v}):", "    return {v} % {k} == 0"),
        wrong_return="    return {v} % {k} == 1",
        params=lambda r: {"k": r.randint(2, 9)},
        reference=lambda p: lambda n: n % p["k"] == 0,
        examples=lambda p: [(3 * p["k"],), (3 * p["k"] + 1,)],
    ),
    CodeFamily(
        names=("average", "mean", "mean_value"), args=("values", "numbers"),
        task="returns the average of the non-empty list of numbers `{v}`",
        lines=("def {f}({v}):", "    total = sum({v})", "    return total / len({v})"),
        wrong_return="    return total / (len({v}) + 1)",
        params=_no_params,
        reference=lambda p: lambda values: sum(values) / len(values),
        examples=lambda p: [([2, 4, 6],)],
    ),
    CodeFamily(
        names=("clamp", "limit", "bounded"), args=("x", "value"),
        task="returns `{v}` limited to the range from {lo} to {hi}",
        lines=("def {f}({v}):", "    if {v} < {lo}:", "        return {lo}", "    if {v} > {hi}:",
               "        return {hi}", "    return {v}"),
        wrong_return="    return {lo}",
        params=lambda r: (lambda lo: {"lo": lo, "hi": lo + r.randint(5, 20)})(r.randint(0, 5)),
        reference=lambda p: lambda x: min(max(x, p["lo"]), p["hi"]),
        examples=lambda p: [(p["lo"] - 1,), (p["hi"] + 1,), (p["lo"] + 2,)],
    ),
    CodeFamily(
        names=("factorial", "fact", "product_up_to"), args=("n", "k"),
        task="returns the product of the integers from 1 to `{v}`",
        lines=("def {f}({v}):", "    result = 1", "    for i in range(2, {v} + 1):", "        result *= i",
               "    return result"),
        wrong_return="    return result * {v}",
        params=_no_params,
        reference=lambda p: lambda n: math.factorial(n),
        examples=lambda p: [(4,), (1,)],
    ),
    CodeFamily(
        names=("count_vowels", "vowel_count", "num_vowels"), args=("text", "word"),
        task="returns the number of vowels (a, e, i, o, u, any case) in `{v}`",
        lines=("def {f}({v}):", "    count = 0", "    for ch in {v}.lower():", '        if ch in "aeiou":',
               "            count += 1", "    return count"),
        wrong_return="    return len({v})",
        params=_no_params,
        reference=lambda p: lambda text: sum(1 for ch in text.lower() if ch in "aeiou"),
        examples=lambda p: [("Banana",), ("sky",)],
    ),
    CodeFamily(
        names=("label", "tag_number", "describe"), args=("n", "number"),
        task='returns "{word}" when `{v}` is divisible by {k} and otherwise `{v}` as a string',
        lines=("def {f}({v}):", "    if {v} % {k} == 0:", '        return "{word}"', "    return str({v})"),
        wrong_return="    return str({v} + 1)",
        params=lambda r: {"k": r.randint(2, 7), "word": r.choice(("fizz", "buzz", "ping", "bingo"))},
        reference=lambda p: lambda n: p["word"] if n % p["k"] == 0 else str(n),
        examples=lambda p: [(p["k"] + 1,), (p["k"],)],
    ),
    CodeFamily(
        names=("perimeter", "rectangle_perimeter", "fence_length"), args=("width",),
        task="returns the perimeter of a rectangle with sides `{v}` and `height`",
        lines=("def {f}({v}, height):", "    return 2 * ({v} + height)"),
        wrong_return="    return {v} + height",
        params=_no_params,
        reference=lambda p: lambda width, height: 2 * (width + height),
        examples=lambda p: [(3, 4)],
    ),
    CodeFamily(
        names=("unique", "dedupe", "remove_duplicates"), args=("items", "values"),
        task="returns the items of `{v}` without duplicates, keeping the first occurrence order",
        lines=("def {f}({v}):", "    seen = set()", "    result = []", "    for item in {v}:",
               "        if item not in seen:", "            seen.add(item)", "            result.append(item)",
               "    return result"),
        wrong_return="    return {v}",
        params=_no_params,
        reference=lambda p: lambda items: list(dict.fromkeys(items)),
        examples=lambda p: [([1, 1, 2, 3, 2],)],
    ),
    CodeFamily(
        names=("to_fahrenheit", "celsius_to_fahrenheit", "c_to_f"), args=("celsius", "degrees"),
        task="converts the temperature `{v}` from Celsius to Fahrenheit",
        lines=("def {f}({v}):", "    return {v} * 9 / 5 + 32"),
        wrong_return="    return {v} * 9 / 5",
        params=_no_params,
        reference=lambda p: lambda c: c * 9 / 5 + 32,
        examples=lambda p: [(10,), (0,)],
    ),
    CodeFamily(
        names=("count_even", "even_count", "num_even"), args=("values", "numbers"),
        task="returns how many numbers in `{v}` are even",
        lines=("def {f}({v}):", "    return sum(1 for x in {v} if x % 2 == 0)"),
        wrong_return="    return sum(1 for x in {v} if x % 2 == 1)",
        params=_no_params,
        reference=lambda p: lambda values: sum(1 for x in values if x % 2 == 0),
        examples=lambda p: [([1, 2, 4],)],
    ),
)

_CODE_LEADS = ("Write a Python function", "Implement a Python function", "Define a Python function",
               "Create a Python function")
_CODE_STYLE_NOTES = ("Keep the function short.", "Do not import any modules.", "Use clear variable names.",
                     "Do not print anything.", "Use plain Python only.", "Keep it simple.")


def sample_code_task(rng: random.Random, family: CodeFamily | None = None) -> CodeTask:
    """A task of ``family`` (drawn when None) with drawn function name, argument name and parameters."""
    family = family or rng.choice(CODE_FAMILIES)
    params = {"f": rng.choice(family.names), "v": rng.choice(family.args), **family.params(rng)}
    lines = [line.format(**params) for line in family.lines]
    return CodeTask(family, params, lines, family.wrong_return.format(**params))


def code_task(rng: random.Random) -> Task:
    """A clean code task: the prompt asks for the function, the response is its lines."""
    code = sample_code_task(rng)
    signature = code.lines[0][len("def "):-1]
    lead = rng.choice(_CODE_LEADS)
    sentences = [f"{lead} `{signature}` that {code.family.task.format(**code.params)}."]
    if rng.random() < 0.4:
        sentences.append(rng.choice(_CODE_STYLE_NOTES))
    return Task("code", code.family.names[0], [(s, False) for s in sentences], code.lines, code=code)


def wrong_code_return(code: CodeTask) -> str:
    """The function with its last ``return`` line replaced by the family's wrong one."""
    return "\n".join(code.lines[:-1] + [code.wrong_return])
