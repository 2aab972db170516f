"""Small evaluation metrics on numpy arrays (pure)."""

from __future__ import annotations

import numpy as np


def auroc(scores: np.ndarray, positives: np.ndarray) -> float:
    """Area under the ROC curve of ``scores`` separating positives from negatives (Mann-Whitney U; ties count 1/2).

    Args:
        scores: (N,) real scores, higher = more likely positive.
        positives: (N,) bool labels.

    Returns:
        AUROC in [0, 1]; 0.5 is chance.

    Raises:
        ValueError: when one class is empty (AUROC is undefined).
    """
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(positives, dtype=bool)
    if s.shape != y.shape or s.ndim != 1:
        raise ValueError(f"scores {s.shape} and labels {y.shape} must be matching (N,) vectors")
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"AUROC needs both classes; got {n_pos} positives and {n_neg} negatives")
    order = np.argsort(s, kind="stable")
    ranks = np.empty(len(s), dtype=np.float64)
    sorted_s = s[order]
    i = 0
    while i < len(s):  # average ranks over ties
        j = i
        while j + 1 < len(s) and sorted_s[j + 1] == sorted_s[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    u = ranks[y].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def bootstrap_auroc_ci(scores: np.ndarray, positives: np.ndarray, rng: np.random.Generator,
                       resamples: int = 1000, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of :func:`auroc`: rows resampled with replacement, per class.

    Resampling within each class keeps both classes present in every resample (and their sizes fixed).

    Args:
        scores: (N,) real scores, higher = more likely positive.
        positives: (N,) bool labels, both classes present.
        rng: Seeded generator (same seed, same interval).
        resamples: Bootstrap resamples.
        level: Coverage, e.g. 0.95.

    Returns:
        (low, high) AUROC quantiles at (1 - level) / 2 and (1 + level) / 2.
    """
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(positives, dtype=bool)
    auroc(s, y)  # validates shapes and classes
    pos, neg = np.flatnonzero(y), np.flatnonzero(~y)
    labels = np.r_[np.ones(len(pos), bool), np.zeros(len(neg), bool)]
    values = np.empty(resamples)
    for k in range(resamples):
        rows = np.r_[rng.choice(pos, len(pos)), rng.choice(neg, len(neg))]
        values[k] = _auroc_vectorised(s[rows], labels)
    tail = (1.0 - level) / 2.0
    return float(np.quantile(values, tail)), float(np.quantile(values, 1.0 - tail))


def auroc_by_kind(scores: np.ndarray, kinds: np.ndarray, clean_kind: str = "none") -> dict[str, float]:
    """AUROC of ``scores`` separating the clean rows (positives) from each other kind of row on its own.

    Args:
        scores: (N,) real scores, higher = more likely clean.
        kinds: (N,) str kind of each row (e.g. ``label.corruption``); ``clean_kind`` marks the clean ones.
        clean_kind: The kind of the clean rows.

    Returns:
        {kind: AUROC clean vs that kind}, kinds sorted; empty when there is no clean row.
    """
    s = np.asarray(scores, dtype=np.float64)
    k = np.asarray(kinds).astype(str)
    clean = k == clean_kind
    if not clean.any():
        return {}
    out = {}
    for kind in sorted(set(k[~clean].tolist())):
        rows = clean | (k == kind)
        out[kind] = auroc(s[rows], clean[rows])
    return out


def _auroc_vectorised(s: np.ndarray, y: np.ndarray) -> float:
    """:func:`auroc` without its checks and with vectorised tie ranks (the bootstrap calls it a thousand times)."""
    from raycurate.algorithms.fidelity import average_ranks

    n_pos = int(y.sum())
    u = average_ranks(s)[y].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * (len(s) - n_pos)))
