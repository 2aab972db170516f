"""Composable curation (pure): apply example-level steps in order, and cut rankings to a response-token budget.

A step either *ranks* the rows it receives (a score per row id, higher = better; ``keep_fraction`` of them stay) or
*drops* rows (a set of ids, e.g. near-duplicates).  Ties between equal scores are broken by a seeded permutation,
so a constant score is a seeded random order (the ``random`` arm of the comparison).

At a matched token budget T (the response tokens the composition trains on) each single step is cut to the
top-ranked prefix whose response tokens are closest to T (:func:`rows_until_tokens`), and BRIDGE alone gets the
response ratio that supervises T tokens over the whole pool (:func:`matched_response_ratio`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np


@dataclass(frozen=True)
class Step:
    """One example-level step: ``scores`` (id -> score, ranks and keeps a fraction, or with ``min_score`` the rows
    scoring at least that) or ``dropped`` (ids removed)."""

    name: str
    scores: Mapping[str, float] | None = None
    dropped: frozenset[str] | None = None
    min_score: float | None = None

    def __post_init__(self) -> None:
        if (self.scores is None) == (self.dropped is None):
            raise ValueError(f"step {self.name!r}: give exactly one of scores (a ranking) or dropped (a filter)")
        if self.min_score is not None and self.scores is None:
            raise ValueError(f"step {self.name!r}: min_score needs scores")


def keep_count(fraction: float, rows: int) -> int:
    """``round(fraction * rows)`` with halves up, clamped to ``[1, rows]`` (0 for no rows)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"keep_fraction={fraction} must lie in (0, 1]")
    if rows == 0:
        return 0
    return min(rows, max(1, math.floor(fraction * rows + 0.5 + 1e-9)))


def ranked_ids(ids: Sequence[str], scores: Mapping[str, float], seed: int) -> list[str]:
    """``ids`` from the highest score to the lowest; equal scores in a seeded random order.

    Raises:
        ValueError: when a row has no score (every step scores the whole pool; a gap is a bug upstream).
    """
    missing = [i for i in ids if i not in scores]
    if missing:
        raise ValueError(f"{len(missing)} of {len(ids)} rows have no score (e.g. {missing[:3]}); every step must "
                         "score the whole pool")
    ordered = sorted(ids)  # the permutation must not depend on the caller's order
    tie_break = np.random.default_rng(seed).permutation(len(ordered))  # (N,)
    values = np.array([float(scores[i]) for i in ordered], dtype=np.float64)
    if np.isnan(values).any():
        raise ValueError("scores contain NaN; rank only finite scores")
    order = np.lexsort((tie_break, -values))  # primary key last: score descending, then the permutation
    return [ordered[k] for k in order]


def apply_step(kept: Sequence[str], step: Step, keep_fraction: float, seed: int) -> list[str]:
    """The rows of ``kept`` that survive ``step`` (sorted by id): the top ``keep_fraction``, those scoring at least
    ``step.min_score``, or the undropped."""
    if step.dropped is not None:
        return sorted(i for i in kept if i not in step.dropped)
    assert step.scores is not None
    if step.min_score is not None:
        return sorted(i for i in kept if step.scores[i] >= step.min_score)
    top = ranked_ids(kept, step.scores, seed)[:keep_count(keep_fraction, len(kept))]
    return sorted(top)


def compose(pool: Sequence[str], steps: Sequence[Step], keep_fraction: float, seed: int) -> list[list[str]]:
    """Apply ``steps`` in order, each to the rows the previous one kept.

    Returns:
        One sorted id list per step: the rows kept after it (the last one is what the composition trains on).
    """
    kept, history = sorted(pool), []
    for step in steps:
        kept = apply_step(kept, step, keep_fraction, seed)
        if not kept:
            raise ValueError(f"step {step.name!r} kept no rows; raise curate.keep_fraction or check the pool")
        history.append(kept)
    return history


def rows_until_tokens(tokens: Sequence[int], budget: int) -> int:
    """How many leading rows of a ranking to train on so that their response tokens come closest to ``budget``.

    Args:
        tokens: (N,) response tokens of each row, in rank order.
        budget: Target T.

    Returns:
        ``k`` in ``[0, N]`` minimising ``|sum(tokens[:k]) - budget|`` (the smaller ``k`` on a tie), so the matched
        arm is off by at most half a row's tokens unless the whole pool holds fewer than T.
    """
    if budget < 0:
        raise ValueError(f"token budget must be >= 0, got {budget}")
    cumulative = np.concatenate([[0], np.cumsum(np.asarray(tokens, dtype=np.int64))])  # (N + 1,)
    if (np.diff(cumulative) < 0).any():
        raise ValueError("token counts must be >= 0")
    return int(np.argmin(np.abs(cumulative - budget)))  # argmin returns the first (smallest k) minimiser


