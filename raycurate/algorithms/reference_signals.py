"""Row and token signals from a reference model trained on the trusted set (pure numpy).

A reference that has learnt the task from trusted rows assigns a low loss to a clean response and a high one to the
tokens where a corrupted response departs from what the trusted rows teach: the swapped look-up number, the wrong
result, the unsafe line, the missing final line of a truncated response (its end-of-turn token comes too early).
Each row keeps its per-token losses over the supervised response positions; the row signals aggregate them
(``docs/design.md``, "The trusted set").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: Row signals, each "higher = worse": mean, max (the worst token), top3 (mean of the three worst tokens),
#: eos (the last supervised position: the end-of-turn token) and excess_max (the worst token of
#: reference loss minus base loss: what the reference finds harder than the untrained model does).
ROW_SIGNALS = ("mean", "max", "top3", "eos", "excess_max")


def row_signals(reference: np.ndarray, base: np.ndarray | None = None) -> dict[str, float]:
    """The row signals of one row.

    Args:
        reference: (R,) losses of the row's supervised response positions under the reference, in order.
        base: (R,) the same positions' losses under the base model, or None (``excess_max`` is then NaN).

    Returns:
        ``{signal: value}`` for every name in :data:`ROW_SIGNALS` (NaN for a row without supervised tokens).
    """
    ref = np.asarray(reference, dtype=np.float64)
    if ref.ndim != 1:
        raise ValueError(f"reference losses must be 1-D, got shape {ref.shape}")
    if ref.size == 0:
        return {name: float("nan") for name in ROW_SIGNALS}
    worst = np.sort(ref)[::-1]
    excess = float("nan")
    if base is not None:
        b = np.asarray(base, dtype=np.float64)
        if b.shape != ref.shape:
            raise ValueError(f"base losses have shape {b.shape}, reference losses {ref.shape}; score the same "
                             "positions")
        excess = float((ref - b).max())
    return {"mean": float(ref.mean()), "max": float(worst[0]), "top3": float(worst[:3].mean()),
            "eos": float(ref[-1]), "excess_max": excess}


def calibrated_percentiles(values: np.ndarray, calibration: np.ndarray) -> np.ndarray:
    """Where each value falls among clean rows' values: the share of ``calibration`` values <= it.

    Args:
        values: (N,) a signal of the rows to judge (higher = worse; NaN = no supervised token, judged worst).
        calibration: (M,) the same signal on held-out trusted rows (clean by construction), M >= 1.

    Returns:
        (N,) in [0, 1]: 0.95 means the row is worse than 95% of clean rows.
    """
    ref = np.sort(np.asarray(calibration, dtype=np.float64))
    ref = ref[~np.isnan(ref)]
    if ref.size == 0:
        raise ValueError("calibration needs at least one trusted row with a finite signal")
    v = np.asarray(values, dtype=np.float64)
    out = np.searchsorted(ref, v, side="right") / ref.size
    return np.where(np.isnan(v), 1.0, out)


def pool_percentiles(values: np.ndarray) -> np.ndarray:
    """(N,) each value's average rank among ``values`` over N, in (0, 1] (NaN judged worst): the pool's own scale
    when no calibration rows are held out."""
    v = np.asarray(values, dtype=np.float64)
    filled = np.where(np.isnan(v), np.inf, v)
    order = filled.argsort(kind="stable")
    ranks = np.empty(v.size)
    ranks[order] = np.arange(1, v.size + 1)
    for value in np.unique(filled):  # ties share their average rank
        tied = filled == value
        ranks[tied] = ranks[tied].mean()
    return ranks / max(v.size, 1)


def badness(signals: dict[str, np.ndarray], calibration: dict[str, np.ndarray] | None) -> np.ndarray:
    """(N,) a row's worst standing over several signals: the max over ``signals`` of its calibrated percentile
    (:func:`calibrated_percentiles`; the pool's own ranks without ``calibration``).  A row is as bad as the signal
    it is most unusual in: the worst token catches wrong results and unsafe lines, the excess over the base model
    catches a plausible number that the trusted rows contradict."""
    if not signals:
        raise ValueError("give at least one signal")
    scaled = [calibrated_percentiles(v, calibration[name]) if calibration is not None else pool_percentiles(v)
              for name, v in signals.items()]
    return np.maximum.reduce(scaled)


def signal_scores(values: Sequence[float]) -> np.ndarray:
    """Ranking scores (higher = keep) from signal values (higher = worse): their negation, NaN (a row without
    supervised tokens) ranked last."""
    v = -np.asarray(values, dtype=np.float64)
    return np.where(np.isnan(v), -np.inf, v)


def high_loss_mask(losses: np.ndarray, threshold: float, *, keep_last: bool = True) -> np.ndarray:
    """Which supervised positions of one row stay supervised when tokens above a reference loss are masked.

    Args:
        losses: (R,) reference losses of the row's supervised positions, in order.
        threshold: Positions with a loss above this (nats) are masked.
        keep_last: Keep the last position (the end-of-turn token) supervised whatever its loss, so the model
            still learns to stop.

    Returns:
        (R,) bool, True where the position stays supervised.
    """
    x = np.asarray(losses, dtype=np.float64)
    if not np.isfinite(threshold) or threshold <= 0:
        raise ValueError(f"mask threshold must be a positive number of nats, got {threshold}")
    keep = ~(x > threshold)
    if keep_last and keep.size:
        keep[-1] = True
    return keep
