"""Rank and selection metrics between score vectors (pure numpy; no torch, no Ray, no I/O).

* :func:`average_ranks`, the one tie-averaged ranker (scipy ``rankdata(method="average")``), and the metrics
  built on it: :func:`spearman` and :func:`auroc` (Mann-Whitney U, ties count 1/2) with its per-class
  :func:`bootstrap_auroc_ci` and :func:`auroc_by_kind`.
* Budget-``b`` selection agreement between a reference and a proxy score vector over the same candidates (paper
  §5.4 Table 3, App. F.2), with the Top-b sets of :func:`raycurate.algorithms.bridge.selection.top_b` (ties by
  position): :func:`top_b_overlap`, :func:`jaccard`, :func:`normalized_regret`, :func:`utility_retention` and
  :func:`selection_metrics`.  The conventions for degenerate cases (NaN, left out of means) are described in
  :mod:`raycurate.algorithms.bridge.fidelity`, which compares model-based references with proxies through them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from raycurate.algorithms.bridge.selection import top_b

METRICS = ("spearman", "top_b_overlap", "jaccard", "normalized_regret")


# ------------------------------------------------------------------------------------------------ ranks


def _pair(ref: np.ndarray, proxy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ref, proxy = np.asarray(ref, dtype=np.float64), np.asarray(proxy, dtype=np.float64)
    if ref.ndim != 1 or ref.shape != proxy.shape:
        raise ValueError(f"ref {ref.shape} and proxy {proxy.shape} must be score vectors over the same candidates")
    if not (np.isfinite(ref.sum()) and np.isfinite(proxy.sum())):
        raise ValueError("scores must be finite; drop the example or zero its NaN/inf scores before the metrics")
    return ref, proxy


def average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks with ties sharing their average rank (scipy.stats.rankdata ``method="average"``).

    Args:
        x: (n,) scores.

    Returns:
        (n,) float64 ranks; the smallest score gets rank 1.
    """
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[0]
    order = np.argsort(x, kind="stable")  # (n,)
    inverse = np.empty(n, dtype=np.int64)
    inverse[order] = np.arange(n)
    xs = x[order]
    new_value = np.r_[True, xs[1:] != xs[:-1]]  # (n,) True where a run of equal values starts
    run = np.cumsum(new_value)[inverse]  # (n,) 1-based run id of each element
    bounds = np.r_[np.flatnonzero(new_value), n]  # (runs + 1,) run start offsets, then n
    return 0.5 * (bounds[run] + bounds[run - 1] + 1)  # mean of ranks start+1 .. end


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman rank correlation: Pearson correlation of the average ranks (ties share their mean rank).

    Args:
        x: (n,) scores.
        y: (n,) scores over the same candidates.

    Returns:
        The correlation in [-1, 1]; NaN when n < 2 or either vector is constant (undefined, left out of means).
    """
    x, y = _pair(x, y)
    if x.shape[0] < 2:
        return math.nan
    rx, ry = average_ranks(x), average_ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denom = math.sqrt(float(rx @ rx) * float(ry @ ry))
    if denom == 0.0:
        return math.nan
    return float(np.clip(float(rx @ ry) / denom, -1.0, 1.0))


def _top_sets(ref: np.ndarray, proxy: np.ndarray, b: int) -> tuple[np.ndarray, np.ndarray]:
    ref, proxy = _pair(ref, proxy)
    return top_b(ref, b), top_b(proxy, b)


def top_b_overlap(ref: np.ndarray, proxy: np.ndarray, b: int) -> float:
    """``|Top_b(ref) & Top_b(proxy)| / b`` (paper Table 3 "Top-b Overlap").

    Args:
        ref: (n,) reference scores.
        proxy: (n,) proxy scores.
        b: budget, 0 <= b <= n.

    Returns:
        The overlap in [0, 1]; NaN for b = 0.
    """
    s_ref, s_proxy = _top_sets(ref, proxy, b)
    return math.nan if b == 0 else float((s_ref & s_proxy).sum()) / b


def jaccard(ref: np.ndarray, proxy: np.ndarray, b: int) -> float:
    """``|Top_b(ref) & Top_b(proxy)| / |Top_b(ref) | Top_b(proxy)|`` (paper Table 3 "Jaccard").

    Both sets have b elements, so Jaccard = o / (2 - o) for the overlap o of :func:`top_b_overlap`.

    Args:
        ref: (n,) reference scores.
        proxy: (n,) proxy scores.
        b: budget, 0 <= b <= n.

    Returns:
        The Jaccard index in [0, 1]; NaN for b = 0.
    """
    s_ref, s_proxy = _top_sets(ref, proxy, b)
    union = int((s_ref | s_proxy).sum())
    return math.nan if union == 0 else float((s_ref & s_proxy).sum()) / union


def normalized_regret(ref: np.ndarray, proxy: np.ndarray, b: int) -> float:
    """Reference-utility loss of selecting by the proxy (paper Table 3, App. F.2 Table 18: ``1 - Ret``).

    ``(U_ref(S_ref) - U_ref(S_proxy)) / |U_ref(S_ref)|`` with ``U_ref(S) = sum_{x in S} ref_x`` and
    ``S = Top_b``; ``S_ref`` maximises ``U_ref`` over size-b sets, so the regret is >= 0.

    Args:
        ref: (n,) reference scores.
        proxy: (n,) proxy scores.
        b: budget, 0 <= b <= n.

    Returns:
        The regret (>= 0; 0 when the proxy set is reference-optimal, also at b = 0); NaN when
        ``U_ref(S_ref) = 0`` but the proxy set loses utility.
    """
    ref, proxy = _pair(ref, proxy)
    s_ref, s_proxy = top_b(ref, b), top_b(proxy, b)
    best, got = float(ref[s_ref].sum()), float(ref[s_proxy].sum())
    loss = max(best - got, 0.0)  # >= 0 up to float summation order
    if loss == 0.0:
        return 0.0
    return math.nan if best == 0.0 else loss / abs(best)


def utility_retention(ref: np.ndarray, proxy: np.ndarray, b: int) -> float:
    """``Ret = U_ref(S_proxy) / U_ref(S_ref)`` (paper App. F.2, Table 18 "Utility Ret.").

    Args:
        ref: (n,) reference scores.
        proxy: (n,) proxy scores.
        b: budget, 0 <= b <= n.

    Returns:
        The retention (<= 1); NaN when ``U_ref(S_ref) <= 0`` (the ratio is not a retention then; use
        :func:`normalized_regret`).
    """
    ref, proxy = _pair(ref, proxy)
    best = float(ref[top_b(ref, b)].sum())
    return math.nan if best <= 0.0 else float(ref[top_b(proxy, b)].sum()) / best


def selection_metrics(ref: np.ndarray, proxy: np.ndarray, b: int) -> dict[str, float]:
    """All Table 3 metrics of one proxy against one reference at budget b.

    Args:
        ref: (n,) reference scores.
        proxy: (n,) proxy scores.
        b: budget, 0 <= b <= n.

    Returns:
        ``{"spearman", "top_b_overlap", "jaccard", "normalized_regret"}`` floats (NaN where undefined).
    """
    return {
        "spearman": spearman(ref, proxy),
        "top_b_overlap": top_b_overlap(ref, proxy, b),
        "jaccard": jaccard(ref, proxy, b),
        "normalized_regret": normalized_regret(ref, proxy, b),
    }


# ------------------------------------------------------------------------------------------------ AUROC


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
    return _auroc_unchecked(s, y)


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
        values[k] = _auroc_unchecked(s[rows], labels)
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


def label_separation(scores: np.ndarray, clean: np.ndarray, kinds: np.ndarray, seed: int,
                     resamples: int = 1000) -> dict[str, Any]:
    """How well ``scores`` (N,) rank the clean rows above the corrupted ones: overall, per corruption kind and
    without near-duplicates, each AUROC with a seeded 95% bootstrap interval.

    Args:
        scores: (N,) scores, higher = more likely clean.
        clean: (N,) bool ground truth.
        kinds: (N,) str corruption kind (``"none"`` on clean rows).
        seed: Seed of the bootstrap generator.
        resamples: Bootstrap resamples per interval.

    Returns:
        ``auroc``, ``auroc_ci95``, ``auroc_by_kind`` ({kind: {auroc, ci95, rows}}) and, when there are
        near-duplicates and other corruptions, ``auroc_excluding_near_duplicate`` (+ ``_ci95``).
    """
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {"auroc": auroc(scores, clean),
                           "auroc_ci95": list(bootstrap_auroc_ci(scores, clean, rng, resamples))}
    by_kind = {}
    for kind, value in auroc_by_kind(scores, np.where(clean, "none", kinds)).items():
        rows = clean | (kinds == kind)
        by_kind[kind] = {"auroc": value, "rows": int((kinds[~clean] == kind).sum()),
                         "ci95": list(bootstrap_auroc_ci(scores[rows], clean[rows], rng, resamples))}
    out["auroc_by_kind"] = by_kind
    keep = kinds != "near_duplicate"
    if (~keep).any() and (~clean[keep]).any():
        out["auroc_excluding_near_duplicate"] = auroc(scores[keep], clean[keep])
        out["auroc_excluding_near_duplicate_ci95"] = list(bootstrap_auroc_ci(scores[keep], clean[keep], rng,
                                                                             resamples))
    return out


def _auroc_unchecked(s: np.ndarray, y: np.ndarray) -> float:
    """:func:`auroc` without its checks (the bootstrap calls it a thousand times): Mann-Whitney U over ranks."""
    n_pos = int(y.sum())
    u = average_ranks(s)[y].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * (len(s) - n_pos)))
