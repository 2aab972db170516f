"""Bootstrap intervals: hand-computable cases, pairing, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from raycurate.algorithms.stats import (
    Estimate,
    bootstrap_mean_ci,
    bootstrap_precision_ci,
    gap_closed,
    paired_bootstrap_ci,
)


def test_constant_scores_give_a_degenerate_interval():
    est = bootstrap_mean_ci(np.full(50, 0.4))
    assert est == Estimate(pytest.approx(0.4), pytest.approx(0.4), pytest.approx(0.4), 50)


def test_mean_interval_contains_the_mean_and_has_binomial_width():
    x = (np.arange(400) % 2).astype(float)  # mean 0.5, sd 0.5 -> 95% half-width ~ 1.96 * 0.5 / 20 = 0.049
    est = bootstrap_mean_ci(x, seed=1)
    assert est.low < 0.5 < est.high
    assert est.high - est.low == pytest.approx(2 * 0.049, rel=0.15)


def test_paired_interval_is_tighter_than_unpaired_when_models_agree():
    rng = np.random.default_rng(0)
    base = (rng.random(500) < 0.5).astype(float)
    better = base.copy()
    better[np.flatnonzero(base == 0)[:30]] = 1.0  # +30 items out of 500 = +0.06, everything else identical
    est = paired_bootstrap_ci(better, base)
    assert est.value == pytest.approx(0.06)
    assert est.excludes_zero()  # a paired test sees 30 wins and 0 losses
    unpaired_half_width = 1.96 * np.sqrt(2 * 0.25 / 500)  # ~0.062: an unpaired comparison could not tell
    assert (est.high - est.low) / 2 < unpaired_half_width / 2


def test_identical_models_have_a_zero_difference():
    x = (np.arange(100) % 3 == 0).astype(float)
    est = paired_bootstrap_ci(x, x)
    assert (est.value, est.low, est.high) == (0.0, 0.0, 0.0) and not est.excludes_zero()


def test_same_seed_same_interval_and_mismatched_lengths_refused():
    x = np.random.default_rng(3).random(80)
    assert bootstrap_mean_ci(x, seed=5) == bootstrap_mean_ci(x, seed=5)
    assert bootstrap_mean_ci(x, seed=5) != bootstrap_mean_ci(x, seed=6)
    with pytest.raises(ValueError, match="same items"):
        paired_bootstrap_ci(x, x[:-1])


def test_precision_counts_positives_among_selected():
    selected = np.array([1, 1, 1, 1, 0, 0], dtype=bool)
    clean = np.array([1, 1, 1, 0, 0, 0], dtype=bool)
    assert bootstrap_precision_ci(selected, clean).value == pytest.approx(0.75)
    with pytest.raises(ValueError):
        bootstrap_precision_ci(np.zeros(6, dtype=bool), clean)


@pytest.mark.parametrize(("method", "mixed", "clean", "expected"),
                         [(0.5, 0.4, 0.6, 0.5), (0.6, 0.4, 0.6, 1.0), (0.3, 0.4, 0.6, -0.5), (0.5, 0.6, 0.6, None)])
def test_gap_closed(method, mixed, clean, expected):
    assert gap_closed(method, mixed, clean) == (pytest.approx(expected) if expected is not None else None)


def test_stratified_bootstrap_averages_strata_and_reduces_to_paired_for_one():
    from raycurate.algorithms.stats import stratified_paired_bootstrap_ci

    a1, b1 = np.ones(100), np.zeros(100)  # stratum 1: +1 on every item
    a2, b2 = np.zeros(40), np.zeros(40)  # stratum 2: no difference
    est = stratified_paired_bootstrap_ci([(a1, b1), (a2, b2)])
    assert (est.value, est.low, est.high, est.n) == (0.5, 0.5, 0.5, 140)  # strata weigh equally, not by size
    x, y = np.random.default_rng(1).random(60), np.random.default_rng(2).random(60)
    assert stratified_paired_bootstrap_ci([(x, y)], seed=4) == paired_bootstrap_ci(x, y, seed=4)
