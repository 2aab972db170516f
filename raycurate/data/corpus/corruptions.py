"""The seven corruption kinds: which apply to which domain, how corrupted rows get their kind, and the corrupted
responses (the math- and code-specific wrong answers live with their domains, in :mod:`.math_tasks` and
:mod:`.code_tasks`)."""

from __future__ import annotations

import math
import random

from raycurate.data.corpus.code_tasks import CodeTask, wrong_code_return
from raycurate.data.corpus.domains import DOMAINS, clean_task, largest_remainder_counts
from raycurate.data.corpus.math_tasks import (
    CORPUS_NAMES,
    MathProblem,
    swapped_entity_response,
    wrong_math_answer,
    wrong_math_step,
)
from raycurate.data.corpus.rows import Task, make_row

CORRUPTIONS_BY_DOMAIN: dict[str, tuple[str, ...]] = {
    "math": ("wrong_final_answer", "wrong_intermediate_step", "swapped_entity", "off_topic", "truncated", "unsafe",
             "near_duplicate"),
    "code": ("wrong_final_answer", "off_topic", "truncated", "unsafe", "near_duplicate"),
    "instruction": ("off_topic", "truncated", "unsafe", "near_duplicate"),
}
CORRUPTION_KINDS: tuple[str, ...] = CORRUPTIONS_BY_DOMAIN["math"]


# Tiny prompt edits for near duplicates: (prefix, suffix); one of them is empty.
_PERTURBATIONS: tuple[tuple[str, str], ...] = (
    ("Question: ", ""), ("Please help: ", ""), ("Task: ", ""), ("", " Thanks."), ("", " Please answer."),
    ("", " Thank you!"), ("Hi! ", ""),
)


def near_duplicate_row(row_id: str, source: Task, source_id: str, rng: random.Random) -> dict:
    """A ``near_duplicate`` row: ``source``'s prompt with a tiny prefix or suffix, and its response."""
    prefix, suffix = rng.choice(_PERTURBATIONS)
    return make_row(row_id, source, "near_duplicate", source.response, prefix, suffix, source_id)


def num_corrupted(n_rows: int, corrupt_fraction: float) -> int:
    """Rows to corrupt: ``corrupt_fraction * n_rows`` rounded half up, at most ``n_rows``."""
    return min(n_rows, int(math.floor(corrupt_fraction * n_rows + 0.5)))


def assign_corruptions(corrupted: list[int], domains: list[str], rng: random.Random,
                        mix: dict[str, float] | None = None) -> dict[int, str]:
    """Map each corrupted row index to a kind.

    Without ``mix`` (None or empty) the kinds are balanced: each domain's corrupted rows cycle through its kinds
    in a shuffled order. With ``mix`` (kind -> relative weight) each domain's corrupted rows are apportioned
    exactly, by largest remainder, over the kinds that apply to it in proportion to their weights, then shuffled.

    Raises:
        ValueError: ``mix`` names an unknown kind, has a negative weight, or gives no weight to any kind that
            applies to a domain with corrupted rows.
    """
    check_corruption_mix(mix)
    kinds: dict[int, str] = {}
    for domain in DOMAINS:
        rows = [i for i in corrupted if domains[i] == domain]
        has_clean_row = domains.count(domain) > len(rows)
        applicable = [k for k in CORRUPTIONS_BY_DOMAIN[domain] if k != "near_duplicate" or has_clean_row]
        if not mix:
            rng.shuffle(applicable)
            rng.shuffle(rows)
            for position, i in enumerate(rows):
                kinds[i] = applicable[position % len(applicable)]
        elif rows:
            kinds.update(zip(rows, _mixed_kinds(len(rows), domain, applicable, mix, rng)))
    return kinds


