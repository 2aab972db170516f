"""BRIDGE structure-aware closure projection of the response mask (paper App. G.1), pure Python/numpy.

After the alternating selection, the response mask is projected onto whole structural units under the same budget
``b_r``, from the final conditional scores alone (no model call)::

    check = verify_alignment(response, offsets)                    # :mod:`.alignment`
    units = structural_units(response, domain, offsets)            # :mod:`.units`
    result = closure_projection(scores, units, b_r, token_mask=m)  # :func:`unit_quality`, :mod:`.knapsack`
    # or all three, falling back to the token mask:  project_response(response, domain, offsets, scores, b_r, ...)
Constants, tie-breaks, mandatory units and budget completion: docs/bridge.md, "Closure".
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from raycurate.algorithms.bridge import kernels
from raycurate.algorithms.bridge.knapsack import greedy_density, knapsack_dp
from raycurate.algorithms.bridge.selection import top_b
from raycurate.algorithms.bridge.units import MAX_UNIT_TOKENS, MIN_UNIT_TOKENS, Unit, units_and_core

DP_CAPACITY_LIMIT = 2048
ALPHA = 0.5
EPS = 1.0


@dataclass
class ClosureResult:
    """Projected response mask and diagnostics for one example.

    Attributes:
        mask: (r,) bool, the projected response supervision set ``S_r^cl``.
        chosen_units: Indices into ``units`` of the whole units kept (sorted).
        used_budget: ``mask.sum()``, never above ``b_r``.
        fallback: True when the token mask was returned unchanged (alignment could not be verified or no units).
        final_answer_kept: True when there is a mandatory unit and every mandatory position is in ``mask``.
        utility_retained: ``sum(s[mask]) / sum(s[token_mask])`` (diagnostic; NaN when the denominator <= 0).
        units: The units the projection worked on (empty on an alignment fallback).
        has_final_answer: Whether any unit is mandatory (the denominator of final-answer coverage).
        solver: ``"dp"``, ``"greedy"``, ``"all"`` (every unit with ``q >= 0`` fits: the exact optimum without a
            search), ``"none"`` (no residual capacity or no optional unit) or ``"fallback"``.
        fallback_reason: Why the fallback happened; empty otherwise.
        completed_positions: Single positions added by budget completion.
        partial_mandatory: A mandatory unit did not fit and was cut to its highest-priority positions.
    """

    mask: np.ndarray
    chosen_units: list[int]
    used_budget: int
    fallback: bool
    final_answer_kept: bool
    utility_retained: float
    units: list[Unit] = field(default_factory=list)
    has_final_answer: bool = False
    solver: str = "none"
    fallback_reason: str = ""
    completed_positions: int = 0
    partial_mandatory: bool = False


# ----------------------------------------------------------------------------------------------------------------
# Unit quality


def default_tau(scores: np.ndarray) -> float:
    """Scale-free clipping threshold: ``mean |s_j|`` over the eligible positions (0 for an empty example)."""
    return float(np.mean(np.abs(scores))) if scores.size else 0.0


def _unit_index(units: Sequence[Unit], r: int, partition: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(r,) unit id per position (-1 outside every unit) and (r,) core flags.

    ``partition=True`` promises that the units partition ``[0, r)`` in order (checked by the caller).
    """
    m = len(units)
    if partition:
        unit_id = np.repeat(np.arange(m), [u.size for u in units])
    else:
        unit_id = np.full(r, -1, dtype=np.int64)
        for i, u in enumerate(units):
            unit_id[u.token_start : u.token_end] = i
    core_positions = itertools.chain.from_iterable(
        range(u.token_start, u.token_end) if u.core is None else u.core for u in units
    )
    core = np.zeros(r, dtype=bool)
    core[np.fromiter(core_positions, dtype=np.int64)] = True
    return unit_id, core


def unit_quality(
    scores: np.ndarray, units: Sequence[Unit], *, tau: float | None = None, alpha: float = ALPHA, eps: float = EPS
) -> np.ndarray:
    """Eq. (11): ``q(u) = sum_{j in core(u)} max(s_j, -tau) / (|core(u)| + eps)^alpha``.

    Args:
        scores: (r,) final conditional response scores ``s_j``.
        units: M non-overlapping units inside ``[0, r)``.
        tau: Clipping threshold (>= 0); None uses :func:`default_tau`.
        alpha: Size exponent (>= 0).
        eps: Size smoothing (> 0 when alpha > 0).

    Returns:
        (M,) float64 qualities; 0 for a unit with an empty core.
    """
    scores = np.asarray(scores, dtype=np.float64)
    unit_id, core = _unit_index(units, scores.shape[0])
    return _quality(scores, unit_id, core, len(units), tau, alpha, eps)


