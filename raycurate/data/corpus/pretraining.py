"""Clean texts of all domains to pre-train the tiny base model (corpus names only, never held-out ones)."""

from __future__ import annotations

import random

from raycurate.data.corpus.domains import DEFAULT_DOMAIN_WEIGHTS, assign_domains, clean_task
from raycurate.data.corpus.math_tasks import CORPUS_NAMES
from raycurate.data.corpus.rows import render_prompt


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
    domains = assign_domains(n_rows, DEFAULT_DOMAIN_WEIGHTS, rng)
    texts = []
    for domain in domains:
        task = clean_task(domain, rng, CORPUS_NAMES)
        texts.append(render_prompt(task.sentences)[0] + "\n" + task.response)
    return texts
