"""Compiled (numba) kernels for BRIDGE's per-example selection and closure, with the numpy code as the fallback.

Each kernel fuses the few dozen small numpy calls of one step of :mod:`.selection`, :mod:`.units` or
:mod:`.closure` (arrays of ~300 elements, where per-call overhead dominates) into one loop, and reproduces the numpy
code bit for bit: numpy's pairwise summation (:func:`_np_sum`), matrix-vector products left to BLAS, Top-b with
ties by position.  ``tests/test_kernels.py`` and ``benchmarks/selection_reference.py --paths`` check both paths
agree.  ``RAYCURATE_KERNELS=0`` (or :func:`enabled`) runs the numpy code; without numba it runs anyway.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

try:  # numba is a core dependency; the numpy path stays for environments without it and as the tested reference
    import numba
except ImportError:  # pragma: no cover - exercised only where numba is missing
    numba = None

AVAILABLE = numba is not None
_state = {"on": AVAILABLE and os.environ.get("RAYCURATE_KERNELS", "1") != "0"}


def active() -> bool:
    """True when the compiled kernels run (numba importable and not switched off)."""
    return _state["on"]


@contextmanager
def enabled(on: bool) -> Iterator[None]:
    """Run a block with the kernels on or off (off: the numpy code); on needs numba."""
    if on and not AVAILABLE:
        raise RuntimeError("the compiled kernels need numba; pip install numba (a core dependency of raycurate)")
    before = _state["on"]
    _state["on"] = bool(on)
    try:
        yield
    finally:
        _state["on"] = before


def _jit(fn):
    return numba.njit(cache=True, nogil=True)(fn) if AVAILABLE else fn


# ----------------------------------------------------------------------------------------------------------------
# Building blocks


@_jit
def _block(a, lo, n):  # numpy's DOUBLE_pairwise_sum for n <= 128 (loops_utils.h.src): 8 accumulators
    if n < 8:
        res = 0.0
        for i in range(n):
            res += a[lo + i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    stop = n - n % 8
    while i < stop:
        r0 += a[lo + i]
        r1 += a[lo + i + 1]
        r2 += a[lo + i + 2]
        r3 += a[lo + i + 3]
        r4 += a[lo + i + 4]
        r5 += a[lo + i + 5]
        r6 += a[lo + i + 6]
        r7 += a[lo + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@_jit
def _pairwise(a, lo, n):
    """numpy's pairwise sum of a[lo : lo + n]: above 128 elements, left half (a multiple of 8) + right half.

    The recursion runs on an explicit stack (numba's on-disk cache does not take recursive functions)."""
    if n <= 128:
        return _block(a, lo, n)
    frame_lo, frame_n = np.empty(64, dtype=np.int64), np.empty(64, dtype=np.int64)
    state, left = np.zeros(64, dtype=np.int64), np.empty(64)
    top, result = 0, 0.0
    frame_lo[0], frame_n[0], state[0] = lo, n, 0
    while top >= 0:
        m = frame_n[top]
        half = m // 2
        half -= half % 8
        if m <= 128:
            result = _block(a, frame_lo[top], m)
            top -= 1
        elif state[top] == 0:
            state[top] = 1
            frame_lo[top + 1], frame_n[top + 1], state[top + 1] = frame_lo[top], half, 0
            top += 1
        elif state[top] == 1:
            state[top], left[top] = 2, result
            frame_lo[top + 1], frame_n[top + 1], state[top + 1] = frame_lo[top] + half, m - half, 0
            top += 1
        else:
            result = left[top] + result
            top -= 1
    return result


@_jit
def _np_sum(a, n):
    """``a[:n].sum()`` exactly as numpy computes it (identity 0 plus the pairwise sum)."""
    return 0.0 + _pairwise(a, 0, n)


@_jit
def _masked_sum(values, mask, buf):
    """``values[mask].sum()`` as numpy computes it (the selected values in position order, pairwise)."""
    k = 0
    for i in range(values.shape[0]):
        if mask[i]:
            buf[k] = values[i]
            k += 1
    return _np_sum(buf, k)


@_jit
def _top_b(scores, b, mask):
    """``mask`` <- the ``b`` highest scores, ties by position (earlier first); False when a score is NaN."""
    n = scores.shape[0]
    for i in range(n):
        if scores[i] != scores[i]:
            return False
    if b <= 0:
        mask[:] = False
        return True
    if b >= n:
        mask[:] = True
        return True
    threshold = np.partition(scores, n - b)[n - b]  # the b-th highest score
    above = 0
    for i in range(n):
        above += scores[i] > threshold
    ties = b - above  # equal scores taken from the left
    for i in range(n):
        s = scores[i]
        if s > threshold:
            mask[i] = True
        elif s == threshold and ties > 0:
            mask[i] = True
            ties -= 1
        else:
            mask[i] = False
    return True


def top_b_into(scores: np.ndarray, b: int, mask: np.ndarray) -> bool:
    """Compiled Top-b: ``mask`` (n,) bool <- the ``b`` highest of ``scores`` (n,) float64, ties by position.

    Returns False (``mask`` undefined) when a score is NaN; the caller then uses the sort.
    """
    return bool(_top_b(scores, b, mask))


# ----------------------------------------------------------------------------------------------------------------
# Alternating selection: what lies between the two matrix-vector products of a round


@_jit
def _prompt_half(scores, bias, gamma, s_r, b_p, s_p, s_p_float, buf):
    """scores <- bias + scores (Delta_p); S_p <- Top_bp; returns (U = sum gamma[S_r] + sum Delta_p[S_p], no NaN)."""
    for i in range(scores.shape[0]):
        scores[i] = bias[i] + scores[i]
    if not _top_b(scores, b_p, s_p):
        return 0.0, False
    for i in range(s_p.shape[0]):
        s_p_float[i] = 1.0 if s_p[i] else 0.0
    return _masked_sum(gamma, s_r, buf) + _masked_sum(scores, s_p, buf), True


@_jit
def _response_half(scores, gamma, bias, s_p, b_r, s_r, s_r_float, new, buf):
    """scores <- gamma + scores (Delta_r); S_r <- Top_br (in place); returns (U, S_r unchanged, no NaN)."""
    for j in range(scores.shape[0]):
        scores[j] = gamma[j] + scores[j]
    if not _top_b(scores, b_r, new):
        return 0.0, False, False
    u = _masked_sum(bias, s_p, buf) + _masked_sum(scores, new, buf)
    same = True
    for j in range(new.shape[0]):
        if new[j] != s_r[j]:
            same = False
        s_r[j] = new[j]
        s_r_float[j] = 1.0 if new[j] else 0.0
    return u, same, True


def alternate(beta: np.ndarray, gamma: np.ndarray, bias: np.ndarray, b_p: int, b_r: int, rounds: int):
    """The alternating schedule of :func:`raycurate.algorithms.bridge.selection.select` (inputs already checked finite).

    Args:
        beta: (p, r) float64 interactions.
        gamma: (r,) float64 history utilities.
        bias: (p,) float64 prompt term (zeros when absent).
        b_p: Prompt budget.
        b_r: Response budget.
        rounds: T >= 1.

    Returns:
        (s_p (p,) bool, s_r (r,) bool, prompt_scores (p,), response_scores (r,), u_sur list, rounds_run, converged),
        or None when a score came out NaN (finite inputs whose products overflow): the caller runs the numpy code,
        whose sort places NaN last.
    """
    p, r = beta.shape
    s_r, s_p, new = np.empty(r, dtype=bool), np.empty(p, dtype=bool), np.empty(r, dtype=bool)
    _top_b(gamma, b_r, s_r)  # S_r^0 = Top gamma
    s_r_float = s_r.astype(np.float64)
    s_p_float = np.empty(p)
    buf = np.empty(max(p, r))
    u_sur: list[float] = []
    converged, t = False, 0
    for t in range(1, rounds + 1):  # noqa: B007 (t is reported after the loop)
        prompt_scores = beta @ s_r_float  # (p,) BLAS, as the numpy code
        u, ok = _prompt_half(prompt_scores, bias, gamma, s_r, b_p, s_p, s_p_float, buf)
        if not ok:
            return None
        u_sur.append(float(u))
        response_scores = s_p_float @ beta  # (r,)
        u, converged, ok = _response_half(response_scores, gamma, bias, s_p, b_r, s_r, s_r_float, new, buf)
        if not ok:
            return None
        u_sur.append(float(u))
        if converged:
            break
    return s_p, s_r, prompt_scores, response_scores, u_sur, t, bool(converged)


# ----------------------------------------------------------------------------------------------------------------
# Closure: the exact 0/1 knapsack over capacities


@_jit
def _knapsack(weights, gains, capacity):
    m = weights.shape[0]
    value = np.zeros(capacity + 1)
    take = np.zeros((m, capacity + 1), dtype=np.bool_)
    for i in range(m):
        wi = weights[i]
        if wi > capacity:
            continue
        g = gains[i]
        for c in range(capacity, wi - 1, -1):  # descending: value[c - wi] is still the previous item's
            cand = value[c - wi] + g
            if cand > value[c]:  # strict: the incumbent stays on an exact tie
                take[i, c] = True
                value[c] = cand
    chosen = np.zeros(m, dtype=np.bool_)
    c = capacity
    for i in range(m - 1, -1, -1):
        wi = weights[i]
        if wi <= capacity and c >= wi and take[i, c]:
            chosen[i] = True
            c -= wi
    return chosen


def knapsack_chosen(weights: np.ndarray, gains: np.ndarray, capacity: int) -> list[int]:
    """Indices chosen by :func:`raycurate.algorithms.bridge.knapsack.knapsack_dp`'s DP over the perturbed ``gains``.

    Args:
        weights: (M,) int64 positive sizes.
        gains: (M,) float64 perturbed values.
        capacity: Non-negative capacity.

    Returns:
        Sorted indices.
    """
    return np.flatnonzero(_knapsack(weights, gains, int(capacity))).tolist()


# ----------------------------------------------------------------------------------------------------------------
# Structural units: alignment check, token ownership, drafts, merge of short units, split of long ones, core mask


@_jit
def _aligned_ok(spans, nonws):
    """:func:`raycurate.algorithms.bridge.alignment.verify_alignment`'s verdict (the numpy code words the reason)."""
    n = nonws.shape[0]
    covered = np.zeros(n, dtype=np.bool_)
    prev_start, prev_end, seen = 0, 0, False
    for k in range(spans.shape[0]):
        s, e = spans[k, 0], spans[k, 1]
        if s == -1 and e == -1:
            continue
        if s < 0 or s >= e or e > n:
            return False
        if seen and (s < prev_start or e < prev_end):
            return False
        prev_start, prev_end, seen = s, e, True
        for c in range(s, e):
            covered[c] = True
    for c in range(n):
        if nonws[c] and not covered[c]:
            return False
    return True


@_jit
def _units(spans, nonws, alnum, seg_start, seg_kind, seg_mandatory, seg_protected, key_ptr, key_lo, key_hi,
           min_tokens, max_tokens):
    """Units of verified spans over the given segments (``units._build_units``); see :func:`build_units`."""
    r, n, m = spans.shape[0], nonws.shape[0], seg_start.shape[0]
    aligned = np.empty(r, dtype=np.bool_)
    for k in range(r):
        aligned[k] = spans[k, 0] != -1 or spans[k, 1] != -1
    # owners: the segment of each token's first non-whitespace character (whitespace-only tokens: their start)
    next_nonws = np.empty(n + 1, dtype=np.int64)
    next_nonws[n] = n
    for c in range(n - 1, -1, -1):
        next_nonws[c] = c if nonws[c] else next_nonws[c + 1]
    owner = np.full(r, -1, dtype=np.int64)
    if n > 0:
        for k in range(r):
            if aligned[k]:
                first = next_nonws[spans[k, 0]]
                anchor = first if first < spans[k, 1] else spans[k, 0]
                owner[k] = np.searchsorted(seg_start, anchor, side="right") - 1
    lead_owner, running = -1, -1
    for k in range(r):
        running = max(running, owner[k])
        owner[k] = running
        if running >= 0 and lead_owner < 0:
            lead_owner = running
    for k in range(r):
        if owner[k] < 0:
            owner[k] = lead_owner if lead_owner >= 0 else 0
    # key positions: tokens overlapping an answer payload of their run's segment
    key = np.zeros(r, dtype=np.bool_)
    d_start = np.empty(r + m + 1, dtype=np.int64)
    d_end = np.empty(r + m + 1, dtype=np.int64)
    d_kind = np.empty(r + m + 1, dtype=np.int64)
    d_mand = np.empty(r + m + 1, dtype=np.bool_)
    d_prot = np.empty(r + m + 1, dtype=np.bool_)
    count = 0
    a = 0
    while a < r:
        b = a + 1
        while b < r and owner[b] == owner[a]:
            b += 1
        g = owner[a]
        for q in range(key_ptr[g], key_ptr[g + 1]):
            for k in range(a, b):
                if spans[k, 0] < key_hi[q] and spans[k, 1] > key_lo[q] and spans[k, 0] >= 0:
                    key[k] = True
        d_start[count], d_end[count], d_kind[count] = a, b, seg_kind[g]
        d_mand[count], d_prot[count] = seg_mandatory[g], seg_protected[g]
        count += 1
        a = b
    # merge: the first short non-protected draft into a neighbour (non-mandatory, then smaller, then left), repeat
    while count > 1:
        short = -1
        for i in range(count):
            if d_end[i] - d_start[i] < min_tokens and not d_prot[i]:
                short = i
                break
        if short < 0:
            break
        j = -1
        for cand in (short - 1, short + 1):
            if 0 <= cand < count:
                if j < 0:
                    j = cand
                else:
                    mc, mj = int(d_mand[cand]), int(d_mand[j])
                    better = mc < mj or (mc == mj and d_end[cand] - d_start[cand] < d_end[j] - d_start[j])
                    if better:
                        j = cand
        d_start[j] = min(d_start[j], d_start[short])
        d_end[j] = max(d_end[j], d_end[short])
        for i in range(short, count - 1):
            d_start[i], d_end[i], d_kind[i] = d_start[i + 1], d_end[i + 1], d_kind[i + 1]
            d_mand[i], d_prot[i] = d_mand[i + 1], d_prot[i + 1]
        count -= 1
    # split: non-protected drafts longer than max_tokens into near-equal chunks (earlier chunks one longer)
    total = 0
    for i in range(count):
        size = d_end[i] - d_start[i]
        total += 1 if d_prot[i] or size <= max_tokens else (size + max_tokens - 1) // max_tokens
    u_start = np.empty(total, dtype=np.int64)
    u_end = np.empty(total, dtype=np.int64)
    u_kind = np.empty(total, dtype=np.int64)
    u_mand = np.empty(total, dtype=np.bool_)
    u = 0
    for i in range(count):
        size = d_end[i] - d_start[i]
        if d_prot[i] or size <= max_tokens:
            u_start[u], u_end[u], u_kind[u], u_mand[u] = d_start[i], d_end[i], d_kind[i], d_mand[i]
            u += 1
            continue
        pieces = (size + max_tokens - 1) // max_tokens
        base, extra = size // pieces, size % pieces
        start = d_start[i]
        for piece in range(pieces):
            end = start + base + (1 if piece < extra else 0)
            u_start[u], u_end[u], u_kind[u], u_mand[u] = start, end, d_kind[i], False
            u += 1
            start = end
    # core: aligned tokens spanning at least one letter or digit
    alnum_before = np.zeros(n + 1, dtype=np.int64)
    for c in range(n):
        alnum_before[c + 1] = alnum_before[c] + (1 if alnum[c] else 0)
    core = np.zeros(r, dtype=np.bool_)
    for k in range(r):
        if aligned[k]:
            core[k] = alnum_before[spans[k, 1]] > alnum_before[spans[k, 0]]
    return u_start, u_end, u_kind, u_mand, core, key


def aligned_ok(spans: np.ndarray, nonws: np.ndarray) -> bool:
    """Whether (r, 2) int64 ``spans`` pass the alignment check over the (n,) non-whitespace flags of the text."""
    return bool(_aligned_ok(spans, nonws))


def build_units(spans: np.ndarray, nonws: np.ndarray, alnum: np.ndarray, segments: list, kinds: list[str],
                min_tokens: int, max_tokens: int):
    """Unit boundaries over verified spans, as ``units._build_units`` computes them.

    Args:
        spans: (r, 2) int64 token spans, ``(-1, -1)`` for template tokens.
        nonws: (n,) bool non-whitespace flags of the text.
        alnum: (n,) bool letter-or-digit flags.
        segments: The text's segments (``units._Seg``: start, kind, mandatory, protected, keys), ascending.
        kinds: Kind names; ``segments``' kinds are looked up here.
        min_tokens: Shorter non-protected units merge into a neighbour.
        max_tokens: Longer non-protected units are split.

    Returns:
        (start (M,), end (M,), kind id (M,), mandatory (M,), core (r,) bool, key (r,) bool answer-payload tokens).
    """
    m = len(segments)
    seg_start = np.fromiter((s.start for s in segments), dtype=np.int64, count=m)
    seg_kind = np.fromiter((kinds.index(s.kind) for s in segments), dtype=np.int64, count=m)
    seg_mandatory = np.fromiter((s.mandatory for s in segments), dtype=np.bool_, count=m)
    seg_protected = np.fromiter((s.protected for s in segments), dtype=np.bool_, count=m)
    key_ptr = np.zeros(m + 1, dtype=np.int64)
    key_ptr[1:] = np.cumsum([len(s.keys) for s in segments])
    pairs = [k for s in segments for k in s.keys]
    key_lo = np.fromiter((k[0] for k in pairs), dtype=np.int64, count=len(pairs))
    key_hi = np.fromiter((k[1] for k in pairs), dtype=np.int64, count=len(pairs))
    return _units(spans, nonws, alnum, seg_start, seg_kind, seg_mandatory, seg_protected, key_ptr, key_lo, key_hi,
                  int(min_tokens), int(max_tokens))


# ----------------------------------------------------------------------------------------------------------------
# Closure projection: unit sums, budget completion, retained utility


@_jit
def _unit_sums(scores, unit_id, core, m, tau, tau_given):
    r = scores.shape[0]
    if not tau_given:
        buf = np.empty(r)
        for j in range(r):
            buf[j] = abs(scores[j])
        tau = _np_sum(buf, r) / r if r else 0.0
    sums, sizes, positive = np.zeros(m), np.zeros(m, dtype=np.int64), np.zeros(m)
    for j in range(r):  # np.bincount order: positions ascending
        u = unit_id[j]
        if core[j] and u >= 0:
            s = scores[j]
            sums[u] += s if s >= -tau else -tau
            sizes[u] += 1
    for j in range(r):
        u = unit_id[j]
        if u >= 0:
            s = scores[j]
            positive[u] += s if s >= 0.0 else 0.0
    return sums, sizes, positive


def unit_sums(scores: np.ndarray, unit_id: np.ndarray, core: np.ndarray, m: int, tau: float | None):
    """Per unit: clipped core sums ``sum max(s_j, -tau)``, core sizes and ``sum max(s_j, 0)`` over all positions.

    Args:
        scores: (r,) float64 scores.
        unit_id: (r,) int64 unit per position (-1: none).
        core: (r,) bool core flags.
        m: Number of units.
        tau: Clipping threshold; None is ``mean |s|``.

    Returns:
        (sums (M,) float64, sizes (M,) int64, positive (M,) float64), as the numpy bincounts give them.
    """
    return _unit_sums(scores, unit_id, core, m, 0.0 if tau is None else float(tau), tau is not None)


@_jit
def _finish(mask, chosen, unit_id, scores, b_r, complete, token_mask):
    r = mask.shape[0]
    taken = 0
    for j in range(r):
        if chosen[unit_id[j]]:
            mask[j] = True
        taken += mask[j]
    completed = 0
    if complete and b_r > taken:
        free = np.empty(r - taken)
        where = np.empty(r - taken, dtype=np.int64)
        k = 0
        for j in range(r):
            if not mask[j]:
                free[k], where[k] = scores[j], j
                k += 1
        pick = np.empty(k, dtype=np.bool_)
        _top_b(free, b_r - taken, pick)  # by score, ties by position
        for i in range(k):
            if pick[i]:
                mask[where[i]] = True
        completed = b_r - taken
    buf = np.empty(r)
    return completed, _masked_sum(scores, mask, buf), _masked_sum(scores, token_mask, buf)


def finish_projection(mask: np.ndarray, chosen: np.ndarray, unit_id: np.ndarray, scores: np.ndarray, b_r: int,
                      complete: bool, token_mask: np.ndarray) -> tuple[int, float]:
    """``mask |= chosen[unit_id]``, the budget completion by score, and the retained utility.

    Returns:
        (positions completed, ``sum s[mask] / sum s[token_mask]`` or NaN when the denominator is <= 0).
    """
    completed, kept, denom = _finish(mask, chosen, unit_id, scores, int(b_r), bool(complete), token_mask)
    return int(completed), (float(kept) / float(denom) if denom > 0 else float("nan"))
