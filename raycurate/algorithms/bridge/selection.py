"""BRIDGE budgets and coupled prompt/response token selection (paper §4.4, App. A.4, C.2, G.1), per example, numpy.

Inputs are arrays over one row's *eligible* positions: ``beta`` (p, r) interactions, ``gamma`` (r,) history
utilities and an optional unary ``prompt_bias`` (:func:`fold_fixed_positions`).  ``U_sur(S_p, S_r)`` sums gamma over
S_r, bias over S_p and beta over S_p x S_r (:func:`surrogate_utility`); the conditional scores ``Delta_p(i | S_r)``
and ``Delta_r(j | S_p)`` are its marginal gains.  :func:`eligible_positions` and :func:`budgets` (or
:func:`corpus_budgets`) size the budgets, :func:`select` runs a schedule, :func:`knockout_update` and
:func:`supervise_first` are the beyond-the-paper options, :func:`to_row_masks` maps back onto the token row.
Ties break by position (:func:`top_b`); compiled paths are in :mod:`.kernels`.  Decisions: docs/bridge.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from raycurate.algorithms.bridge import kernels

Schedule = Literal["independent", "one_pass", "alternating"]
SCHEDULES: tuple[Schedule, ...] = ("independent", "one_pass", "alternating")

# Added before flooring in ``budgets`` so that an exact half (rho * n = k + 0.5 in decimal) rounds up even when
# the float product lands a hair below it (e.g. 0.35 * 90 = 31.499999999999996).
_HALF_UP_SLACK = 1e-9


@dataclass
class SelectionResult:
    """Outcome of :func:`select` for one example (all arrays over eligible positions).

    Attributes:
        prompt_mask: (p,) bool, the selected prompt subset S_p (exactly ``b_p`` True).
        response_mask: (r,) bool, the selected response subset S_r (exactly ``b_r`` True).
        prompt_scores: (p,) float64, the last prompt scores computed, ``Delta_p(. | S_r)`` for the response
            subset that S_p was selected against (the full response for ``independent``).
        response_scores: (r,) float64, the last response scores, ``Delta_r(. | S_p)`` for the final S_p (the full
            prompt for ``independent``); closure uses these (App. G.1).
        u_sur: U_sur after every update: one value for ``independent``; for ``one_pass``/``alternating`` two
            per round, ``[U(S_p^1, S_r^0), U(S_p^1, S_r^1), U(S_p^2, S_r^1), ...]``; non-decreasing (App. A.4).
        rounds_run: rounds executed (0 for ``independent``; at most ``rounds``).
        converged: True when the last round left S_r unchanged, i.e. the pair is a fixed point of the
            alternating updates (see :func:`select`); False for ``independent``.
    """

    prompt_mask: np.ndarray
    response_mask: np.ndarray
    prompt_scores: np.ndarray
    response_scores: np.ndarray
    u_sur: list[float] = field(default_factory=list)
    rounds_run: int = 0
    converged: bool = False

    @property
    def realised_budgets(self) -> tuple[int, int]:
        """(|S_p|, |S_r|), the number of selected eligible prompt and response positions."""
        return int(self.prompt_mask.sum()), int(self.response_mask.sum())


def budgets(n_prompt_eligible: int, n_response_eligible: int, rho_p: float, rho_r: float) -> tuple[int, int]:
    """Per-side token budgets ``b = round(rho * n)`` over the eligible positions (paper App. G.1).

    Rounding is half up, ``floor(rho * n + 0.5)`` (not Python's banker's ``round``): 0.75 * 2 = 1.5 -> 2 and
    0.5 * 5 = 2.5 -> 3.  With ``0 <= rho <= 1`` this gives ``0 <= b <= n``.

    Args:
        n_prompt_eligible: number of eligible prompt positions (fixed positions excluded), >= 0.
        n_response_eligible: number of eligible response positions (fixed positions excluded), >= 0.
        rho_p: prompt retention ratio in [0, 1].
        rho_r: response supervision ratio in [0, 1].

    Returns:
        (b_p, b_r) integer budgets.
    """
    return _budget(n_prompt_eligible, rho_p, "prompt"), _budget(n_response_eligible, rho_r, "response")


def _budget(n: int, rho: float, side: str) -> int:
    if isinstance(n, bool) or int(n) != n or n < 0:
        raise ValueError(f"n_{side}_eligible must be a non-negative integer, got {n!r}")
    if not (0.0 <= float(rho) <= 1.0):
        raise ValueError(f"rho for the {side} side must lie in [0, 1], got {rho!r}; it is a retention ratio")
    return min(int(n), max(0, math.floor(float(rho) * int(n) + 0.5 + _HALF_UP_SLACK)))


def eligible_positions(
    n_tokens: int,
    prompt_len: int,
    has_bos: bool,
    fixed_prompt_mask: np.ndarray | None = None,
    fixed_response_mask: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Row positions that the budgets range over; everything else is fixed (App. G.1).

    Row contract: ``input_ids = [BOS] + prompt (+ template tokens) + response (+ end-of-turn marker) + [EOS]``;
    positions ``[0, prompt_len)`` are the prompt side and ``[prompt_len, n_tokens)`` the response side, EOS last.
    Fixed prompt positions are always kept: BOS (position 0 when ``has_bos``) and the ones flagged in
    ``fixed_prompt_mask``.  Fixed response positions are always supervised: EOS (the last position) and the ones
    flagged in ``fixed_response_mask``.  The stage flags chat-template/special tokens, i.e. tokens whose
    character offsets are -1 (decision: template markup carries no content to compress or to rank, and the
    end-of-turn marker teaches the model to stop, so both stay in like BOS/EOS).

    Args:
        n_tokens: row length n.
        prompt_len: number of prompt-side positions, 1 <= prompt_len < n_tokens.
        has_bos: whether position 0 is a BOS token.
        fixed_prompt_mask: optional (prompt_len,) bool, True at extra always-kept prompt positions.
        fixed_response_mask: optional (n_tokens - prompt_len,) bool, True at extra always-supervised response
            positions (EOS is fixed whatever this says).

    Returns:
        (prompt_idx (p,), response_idx (r,)) int64 ascending row positions of the eligible tokens.
    """
    if not 1 <= prompt_len < n_tokens:
        raise ValueError(
            f"need 1 <= prompt_len < n_tokens (got prompt_len={prompt_len}, n_tokens={n_tokens}): position 0 "
            "has no prediction and every row ends with a supervised EOS on the response side"
        )
    prompt_fixed = _fixed_mask(fixed_prompt_mask, prompt_len, "fixed_prompt_mask", "prompt_len")
    response_fixed = _fixed_mask(fixed_response_mask, n_tokens - prompt_len, "fixed_response_mask",
                                 "n_tokens - prompt_len")
    if has_bos:
        prompt_fixed[0] = True
    response_fixed[-1] = True  # EOS
    prompt_idx = np.flatnonzero(~prompt_fixed).astype(np.int64)
    response_idx = (np.flatnonzero(~response_fixed) + prompt_len).astype(np.int64)
    return prompt_idx, response_idx


