"""The three domains: their default mix, exact per-domain row counts, and drawing a clean task of one domain."""

from __future__ import annotations

import math
import random

from raycurate.data.corpus.code_tasks import code_task
from raycurate.data.corpus.instruction_tasks import instruction_task
from raycurate.data.corpus.math_tasks import CORPUS_NAMES, math_task
from raycurate.data.corpus.rows import Task, render_prompt

DOMAINS: tuple[str, ...] = ("math", "code", "instruction")
DEFAULT_DOMAIN_WEIGHTS: dict[str, float] = {"math": 0.6, "code": 0.2, "instruction": 0.2}


def clean_task(domain: str, rng: random.Random, names: tuple[tuple[str, str], ...]) -> Task:
    """A clean task of ``domain``; math problems draw their people from ``names``."""
    if domain == "math":
        return math_task(rng, names)
    if domain == "code":
        return code_task(rng)
    return instruction_task(rng)


def unseen_clean_task(domain: str, rng: random.Random, seen_prompts: set[str], max_draws: int = 50) -> Task:
    """A clean task whose prompt is not in ``seen_prompts`` (re-drawn up to ``max_draws`` times); records it.

    Keeps exact duplicate prompts out of the clean rows, so ``near_duplicate`` labels are the duplicates. Code
    and instruction generators have a few thousand distinct prompts each; past that, duplicates are accepted.
    """
    for _ in range(max_draws):
        task = clean_task(domain, rng, CORPUS_NAMES)
        prompt = render_prompt(task.sentences)[0]
        if prompt not in seen_prompts:
            break
    seen_prompts.add(prompt)
    return task


def normalized_weights(domain_weights: dict[str, float] | None) -> dict[str, float]:
    """``domain_weights`` (default :data:`DEFAULT_DOMAIN_WEIGHTS`) checked and scaled to sum to 1 over DOMAINS."""
    weights = dict(DEFAULT_DOMAIN_WEIGHTS if domain_weights is None else domain_weights)
    unknown = sorted(set(weights) - set(DOMAINS))
    if unknown:
        raise ValueError(f"Unknown domains {unknown} in domain_weights; use keys among {list(DOMAINS)}.")
    if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise ValueError(f"domain_weights must be >= 0 with a positive sum, got {weights}.")
    total = sum(weights.values())
    return {domain: weights.get(domain, 0.0) / total for domain in DOMAINS}


def largest_remainder_counts(n: int, shares: dict[str, float], order: tuple[str, ...]) -> dict[str, int]:
    """Split ``n`` into integer counts proportional to ``shares`` (summing to 1 over ``order``), by largest
    remainder; ties go to the key earlier in ``order``. The counts sum to ``n`` exactly."""
    quotas = {key: shares.get(key, 0.0) * n for key in order}
    counts = {key: int(math.floor(q)) for key, q in quotas.items()}
    by_remainder = sorted(order, key=lambda k: (-(quotas[k] - counts[k]), order.index(k)))
    for key in by_remainder[: n - sum(counts.values())]:
        counts[key] += 1
    return counts


def assign_domains(n_rows: int, weights: dict[str, float], rng: random.Random) -> list[str]:
    """Exact per-domain counts by largest remainder, in shuffled order."""
    counts = largest_remainder_counts(n_rows, weights, DOMAINS)
    domains = [domain for domain in DOMAINS for _ in range(counts[domain])]
    rng.shuffle(domains)
    return domains
