"""Clean math questions outside the corpus: the held-out set that results report, and the validation questions
that sweeps choose settings on (their own random stream, disjoint from the held-out set)."""

from __future__ import annotations

import random

from raycurate.data.corpus.domains import clean_task
from raycurate.data.corpus.math_tasks import HELDOUT_NAMES
from raycurate.data.corpus.rows import Task, make_row, render_prompt


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
    return [make_row(f"heldout-{i + 1:06d}", task, "none", task.response)
            for i, task in enumerate(heldout_tasks(n_rows, seed))]


def heldout_tasks(n_rows: int, seed: int) -> list[Task]:
    """The tasks behind :func:`generate_heldout`'s rows, in order (for analyses that need the math problem)."""
    rng = random.Random(f"raycurate.heldout:{seed}")
    return [clean_task("math", rng, HELDOUT_NAMES) for _ in range(n_rows)]


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
    return [make_row(f"validation-{i + 1:06d}", task, "none", task.response)
            for i, task in enumerate(validation_tasks(n_rows, seed, exclude_prompts))]


def validation_tasks(n_rows: int, seed: int, exclude_prompts: set[str] | frozenset[str] = frozenset()) -> list[Task]:
    """The tasks behind :func:`generate_validation_questions`'s rows, in order."""
    rng = random.Random(f"raycurate.validation:{seed}")
    tasks: list[Task] = []
    seen = set(exclude_prompts)
    while len(tasks) < n_rows:
        task = clean_task("math", rng, HELDOUT_NAMES)
        prompt = render_prompt(task.sentences)[0]
        if prompt not in seen:
            seen.add(prompt)
            tasks.append(task)
    return tasks
