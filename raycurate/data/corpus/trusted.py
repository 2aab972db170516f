"""The embedded corpus's trusted set: clean rows standing in for the small hand-checked file a user brings.

Every method aims at trusted rows (docs/design.md, "The trusted set"). In the proving ground they are clean rows of
the corpus's own domains, drawn from their own random stream, and disjoint from the pool, the held-out questions
and the validation questions by prompt.
"""

from __future__ import annotations

import random

from raycurate.data.corpus.domains import assign_domains, normalized_weights, unseen_clean_task
from raycurate.data.corpus.rows import make_row


def generate_trusted(n_rows: int, seed: int, exclude_prompts: set[str] | frozenset[str] = frozenset(),
                     domain_weights: dict[str, float] | None = None) -> list[dict]:
    """Generate ``n_rows`` clean rows whose prompts are not in ``exclude_prompts``.

    Args:
        n_rows: Number of trusted rows (>= 0).
        seed: The corpus seed; the rows come from the stream ``raycurate.trusted:<seed>``, so the same seed gives
            the same rows and the pool's rows never change with ``n_rows``.
        exclude_prompts: Prompts already used (the pool's, the held-out and validation questions').
        domain_weights: Relative weight per domain, as :func:`raycurate.data.corpus.generate_corpus`.

    Returns:
        Rows in the corpus schema with ids ``trusted-s<seed>-000001`` ..., all clean.

    Raises:
        ValueError: when the generators cannot draw ``n_rows`` unseen prompts (code and instruction have a few
            thousand each).
    """
    if n_rows < 0:
        raise ValueError(f"n_rows must be >= 0, got {n_rows}.")
    rng = random.Random(f"raycurate.trusted:{seed}")
    seen = set(exclude_prompts)
    rows = []
    for i, domain in enumerate(assign_domains(n_rows, normalized_weights(domain_weights), rng)):
        before = len(seen)
        task = unseen_clean_task(domain, rng, seen)
        if len(seen) == before:
            raise ValueError(f"could not draw an unseen {domain} prompt for trusted row {i + 1} of {n_rows}; "
                             "lower data.trusted_rows")
        rows.append(make_row(f"trusted-s{seed}-{i + 1:06d}", task, "none", task.response))
    return rows