def check_corruption_mix(mix: dict[str, float] | None, domains: tuple[str, ...] = ()) -> None:
    """Raise ValueError naming the problem if ``mix`` has an unknown kind, a negative or non-finite weight, or (when
    non-empty) no positive weight on any kind that applies to one of ``domains``."""
    if not mix:
        return
    unknown = sorted(set(mix) - set(CORRUPTION_KINDS))
    if unknown:
        raise ValueError(f"Unknown corruption kinds {unknown} in the corruption mix; use keys among "
                         f"{list(CORRUPTION_KINDS)}.")
    bad = {k: w for k, w in mix.items() if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0)}
    if bad:
        raise ValueError(f"Corruption mix weights must be finite numbers >= 0, got {bad}.")
    for domain in domains:
        if not any(mix.get(kind, 0) > 0 for kind in CORRUPTIONS_BY_DOMAIN[domain]):
            raise ValueError(f"The corruption mix gives no weight to any corruption of the {domain} domain; give one "
                             f"of {', '.join(CORRUPTIONS_BY_DOMAIN[domain])} a weight.")


def _mixed_kinds(n: int, domain: str, applicable: list[str], mix: dict[str, float], rng: random.Random,
                 ) -> list[str]:
    """``n`` kinds for ``domain``'s corrupted rows, apportioned over ``applicable`` by ``mix``, shuffled."""
    weights = {k: float(mix.get(k, 0.0)) for k in applicable}
    total = sum(weights.values())
    if total <= 0:
        raise ValueError(f"The corruption mix gives no weight to any corruption of the {domain} domain "
                         f"({', '.join(applicable)}), which has {n} corrupted rows; give one of them a weight.")
    counts = largest_remainder_counts(n, {k: w / total for k, w in weights.items()}, tuple(applicable))
    kinds = [k for k in applicable for _ in range(counts[k])]
    rng.shuffle(kinds)
    return kinds


def corrupt_response(task: Task, kind: str, rng: random.Random) -> str:
    """``task``'s response corrupted by ``kind`` (``"none"``: the clean response)."""
    if kind == "none":
        return task.response
    if kind == "wrong_final_answer":
        return wrong_math_answer(_math(task), rng) if task.domain == "math" else wrong_code_return(_code(task))
    if kind == "wrong_intermediate_step":
        return wrong_math_step(_math(task), rng)
    if kind == "swapped_entity":
        return swapped_entity_response(_math(task))
    if kind == "off_topic":
        return _off_topic_response(task, rng)
    if kind == "truncated":
        return _truncate(task, rng)
    if kind == "unsafe":
        return _insert_unsafe(task, rng)
    raise ValueError(f"Unknown corruption {kind!r}; use one of {list(CORRUPTION_KINDS)}.")


def _math(task: Task) -> MathProblem:
    if not isinstance(task.math, MathProblem):
        raise ValueError(f"a {task.domain} task has no math problem to corrupt; math corruptions apply to math rows")
    return task.math


def _code(task: Task) -> CodeTask:
    if not isinstance(task.code, CodeTask):
        raise ValueError(f"a {task.domain} task has no function to corrupt; code corruptions apply to code rows")
    return task.code


def _off_topic_response(task: Task, rng: random.Random) -> str:
    """The response of a fresh task from a random domain; from a different family when the domain is the same."""
    domain = rng.choice(DOMAINS)
    while True:
        donor = clean_task(domain, rng, CORPUS_NAMES)
        if donor.family != task.family:
            return donor.response


def _truncate(task: Task, rng: random.Random) -> str:
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


def _insert_unsafe(task: Task, rng: random.Random) -> str:
    """Insert an ``[UNSAFE]`` line (a comment in code, before the ``####`` line in math)."""
    passage = rng.choice(_UNSAFE_PASSAGES)
    lines = list(task.response_lines)
    if task.domain == "code":
        lines.insert(rng.randint(1, len(lines) - 1), "    # " + passage)
    else:
        n_body = len(lines) - (1 if task.domain == "math" else 0)
        lines.insert(rng.randint(0, n_body), passage)
    return "\n".join(lines)
