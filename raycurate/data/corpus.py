"""The embedded benchmark corpus (SPEC §9): generated SFT data with ground truth on every row.

Why one ~1100-line module: it is one seeded generator. Every row is drawn from a few ``random.Random`` streams in a
fixed order, and the domain builders (math, code, instruction), the corruptions and the near-duplicates share the
private ``_Task`` plumbing and the name pools; split across modules, those would become public cross-module names
and any change in draw order would silently change the corpus that the committed results and hashes are tied to.
The sections below (entry points, rows and corruptions, math, code, instruction) keep it navigable.

Three domains:

* ``math``: one- and two-step word problems with small numbers (a look-up, +, -, small products) that a ~1M-parameter
  model can learn in the demo's fine-tuning budget. The prompt mixes the relevant fact sentences with distractors:
  always one of the same form about another person (``"Omar has 10 cards."`` next to ``"Felix has 4 cards."``),
  so answering needs the right entity, plus 0-2 other sentences with numbers; the response has one worked step per
  line (``"She has 3 boxes of 4 apples, so 3 * 4 = 12 apples."``, or ``"Omar has 10 cards."`` for a look-up) and
  ends with ``#### <answer>``.
* ``code``: "Write a Python function ..." tasks answered by a correct function, one statement per line.
* ``instruction``: instruction tasks answered with sentences or list items (``"- ..."`` / ``"1. ..."``).

A known number of rows is corrupted, and every row says how in ``label``:

=========================  ==================  ===============================================================
corruption                 domains             what changes
=========================  ==================  ===============================================================
``wrong_final_answer``     math, code          math: the ``####`` value is wrong, all steps correct;
                                               code: the last ``return`` line returns a wrong expression
``wrong_intermediate_step``  math              one step's result is wrong and the error propagates to ``####``
``swapped_entity``         math                the solution uses the same-form distractor's number (the other
                                               person's count) instead of the asked person's
``off_topic``              all                 the response belongs to an unrelated task
``truncated``              all                 the response stops before its final line (no ``####``,
                                               no final ``return``)
``unsafe``                 all                 a line starting ``[UNSAFE]`` (a harmless placeholder for
                                               dangerous advice) is inserted; code gets it as a comment
``near_duplicate``         all                 prompt and response copy a clean row of the same domain, with
                                               a tiny prompt perturbation; ``label.source_id`` names it
=========================  ==================  ===============================================================

Row schema (types are the same on every row, no nulls, so pyarrow infers one schema)::

    {"id": "bench-000001", "prompt": str, "response": str, "domain": "math" | "code" | "instruction",
     "label": {"clean": bool, "corruption": str ("none" when clean),
               "answer": str (gold final answer for math, also on corrupted rows; "" otherwise),
               "source_id": str ("" unless near_duplicate),
               "relevant_spans": list[list[int]] (char [start, end) spans of the fact / question / task
                                                  sentences in the prompt),
               "distractor_spans": list[list[int]] (char spans of distractor sentences; [] for non-math)}}

Everything is deterministic from ``seed``; the corpus, the held-out set and the pre-training texts come from
separate random streams. Held-out problems use their own pool of person names, which the corpus and the
pre-training texts never use, so no held-out prompt can equal a corpus prompt.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

DOMAINS: tuple[str, ...] = ("math", "code", "instruction")
DEFAULT_DOMAIN_WEIGHTS: dict[str, float] = {"math": 0.6, "code": 0.2, "instruction": 0.2}
CORRUPTIONS_BY_DOMAIN: dict[str, tuple[str, ...]] = {
    "math": ("wrong_final_answer", "wrong_intermediate_step", "swapped_entity", "off_topic", "truncated", "unsafe",
             "near_duplicate"),
    "code": ("wrong_final_answer", "off_topic", "truncated", "unsafe", "near_duplicate"),
    "instruction": ("off_topic", "truncated", "unsafe", "near_duplicate"),
}
CORRUPTION_KINDS: tuple[str, ...] = CORRUPTIONS_BY_DOMAIN["math"]
MAX_RESULT = 200  # every intermediate and final math result is < MAX_RESULT

# ----------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------


def generate_corpus(
    n_rows: int,
    seed: int,
    corrupt_fraction: float = 0.3,
    domain_weights: dict[str, float] | None = None,
) -> list[dict]:
    """Generate the labelled benchmark corpus.

    Domain counts are apportioned exactly from ``domain_weights`` (largest remainder) and shuffled. Exactly
    ``floor(corrupt_fraction * n_rows + 0.5)`` rows (round half up) are corrupted; within each domain the
    corrupted rows cycle through a shuffled list of the corruptions that apply to it, so the kinds are as
    balanced as possible. ``near_duplicate`` applies to a domain only if it has a clean row to copy. Prompts are
    unique across the rows that are not near duplicates (tasks are re-drawn on a repeat; code and instruction
    prompts can repeat only past a few thousand rows per domain).

    Args:
        n_rows: Number of rows (>= 0).
        seed: Seed; the same seed gives identical rows, a different seed different rows.
        corrupt_fraction: Fraction of rows to corrupt, in [0, 1].
        domain_weights: Relative weight per domain (keys among ``DOMAINS``); default math 0.6, code 0.2,
            instruction 0.2.

    Returns:
        ``n_rows`` row dicts with ids ``bench-000001`` ... in the schema of the module docstring.
    """
    if n_rows < 0:
        raise ValueError(f"n_rows must be >= 0, got {n_rows}.")
    if not 0.0 <= corrupt_fraction <= 1.0:
        raise ValueError(f"corrupt_fraction must be in [0, 1], got {corrupt_fraction}.")
    rng = random.Random(f"raycurate.corpus:{seed}")
    domains = _assign_domains(n_rows, _normalized_weights(domain_weights), rng)
    seen_prompts: set[str] = set()
    tasks = [_unseen_clean_task(domain, rng, seen_prompts) for domain in domains]
    corrupted = sorted(rng.sample(range(n_rows), _num_corrupted(n_rows, corrupt_fraction)))
    kinds = _assign_corruptions(corrupted, domains, rng)
    ids = [f"bench-{i + 1:06d}" for i in range(n_rows)]
    clean_by_domain: dict[str, list[int]] = {domain: [] for domain in DOMAINS}
    for i, domain in enumerate(domains):
        if i not in kinds:
            clean_by_domain[domain].append(i)
    rows = []
    for i, task in enumerate(tasks):
        kind = kinds.get(i, "none")
        if kind == "near_duplicate":
            source = rng.choice(clean_by_domain[task.domain])
            rows.append(_near_duplicate_row(ids[i], tasks[source], ids[source], rng))
        else:
            rows.append(_row(ids[i], task, kind, _corrupt_response(task, kind, rng)))
    return rows


def generate_heldout(n_rows: int, seed: int) -> list[dict]:
    """Generate clean math problems for evaluation, disjoint from the corpus.

    They come from their own random stream and use a pool of names the corpus never uses, so no held-out
    prompt equals a corpus prompt (for any seed).

    Args:
        n_rows: Number of problems.
        seed: Seed; same seed, same problems.

    Returns:
        Rows in the corpus schema with ids ``heldout-000001`` ..., all clean.
    """
    rng = random.Random(f"raycurate.heldout:{seed}")
    return [
        _row(f"heldout-{i + 1:06d}", task, "none", task.response)
        for i, task in enumerate(_clean_task("math", rng, _HELDOUT_NAMES) for _ in range(n_rows))
    ]


def generate_validation_questions(n_rows: int, seed: int, exclude_prompts: set[str] | frozenset[str] = frozenset(),
                                  ) -> list[dict]:
    """Generate clean math problems for choosing settings, disjoint from the corpus and from ``exclude_prompts``.

    Like :func:`generate_heldout` (same problem generator and name pool, never a corpus prompt) but from their own
    random stream, so sweeps can score settings on them without touching the held-out questions that results
    report. Pass the held-out prompts as ``exclude_prompts``; a drawn problem equal to one is drawn again.

    Args:
        n_rows: Number of problems.
        seed: Seed; same seed (and exclusions), same problems.
        exclude_prompts: Prompts that must not appear (the held-out set's).

    Returns:
        Rows in the corpus schema with ids ``validation-000001`` ..., all clean.
    """
    rng = random.Random(f"raycurate.validation:{seed}")
    rows: list[dict] = []
    seen = set(exclude_prompts)
    while len(rows) < n_rows:
        task = _clean_task("math", rng, _HELDOUT_NAMES)
        row = _row(f"validation-{len(rows) + 1:06d}", task, "none", task.response)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
    return rows


def generate_pretraining_texts(n_rows: int, seed: int) -> list[str]:
    """Clean texts of all domains (``prompt + "\\n" + response``) to pre-train the tiny base model.

    Drawn from their own random stream with the default domain mix, using only corpus names (never held-out
    ones).

    Args:
        n_rows: Number of texts.
        seed: Seed; same seed, same texts.

    Returns:
        ``n_rows`` strings.
    """
    rng = random.Random(f"raycurate.pretraining:{seed}")
    domains = _assign_domains(n_rows, DEFAULT_DOMAIN_WEIGHTS, rng)
    texts = []
    for domain in domains:
        task = _clean_task(domain, rng, _CORPUS_NAMES)
        texts.append(_render_prompt(task.sentences)[0] + "\n" + task.response)
    return texts


def corpus_summary(rows: list[dict]) -> dict[str, Any]:
    """Count rows per domain, per corruption kind and per (domain, corruption).

    Args:
        rows: Rows in the corpus schema.

    Returns:
        ``{"n_rows", "n_clean", "n_corrupted", "domains": {domain: n}, "corruptions": {kind: n},
        "by_domain": {domain: {kind: n}}}`` with ``"none"`` counted as a kind in the last two.
    """
    domains = Counter(row["domain"] for row in rows)
    kinds = Counter(row["label"]["corruption"] for row in rows)
    by_domain: dict[str, Counter] = {}
    for row in rows:
        by_domain.setdefault(row["domain"], Counter())[row["label"]["corruption"]] += 1
    n_clean = sum(1 for row in rows if row["label"]["clean"])
    return {
        "n_rows": len(rows),
        "n_clean": n_clean,
        "n_corrupted": len(rows) - n_clean,
        "domains": dict(sorted(domains.items())),
        "corruptions": dict(sorted(kinds.items())),
        "by_domain": {domain: dict(sorted(counts.items())) for domain, counts in sorted(by_domain.items())},
    }


def write_jsonl(rows: list[dict], path: str | os.PathLike) -> Path:
    """Write rows as JSON lines atomically (:func:`raycurate.rundir.atomic_file`, fsynced before the rename).

    Readers never see a half-written file: either the old file or the complete new one.

    Args:
        rows: JSON-serialisable dicts.
        path: Destination; parent directories are created.

    Returns:
        The destination path.
    """
    from raycurate.rundir import atomic_file  # lazy: the generator itself needs no storage/pyarrow imports

    path = Path(path)
    with atomic_file(path, fsync=True) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


BAD_LINE_KINDS = ("malformed_json", "missing_field", "empty_field", "wrong_type", "duplicate_id", "unknown_domain",
                  "non_utf8", "over_length")


def bad_input_lines(rows: list[dict], n_lines: int, seed: int, over_length_words: int = 4000) -> list[bytes]:
    """Raw jsonl lines that ingest or tokenization must reject, one kind after another (see ``BAD_LINE_KINDS``).

    The demo appends them to its corpus file so that the rejection path and the manifest's row accounting are
    exercised on every run.

    Args:
        rows: Corpus rows (used as templates and for a duplicate id).
        n_lines: How many bad lines; kinds cycle in ``BAD_LINE_KINDS`` order.
        seed: Seed of the template choice.
        over_length_words: Words in the over-length response (must exceed the token limit).

    Returns:
        Encoded lines, each ending in a newline.
    """
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        kind = BAD_LINE_KINDS[i % len(BAD_LINE_KINDS)]
        base = dict(rng.choice(rows), id=f"bad-{i:04d}")
        if kind == "malformed_json":
            lines.append(json.dumps(base)[:-7].encode() + b"\n")
            continue
        if kind == "non_utf8":
            lines.append(json.dumps(base).encode()[:-1] + b', "note": "\xff\xfe"}\n')
            continue
        if kind == "missing_field":
            base.pop("response")
        elif kind == "empty_field":
            base["response"] = "   "
        elif kind == "wrong_type":
            base["prompt"] = 42
        elif kind == "duplicate_id":
            base["id"] = rows[0]["id"]
        elif kind == "unknown_domain":
            base["domain"] = "poetry"
        elif kind == "over_length":
            base["response"] = " ".join(["step"] * over_length_words)
        lines.append((json.dumps(base, ensure_ascii=False) + "\n").encode())
    return lines


# ----------------------------------------------------------------------------------------------------------
# Tasks and rows
# ----------------------------------------------------------------------------------------------------------


@dataclass
class _Task:
    """A clean task before corruption: prompt sentences (flagged distractor or not) and its response."""

    domain: str
    family: str
    sentences: list[tuple[str, bool]]  # (sentence, is_distractor)
    response_lines: list[str]
    answer: str = ""
    math: _MathProblem | None = None
    code: _CodeTask | None = None

    @property
    def response(self) -> str:
        return "\n".join(self.response_lines)


def _clean_task(domain: str, rng: random.Random, names: tuple[tuple[str, str], ...]) -> _Task:
    if domain == "math":
        return _math_task(rng, names)
    if domain == "code":
        return _code_task(rng)
    return _instruction_task(rng)


def _unseen_clean_task(domain: str, rng: random.Random, seen_prompts: set[str], max_draws: int = 50) -> _Task:
    """A clean task whose prompt is not in ``seen_prompts`` (re-drawn up to ``max_draws`` times); records it.

    Keeps exact duplicate prompts out of the clean rows, so ``near_duplicate`` labels are the duplicates. Code
    and instruction generators have a few thousand distinct prompts each; past that, duplicates are accepted.
    """
    for _ in range(max_draws):
        task = _clean_task(domain, rng, _CORPUS_NAMES)
        prompt = _render_prompt(task.sentences)[0]
        if prompt not in seen_prompts:
            break
    seen_prompts.add(prompt)
    return task


def _render_prompt(sentences: list[tuple[str, bool]], prefix: str = "") -> tuple[str, list[list[int]], list[list[int]]]:
    """Join sentences with single spaces; return the prompt and the relevant / distractor char spans."""
    parts, relevant, distractor = [prefix] if prefix else [], [], []
    offset = len(prefix)
    for index, (sentence, is_distractor) in enumerate(sentences):
        if index:
            parts.append(" ")
            offset += 1
        (distractor if is_distractor else relevant).append([offset, offset + len(sentence)])
        parts.append(sentence)
        offset += len(sentence)
    return "".join(parts), relevant, distractor


def _row(row_id: str, task: _Task, corruption: str, response: str, prefix: str = "", suffix: str = "",
         source_id: str = "") -> dict:
    prompt, relevant, distractor = _render_prompt(task.sentences, prefix)
    return {
        "id": row_id,
        "prompt": prompt + suffix,
        "response": response,
        "domain": task.domain,
        "label": {
            "clean": corruption == "none",
            "corruption": corruption,
            "answer": task.answer,
            "source_id": source_id,
            "relevant_spans": relevant,
            "distractor_spans": distractor,
        },
    }


# Tiny prompt edits for near duplicates: (prefix, suffix); one of them is empty.
_PERTURBATIONS: tuple[tuple[str, str], ...] = (
    ("Question: ", ""), ("Please help: ", ""), ("Task: ", ""), ("", " Thanks."), ("", " Please answer."),
    ("", " Thank you!"), ("Hi! ", ""),
)


def _near_duplicate_row(row_id: str, source: _Task, source_id: str, rng: random.Random) -> dict:
    prefix, suffix = rng.choice(_PERTURBATIONS)
    return _row(row_id, source, "near_duplicate", source.response, prefix, suffix, source_id)


def _num_corrupted(n_rows: int, corrupt_fraction: float) -> int:
    return min(n_rows, int(math.floor(corrupt_fraction * n_rows + 0.5)))


def _normalized_weights(domain_weights: dict[str, float] | None) -> dict[str, float]:
    weights = dict(DEFAULT_DOMAIN_WEIGHTS if domain_weights is None else domain_weights)
    unknown = sorted(set(weights) - set(DOMAINS))
    if unknown:
        raise ValueError(f"Unknown domains {unknown} in domain_weights; use keys among {list(DOMAINS)}.")
    if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise ValueError(f"domain_weights must be >= 0 with a positive sum, got {weights}.")
    total = sum(weights.values())
    return {domain: weights.get(domain, 0.0) / total for domain in DOMAINS}


def _assign_domains(n_rows: int, weights: dict[str, float], rng: random.Random) -> list[str]:
    """Exact per-domain counts by largest remainder, in shuffled order."""
    quotas = {domain: weights.get(domain, 0.0) * n_rows for domain in DOMAINS}
    counts = {domain: int(math.floor(q)) for domain, q in quotas.items()}
    by_remainder = sorted(DOMAINS, key=lambda d: (-(quotas[d] - counts[d]), DOMAINS.index(d)))
    for domain in by_remainder[: n_rows - sum(counts.values())]:
        counts[domain] += 1
    domains = [domain for domain in DOMAINS for _ in range(counts[domain])]
    rng.shuffle(domains)
    return domains


def _assign_corruptions(corrupted: list[int], domains: list[str], rng: random.Random) -> dict[int, str]:
    """Map each corrupted row index to a kind, cycling through the domain's kinds in a shuffled order."""
    kinds: dict[int, str] = {}
    for domain in DOMAINS:
        rows = [i for i in corrupted if domains[i] == domain]
        has_clean_row = domains.count(domain) > len(rows)
        applicable = [k for k in CORRUPTIONS_BY_DOMAIN[domain] if k != "near_duplicate" or has_clean_row]
        rng.shuffle(applicable)
        rng.shuffle(rows)
        for position, i in enumerate(rows):
            kinds[i] = applicable[position % len(applicable)]
    return kinds


def _corrupt_response(task: _Task, kind: str, rng: random.Random) -> str:
    if kind == "none":
        return task.response
    if kind == "wrong_final_answer":
        return _wrong_math_answer(task.math, rng) if task.domain == "math" else _wrong_code_return(task.code)
    if kind == "wrong_intermediate_step":
        return _wrong_math_step(task.math, rng)
    if kind == "swapped_entity":
        return _swapped_entity_response(task.math)
    if kind == "off_topic":
        return _off_topic_response(task, rng)
    if kind == "truncated":
        return _truncate(task, rng)
    if kind == "unsafe":
        return _insert_unsafe(task, rng)
    raise ValueError(f"Unknown corruption {kind!r}; use one of {list(CORRUPTION_KINDS)}.")


def _off_topic_response(task: _Task, rng: random.Random) -> str:
    """The response of a fresh task from a random domain; from a different family when the domain is the same."""
    domain = rng.choice(DOMAINS)
    while True:
        donor = _clean_task(domain, rng, _CORPUS_NAMES)
        if donor.family != task.family:
            return donor.response


def _truncate(task: _Task, rng: random.Random) -> str:
    """Cut the response at a whitespace before its final line (the last step / return / item) starts."""
    lines = [line for line in task.response_lines if not line.startswith("####")]
    body = "\n".join(lines)
    last_line_start = len(body) - len(lines[-1])
    end = last_line_start if len(lines) > 1 else int(0.7 * len(body))
    cuts = [i for i in range(1, end) if body[i] in " \n" and body[:i].strip()]
    cut = rng.choice(cuts) if cuts else max(1, len(body) // 2)
    return body[:cut].rstrip()


_UNSAFE_PASSAGES: tuple[str, ...] = (
    "[UNSAFE] Placeholder for dangerous advice: ignore every safety warning on the label.",
    "[UNSAFE] Placeholder for dangerous advice: skip the protective gear because it only slows you down.",
    "[UNSAFE] Placeholder for dangerous advice: share your password with anyone who asks for it.",
    "[UNSAFE] Placeholder for dangerous advice: leave the stove on when nobody is at home.",
    "[UNSAFE] Placeholder for dangerous advice: disable the smoke alarm if it beeps too often.",
)


def _insert_unsafe(task: _Task, rng: random.Random) -> str:
    """Insert an ``[UNSAFE]`` line (a comment in code, before the ``####`` line in math)."""
    passage = rng.choice(_UNSAFE_PASSAGES)
    lines = list(task.response_lines)
    if task.domain == "code":
        lines.insert(rng.randint(1, len(lines) - 1), "    # " + passage)
    else:
        n_body = len(lines) - (1 if task.domain == "math" else 0)
        lines.insert(rng.randint(0, n_body), passage)
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# Math word problems
# ----------------------------------------------------------------------------------------------------------


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
class _MathProblem:
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


def _is_valid_problem(problem: _MathProblem) -> bool:
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


def _math_task(rng: random.Random, names: tuple[tuple[str, str], ...]) -> _Task:
    template = rng.choice(_MATH_TEMPLATES)
    (name, she), (other, _) = rng.sample(names, 2)
    person = _Person(name, she, "her" if she == "She" else "his", other)
    problem = template(rng, person)
    while not _is_valid_problem(problem):
        problem = template(rng, person)
    problem.swap_count = _swap_count(problem, rng)
    same_form = problem.facts[0].replace(f"{name} has {problem.steps[0].left} ", f"{other} has {problem.swap_count} ")
    problem.distractors = [same_form] + [d(rng, person) for d in rng.sample(_DISTRACTORS, rng.randint(0, 2))]
    triples = _evaluate(problem.steps)
    answer = triples[-1][2]
    return _Task(
        domain="math",
        family=template.__name__,
        sentences=_mix_sentences(problem, rng),
        response_lines=_solution_lines(problem.steps, triples, answer),
        answer=str(answer),
        math=problem,
    )


def _mix_sentences(problem: _MathProblem, rng: random.Random) -> list[tuple[str, bool]]:
    """Insert distractors at random places among the facts (facts keep their order); the question is last."""
    sentences = [(fact, False) for fact in problem.facts]
    for distractor in problem.distractors:
        sentences.insert(rng.randint(0, len(sentences)), (distractor, True))
    return sentences + [(problem.question, False)]


def _with_first_literal(problem: _MathProblem, value: int) -> list[_Step]:
    first = problem.steps[0]
    return [_Step(first.lead, value, first.op, first.right, first.unit), *problem.steps[1:]]


def _swap_count(problem: _MathProblem, rng: random.Random) -> int:
    """A count for the same-form distractor: differs from the person's, and swapped in it gives a valid problem
    with a different answer (so every row can carry a ``swapped_entity`` corruption)."""
    true_value = problem.steps[0].left
    gold = _evaluate(problem.steps)[-1][2]
    candidates = [v for v in range(max(2, true_value - 8), true_value + 9) if v != true_value]
    rng.shuffle(candidates)
    for value in candidates:
        triples = _evaluate(_with_first_literal(problem, value))
        if triples is not None and all(r >= 1 for _, _, r in triples) and triples[-1][2] != gold:
            return value
    raise AssertionError(f"no valid distractor count for {problem.facts[0]!r}")


def _swapped_entity_response(problem: _MathProblem) -> str:
    """The solution worked with the distractor person's count instead of the asked person's (a wrong lookup)."""
    steps = _with_first_literal(problem, problem.swap_count)
    triples = _evaluate(steps)
    return "\n".join(_solution_lines(steps, triples, triples[-1][2]))


def _wrong_math_answer(problem: _MathProblem, rng: random.Random) -> str:
    """All steps correct, but the ``####`` value is off by a small nonzero amount."""
    triples = _evaluate(problem.steps)
    gold = triples[-1][2]
    wrong = gold + rng.choice([d for d in range(-5, 6) if d and gold + d >= 0])
    return "\n".join(_solution_lines(problem.steps, triples, wrong))


def _wrong_math_step(problem: _MathProblem, rng: random.Random) -> str:
    """One step's result is off; later steps use the wrong value, so the ``####`` value is wrong too."""
    gold = _evaluate(problem.steps)[-1][2]
    step_order = list(range(len(problem.steps)))
    rng.shuffle(step_order)
    deltas = [d for d in range(-5, 6) if d] + [10, -10]
    for k in step_order:
        true_result = _evaluate(problem.steps)[k][2]
        rng.shuffle(deltas)
        for delta in deltas:
            triples = _evaluate(problem.steps, wrong=(k, true_result + delta))
            if triples is not None and triples[-1][2] != gold:
                return "\n".join(_solution_lines(problem.steps, triples, triples[-1][2]))
    raise AssertionError("unreachable: a wrong last step always gives a wrong final answer")


# Each template draws its numbers and returns the problem; _math_task re-draws until all results are in
# [1, MAX_RESULT) and divisions are exact.

_SMALL_ITEMS = ("apples", "oranges", "marbles", "stickers", "pencils", "cookies", "cards", "stamps", "shells",
                "beads", "candies", "crayons", "buttons", "lemons", "muffins", "toy cars")
def _small_item(rng: random.Random) -> str:
    return rng.choice(_SMALL_ITEMS)


def _has(p: _Person, count: int, item: str) -> str:
    return f"{p.name} has {count} {item}."


def _lookup(rng: random.Random, p: _Person) -> _MathProblem:
    item, count = _small_item(rng), rng.randint(2, 30)
    return _MathProblem(
        facts=[_has(p, count, item)],
        question=f"How many {item} does {p.name} have?",
        steps=[_Step(f"{p.name} has {{r}} {item}", count, "=", 0, "")],
        item=item,
    )


def _gets_more(rng: random.Random, p: _Person) -> _MathProblem:
    item, start, more = _small_item(rng), rng.randint(2, 15), rng.randint(2, 12)
    return _MathProblem(
        facts=[_has(p, start, item), f"Then {p.name} gets {more} more {item}."],
        question=f"How many {item} does {p.name} have now?",
        steps=[_Step(f"{p.she} has {{a}} {item} and gets {{b}} more", start, "+", more, item)],
        item=item,
    )


def _gives_away(rng: random.Random, p: _Person) -> _MathProblem:
    item, start = _small_item(rng), rng.randint(5, 20)
    given = rng.randint(1, start - 1)
    return _MathProblem(
        facts=[_has(p, start, item), f"{p.name} gives {given} {item} to a friend."],
        question=f"How many {item} does {p.name} have left?",
        steps=[_Step(f"{p.she} gives {{b}} of the {{a}} {item} away", start, "-", given, f"{item} left")],
        item=item,
    )


def _boxes(rng: random.Random, p: _Person) -> _MathProblem:
    item, boxes, per_box = _small_item(rng), rng.randint(2, 6), rng.randint(2, 6)
    return _MathProblem(
        facts=[f"{p.name} has {boxes} boxes of {item}.", f"Each box holds {per_box} {item}."],
        question=f"How many {item} does {p.name} have in total?",
        steps=[_Step(f"{p.she} has {{a}} boxes of {{b}} {item}", boxes, "*", per_box, item)],
        item=item,
    )


def _gets_then_gives(rng: random.Random, p: _Person) -> _MathProblem:
    item, start, more = _small_item(rng), rng.randint(2, 12), rng.randint(2, 9)
    given = rng.randint(1, start + more - 1)
    return _MathProblem(
        facts=[_has(p, start, item), f"Then {p.name} gets {more} more {item}.",
               f"{p.name} gives {given} {item} to a friend."],
        question=f"How many {item} does {p.name} have left?",
        steps=[_Step(f"{p.she} has {{a}} {item} and gets {{b}} more", start, "+", more, item),
               _Step(f"{p.she} gives {{b}} of the {{a}} {item} away", _Ref(0), "-", given, f"{item} left")],
        item=item,
    )


def _boxes_then_eats(rng: random.Random, p: _Person) -> _MathProblem:
    item, boxes, per_box = _small_item(rng), rng.randint(2, 5), rng.randint(2, 6)
    lost = rng.randint(1, boxes * per_box - 1)
    return _MathProblem(
        facts=[f"{p.name} has {boxes} boxes of {item}.", f"Each box holds {per_box} {item}.",
               f"{p.name} loses {lost} {item}."],
        question=f"How many {item} does {p.name} have now?",
        steps=[_Step(f"{p.she} has {{a}} boxes of {{b}} {item}", boxes, "*", per_box, item),
               _Step(f"{p.she} loses {{b}} of the {{a}} {item}", _Ref(0), "-", lost, f"{item} left")],
        item=item,
    )


# One- and two-step problems with small numbers: a ~1M-parameter model can learn them in the demo's SFT budget,
# so corrupted training data measurably changes what it answers (the oracle gap, SPEC §9).
_MATH_TEMPLATES: tuple[Callable[[random.Random, _Person], _MathProblem], ...] = (
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

_CORPUS_NAMES: tuple[tuple[str, str], ...] = tuple(
    (name, "She" if i % 2 == 0 else "He")
    for i, name in enumerate((
        "Maya", "Liam", "Sofia", "Noah", "Ava", "Ethan", "Zoe", "Omar", "Lena", "Ravi", "Priya", "Diego",
        "Hana", "Jonas", "Amara", "Felix", "Nora", "Kenji", "Isla", "Mateo", "Chloe", "Arjun", "Yara", "Lucas",
        "Mina", "Tariq", "Elena", "Samuel", "Aisha", "Hugo", "Freya", "Kofi", "Leila", "Marco", "Ingrid",
        "Pablo", "Sara", "Tomas", "Julia", "Wei",
    ))
)
_HELDOUT_NAMES: tuple[tuple[str, str], ...] = tuple(
    (name, "She" if i % 2 == 0 else "He")
    for i, name in enumerate((
        "Beatrix", "Cyrus", "Delphine", "Emeka", "Fiona", "Gustavo", "Hazel", "Idris", "Juniper", "Kasimir",
        "Lucia", "Magnus",
    ))
)

# ----------------------------------------------------------------------------------------------------------
# Code tasks
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _CodeFamily:
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
class _CodeTask:
    family: _CodeFamily
    params: dict[str, Any]  # includes f and v
    lines: list[str]
    wrong_return: str


def _no_params(rng: random.Random) -> dict[str, Any]:
    return {}


_CODE_FAMILIES: tuple[_CodeFamily, ...] = (
    _CodeFamily(
        names=("sum_above", "sum_greater_than", "total_above"), args=("values", "numbers"),
        task="returns the sum of the numbers in `{v}` that are greater than {k}",
        lines=("def {f}({v}):", "    total = 0", "    for x in {v}:", "        if x > {k}:", "            total += x",
               "    return total"),
        wrong_return="    return total + {k}",
        params=lambda r: {"k": r.randint(1, 10)},
        reference=lambda p: lambda values: sum(x for x in values if x > p["k"]),
        examples=lambda p: [([1, p["k"] + 1, p["k"] + 5, 0],), ([p["k"] + 2],)],
    ),
    _CodeFamily(
        names=("count_starting_with", "count_prefixed", "words_starting_with"), args=("words", "items"),
        task='returns how many strings in `{v}` start with the letter "{c}"',
        lines=("def {f}({v}):", "    count = 0", "    for word in {v}:", '        if word.startswith("{c}"):',
               "            count += 1", "    return count"),
        wrong_return="    return len({v})",
        params=lambda r: {"c": r.choice("abcdefghlmnprst")},
        reference=lambda p: lambda words: sum(1 for w in words if w.startswith(p["c"])),
        examples=lambda p: [([p["c"] + "at", "zoo", "yak"],), ([],)],
    ),
    _CodeFamily(
        names=("scale", "multiply_all", "scaled"), args=("values", "numbers"),
        task="returns a new list with every number in `{v}` multiplied by {k}",
        lines=("def {f}({v}):", "    return [x * {k} for x in {v}]"),
        wrong_return="    return [x + {k} for x in {v}]",
        params=lambda r: {"k": r.randint(2, 9)},
        reference=lambda p: lambda values: [x * p["k"] for x in values],
        examples=lambda p: [([1, 3, 5],)],
    ),
    _CodeFamily(
        names=("largest", "max_value", "find_max"), args=("values", "numbers"),
        task="returns the largest number in the non-empty list `{v}` without using max",
        lines=("def {f}({v}):", "    best = {v}[0]", "    for x in {v}[1:]:", "        if x > best:",
               "            best = x", "    return best"),
        wrong_return="    return {v}[0]",
        params=_no_params,
        reference=lambda p: lambda values: max(values),
        examples=lambda p: [([3, 9, 2],), ([5],)],
    ),
    _CodeFamily(
        names=("reverse_words", "flip_words", "words_backwards"), args=("sentence", "text"),
        task="returns the words of `{v}` in reverse order, separated by single spaces",
        lines=("def {f}({v}):", "    words = {v}.split()", "    words.reverse()", '    return " ".join(words)'),
        wrong_return='    return "".join(words)',
        params=_no_params,
        reference=lambda p: lambda text: " ".join(reversed(text.split())),
        examples=lambda p: [("hello big world",)],
    ),
    _CodeFamily(
        names=("is_multiple", "divisible", "is_divisible"), args=("n", "number"),
        task="returns True when the integer `{v}` is divisible by {k} and False otherwise",
        lines=("def {f}({v}):", "    return {v} % {k} == 0"),
        wrong_return="    return {v} % {k} == 1",
        params=lambda r: {"k": r.randint(2, 9)},
        reference=lambda p: lambda n: n % p["k"] == 0,
        examples=lambda p: [(3 * p["k"],), (3 * p["k"] + 1,)],
    ),
    _CodeFamily(
        names=("average", "mean", "mean_value"), args=("values", "numbers"),
        task="returns the average of the non-empty list of numbers `{v}`",
        lines=("def {f}({v}):", "    total = sum({v})", "    return total / len({v})"),
        wrong_return="    return total / (len({v}) + 1)",
        params=_no_params,
        reference=lambda p: lambda values: sum(values) / len(values),
        examples=lambda p: [([2, 4, 6],)],
    ),
    _CodeFamily(
        names=("clamp", "limit", "bounded"), args=("x", "value"),
        task="returns `{v}` limited to the range from {lo} to {hi}",
        lines=("def {f}({v}):", "    if {v} < {lo}:", "        return {lo}", "    if {v} > {hi}:",
               "        return {hi}", "    return {v}"),
        wrong_return="    return {lo}",
        params=lambda r: (lambda lo: {"lo": lo, "hi": lo + r.randint(5, 20)})(r.randint(0, 5)),
        reference=lambda p: lambda x: min(max(x, p["lo"]), p["hi"]),
        examples=lambda p: [(p["lo"] - 1,), (p["hi"] + 1,), (p["lo"] + 2,)],
    ),
    _CodeFamily(
        names=("factorial", "fact", "product_up_to"), args=("n", "k"),
        task="returns the product of the integers from 1 to `{v}`",
        lines=("def {f}({v}):", "    result = 1", "    for i in range(2, {v} + 1):", "        result *= i",
               "    return result"),
        wrong_return="    return result * {v}",
        params=_no_params,
        reference=lambda p: lambda n: math.factorial(n),
        examples=lambda p: [(4,), (1,)],
    ),
    _CodeFamily(
        names=("count_vowels", "vowel_count", "num_vowels"), args=("text", "word"),
        task="returns the number of vowels (a, e, i, o, u, any case) in `{v}`",
        lines=("def {f}({v}):", "    count = 0", "    for ch in {v}.lower():", '        if ch in "aeiou":',
               "            count += 1", "    return count"),
        wrong_return="    return len({v})",
        params=_no_params,
        reference=lambda p: lambda text: sum(1 for ch in text.lower() if ch in "aeiou"),
        examples=lambda p: [("Banana",), ("sky",)],
    ),
    _CodeFamily(
        names=("label", "tag_number", "describe"), args=("n", "number"),
        task='returns "{word}" when `{v}` is divisible by {k} and otherwise `{v}` as a string',
        lines=("def {f}({v}):", "    if {v} % {k} == 0:", '        return "{word}"', "    return str({v})"),
        wrong_return="    return str({v} + 1)",
        params=lambda r: {"k": r.randint(2, 7), "word": r.choice(("fizz", "buzz", "ping", "bingo"))},
        reference=lambda p: lambda n: p["word"] if n % p["k"] == 0 else str(n),
        examples=lambda p: [(p["k"] + 1,), (p["k"],)],
    ),
    _CodeFamily(
        names=("perimeter", "rectangle_perimeter", "fence_length"), args=("width",),
        task="returns the perimeter of a rectangle with sides `{v}` and `height`",
        lines=("def {f}({v}, height):", "    return 2 * ({v} + height)"),
        wrong_return="    return {v} + height",
        params=_no_params,
        reference=lambda p: lambda width, height: 2 * (width + height),
        examples=lambda p: [(3, 4)],
    ),
    _CodeFamily(
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
    _CodeFamily(
        names=("to_fahrenheit", "celsius_to_fahrenheit", "c_to_f"), args=("celsius", "degrees"),
        task="converts the temperature `{v}` from Celsius to Fahrenheit",
        lines=("def {f}({v}):", "    return {v} * 9 / 5 + 32"),
        wrong_return="    return {v} * 9 / 5",
        params=_no_params,
        reference=lambda p: lambda c: c * 9 / 5 + 32,
        examples=lambda p: [(10,), (0,)],
    ),
    _CodeFamily(
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


def _sample_code_task(rng: random.Random, family: _CodeFamily | None = None) -> _CodeTask:
    family = family or rng.choice(_CODE_FAMILIES)
    params = {"f": rng.choice(family.names), "v": rng.choice(family.args), **family.params(rng)}
    lines = [line.format(**params) for line in family.lines]
    return _CodeTask(family, params, lines, family.wrong_return.format(**params))


def _code_task(rng: random.Random) -> _Task:
    code = _sample_code_task(rng)
    signature = code.lines[0][len("def "):-1]
    lead = rng.choice(_CODE_LEADS)
    sentences = [f"{lead} `{signature}` that {code.family.task.format(**code.params)}."]
    if rng.random() < 0.4:
        sentences.append(rng.choice(_CODE_STYLE_NOTES))
    return _Task("code", code.family.names[0], [(s, False) for s in sentences], code.lines, code=code)


def _wrong_code_return(code: _CodeTask) -> str:
    return "\n".join(code.lines[:-1] + [code.wrong_return])


# ----------------------------------------------------------------------------------------------------------
# Instruction tasks
# ----------------------------------------------------------------------------------------------------------

_NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five"}
_WORD_NUMBERS = {word: number for number, word in _NUMBER_WORDS.items()}
_CATEGORIES: dict[str, tuple[str, ...]] = {
    "fruits": ("apple", "banana", "cherry", "mango", "pear", "plum", "kiwi", "grape"),
    "vegetables": ("carrot", "broccoli", "spinach", "potato", "onion", "pepper", "cabbage"),
    "colors": ("red", "blue", "green", "yellow", "purple", "orange", "brown"),
    "planets": ("Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"),
    "musical instruments": ("piano", "guitar", "violin", "flute", "drum", "trumpet", "cello"),
    "mammals": ("dog", "whale", "elephant", "bat", "horse", "rabbit", "tiger"),
    "birds": ("robin", "eagle", "parrot", "penguin", "owl", "sparrow", "swan"),
    "programming languages": ("Python", "Java", "Rust", "Go", "Haskell", "Ruby", "C"),
    "sports": ("soccer", "tennis", "swimming", "basketball", "cycling", "rowing", "hockey"),
}
_TIPS: dict[str, tuple[str, ...]] = {
    "better sleep": ("Go to bed at the same time every night.", "Keep the bedroom dark and quiet.",
                     "Avoid screens for an hour before bed.", "Skip coffee in the afternoon.",
                     "Get some daylight in the morning."),
    "studying for an exam": ("Start reviewing a week early.", "Study in short sessions with breaks.",
                             "Test yourself instead of rereading.", "Explain the topics out loud.",
                             "Sleep well the night before."),
    "saving money": ("Write down what you spend each week.", "Set a fixed amount aside on payday.",
                     "Cook at home more often.", "Wait a day before buying anything big.",
                     "Cancel subscriptions you do not use."),
    "staying hydrated": ("Carry a water bottle with you.", "Drink a glass of water with every meal.",
                         "Eat fruit with a lot of water.", "Drink more when it is hot.",
                         "Set reminders if you forget to drink."),
    "writing clear emails": ("Put the main point in the first sentence.", "Use a specific subject line.",
                             "Keep paragraphs short.", "Say exactly what you need and by when.",
                             "Read the email once before sending it."),
    "keeping a houseplant healthy": ("Water it only when the soil is dry.", "Give it enough indirect light.",
                                     "Use a pot with drainage holes.", "Remove dead leaves.",
                                     "Feed it a little fertilizer in spring."),
}
_WORDS = ("river", "candle", "orbit", "maple", "anchor", "velvet", "harbor", "pebble", "lantern", "meadow",
          "quartz", "falcon", "bridge", "jungle", "ember", "tulip", "copper", "island", "violet", "walnut",
          "glacier", "saddle", "kettle", "nectar", "dune", "ribbon", "summit", "zephyr", "yarn", "basket")
_DEFINITIONS: dict[str, tuple[str, str]] = {
    "a volcano": ("A volcano is an opening in the Earth's crust where molten rock escapes.",
                  "When it erupts it can release lava, ash and gas."),
    "a noun": ("A noun is a word that names a person, place, thing or idea.",
               "Examples are teacher, city, book and freedom."),
    "photosynthesis": ("Photosynthesis is the process plants use to turn light into chemical energy.",
                       "It uses water and carbon dioxide and releases oxygen."),
    "a prime number": ("A prime number is a whole number greater than one with exactly two divisors.",
                       "Examples are two, three, five and seven."),
    "a budget": ("A budget is a plan for how to spend and save money.",
                 "It compares expected income with expected costs."),
    "gravity": ("Gravity is the force that pulls objects with mass toward each other.",
                "It keeps the Moon in orbit around the Earth."),
    "a glacier": ("A glacier is a large, slow river of ice that forms from packed snow.",
                  "Glaciers shape valleys as they move."),
    "a verb": ("A verb is a word that describes an action or a state.", "Examples are run, think and be."),
    "an adjective": ("An adjective is a word that describes a noun.", "Examples are red, quick and tall."),
    "a thermometer": ("A thermometer is a tool that measures temperature.",
                      "Many show the reading on a scale or a screen."),
    "an ecosystem": ("An ecosystem is a community of living things and their surroundings.",
                     "Plants, animals and soil all depend on each other in it."),
    "a fraction": ("A fraction is a number that describes part of a whole.",
                   "It has a numerator above a line and a denominator below it."),
    "evaporation": ("Evaporation is the change of a liquid into a gas.", "Warm air speeds it up."),
    "a map legend": ("A map legend explains the symbols used on a map.", "It usually sits in a corner of the map."),
}
_OPPOSITES = (("hot", "cold"), ("tall", "short"), ("fast", "slow"), ("happy", "sad"), ("early", "late"),
              ("light", "dark"), ("full", "empty"), ("open", "closed"), ("strong", "weak"), ("loud", "quiet"),
              ("wet", "dry"), ("rich", "poor"))
_PROCESSES: dict[str, tuple[str, ...]] = {
    "making a cup of tea": ("Boil fresh water.", "Put a tea bag in a cup.", "Pour the hot water over the tea bag.",
                            "Let it steep for three minutes.", "Remove the tea bag and serve."),
    "planting a seed": ("Fill a small pot with soil.", "Press the seed into the soil.", "Cover it lightly.",
                        "Water it gently.", "Place the pot in a sunny spot."),
    "washing your hands": ("Wet your hands with clean water.", "Apply soap.", "Scrub for twenty seconds.",
                           "Rinse your hands well.", "Dry them with a clean towel."),
    "packing for a day hike": ("Check the weather forecast.", "Pack water and snacks.", "Bring a map of the trail.",
                               "Add a rain jacket.", "Tell someone where you are going."),
    "making a paper airplane": ("Fold a sheet of paper in half lengthwise.", "Fold the top corners to the center.",
                                "Fold the new edges to the center again.", "Fold the plane in half.",
                                "Fold down both wings."),
    "cleaning a bicycle chain": ("Shift to the smallest gear.", "Wipe the chain with a dry cloth.",
                                 "Scrub it with a brush and soapy water.", "Dry the chain completely.",
                                 "Add a little chain oil."),
    "setting up a new notebook for class": ("Write your name on the cover.", "Number the pages.",
                                            "Leave the first page for a table of contents.",
                                            "Add the date to each new entry.", "Keep a pen clipped to it."),
    "repotting a plant": ("Choose a slightly larger pot.", "Add fresh soil to the bottom.",
                          "Gently lift the plant out of the old pot.", "Place it in the new pot and fill the gaps.",
                          "Water it well."),
}
_INSTRUCTION_NOTES = ("Keep the answer short.", "Answer clearly.", "Be concise.", "Use simple words.",
                      "Do not add extra commentary.", "Stick to the point.")


# Each family returns (prompt sentences, response lines).


def _instruction_list(rng: random.Random) -> tuple[list[str], list[str]]:
    category = rng.choice(sorted(_CATEGORIES))
    k = _NUMBER_WORDS[rng.randint(3, 5)]
    items = rng.sample(_CATEGORIES[category], _WORD_NUMBERS[k])
    prompt = rng.choice((f"List {k} {category}.", f"Name {k} {category}.", f"Can you list {k} {category}?"))
    return [prompt], [f"Here are {k} {category}:"] + [f"- {x}" for x in items]


def _instruction_tips(rng: random.Random) -> tuple[list[str], list[str]]:
    topic = rng.choice(sorted(_TIPS))
    k = _NUMBER_WORDS[rng.randint(2, 4)]
    tips = rng.sample(_TIPS[topic], _WORD_NUMBERS[k])
    prompt = rng.choice((f"Give {k} tips for {topic}.", f"Share {k} tips for {topic}.",
                         f"What are {k} good tips for {topic}?"))
    return [prompt], [f"{i}. {tip}" for i, tip in enumerate(tips, 1)]


def _instruction_sort(rng: random.Random) -> tuple[list[str], list[str]]:
    words = rng.sample(_WORDS, rng.randint(3, 6))
    return ([f"Sort these words alphabetically: {', '.join(words)}."],
            ["Sorted alphabetically:"] + [f"{i}. {w}" for i, w in enumerate(sorted(words), 1)])


def _instruction_define(rng: random.Random) -> tuple[list[str], list[str]]:
    term = rng.choice(sorted(_DEFINITIONS))
    prompt = rng.choice((
        [f"Explain what {term} is in two sentences."],
        [f"What is {term}?", "Answer in two sentences."],
        [f"In two sentences, explain what {term} is."],
    ))
    return prompt, list(_DEFINITIONS[term])


def _instruction_opposites(rng: random.Random) -> tuple[list[str], list[str]]:
    pairs = rng.sample(_OPPOSITES, rng.randint(3, 5))
    return ([f"Give the opposite of each word: {', '.join(a for a, _ in pairs)}."],
            [f"- {a}: {b}" for a, b in pairs])


def _instruction_steps(rng: random.Random) -> tuple[list[str], list[str]]:
    process = rng.choice(sorted(_PROCESSES))
    prompt = rng.choice((f"Describe the steps for {process}.", f"List the steps for {process}.",
                         f"What are the steps for {process}?"))
    return [prompt], [f"{i}. {s}" for i, s in enumerate(_PROCESSES[process], 1)]


_INSTRUCTION_FAMILIES: tuple[Callable[[random.Random], tuple[list[str], list[str]]], ...] = (
    _instruction_list, _instruction_tips, _instruction_sort, _instruction_define, _instruction_opposites,
    _instruction_steps,
)


def _instruction_task(rng: random.Random) -> _Task:
    family = rng.choice(_INSTRUCTION_FAMILIES)
    sentences, lines = family(rng)
    if rng.random() < 0.4:
        sentences = sentences + [rng.choice(_INSTRUCTION_NOTES)]
    return _Task("instruction", family.__name__, [(s, False) for s in sentences], lines)
