"""The labelled benchmark corpus: exact domain and corruption counts, unique prompts, near duplicates of clean
rows, and a per-domain / per-corruption summary."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from raycurate.data.corpus.corruptions import assign_corruptions, corrupt_response, near_duplicate_row, num_corrupted
from raycurate.data.corpus.domains import DOMAINS, assign_domains, normalized_weights, unseen_clean_task
from raycurate.data.corpus.rows import make_row


def generate_corpus(
    n_rows: int,
    seed: int,
    corrupt_fraction: float = 0.3,
    domain_weights: dict[str, float] | None = None,
    corruption_mix: dict[str, float] | None = None,
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
        corruption_mix: Relative weight per corruption kind (keys among ``CORRUPTION_KINDS``); each domain's
            corrupted rows are apportioned exactly over its applicable kinds by these weights. Default (None or empty):
            balanced kinds, as above.

    Returns:
        ``n_rows`` row dicts with ids ``bench-s<seed>-000001`` ... (:func:`corpus_ids`) in the schema of
        :mod:`raycurate.data.corpus`.
    """
    if n_rows < 0:
        raise ValueError(f"n_rows must be >= 0, got {n_rows}.")
    if not 0.0 <= corrupt_fraction <= 1.0:
        raise ValueError(f"corrupt_fraction must be in [0, 1], got {corrupt_fraction}.")
    rng = random.Random(f"raycurate.corpus:{seed}")
    domains = assign_domains(n_rows, normalized_weights(domain_weights), rng)
    seen_prompts: set[str] = set()
    tasks = [unseen_clean_task(domain, rng, seen_prompts) for domain in domains]
    corrupted = sorted(rng.sample(range(n_rows), num_corrupted(n_rows, corrupt_fraction)))
    kinds = assign_corruptions(corrupted, domains, rng, corruption_mix)
    ids = corpus_ids(n_rows, seed)
    clean_by_domain: dict[str, list[int]] = {domain: [] for domain in DOMAINS}
    for i, domain in enumerate(domains):
        if i not in kinds:
            clean_by_domain[domain].append(i)
    rows = []
    for i, task in enumerate(tasks):
        kind = kinds.get(i, "none")
        if kind == "near_duplicate":
            source = rng.choice(clean_by_domain[task.domain])
            rows.append(near_duplicate_row(ids[i], tasks[source], ids[source], rng))
        else:
            rows.append(make_row(ids[i], task, kind, corrupt_response(task, kind, rng)))
    return rows


def corpus_ids(n_rows: int, seed: int) -> list[str]:
    """Row ids ``bench-s<seed>-000001`` ...: the seed is part of the id, so each corpus seed gets its own
    (id, split_seed) -> split assignment instead of every seed sharing one."""
    return [f"bench-s{seed}-{i + 1:06d}" for i in range(n_rows)]


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
