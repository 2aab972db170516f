"""Generic 0/1 knapsack solvers: the closure projection (:mod:`.closure`) picks whole structural units with them,
under the response budget.

:func:`knapsack_dp` is exact (a DP over capacities; near-ties broken by structural priority, then positive
utility, through a perturbation far below the values' own tolerance); :func:`greedy_density` is the fallback for
capacities above the DP limit.  Compiled path: :mod:`.kernels`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from raycurate.algorithms.bridge import kernels


def knapsack_dp(
    weights: Sequence[int],
    values: Sequence[float] | np.ndarray,
    capacity: int,
    *,
    priority: Sequence[int] | None = None,
    positive: Sequence[float] | np.ndarray | None = None,
) -> list[int]:
    """Exact 0/1 knapsack: maximise ``sum values`` s.t. ``sum weights <= capacity``; O(M * capacity).

    One vectorised update over all capacities per item.  Tie-breaks are folded into the objective as a
    perturbation below the tie tolerance ``tol = 1e-9 * (1 + sum |values|)``: each value gets
    ``+ delta * (priority * (1 + sum |positive|) + positive)`` with the total perturbation of any subset under
    ``tol / 2``.  So the optimum is within ``tol`` of the exact one, and among solutions tied on ``sum values``
    the higher ``sum priority`` (integers) wins, then the higher ``sum positive``; on an exact tie the incumbent
    is kept (items are processed in the given order, so earlier items win).

    Args:
        weights: (M,) positive integer sizes.
        values: (M,) item values (``q(u)``).
        capacity: Non-negative integer capacity.
        priority: (M,) integer first tie-break key (default zeros).
        positive: (M,) non-negative second tie-break key (default zeros).

    Returns:
        Sorted indices of the chosen items.
    """
    m = len(weights)
    w = [int(x) for x in weights]
    q = np.asarray(values, dtype=np.float64)  # (M,)
    pri = np.zeros(m) if priority is None else np.asarray(priority, dtype=np.float64)
    pos = np.zeros(m) if positive is None else np.asarray(positive, dtype=np.float64)
    secondary = pri * (1.0 + float(np.abs(pos).sum())) + pos  # (M,) priority first, then positive utility
    tol = 1e-9 * (1.0 + float(np.abs(q).sum()))
    delta = 0.5 * tol / (1.0 + float(np.abs(secondary).sum()))
    gains_array = q + delta * secondary  # (M,)
    if kernels.active():
        return kernels.knapsack_chosen(np.asarray(w, dtype=np.int64), gains_array, capacity)
    gains = gains_array.tolist()
    value = np.zeros(capacity + 1)  # best perturbed value within capacity c, (C+1,)
    take: list[np.ndarray | None] = [None] * m  # take[i][c - w_i]: item i improves capacity c, (C+1-w_i,) each
    for i in range(m):
        wi = w[i]
        if wi > capacity:
            continue
        cand = value[: capacity + 1 - wi] + gains[i]  # item i on top of the best within c - wi
        take[i] = cand > value[wi:]  # strict: the incumbent stays on an exact tie
        np.maximum(value[wi:], cand, out=value[wi:])
    chosen, c = [], capacity
    for i in range(m - 1, -1, -1):
        row = take[i]
        if row is not None and c >= w[i] and row[c - w[i]]:
            chosen.append(i)
            c -= w[i]
    return sorted(chosen)


def greedy_density(
    weights: Sequence[int],
    values: Sequence[float] | np.ndarray,
    capacity: int,
    *,
    priority: Sequence[float] | None = None,
    positive: Sequence[float] | np.ndarray | None = None,
) -> list[int]:
    """Greedy by density ``value / weight`` (then priority, positive utility, index); skips what does not fit.

    Only items with a positive value are taken.  Args and return as :func:`knapsack_dp`.
    """
    m = len(weights)
    pri = np.zeros(m) if priority is None else np.asarray(priority, dtype=np.float64)
    pos = np.zeros(m) if positive is None else np.asarray(positive, dtype=np.float64)
    order = sorted(range(m), key=lambda i: (-values[i] / weights[i], -pri[i], -pos[i], i))
    chosen, left = [], capacity
    for i in order:
        if values[i] > 0 and weights[i] <= left:
            chosen.append(i)
            left -= int(weights[i])
    return sorted(chosen)
