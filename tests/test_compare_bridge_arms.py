"""benchmarks/compare_bridge_arms.py: the t-interval over runs (replicates carry the training's randomness)."""

from __future__ import annotations

import numpy as np
from benchmark_scripts import load_benchmark


def test_over_runs_is_the_t_interval_of_the_per_run_differences():
    over_runs = load_benchmark("compare_bridge_arms").over_runs
    ones, zeros = np.ones(4), np.zeros(4)
    half = np.array([1.0, 1.0, 0.0, 0.0])
    assert over_runs([(ones, zeros), (half, zeros)]) == "", "two runs: no interval"
    # per-run differences 1.0, 0.5, 0.0: mean 0.5, sd 0.5, t(0.975, 2) = 4.303 -> half-width 4.303 * 0.5 / sqrt(3)
    text = over_runs([(ones, zeros), (half, zeros), (zeros, zeros)])
    assert text == "; over 3 runs +0.500 [-0.742, +1.742]"