def _quality(
    scores: np.ndarray, unit_id: np.ndarray, core: np.ndarray, m: int, tau: float | None, alpha: float, eps: float
) -> np.ndarray:
    tau = default_tau(scores) if tau is None else float(tau)
    counted = core & (unit_id >= 0)
    ids = unit_id[counted]
    sums = np.bincount(ids, weights=np.maximum(scores[counted], -tau), minlength=m)  # (M,)
    sizes = np.bincount(ids, minlength=m)  # (M,)
    return np.where(sizes > 0, sums / np.power(sizes + eps, alpha), 0.0)


# ----------------------------------------------------------------------------------------------------------------
# Projection


def _check_inputs(scores: np.ndarray, units: Sequence[Unit], b_r: int) -> None:
    r = scores.shape[0]
    if scores.ndim != 1 or not np.all(np.isfinite(scores)):
        raise ValueError(f"scores must be a finite (r,) vector; got shape {scores.shape}")
    if not 0 <= b_r <= r:
        raise ValueError(f"b_r={b_r} must lie in [0, r={r}]; compute it over the eligible response positions")
    cursor = 0
    for i, u in enumerate(units):
        if u.token_start != cursor or u.size < 1:
            raise ValueError(f"unit {i} [{u.token_start}, {u.token_end}) does not continue a partition of [0, {r}) "
                             f"at {cursor}; build units with structural_units")
        cursor = u.token_end
    if units and cursor != r:
        raise ValueError(f"units cover [0, {cursor}) but scores have r={r} positions; use the same offsets")


def top_b_mask(scores: np.ndarray, b: int) -> np.ndarray:
    """(r,) bool mask of the ``b`` highest scores, ties by position (lower first): :func:`selection.top_b`."""
    return top_b(np.asarray(scores, dtype=np.float64), b)


