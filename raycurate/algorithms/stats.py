"""Confidence intervals for the comparisons the report shows (pure numpy); every bootstrap is seeded.

:func:`bootstrap_mean_ci` (one model's mean per-item score); :func:`paired_bootstrap_ci` (two models on the SAME
held-out items, resampled once per replicate, so agreement tightens the interval);
:func:`stratified_paired_bootstrap_ci` (the same pooled over corpus seeds, resampling within each seed);
:func:`t_interval_over_runs` (over repeated trainings, which includes the training's own noise);
:func:`bootstrap_precision_ci` (selection precision against labels; AUROC intervals are
:func:`raycurate.algorithms.ranking.bootstrap_auroc_ci`); :func:`gap_closed` (the share of the clean-vs-mixed oracle
gap a method closes).  Why paired, and which metric: docs/design.md, "The proving ground".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

DEFAULT_REPLICATES = 2000


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its 95% (by default) bootstrap interval and the number of items behind it."""

    value: float
    low: float
    high: float
    n: int

    def excludes_zero(self) -> bool:
        """Whether the interval lies strictly on one side of 0 (the difference is not noise at this level)."""
        return self.low > 0.0 or self.high < 0.0

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def _as_vector(values: np.ndarray, name: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{name} must be a non-empty (N,) vector, got shape {array.shape}")
    return array


def _resample_indices(n: int, replicates: int, seed: int) -> np.ndarray:
    """(R, n) indices drawn with replacement from a seeded generator."""
    if replicates < 1:
        raise ValueError(f"replicates must be >= 1, got {replicates}")
    return np.random.default_rng(seed).integers(0, n, size=(replicates, n))


def _interval(point: float, replicate_values: np.ndarray, n: int, level: float) -> Estimate:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    tail = 100.0 * (1.0 - level) / 2.0
    low, high = np.percentile(replicate_values, [tail, 100.0 - tail])
    return Estimate(float(point), float(low), float(high), n)


def bootstrap_mean_ci(scores: np.ndarray, *, replicates: int = DEFAULT_REPLICATES, seed: int = 0,
                      level: float = 0.95) -> Estimate:
    """Mean of per-item scores with a percentile bootstrap interval.

    Args:
        scores: (N,) per-item scores (e.g. 0/1 exact match, or a per-question accuracy over samples).
        replicates: Bootstrap replicates R.
        seed: Seed of the resampling.
        level: Interval coverage.
    """
    x = _as_vector(scores, "scores")
    means = x[_resample_indices(len(x), replicates, seed)].mean(axis=1)  # (R,)
    return _interval(x.mean(), means, len(x), level)


def paired_bootstrap_ci(treatment: np.ndarray, control: np.ndarray, *, replicates: int = DEFAULT_REPLICATES,
                        seed: int = 0, level: float = 0.95) -> Estimate:
    """Mean of ``treatment - control`` over the same items, with a paired percentile bootstrap interval.

    Args:
        treatment: (N,) per-item scores of one model.
        control: (N,) per-item scores of the other model on the same items, in the same order.
        replicates, seed, level: As in :func:`bootstrap_mean_ci`.

    Raises:
        ValueError: when the two vectors do not cover the same number of items.
    """
    a, b = _as_vector(treatment, "treatment"), _as_vector(control, "control")
    if a.shape != b.shape:
        raise ValueError(f"paired scores must cover the same items: {a.shape[0]} vs {b.shape[0]}")
    return bootstrap_mean_ci(a - b, replicates=replicates, seed=seed, level=level)


def stratified_paired_bootstrap_ci(pairs: list[tuple[np.ndarray, np.ndarray]], *, replicates: int = DEFAULT_REPLICATES,
                                   seed: int = 0, level: float = 0.95) -> Estimate:
    """Mean over strata (corpus seeds) of the mean paired difference, resampling questions within each stratum.

    Args:
        pairs: One ``(treatment, control)`` pair of (N_s,) per-question score vectors per stratum.
        replicates, seed, level: As in :func:`bootstrap_mean_ci`.
    """
    if not pairs:
        raise ValueError("need at least one (treatment, control) pair")
    diffs = []
    for index, (treatment, control) in enumerate(pairs):
        a, b = _as_vector(treatment, f"treatment[{index}]"), _as_vector(control, f"control[{index}]")
        if a.shape != b.shape:
            raise ValueError(f"stratum {index}: paired scores must cover the same items: "
                             f"{a.shape[0]} vs {b.shape[0]}")
        diffs.append(a - b)
    replicate_means = np.zeros(replicates)
    for index, d in enumerate(diffs):
        replicate_means += d[_resample_indices(len(d), replicates, seed + index)].mean(axis=1)
    point = float(np.mean([d.mean() for d in diffs]))
    return _interval(point, replicate_means / len(diffs), int(sum(len(d) for d in diffs)), level)


def t_interval_over_runs(differences: np.ndarray, *, level: float = 0.95) -> Estimate | None:
    """Mean of per-run differences with a Student-t interval (``None`` below 3 runs).

    The paired bootstrap resamples questions and holds each run's training fixed; runs that repeat a corpus seed
    with another ``train.seed`` make this interval include the training's own randomness, which on the embedded
    model is as large as some arms' differences (docs/bridge.md, "BRIDGE vs random tokens on the
    proving ground").

    Args:
        differences: (R,) one mean difference (treatment minus control) per run.
        level: Interval coverage.
    """
    d = _as_vector(differences, "differences")
    if len(d) < 3:
        return None
    from scipy.stats import t as student_t

    half = float(student_t.ppf(0.5 + level / 2.0, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d)))
    return Estimate(float(d.mean()), float(d.mean() - half), float(d.mean() + half), len(d))


def bootstrap_precision_ci(selected: np.ndarray, positives: np.ndarray, *, replicates: int = DEFAULT_REPLICATES,
                           seed: int = 0, level: float = 0.95) -> Estimate:
    """Share of positives among the selected rows, with an interval from resampling the selected rows.

    Args:
        selected: (N,) bool, the rows a method kept.
        positives: (N,) bool ground truth (e.g. ``label.clean``).
    """
    keep, y = np.asarray(selected, dtype=bool), np.asarray(positives, dtype=bool)
    if keep.shape != y.shape or not keep.any():
        raise ValueError(f"need matching (N,) masks with at least one selected row; got {keep.shape}, {y.shape}")
    return bootstrap_mean_ci(y[keep].astype(np.float64), replicates=replicates, seed=seed, level=level)


def gap_closed(method: float, mixed: float, clean: float) -> float | None:
    """``(method - mixed) / (clean - mixed)``: 0 = no better than training on everything, 1 = as good as the
    clean-only oracle; ``None`` when there is no gap to close (clean is not above mixed)."""
    gap = clean - mixed
    return None if gap <= 0 else (method - mixed) / gap
