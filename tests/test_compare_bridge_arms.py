"""benchmarks/compare_bridge_arms.py: the t-interval over runs (replicates carry the training's randomness)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("compare_bridge_arms", ROOT / "benchmarks/compare_bridge_arms.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_over_runs_is_the_t_interval_of_the_per_run_differences():
    over_runs = _script().over_runs
    ones, zeros = np.ones(4), np.zeros(4)
    half = np.array([1.0, 1.0, 0.0, 0.0])
    assert over_runs([(ones, zeros), (half, zeros)]) == "", "two runs: no interval"
    # per-run differences 1.0, 0.5, 0.0: mean 0.5, sd 0.5, t(0.975, 2) = 4.303 -> half-width 4.303 * 0.5 / sqrt(3)
    text = over_runs([(ones, zeros), (half, zeros), (zeros, zeros)])
    assert text == "; over 3 runs +0.500 [-0.742, +1.742]"