def matched_response_ratio(budget: int, eligible: int, fixed: int) -> float:
    """BRIDGE's ``rho_r`` that supervises about ``budget`` response tokens over a pool.

    Every row supervises its fixed positions (EOS, end-of-turn) plus ``round(rho_r * eligible_i)`` eligible ones,
    so ``rho_r = (budget - fixed) / eligible`` summed over the pool (off by the per-row rounding only).

    Args:
        budget: Target T (response tokens trained on).
        eligible: Eligible response positions summed over the pool.
        fixed: Always-supervised response positions summed over the pool.

    Raises:
        ValueError: when no ratio in (0, 1] reaches the budget.
    """
    if eligible <= 0:
        raise ValueError("the pool has no eligible response tokens")
    ratio = (budget - fixed) / eligible
    if not 0.0 < ratio <= 1.0 + 1e-9:
        raise ValueError(f"no BRIDGE response ratio in (0, 1] supervises {budget} tokens on a pool with {eligible} "
                         f"eligible and {fixed} fixed response tokens (needs {ratio:.4f})")
    return min(ratio, 1.0)


def normalised_weights(weights: Mapping[str, float], ids: Sequence[str]) -> dict[str, float]:
    """``weights`` of ``ids`` divided by their mean over ``ids`` (mean 1: the SFT loss keeps its scale).

    Raises:
        ValueError: when an id has no weight or the weights are not positive.
    """
    values = np.array([float(weights[i]) for i in ids], dtype=np.float64)  # KeyError names a missing id
    if values.size == 0 or not (values > 0).all():
        raise ValueError("weights to normalise must be positive and non-empty")
    return {i: float(v) for i, v in zip(ids, values / values.mean())}


@dataclass(frozen=True)
class Ledger:
    """What :func:`compose` decided for each row, step by step (for telling a user why a row was dropped).

    Attributes:
        kept: The rows kept after the last step, sorted (= ``compose(...)[-1]``; the whole pool without steps).
        dropped: ``id -> name of the step that dropped it`` (each row is dropped at most once).
        ranks: ``step -> {id: rank}`` for a ranking step: the rank (1 = best) of each row it received among them.
        received: ``step -> rows it received``.
        passed: ``step -> rows it kept`` (passed on to the next step).
    """

    kept: list[str]
    dropped: dict[str, str]
    ranks: dict[str, dict[str, int]]
    received: dict[str, int]
    passed: dict[str, int]


def ledger(pool: Sequence[str], steps: Sequence[Step], keep_fraction: float, seed: int) -> Ledger:
    """:func:`compose`'s decisions row by row: the step that dropped each row and, for ranking steps, the rank of
    every row the step received (the same seeded tie-break).  Each step's survivors are :func:`apply_step`'s, as in
    :func:`compose`, so ``ledger(...).kept == compose(...)[-1]``."""
    kept = sorted(pool)
    dropped: dict[str, str] = {}
    ranks: dict[str, dict[str, int]] = {}
    received: dict[str, int] = {}
    passed: dict[str, int] = {}
    for step in steps:
        received[step.name] = len(kept)
        if step.scores is not None:
            ranks[step.name] = {i: rank for rank, i in enumerate(ranked_ids(kept, step.scores, seed), start=1)}
        survivors = apply_step(kept, step, keep_fraction, seed)
        chosen = set(survivors)
        dropped.update((i, step.name) for i in kept if i not in chosen)
        kept = survivors
        if not kept:
            raise ValueError(f"step {step.name!r} kept no rows; raise curate.keep_fraction or check the pool")
        passed[step.name] = len(kept)
    return Ledger(kept=kept, dropped=dropped, ranks=ranks, received=received, passed=passed)


def composition_scores(pool: Sequence[str], steps: Sequence[Step], history: Sequence[Sequence[str]]) -> np.ndarray:
    """(N,) one ranking score per pool row for the whole composition (for its AUROC): a row kept by more steps ranks
    above one dropped earlier; within the same count, by the last ranking step's score rank (ties keep pool order).

    Args:
        pool: N pool ids.
        steps: The example-level steps, in order.
        history: :func:`compose`'s kept ids after each step.
    """
    survived = np.zeros(len(pool))
    for kept in history:
        chosen = set(kept)
        survived += np.array([i in chosen for i in pool], dtype=np.float64)
    ranking = [s for s in steps if s.scores is not None]
    if not ranking:
        return survived
    scores = ranking[-1].scores
    assert scores is not None
    values = np.array([scores.get(i, -math.inf) for i in pool], dtype=np.float64)
    within = np.argsort(np.argsort(values, kind="stable"), kind="stable") / max(len(pool), 1)  # in [0, 1)
    return survived + within
