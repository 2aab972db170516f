"""Math word problems: one- and two-step templates with small numbers, distractor sentences, the person-name
pools (the corpus's and the held-out set's, disjoint), and the math-only corruptions (wrong final answer, wrong
intermediate step, swapped entity)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from raycurate.data.corpus.rows import Task

MAX_RESULT = 200  # every intermediate and final math result is < MAX_RESULT


class _Ref(NamedTuple):
    """Operand that refers to the result of an earlier step."""

    step: int


@dataclass(frozen=True)
class _Step:
    """One worked step, rendered as ``"<lead>, so <a> <op> <b> = <r> <unit>."``; ``lead`` may use {a} and {b}.

    The op ``"="`` is a look-up: the result is ``a`` and the step renders as ``"<lead>."`` (``lead`` uses {r}).
    """

    lead: str
    left: int | _Ref
    op: str
    right: int | _Ref
    unit: str


@dataclass
class MathProblem:
    """``facts[0]`` states ``steps[0].left`` about the person in the form ``"{name} has {n} ..."``; ``item`` is the
    counted thing.  ``swap_count`` is the count of the same-form distractor about another person (the value a
    ``swapped_entity`` response uses instead of ``steps[0].left``)."""

    facts: list[str]
    question: str
    steps: list[_Step]
    item: str = ""
    distractors: list[str] = field(default_factory=list)
    swap_count: int = 0


class _Person(NamedTuple):
    name: str
    she: str  # "She" / "He"
    her: str  # "her" / "his"
    other: str  # another name from the same pool, for distractors


def _apply(op: str, a: int, b: int) -> int | None:
    if op == "=":
        return a
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "/":
        return a // b if b and a % b == 0 else None
    raise ValueError(f"Unknown operator {op!r}; use one of = + - * /.")


def _evaluate(steps: list[_Step], wrong: tuple[int, int] | None = None) -> list[tuple[int, int, int]] | None:
    """Evaluate the steps to ``(a, b, result)`` triples; ``wrong=(k, r)`` forces step k's result to r.

    Returns None when a division is inexact or a result leaves [0, MAX_RESULT).
    """
    results: list[int] = []
    triples = []
    for index, step in enumerate(steps):
        a = results[step.left.step] if isinstance(step.left, _Ref) else step.left
        b = results[step.right.step] if isinstance(step.right, _Ref) else step.right
        result = _apply(step.op, a, b)
        if wrong is not None and wrong[0] == index:
            result = wrong[1]
        if result is None or not 0 <= result < MAX_RESULT:
            return None
        results.append(result)
        triples.append((a, b, result))
    return triples


def _valid_triples(steps: list[_Step]) -> list[tuple[int, int, int]]:
    """:func:`_evaluate` of steps already known to be valid (every caller's problem passed the validity checks)."""
    triples = _evaluate(steps)
    if triples is None:
        raise AssertionError("unreachable: these steps were checked to evaluate to results in [1, MAX_RESULT)")
    return triples


def _is_valid_problem(problem: MathProblem) -> bool:
    triples = _evaluate(problem.steps)
    operands = [x for s in problem.steps for x in ((s.left,) if s.op == "=" else (s.left, s.right))]
    literals = [x for x in operands if not isinstance(x, _Ref)]
    return triples is not None and all(r >= 1 for _, _, r in triples) and all(x >= 1 for x in literals)


def _solution_lines(steps: list[_Step], triples: list[tuple[int, int, int]], final: int) -> list[str]:
    lines = []
    for step, (a, b, result) in zip(steps, triples):
        lead = step.lead.format(a=a, b=b, r=result)
        if step.op == "=":
            lines.append(f"{lead}.")
            continue
        unit = f" {step.unit}" if step.unit else ""
        lines.append(f"{lead}, so {a} {step.op} {b} = {result}{unit}.")
    return lines + [f"#### {final}"]


def math_task(rng: random.Random, names: tuple[tuple[str, str], ...]) -> Task:
    """A clean math problem about a person from ``names``, with a same-form distractor about another one."""
    template = rng.choice(_MATH_TEMPLATES)
    (name, she), (other, _) = rng.sample(names, 2)
    person = _Person(name, she, "her" if she == "She" else "his", other)
    problem = template(rng, person)
    while not _is_valid_problem(problem):
        problem = template(rng, person)
    problem.swap_count = _swap_count(problem, rng)
    same_form = problem.facts[0].replace(f"{name} has {problem.steps[0].left} ", f"{other} has {problem.swap_count} ")
    problem.distractors = [same_form] + [d(rng, person) for d in rng.sample(_DISTRACTORS, rng.randint(0, 2))]
    triples = _valid_triples(problem.steps)
    answer = triples[-1][2]
    return Task(
        domain="math",
        family=template.__name__,
        sentences=_mix_sentences(problem, rng),
        response_lines=_solution_lines(problem.steps, triples, answer),
        answer=str(answer),
        math=problem,
    )


def _mix_sentences(problem: MathProblem, rng: random.Random) -> list[tuple[str, bool]]:
    """Insert distractors at random places among the facts (facts keep their order); the question is last."""
    sentences = [(fact, False) for fact in problem.facts]
    for distractor in problem.distractors:
        sentences.insert(rng.randint(0, len(sentences)), (distractor, True))
    return sentences + [(problem.question, False)]


def _with_first_literal(problem: MathProblem, value: int) -> list[_Step]:
    first = problem.steps[0]
    return [_Step(first.lead, value, first.op, first.right, first.unit), *problem.steps[1:]]


def _swap_count(problem: MathProblem, rng: random.Random) -> int:
    """A count for the same-form distractor: differs from the person's, and swapped in it gives a valid problem
    with a different answer (so every row can carry a ``swapped_entity`` corruption)."""
    true_value = problem.steps[0].left
    if not isinstance(true_value, int):
        raise AssertionError("unreachable: every template's first step starts from a literal count")
    gold = _valid_triples(problem.steps)[-1][2]
    candidates = [v for v in range(max(2, true_value - 8), true_value + 9) if v != true_value]
    rng.shuffle(candidates)
    for value in candidates:
        triples = _evaluate(_with_first_literal(problem, value))
        if triples is not None and all(r >= 1 for _, _, r in triples) and triples[-1][2] != gold:
            return value
    raise AssertionError(f"no valid distractor count for {problem.facts[0]!r}")


def swapped_entity_response(problem: MathProblem) -> str:
    """The solution worked with the distractor person's count instead of the asked person's (a wrong lookup)."""
    steps = _with_first_literal(problem, problem.swap_count)
    triples = _valid_triples(steps)
    return "\n".join(_solution_lines(steps, triples, triples[-1][2]))


def wrong_math_answer(problem: MathProblem, rng: random.Random) -> str:
    """All steps correct, but the ``####`` value is off by a small nonzero amount."""
    triples = _valid_triples(problem.steps)
    gold = triples[-1][2]
    wrong = gold + rng.choice([d for d in range(-5, 6) if d and gold + d >= 0])
    return "\n".join(_solution_lines(problem.steps, triples, wrong))


def wrong_math_step(problem: MathProblem, rng: random.Random) -> str:
    """One step's result is off; later steps use the wrong value, so the ``####`` value is wrong too."""
    gold = _valid_triples(problem.steps)[-1][2]
    step_order = list(range(len(problem.steps)))
    rng.shuffle(step_order)
    deltas = [d for d in range(-5, 6) if d] + [10, -10]
    for k in step_order:
        true_result = _valid_triples(problem.steps)[k][2]
        rng.shuffle(deltas)
        for delta in deltas:
            triples = _evaluate(problem.steps, wrong=(k, true_result + delta))
            if triples is not None and triples[-1][2] != gold:
                return "\n".join(_solution_lines(problem.steps, triples, triples[-1][2]))
    raise AssertionError("unreachable: a wrong last step always gives a wrong final answer")


# Each template draws its numbers and returns the problem; math_task re-draws until all results are in
# [1, MAX_RESULT) and divisions are exact.

_SMALL_ITEMS = ("apples", "oranges", "marbles", "stickers", "pencils", "cookies", "cards", "stamps", "shells",
                "beads", "candies", "crayons", "buttons", "lemons", "muffins", "toy cars")
def _small_item(rng: random.Random) -> str:
    return rng.choice(_SMALL_ITEMS)


def _has(p: _Person, count: int, item: str) -> str:
    return f"{p.name} has {count} {item}."


def _lookup(rng: random.Random, p: _Person) -> MathProblem:
    item, count = _small_item(rng), rng.randint(2, 30)
    return MathProblem(
        facts=[_has(p, count, item)],
        question=f"How many {item} does {p.name} have?",
        steps=[_Step(f"{p.name} has {{r}} {item}", count, "=", 0, "")],
        item=item,
    )


def _gets_more(rng: random.Random, p: _Person) -> MathProblem:
    item, start, more = _small_item(rng), rng.randint(2, 15), rng.randint(2, 12)
    return MathProblem(
        facts=[_has(p, start, item), f"Then {p.name} gets {more} more {item}."],
        question=f"How many {item} does {p.name} have now?",
        steps=[_Step(f"{p.she} has {{a}} {item} and gets {{b}} more", start, "+", more, item)],
        item=item,
    )


def _gives_away(rng: random.Random, p: _Person) -> MathProblem:
    item, start = _small_item(rng), rng.randint(5, 20)
    given = rng.randint(1, start - 1)
    return MathProblem(
        facts=[_has(p, start, item), f"{p.name} gives {given} {item} to a friend."],
        question=f"How many {item} does {p.name} have left?",
        steps=[_Step(f"{p.she} gives {{b}} of the {{a}} {item} away", start, "-", given, f"{item} left")],
        item=item,
    )


def _boxes(rng: random.Random, p: _Person) -> MathProblem:
    item, boxes, per_box = _small_item(rng), rng.randint(2, 6), rng.randint(2, 6)
    return MathProblem(
        facts=[f"{p.name} has {boxes} boxes of {item}.", f"Each box holds {per_box} {item}."],
        question=f"How many {item} does {p.name} have in total?",
        steps=[_Step(f"{p.she} has {{a}} boxes of {{b}} {item}", boxes, "*", per_box, item)],
        item=item,
    )


def _gets_then_gives(rng: random.Random, p: _Person) -> MathProblem:
    item, start, more = _small_item(rng), rng.randint(2, 12), rng.randint(2, 9)
    given = rng.randint(1, start + more - 1)
    return MathProblem(
        facts=[_has(p, start, item), f"Then {p.name} gets {more} more {item}.",
               f"{p.name} gives {given} {item} to a friend."],
        question=f"How many {item} does {p.name} have left?",
        steps=[_Step(f"{p.she} has {{a}} {item} and gets {{b}} more", start, "+", more, item),
               _Step(f"{p.she} gives {{b}} of the {{a}} {item} away", _Ref(0), "-", given, f"{item} left")],
        item=item,
    )


def _boxes_then_eats(rng: random.Random, p: _Person) -> MathProblem:
    item, boxes, per_box = _small_item(rng), rng.randint(2, 5), rng.randint(2, 6)
    lost = rng.randint(1, boxes * per_box - 1)
    return MathProblem(
        facts=[f"{p.name} has {boxes} boxes of {item}.", f"Each box holds {per_box} {item}.",
               f"{p.name} loses {lost} {item}."],
        question=f"How many {item} does {p.name} have now?",
        steps=[_Step(f"{p.she} has {{a}} boxes of {{b}} {item}", boxes, "*", per_box, item),
               _Step(f"{p.she} loses {{b}} of the {{a}} {item}", _Ref(0), "-", lost, f"{item} left")],
        item=item,
    )


# One- and two-step problems with small numbers: a ~1M-parameter model can learn them in the demo's SFT budget,
# so corrupted training data measurably changes what it answers (the oracle gap; docs/design.md, "The proving ground").
_MATH_TEMPLATES: tuple[Callable[[random.Random, _Person], MathProblem], ...] = (
    _lookup, _gets_more, _gives_away, _boxes, _gets_then_gives, _boxes_then_eats,
)

# Distractor sentences: plausible, contain numbers, and are irrelevant to every question above.
_RELATIVES = ("uncle", "aunt", "grandmother", "grandfather", "neighbor")
_DISTRACTORS: tuple[Callable[[random.Random, _Person], str], ...] = (
    lambda r, p: f"{p.other} has {r.randint(2, 20)} {r.choice(_SMALL_ITEMS)}.",
    lambda r, p: f"{p.name}'s {r.choice(_RELATIVES)} is {r.randint(30, 80)} years old.",
    lambda r, p: f"The shop down the street is open {r.randint(6, 12)} hours a day.",
    lambda r, p: f"It rained on {r.randint(2, 20)} days last month.",
    lambda r, p: f"{p.name}'s house is {r.randint(2, 15)} blocks from the park.",
    lambda r, p: f"A bus passes by every {r.randint(5, 20)} minutes.",
    lambda r, p: f"{p.other} scored {r.randint(2, 20)} points in a game yesterday.",
    lambda r, p: f"There are {r.randint(3, 12)} windows in {p.name}'s classroom.",
    lambda r, p: f"{p.name} has {r.randint(2, 9)} cousins.",
    lambda r, p: f"{p.other} owns {r.randint(1, 5)} cats and {r.randint(1, 3)} dogs.",
    lambda r, p: f"The school is {r.randint(10, 90)} years old.",
    lambda r, p: f"{p.name}'s favorite number is {r.randint(1, 20)}.",
)

CORPUS_NAMES: tuple[tuple[str, str], ...] = tuple(
    (name, "She" if i % 2 == 0 else "He")
    for i, name in enumerate((
        "Maya", "Liam", "Sofia", "Noah", "Ava", "Ethan", "Zoe", "Omar", "Lena", "Ravi", "Priya", "Diego",
        "Hana", "Jonas", "Amara", "Felix", "Nora", "Kenji", "Isla", "Mateo", "Chloe", "Arjun", "Yara", "Lucas",
        "Mina", "Tariq", "Elena", "Samuel", "Aisha", "Hugo", "Freya", "Kofi", "Leila", "Marco", "Ingrid",
        "Pablo", "Sara", "Tomas", "Julia", "Wei",
    ))
)
HELDOUT_NAMES: tuple[tuple[str, str], ...] = tuple(
    (name, "She" if i % 2 == 0 else "He")
    for i, name in enumerate((
        "Beatrix", "Cyrus", "Delphine", "Emeka", "Fiona", "Gustavo", "Hazel", "Idris", "Juniper", "Kasimir",
        "Lucia", "Magnus",
    ))
)