def _fixed_mask(mask: np.ndarray | None, length: int, name: str, length_name: str) -> np.ndarray:
    if mask is None:
        return np.zeros(length, dtype=bool)
    out = np.asarray(mask, dtype=bool).copy()
    if out.shape != (length,):
        raise ValueError(f"{name} has shape {out.shape}; it must have one flag per position, ({length_name},) = "
                         f"({length},)")
    return out


def fold_fixed_positions(
    beta_full: np.ndarray,
    gamma_full: np.ndarray,
    prompt_eligible: np.ndarray,
    response_eligible: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Restrict interactions to eligible positions, folding in the fixed positions' constant contributions.

    A fixed prompt token (BOS, template) is always in the retained context, so it adds ``beta_fj`` to every
    ``Delta_r(j | .)``; a fixed response token (EOS) is always supervised, so it adds ``beta_if`` to every
    ``Delta_p(i | .)``.  Folding these into ``gamma`` and ``prompt_bias`` makes the scores the exact marginal
    gains of the surrogate over the retained row (decision; the paper leaves it open).  The constant terms among
    fixed positions only shift U_sur and are dropped.

    Args:
        beta_full: (P, R) interactions over all prompt-side and response-side positions of the row.
        gamma_full: (R,) history utilities over all response-side positions.
        prompt_eligible: (P,) bool, True at eligible prompt positions.
        response_eligible: (R,) bool, True at eligible response positions.

    Returns:
        (beta (p, r), gamma (r,), prompt_bias (p,)) float64 over eligible positions, ready for :func:`select`.
    """
    beta_full = _as_float_matrix(beta_full, "beta_full")
    gamma_full = np.asarray(gamma_full, dtype=np.float64)
    pe, re = np.asarray(prompt_eligible, dtype=bool), np.asarray(response_eligible, dtype=bool)
    if pe.shape != (beta_full.shape[0],) or re.shape != (beta_full.shape[1],) or gamma_full.shape != re.shape:
        raise ValueError(
            f"shapes disagree: beta_full {beta_full.shape}, gamma_full {gamma_full.shape}, prompt_eligible "
            f"{pe.shape}, response_eligible {re.shape}; pass (P, R), (R,), (P,), (R,)"
        )
    beta = beta_full[np.ix_(pe, re)]  # (p, r)
    gamma = gamma_full[re] + beta_full[np.ix_(~pe, re)].sum(axis=0)  # (r,)
    prompt_bias = beta_full[np.ix_(pe, ~re)].sum(axis=1)  # (p,)
    return beta, gamma, prompt_bias


def top_b(scores: np.ndarray, b: int) -> np.ndarray:
    """Mask of the ``b`` highest scores; ties broken by position (earlier first).

    Args:
        scores: (n,) finite scores.
        b: number to keep, 0 <= b <= n.

    Returns:
        (n,) bool mask with exactly ``b`` True.
    """
    scores = np.asarray(scores, dtype=np.float64)
    n = scores.shape[0]
    if not 0 <= b <= n:
        raise ValueError(f"budget b={b} must lie in [0, {n}] (the number of eligible positions)")
    if kernels.active():  # the same set by a compiled selection (NaN scores fall through to the sort)
        mask = np.empty(n, dtype=bool)
        if kernels.top_b_into(scores, int(b), mask):
            return mask
    mask = np.zeros(n, dtype=bool)
    # Stable sort of the negated scores: descending order, equal scores keep ascending position order.
    mask[np.argsort(-scores, kind="stable")[:b]] = True
    return mask


BUDGET_MODES = ("per_example", "corpus")


def corpus_budgets(scores: Sequence[np.ndarray], rho: float, floor: float = 0.0) -> np.ndarray:
    """Per-row response budgets from ONE corpus-wide budget, allocated by score (beyond the paper).

    The corpus budget is ``B = floor(rho * sum_i r_i + 0.5)`` over all rows' eligible response positions.  Row i
    first gets its floor ``f_i = floor(floor * r_i)`` (its ``f_i`` best positions); the remaining ``B - sum f_i``
    positions go to the highest scores among all rows' other positions, ties broken by (row, position).  So
    ``sum_i b_i == B`` exactly, ``b_i >= f_i``, and within a row the selected positions are always a prefix of
    its own ranking: rows whose tokens score low (hurt the validation direction) keep only their floor.

    Args:
        scores: one (r_i,) array of finite response scores per row (e.g. ``Delta_r(. | S_p)``), comparable
            across rows (the same scoring direction).
        rho: corpus-wide response supervision ratio in [0, 1].
        floor: per-row minimum share in [0, rho] (0: a row may get nothing).

    Returns:
        (rows,) int64 budgets b_i with ``0 <= f_i <= b_i <= r_i``.
    """
    if not 0.0 <= float(floor) <= float(rho) <= 1.0:
        raise ValueError(f"need 0 <= floor <= rho <= 1 (got floor={floor!r}, rho={rho!r}); the floor is the share "
                         "of every row kept before the corpus-wide allocation")
    arrays = [np.asarray(x, dtype=np.float64).reshape(-1) for x in scores]
    sizes = np.array([a.size for a in arrays], dtype=np.int64)  # (rows,)
    if any(not np.all(np.isfinite(a)) for a in arrays):
        raise ValueError("corpus_budgets needs finite scores; re-run bridge_score")
    total = _budget(int(sizes.sum()), rho, "response")
    floors = np.floor(float(floor) * sizes + 1e-9).astype(np.int64)  # sum floors <= floor * sum r <= B
    rest = total - int(floors.sum())
    budgets_out = floors.copy()
    if rest <= 0 or not arrays:
        return budgets_out
    cand_scores, cand_rows = [], []
    for i, a in enumerate(arrays):
        ranked = np.argsort(-a, kind="stable")  # the row's own ranking (ties by position)
        tail = a[ranked[floors[i]:]]  # (r_i - f_i,) non-increasing
        cand_scores.append(tail)
        cand_rows.append(np.full(tail.size, i, dtype=np.int64))
    pool_scores = np.concatenate(cand_scores)
    pool_rows = np.concatenate(cand_rows)
    # Stable descending sort keeps (row, rank within row) order among equal scores; a row's candidates are
    # non-increasing, so any top-k of the pool takes a prefix of each row's tail.
    taken = pool_rows[np.argsort(-pool_scores, kind="stable")[:rest]]
    budgets_out += np.bincount(taken, minlength=len(arrays))
    return budgets_out


def supervise_first(mask: np.ndarray, scores: np.ndarray, k: int, protected: np.ndarray | None = None) -> np.ndarray:
    """Swap the first ``k`` positions into a response selection, keeping its size (beyond the paper; docs/bridge.md).

    Every position among the first ``k`` that ``mask`` lacks replaces the lowest-scoring selected position outside
    the first ``k`` and outside ``protected`` (ties: the later position goes first).  When no such position is
    left, the remaining first positions stay out, so ``mask.sum()`` never changes.

    Args:
        mask: (r,) bool selection over the eligible response positions.
        scores: (r,) finite scores of those positions.
        k: how many leading positions to supervise, >= 0.
        protected: optional (r,) bool, selected positions never swapped out (e.g. the final-answer line).

    Returns:
        A new (r,) bool mask with the same number of positions.
    """
    out = np.asarray(mask, dtype=bool).copy()
    scores = np.asarray(scores, dtype=np.float64)
    if isinstance(k, bool) or int(k) != k or k < 0:
        raise ValueError(f"k must be a non-negative integer, got {k!r}")
    if out.shape != scores.shape:
        raise ValueError(f"mask {out.shape} and scores {scores.shape} must both be (r,)")
    lead = np.zeros(out.shape[0], dtype=bool)
    lead[:int(k)] = True
    keep = lead.copy() if protected is None else lead | np.asarray(protected, dtype=bool)
    missing = np.flatnonzero(lead & ~out)
    donors = np.flatnonzero(out & ~keep)
    # lowest score first; among equal scores the later position first
    donors = donors[np.lexsort((-donors, scores[donors]))]
    swap = min(missing.size, donors.size)
    out[missing[:swap]] = True
    out[donors[:swap]] = False
    return out


def surrogate_utility(
    S_p: np.ndarray,
    S_r: np.ndarray,
    beta: np.ndarray,
    gamma: np.ndarray,
    prompt_bias: np.ndarray | None = None,
) -> float:
    """U_sur(S_p, S_r) = sum_{j in S_r} gamma_j + sum_{i in S_p} bias_i + sum_{i in S_p, j in S_r} beta_ij.

    Args:
        S_p: (p,) bool prompt subset.
        S_r: (r,) bool response subset.
        beta: (p, r) interactions.
        gamma: (r,) history utilities.
        prompt_bias: optional (p,) unary prompt term (default zero).

    Returns:
        The surrogate utility as a Python float.
    """
    beta, gamma, bias = _check_inputs(beta, gamma, prompt_bias)
    sp = np.asarray(S_p, dtype=bool).astype(np.float64)  # (p,)
    sr = np.asarray(S_r, dtype=bool).astype(np.float64)  # (r,)
    if sp.shape != (beta.shape[0],) or sr.shape != (beta.shape[1],):
        raise ValueError(f"S_p {sp.shape} / S_r {sr.shape} must be masks of shape ({beta.shape[0]},) / "
                         f"({beta.shape[1]},) to match beta")
    return float(gamma @ sr + bias @ sp + sp @ beta @ sr)


def select(
    beta: np.ndarray,
    gamma: np.ndarray,
    b_p: int,
    b_r: int,
    schedule: Schedule = "alternating",
    rounds: int = 4,
    *,
    prompt_bias: np.ndarray | None = None,
) -> SelectionResult:
    """Budgeted coupled selection over precomputed interactions (paper Eq. 9, App. C.2).

    Schedules (all share beta, gamma and the budgets; only the construction of the subsets differs):

    * ``independent`` (T = 0): full-state scoring, ``S_p = Top_bp Delta_p(. | R)``, ``S_r = Top_br Delta_r(. | P)``
      with R, P all eligible positions (App. C.2).
    * ``one_pass`` (T = 1): ``S_r^0 = Top_br gamma``, then one round below (``rounds`` is ignored).
    * ``alternating`` (T = ``rounds``): from ``S_r^0 = Top_br gamma``, each round does
      ``S_p <- Top_bp Delta_p(. | S_r)`` then ``S_r <- Top_br Delta_r(. | S_p)``.  It stops early after a round
      that leaves S_r unchanged: S_p was just selected against that same S_r, so every later round would
      reproduce both sets (a fixed point; ``converged`` is set).

    Monotonicity (App. A.4): ``U(S_p, S_r) = sum_{S_r} gamma + sum_{i in S_p} Delta_p(i | S_r)`` and Top_bp
    maximises the last sum over all |S_p| = b_p, so a prompt update never lowers U;
    ``U(S_p, S_r) = sum_{i in S_p} bias_i + sum_{j in S_r} Delta_r(j | S_p)``, so neither does a response update.

    Cost per round: two matrix-vector products over (p, r) and two sorts; no Python loop over tokens.

    Args:
        beta: (p, r) interactions between eligible prompt and response tokens.
        gamma: (r,) history utilities of the eligible response tokens.
        b_p: prompt budget, 0 <= b_p <= p.
        b_r: response budget, 0 <= b_r <= r.
        schedule: "independent", "one_pass" or "alternating".
        rounds: T for "alternating", >= 1.
        prompt_bias: optional (p,) unary prompt term (see :func:`fold_fixed_positions`); default zero.

    Returns:
        A :class:`SelectionResult`.
    """
    beta, gamma, bias = _check_inputs(beta, gamma, prompt_bias)
    p, r = beta.shape
    if not (_is_int(b_p) and _is_int(b_r) and 0 <= b_p <= p and 0 <= b_r <= r):
        raise ValueError(f"budgets (b_p={b_p}, b_r={b_r}) must lie in [0, {p}] x [0, {r}]; size them with "
                         "budgets() over the eligible positions")
    if schedule == "independent":
        return _independent(beta, gamma, bias, b_p, b_r)
    if schedule == "one_pass":
        return _alternate(beta, gamma, bias, b_p, b_r, rounds=1)
    if schedule == "alternating":
        if isinstance(rounds, bool) or int(rounds) != rounds or rounds < 1:
            raise ValueError(f"rounds must be an integer >= 1 for the alternating schedule, got {rounds!r}; "
                             "use schedule='independent' for T = 0")
        return _alternate(beta, gamma, bias, b_p, b_r, rounds=int(rounds))
    raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")


def _independent(beta: np.ndarray, gamma: np.ndarray, bias: np.ndarray, b_p: int, b_r: int) -> SelectionResult:
    prompt_scores = bias + beta.sum(axis=1)  # (p,) Delta_p(. | R)
    response_scores = gamma + beta.sum(axis=0)  # (r,) Delta_r(. | P)
    s_p, s_r = top_b(prompt_scores, b_p), top_b(response_scores, b_r)
    u = surrogate_utility(s_p, s_r, beta, gamma, bias)
    return SelectionResult(s_p, s_r, prompt_scores, response_scores, [u], rounds_run=0, converged=False)


def _alternate(
    beta: np.ndarray, gamma: np.ndarray, bias: np.ndarray, b_p: int, b_r: int, rounds: int
) -> SelectionResult:
    compiled = kernels.alternate(beta, gamma, bias, int(b_p), int(b_r), rounds) if kernels.active() else None
    if compiled is not None:  # the same rounds with the work between the BLAS products compiled (bit-identical)
        s_p, s_r, prompt_scores, response_scores, compiled_u_sur, t, converged = compiled
        return SelectionResult(s_p, s_r, prompt_scores, response_scores, compiled_u_sur, rounds_run=t,
                               converged=converged)
    s_r = top_b(gamma, b_r)  # (r,) S_r^0 = Top gamma
    u_sur: list[float] = []
    converged, t = False, 0
    for t in range(1, rounds + 1):  # noqa: B007 (t is reported after the loop)
        prompt_scores = bias + beta @ s_r.astype(np.float64)  # (p,) Delta_p(. | S_r^{t-1})
        s_p = top_b(prompt_scores, b_p)
        u_sur.append(float(gamma[s_r].sum() + prompt_scores[s_p].sum()))
        response_scores = gamma + s_p.astype(np.float64) @ beta  # (r,) Delta_r(. | S_p^t)
        new_s_r = top_b(response_scores, b_r)
        u_sur.append(float(bias[s_p].sum() + response_scores[new_s_r].sum()))
        converged = bool(np.array_equal(new_s_r, s_r))
        s_r = new_s_r
        if converged:
            break
    return SelectionResult(s_p, s_r, prompt_scores, response_scores, u_sur, rounds_run=t, converged=converged)


def knockout_update(
    state: SelectionResult,
    prompt_scores: np.ndarray,
    beta: np.ndarray,
    gamma: np.ndarray,
    b_p: int,
    b_r: int,
    *,
    prompt_bias: np.ndarray | None = None,
) -> SelectionResult:
    """One coupled update with externally computed prompt scores (``bridge.prompt_proxy = knockout_grad``).

    ``prompt_scores`` replace ``Delta_p(. | S_r)``: the first-order knock-out derivative conditioned on
    ``state.response_mask`` (:func:`raycurate.algorithms.bridge.token_utility.knockout_prompt_scores`).  Then
    ``S_p = Top_bp prompt_scores`` and ``S_r = Top_br Delta_r(. | S_p)`` with the routing surrogate's
    ``Delta_r(j | S_p) = gamma_j + sum_{i in S_p} beta_ij`` (a reverse pass gives the knock-out derivative only as
    row sums over one response weighting, not the (p, r) matrix the response side would need).  ``u_sur`` extends
    ``state.u_sur`` by the surrogate utility of the new pair, which the surrogate no longer guarantees to be
    non-decreasing (the prompt update maximises another score).

    Args:
        state: The routing surrogate's selection (its ``response_mask`` conditioned ``prompt_scores``).
        prompt_scores: (p,) knock-out scores of the eligible prompt positions.
        beta: (p, r) routing interactions.
        gamma: (r,) history utilities.
        b_p: prompt budget.
        b_r: response budget.
        prompt_bias: optional (p,) unary prompt term of the surrogate (for U_sur only).

    Returns:
        A :class:`SelectionResult` (``rounds_run = state.rounds_run + 1``, ``converged`` when S_r did not change).
    """
    beta, gamma, bias = _check_inputs(beta, gamma, prompt_bias)
    scores = np.asarray(prompt_scores, dtype=np.float64)
    if scores.shape != (beta.shape[0],) or not np.isfinite(scores).all():
        raise ValueError(f"prompt_scores must be {beta.shape[0]} finite scores over the eligible prompt positions, "
                         f"got shape {scores.shape}")
    s_p = top_b(scores, b_p)
    response_scores = gamma + s_p.astype(np.float64) @ beta  # (r,) Delta_r(. | S_p)
    s_r = top_b(response_scores, b_r)
    u = surrogate_utility(s_p, s_r, beta, gamma, bias)
    return SelectionResult(s_p, s_r, scores, response_scores, [*state.u_sur, u], rounds_run=state.rounds_run + 1,
                           converged=bool(np.array_equal(s_r, state.response_mask)))


def to_row_masks(
    n_tokens: int,
    prompt_len: int,
    prompt_idx: np.ndarray,
    response_idx: np.ndarray,
    prompt_mask: np.ndarray,
    response_mask: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Map a selection over eligible positions back onto the token row, fixed positions included.

    Args:
        n_tokens: row length n.
        prompt_len: number of prompt-side positions.
        prompt_idx: (p,) eligible prompt row positions (from :func:`eligible_positions`).
        response_idx: (r,) eligible response row positions.
        prompt_mask: (p,) bool selected prompt subset.
        response_mask: (r,) bool selected response subset.

    Returns:
        (prompt_keep (prompt_len,) bool: fixed or selected prompt positions; loss_mask (n_tokens,) bool: fixed or
        selected response positions, False on the whole prompt side).
    """
    prompt_idx, response_idx = np.asarray(prompt_idx, np.int64), np.asarray(response_idx, np.int64)
    prompt_mask, response_mask = np.asarray(prompt_mask, bool), np.asarray(response_mask, bool)
    if prompt_idx.shape != prompt_mask.shape or response_idx.shape != response_mask.shape:
        raise ValueError("each mask must have one entry per eligible position: got prompt "
                         f"{prompt_mask.shape} vs {prompt_idx.shape}, response {response_mask.shape} vs "
                         f"{response_idx.shape}")
    prompt_keep = np.ones(prompt_len, dtype=bool)
    prompt_keep[prompt_idx] = prompt_mask
    loss_mask = np.zeros(n_tokens, dtype=bool)
    loss_mask[prompt_len:] = True
    loss_mask[response_idx] = response_mask
    return prompt_keep, loss_mask


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _as_float_matrix(x: np.ndarray, name: str) -> np.ndarray:
    out = np.asarray(x, dtype=np.float64)
    if out.ndim != 2:
        raise ValueError(f"{name} must be a (p, r) matrix, got shape {out.shape}")
    return out


def _all_finite(x: np.ndarray) -> bool:
    """Every entry finite.  A finite sum proves it (NaN/inf propagate) at a third of ``isfinite().all()``'s cost;
    an overflowing sum of large finite entries falls back to the exact check."""
    return bool(np.isfinite(x.sum()) or np.isfinite(x).all())


def _check_inputs(
    beta: np.ndarray, gamma: np.ndarray, prompt_bias: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    beta = _as_float_matrix(beta, "beta")
    gamma = np.asarray(gamma, dtype=np.float64)
    bias = np.zeros(beta.shape[0]) if prompt_bias is None else np.asarray(prompt_bias, dtype=np.float64)
    if gamma.shape != (beta.shape[1],) or bias.shape != (beta.shape[0],):
        raise ValueError(f"beta {beta.shape} needs gamma of shape ({beta.shape[1]},) and prompt_bias of shape "
                         f"({beta.shape[0]},); got {gamma.shape} and {bias.shape}")
    if not (_all_finite(beta) and _all_finite(gamma) and _all_finite(bias)):
        raise ValueError("beta, gamma and prompt_bias must be finite; drop or zero the NaN/inf utilities of this "
                         "example before selection")
    return beta, gamma, bias