def _ranked(positions: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """``positions`` (ascending) by score, descending; the stable sort keeps ties in position order."""
    return positions[np.argsort(-scores[positions], kind="stable")]


def _mandatory_order(u: Unit, scores: np.ndarray) -> np.ndarray:
    """Positions of a mandatory unit by priority: answer payload, other core, rest; each by score then position."""
    everything = np.arange(u.token_start, u.token_end, dtype=np.int64)
    key = np.asarray(u.key, dtype=np.int64)
    core = np.setdiff1d(u.core_positions(), key)
    rest = np.setdiff1d(everything, np.concatenate([key, core]))
    return np.concatenate([_ranked(key, scores), _ranked(core, scores), _ranked(rest, scores)])


def _take_mandatory(
    units: Sequence[Unit], scores: np.ndarray, mask: np.ndarray, capacity: int
) -> tuple[list[int], int, bool]:
    """Mandatory units into ``mask``: whole ones last-first while they fit, then cut ones; (whole, left, cut)."""
    mandatory = [i for i in range(len(units) - 1, -1, -1) if units[i].mandatory]  # last first
    whole = []
    for i in mandatory:
        if units[i].size <= capacity:
            mask[units[i].token_start : units[i].token_end] = True
            whole.append(i)
            capacity -= units[i].size
    partial = False
    for i in mandatory:
        if i not in whole and capacity > 0:
            keep = _mandatory_order(units[i], scores)[:capacity]
            mask[keep] = True
            capacity -= keep.size
            partial = True
    return whole, capacity, partial


def _complete(mask: np.ndarray, scores: np.ndarray, b_r: int) -> int:
    """Add single positions by score (then position) until ``mask`` holds ``b_r`` positions."""
    missing = b_r - int(mask.sum())
    if missing <= 0:
        return 0
    free = np.flatnonzero(~mask)
    mask[_ranked(free, scores)[:missing]] = True
    return missing


def _retained(scores: np.ndarray, mask: np.ndarray, token_mask: np.ndarray) -> float:
    denom = float(scores[token_mask].sum())
    return float(scores[mask].sum()) / denom if denom > 0 else float("nan")


def final_answer_covered(mask: np.ndarray, units: Sequence[Unit]) -> bool | None:
    """Complete final-answer supervision: every mandatory position in ``mask``; None when no unit is mandatory.

    Use it on any response mask (score-only, random, closure) to compute the final-answer coverage of Table 20.
    """
    mandatory = [u for u in units if u.mandatory]
    if not mandatory:
        return None
    return all(bool(np.all(mask[u.token_start : u.token_end])) for u in mandatory)


def _fallback(scores: np.ndarray, token_mask: np.ndarray, units: list[Unit], reason: str) -> ClosureResult:
    covered = final_answer_covered(token_mask, units)
    return ClosureResult(
        mask=token_mask.copy(),
        chosen_units=[],
        used_budget=int(token_mask.sum()),
        fallback=True,
        final_answer_kept=bool(covered),
        utility_retained=_retained(scores, token_mask, token_mask),
        units=units,
        has_final_answer=covered is not None,
        solver="fallback",
        fallback_reason=reason,
    )


def _token_mask(scores: np.ndarray, token_mask: np.ndarray | None, b_r: int) -> np.ndarray:
    if token_mask is None:
        return top_b_mask(scores, b_r)
    token_mask = np.asarray(token_mask).astype(bool)
    if token_mask.shape != scores.shape or int(token_mask.sum()) > b_r:
        raise ValueError(f"token_mask must be (r,)={scores.shape} with at most b_r={b_r} positions; "
                         f"got shape {token_mask.shape} with {int(token_mask.sum())}")
    return token_mask


def _select_optional(
    units: list[Unit], optional: list[int], q: np.ndarray, positive: np.ndarray, capacity: int, dp_limit: int
) -> tuple[list[int], str]:
    """Whole non-mandatory units for the residual ``capacity``: (indices into ``units``, solver name).

    Units with ``q < 0`` never improve the objective and are left out; when every remaining unit fits, taking all
    of them is the exact optimum (solver ``all``); otherwise DP (``capacity <= dp_limit``) or greedy.
    """
    if not optional or capacity <= 0:
        return [], "none"
    tol = 1e-9 * (1.0 + float(np.abs(q).sum()))
    pool = [i for i in optional if q[i] >= -tol]
    weights = [units[i].size for i in pool]
    if sum(weights) <= capacity:
        return pool, "all"
    solve, name = (knapsack_dp, "dp") if capacity <= dp_limit else (greedy_density, "greedy")
    picked = solve(weights, q[pool], capacity, priority=[units[i].priority for i in pool], positive=positive[pool])
    return [pool[j] for j in picked], name


def closure_projection(
    scores: np.ndarray,
    units: Sequence[Unit] | None,
    b_r: int,
    *,
    token_mask: np.ndarray | None = None,
    tau: float | None = None,
    alpha: float = ALPHA,
    eps: float = EPS,
    dp_capacity_limit: int = DP_CAPACITY_LIMIT,
    complete_budget: bool = True,
    core_mask: np.ndarray | None = None,
) -> ClosureResult:
    """Project the response selection onto structural units under the budget ``b_r`` (paper eq. 11, App. G.1).

    Args:
        scores: (r,) final conditional response scores ``s_j = Delta_r(j | S_p^(T))``.
        units: Units partitioning ``[0, r)`` (from :func:`units.structural_units`); None or empty -> fallback.
        b_r: Response budget over the eligible positions, ``0 <= b_r <= r``.
        token_mask: (r,) pre-projection selection ``S_r^(T)`` (at most ``b_r`` positions); None = Top-``b_r``.
            Returned on fallback; the denominator of ``utility_retained``.
        tau: Clipping threshold of ``q``; None = ``mean |s|`` (module docstring).
        alpha: Size exponent of ``q`` (default 0.5).
        eps: Size smoothing of ``q`` (default 1.0).
        dp_capacity_limit: Exact DP when the residual capacity is at most this, greedy by density above.
        complete_budget: Fill the residual with single positions so the mask holds exactly ``b_r``.
        core_mask: (r,) bool union of the units' cores when the caller has it (:func:`units.units_and_core`);
            None builds it from the units' ``core`` fields.

    Returns:
        :class:`ClosureResult`; ``mask.sum() <= b_r`` always (``== b_r`` with ``complete_budget``).

    Raises:
        ValueError: Non-finite scores, ``b_r`` out of range, a token mask over budget, or units that do not
            partition ``[0, r)``.
    """
    scores = np.asarray(scores, dtype=np.float64)
    units = list(units or [])
    _check_inputs(scores, units, b_r)
    if core_mask is not None and np.shape(core_mask) != scores.shape:
        raise ValueError(f"core_mask must be (r,)={scores.shape}, the union of the units' cores; got "
                         f"{np.shape(core_mask)}")
    token_mask = _token_mask(scores, token_mask, b_r)
    if not units:
        return _fallback(scores, token_mask, units, "no structural units")
    mask = np.zeros(scores.shape[0], dtype=bool)
    whole, capacity, partial = _take_mandatory(units, scores, mask, b_r)
    optional = [i for i, u in enumerate(units) if not u.mandatory]
    if core_mask is None:
        unit_id, core = _unit_index(units, scores.shape[0], partition=True)
    else:
        unit_id, core = np.repeat(np.arange(len(units)), [u.size for u in units]), np.asarray(core_mask, dtype=bool)
    if kernels.active():  # the same sums in one compiled pass
        sums, sizes, positive = kernels.unit_sums(scores, unit_id, core, len(units), tau)
        q = np.where(sizes > 0, sums / np.power(sizes + eps, alpha), 0.0)  # (M,) as _quality
    else:
        q = _quality(scores, unit_id, core, len(units), tau, alpha, eps)  # (M,)
        positive = np.bincount(unit_id, weights=np.maximum(scores, 0.0), minlength=len(units))  # (M,)
    picked, solver = _select_optional(units, optional, q, positive, capacity, dp_capacity_limit)
    chosen = np.zeros(len(units), dtype=bool)
    chosen[picked] = True
    if kernels.active():
        completed, retained = kernels.finish_projection(mask, chosen, unit_id, scores, b_r, complete_budget,
                                                        token_mask)
    else:
        mask |= chosen[unit_id]
        completed = _complete(mask, scores, b_r) if complete_budget else 0
        retained = _retained(scores, mask, token_mask)
    covered = final_answer_covered(mask, units)
    return ClosureResult(
        mask=mask,
        chosen_units=sorted(whole + picked),
        used_budget=int(mask.sum()),
        fallback=False,
        final_answer_kept=bool(covered),
        utility_retained=retained,
        units=units,
        has_final_answer=covered is not None,
        solver=solver,
        completed_positions=completed,
        partial_mandatory=partial,
    )


def project_response(
    response: str,
    domain: str | None,
    offsets: Sequence[tuple[int, int]] | np.ndarray,
    scores: np.ndarray,
    b_r: int,
    *,
    token_mask: np.ndarray | None = None,
    max_unit_tokens: int = MAX_UNIT_TOKENS,
    min_unit_tokens: int = MIN_UNIT_TOKENS,
    **projection_kwargs,
) -> ClosureResult:
    """Alignment check + :func:`units.structural_units` + :func:`closure_projection`, with the token-mask fallback.

    Args:
        response: Response text.
        domain: Record domain (``math`` / ``code`` / ``instruction`` / other -> sentences).
        offsets: (r,) character spans of the eligible response tokens, pairs or an (r, 2) array (use
            :func:`alignment.spans_from_flat` on the token row's ``response_offsets`` and drop the EOS).
        scores: (r,) final conditional response scores.
        b_r: Response budget.
        token_mask: (r,) pre-projection selection (None = Top-``b_r`` of ``scores``).
        max_unit_tokens: See :func:`units.structural_units`.
        min_unit_tokens: See :func:`units.structural_units`.
        **projection_kwargs: ``tau``, ``alpha``, ``eps``, ``dp_capacity_limit``, ``complete_budget``.

    Returns:
        The :class:`ClosureResult`; ``fallback=True`` with ``fallback_reason`` when the offsets do not align with
        the text (the token mask is returned unchanged).
    """
    scores = np.asarray(scores, dtype=np.float64)
    if len(offsets) != scores.shape[0]:
        raise ValueError(f"{len(offsets)} offsets for {scores.shape[0]} scores; pass the eligible positions only "
                         "(response side without the EOS)")
    units, core, check = units_and_core(response, domain, offsets, max_unit_tokens=max_unit_tokens,
                                        min_unit_tokens=min_unit_tokens)
    if units is None:
        _check_inputs(scores, [], b_r)
        return _fallback(scores, _token_mask(scores, token_mask, b_r), [], f"alignment: {check.reason}")
    return closure_projection(scores, units, b_r, token_mask=token_mask, core_mask=core, **projection_kwargs)
