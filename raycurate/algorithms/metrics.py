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
