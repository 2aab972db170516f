"""BRIDGE selection-level fidelity diagnostics (paper §5.4 Table 3, §3 Fig. 2(b), App. F.1, F.2; SPEC §4).

Why one ~770-line module: the generic rank and selection metrics already live in
:mod:`raycurate.algorithms.ranking`; what remains is one diagnostic, the exact leave-one-out reference, the proxies
and the per-example comparison that aggregates them into Table 3 / Fig. 2(b), and its parts share the eligible-
position and fixed-position conventions through private helpers that would otherwise have to become public.

Three parts, all per example and pure (numpy for the metrics, torch only where the model is evaluated):

1. **Metrics** (in :mod:`raycurate.algorithms.ranking`) between a reference score vector and a proxy score vector
   over the same candidates, with the budget-``b`` Top-b sets taken by :func:`raycurate.algorithms.selection.top_b`
   (ties by position): :func:`spearman` (average ranks for ties),
   :func:`top_b_overlap` ``|Top_b(ref) & Top_b(proxy)| / b``, :func:`jaccard` ``|.&.| / |.|.|``,
   :func:`normalized_regret` and :func:`utility_retention`.  With
   ``U_ref(S) = sum_{x in S} ref_x``, App. F.2 defines the retention ``Ret = U_ref(S_proxy) / U_ref(S_ref)`` and
   Table 18 reports ``Norm. Regret = 1 - Ret`` (0.9925 / 0.0075, 0.9948 / 0.0052), so

       regret = (U_ref(S_ref) - U_ref(S_proxy)) / |U_ref(S_ref)|  >= 0,

   which equals ``1 - Ret`` when ``U_ref(S_ref) > 0`` and stays a non-negative loss when the best reference
   utility is negative (decision: absolute value in the denominator).  Degenerate cases return NaN and are left
   out of the means, as App. F.3 does ("zero-variance ... vectors are excluded ... valid sample counts are
   reported"): Spearman of a constant vector, overlap/Jaccard at ``b = 0``, regret when ``U_ref(S_ref) = 0`` and
   the proxy set is not optimal.

2. **Exact conditional reference scores** (App. F.1, F.2) for one example with direction ``v``:
   ``beta^exact_ij = v . [g_j(P) - g_j(T_i(P))] = a_j(P) - a_j(T_i(P))`` where ``T_i(P)`` physically removes prompt
   token ``i`` (later positions shift left) and ``a_j`` is the JVP token utility
   (:func:`raycurate.algorithms.token_utility.token_utilities`); the leave-one-out rows all have length ``n - 1``
   and go through the model as batches of ``chunk`` rows, one JVP call per chunk.  Then
   ``Delta_p^exact(i | S_r) = sum_{j in S_r} beta^exact_ij`` and ``Delta_r^exact(j | S_p) = a_j(S_p)``, the
   utility recomputed on the physically compacted prompt (paper §5.4, App. F.2).

3. **Proxies** compared with the reference (Table 3): "Attention" (routing weights only, ``a`` set to 1:
   ``sum_{j in S_r} A_p[j, i]`` and ``c_j + sum_{i in S_p} A_p[j, i]``) and "Attention x a" (the BRIDGE
   surrogate ``Delta_p``, ``Delta_r``); :func:`fidelity_table` aggregates per-example metrics into Table 3 rows.
   :func:`ranking_shift` measures Fig. 2(b): one minus the Spearman correlation between the full-retention
   ranking and the ranking conditioned on a smaller opposite-side subset.

Fixed positions (decision, consistent with :func:`raycurate.algorithms.selection.fold_fixed_positions`): the
candidates are the *eligible* positions; fixed prompt tokens (BOS, template) stay in every compacted prompt and
fixed response tokens (EOS, end-of-turn) are always supervised, so they enter both the reference
(``Delta_p^exact`` sums over ``S_r`` plus the fixed response positions) and the proxies (folded into ``gamma``
and the prompt bias); ``count_fixed_response=False`` drops the fixed response terms from the compared prompt
scores, the paper's protocol ("EOS excluded from response evaluation", App. F.3).  BOS is never perturbed and EOS
never ranked.
The conditioning state of a diagnosed example is the final BRIDGE selection ``(S_p^(T), S_r^(T))`` of the
surrogate at the configured budgets (decision; §5.4 does not name the state).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from raycurate.algorithms.ranking import (
    METRICS,
    normalized_regret,
    selection_metrics,
    spearman,
    top_b_overlap,
    utility_retention,
)
from raycurate.algorithms.selection import budgets, fold_fixed_positions, select, top_b

if TYPE_CHECKING:
    import torch
    from torch import nn

SIDES = ("prompt", "response")
PROXIES = ("attention", "attention_x_a")
KNOCKOUT = "knockout_grad"  # beyond the paper: first-order prompt knock-out derivative (example_fidelity only)
DEFAULT_RETENTIONS = (1.0, 0.9, 0.75, 0.5, 0.25, 0.1)


# --------------------------------------------------------------------------------- exact reference scores


def _one_row(input_ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    if input_ids.dim() == 2 and input_ids.shape[0] == 1:
        input_ids = input_ids[0]
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be one unpadded example of shape (n,), got {tuple(input_ids.shape)}")
    if not 1 <= prompt_len < input_ids.shape[0]:
        raise ValueError(f"need 1 <= prompt_len < n, got prompt_len={prompt_len}, n={input_ids.shape[0]}")
    return input_ids


def _prompt_positions(prompt_idx: Sequence[int] | np.ndarray, prompt_len: int) -> np.ndarray:
    idx = np.asarray(prompt_idx, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= prompt_len or np.any(np.diff(idx) <= 0)):
        raise ValueError(f"prompt_idx must be strictly increasing positions in [0, {prompt_len}); use "
                         "selection.eligible_positions")
    return idx


def _response_positions(response_idx: Sequence[int] | np.ndarray, prompt_len: int, n: int) -> np.ndarray:
    idx = np.asarray(response_idx, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < prompt_len or idx.max() >= n or np.any(np.diff(idx) <= 0)):
        raise ValueError(f"response_idx must be strictly increasing positions in [{prompt_len}, {n}); use "
                         "selection.eligible_positions")
    return idx


def _response_utilities(
    model: nn.Module, rows: torch.Tensor, response_start: int, direction: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """Utilities of every response-side token of equal-length rows (one JVP call).

    Args:
        model: Causal LM in eval mode.
        rows: (B, m) token ids, no padding; positions ``[response_start, m)`` are the response side.
        response_start: first response position.
        direction: ``{parameter name: v}``.

    Returns:
        (B, m - response_start) float32 utilities ``a_j``.
    """
    import torch

    from raycurate.algorithms.token_utility import token_utilities

    attention_mask = torch.ones_like(rows)
    loss_mask = torch.zeros_like(rows)
    loss_mask[:, response_start:] = 1
    return token_utilities(model, rows, attention_mask, loss_mask, direction)[:, response_start:]


def leave_one_out_rows(input_ids: torch.Tensor, positions: Sequence[int] | np.ndarray) -> torch.Tensor:
    """Copies of one row with one position physically removed each (``T_i(P)``, App. F.1).

    Args:
        input_ids: (n,) token ids.
        positions: (k,) positions to remove, one per output row.

    Returns:
        (k, n - 1) token ids; row ``m`` is ``input_ids`` without position ``positions[m]``.
    """
    import torch

    n = input_ids.shape[0]
    removed = torch.as_tensor(np.asarray(positions, dtype=np.int64), device=input_ids.device)  # (k,)
    cols = torch.arange(n - 1, device=input_ids.device)  # (n-1,)
    source = cols[None, :] + (cols[None, :] >= removed[:, None]).long()  # (k, n-1): skip the removed column
    return input_ids[source]


def exact_interactions(
    model: nn.Module,
    input_ids: torch.Tensor,
    prompt_len: int,
    prompt_idx: Sequence[int] | np.ndarray,
    direction: Mapping[str, torch.Tensor],
    chunk: int = 16,
) -> tuple[np.ndarray, np.ndarray]:
    """Full-prompt utilities and exact leave-one-out interactions of one example (App. F.1).

    ``beta^exact[m, j] = a_j(P) - a_j(T_i(P))`` for ``i = prompt_idx[m]`` and every response-side token ``j``
    (fixed ones included), with ``a_j`` the JVP utility.  Cost: one JVP pass on the full row plus
    ``ceil(p / chunk)`` JVP passes of ``chunk`` rows of length ``n - 1``.

    Args:
        model: Causal LM at theta_bar, in eval mode.
        input_ids: (n,) token ids of one example, no padding.
        prompt_len: number of prompt-side positions (BOS included).
        prompt_idx: (p,) prompt positions to perturb (the eligible ones; BOS is not perturbed).
        direction: ``{parameter name: v}`` (:func:`raycurate.algorithms.token_utility.scoring_direction`).
        chunk: leave-one-out rows per JVP call (memory knob), >= 1.

    Returns:
        ``a`` (R,) float64 utilities of the response-side tokens on the full prompt (``R = n - prompt_len``), and
        ``beta_exact`` (p, R) float64.
    """
    import torch

    input_ids = _one_row(input_ids, prompt_len)
    idx = _prompt_positions(prompt_idx, prompt_len)
    if isinstance(chunk, bool) or int(chunk) != chunk or chunk < 1:
        raise ValueError(f"chunk must be a positive integer (rows per JVP call), got {chunk!r}")
    full = _response_utilities(model, input_ids[None, :], prompt_len, direction)[0]  # (R,)
    pieces = []
    for start in range(0, idx.size, int(chunk)):
        rows = leave_one_out_rows(input_ids, idx[start:start + int(chunk)])  # (k, n-1)
        pieces.append(full[None, :] - _response_utilities(model, rows, prompt_len - 1, direction))  # (k, R)
    beta = torch.cat(pieces) if pieces else full.new_zeros((0, full.shape[0]))  # (p, R)
    return full.double().cpu().numpy(), beta.double().cpu().numpy()


def compacted_utilities(
    model: nn.Module,
    input_ids: torch.Tensor,
    prompt_len: int,
    prompt_keep: np.ndarray,
    direction: Mapping[str, torch.Tensor],
) -> np.ndarray:
    """Response utilities recomputed on the physically compacted prompt (``a_j(S_p)``, App. F.2).

    Args:
        model: Causal LM at theta_bar, in eval mode.
        input_ids: (n,) token ids of one example, no padding.
        prompt_len: number of prompt-side positions.
        prompt_keep: (prompt_len,) bool, True at the prompt positions that stay (fixed ones and S_p).
        direction: ``{parameter name: v}``.

    Returns:
        (R,) float64 utilities of the response-side tokens, ``R = n - prompt_len``.
    """
    import torch

    input_ids = _one_row(input_ids, prompt_len)
    keep = np.asarray(prompt_keep, dtype=bool)
    if keep.shape != (prompt_len,):
        raise ValueError(f"prompt_keep has shape {keep.shape}; it needs one flag per prompt position ({prompt_len},)")
    if not keep.any():
        raise ValueError("the compacted prompt is empty; keep at least one prompt token (BOS is fixed)")
    kept = torch.as_tensor(np.flatnonzero(keep), device=input_ids.device)
    row = torch.cat([input_ids[:prompt_len][kept], input_ids[prompt_len:]])  # (|kept| + R,)
    return _response_utilities(model, row[None, :], int(kept.numel()), direction)[0].double().cpu().numpy()


def _fixed_response_mask(response_idx: np.ndarray, prompt_len: int, n: int) -> np.ndarray:
    """(R,) bool over response-side positions: True at the fixed (non-eligible, always supervised) ones."""
    fixed = np.ones(n - prompt_len, dtype=bool)
    fixed[response_idx - prompt_len] = False
    return fixed


def _prompt_keep(prompt_idx: np.ndarray, s_p: np.ndarray, prompt_len: int) -> np.ndarray:
    """(prompt_len,) bool: fixed prompt positions plus the selected eligible ones."""
    keep = np.ones(prompt_len, dtype=bool)
    keep[prompt_idx] = s_p
    return keep


def _subset(mask: np.ndarray | Sequence[bool], size: int, name: str) -> np.ndarray:
    out = np.asarray(mask, dtype=bool)
    if out.shape != (size,):
        raise ValueError(f"{name} has shape {out.shape}; it must be a mask over the {size} eligible positions")
    return out


def reference_from_interactions(
    beta_exact: np.ndarray,
    compacted: np.ndarray,
    prompt_len: int,
    response_idx: np.ndarray,
    S_r: np.ndarray,
    count_fixed_response: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Assemble ``Delta_p^exact(. | S_r)`` and ``Delta_r^exact(. | S_p)`` from model outputs (paper §5.4).

    Args:
        beta_exact: (p, R) exact leave-one-out interactions over all response-side tokens.
        compacted: (R,) response utilities on the compacted prompt (fixed prompt positions plus S_p).
        prompt_len: number of prompt-side positions.
        response_idx: (r,) eligible response positions.
        S_r: (r,) bool selected eligible response tokens.
        count_fixed_response: whether ``delta_p`` also sums the fixed response tokens (see
            :func:`exact_reference_scores`).

    Returns:
        ``delta_p`` (p,) = row sums of ``beta_exact`` over S_r (and the fixed response tokens); ``delta_r`` (r,) =
        ``compacted`` at the eligible response positions.
    """
    n = prompt_len + beta_exact.shape[1]
    supervised = _fixed_response_mask(response_idx, prompt_len, n) & count_fixed_response  # (R,)
    supervised[response_idx - prompt_len] = _subset(S_r, response_idx.size, "S_r")
    return beta_exact @ supervised.astype(np.float64), compacted[response_idx - prompt_len]


def exact_reference_scores(
    model: nn.Module,
    input_ids: torch.Tensor,
    prompt_len: int,
    prompt_idx: Sequence[int] | np.ndarray,
    response_idx: Sequence[int] | np.ndarray,
    direction: Mapping[str, torch.Tensor],
    S_p: np.ndarray,
    S_r: np.ndarray,
    chunk: int = 16,
    count_fixed_response: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact conditional reference scores of one example (paper §5.4, App. F.1, F.2).

    ``Delta_p^exact(i | S_r) = sum_{j in S_r or fixed} (a_j(P) - a_j(T_i(P)))`` by leave-one-out removal of each
    eligible prompt token, and ``Delta_r^exact(j | S_p) = a_j`` recomputed on the prompt compacted to the fixed
    positions plus S_p.

    Args:
        model: Causal LM at theta_bar, in eval mode.
        input_ids: (n,) token ids of one example, no padding.
        prompt_len: number of prompt-side positions (BOS included).
        prompt_idx: (p,) eligible prompt positions (``selection.eligible_positions``).
        response_idx: (r,) eligible response positions; the other response-side positions (EOS, end-of-turn)
            are fixed and always supervised.
        direction: ``{parameter name: v}``.
        S_p: (p,) bool selected eligible prompt tokens (conditions the response side).
        S_r: (r,) bool selected eligible response tokens (conditions the prompt side).
        chunk: leave-one-out rows per JVP call.
        count_fixed_response: True (default) sums the always-supervised fixed response tokens into
            ``delta_p_exact`` too, matching the folded surrogate that selection ranks by; False sums S_r only, the
            paper's protocol ("EOS excluded from response evaluation", App. F.3).

    Returns:
        ``delta_p_exact`` (p,) and ``delta_r_exact`` (r,), float64.
    """
    input_ids = _one_row(input_ids, prompt_len)
    p_idx = _prompt_positions(prompt_idx, prompt_len)
    r_idx = _response_positions(response_idx, prompt_len, input_ids.shape[0])
    s_p = _subset(S_p, p_idx.size, "S_p")
    _, beta_exact = exact_interactions(model, input_ids, prompt_len, p_idx, direction, chunk)
    compacted = compacted_utilities(model, input_ids, prompt_len, _prompt_keep(p_idx, s_p, prompt_len), direction)
    return reference_from_interactions(beta_exact, compacted, prompt_len, r_idx, S_r, count_fixed_response)


# ---------------------------------------------------------------------------------------------- proxies


def _eligible_masks(prompt_len: int, n_response: int, prompt_idx: np.ndarray, response_idx: np.ndarray):
    prompt_eligible = np.zeros(prompt_len, dtype=bool)
    prompt_eligible[prompt_idx] = True
    response_eligible = np.zeros(n_response, dtype=bool)
    response_eligible[response_idx - prompt_len] = True
    return prompt_eligible, response_eligible


def _conditional(beta: np.ndarray, gamma: np.ndarray, bias: np.ndarray, s_p: np.ndarray, s_r: np.ndarray):
    """(Delta_p(. | S_r) (p,), Delta_r(. | S_p) (r,)) of the folded surrogate."""
    return bias + beta @ s_r.astype(np.float64), gamma + s_p.astype(np.float64) @ beta


def proxy_scores(
    a_p: np.ndarray,
    c: np.ndarray,
    a: np.ndarray,
    prompt_len: int,
    prompt_idx: Sequence[int] | np.ndarray,
    response_idx: Sequence[int] | np.ndarray,
    S_p: np.ndarray,
    S_r: np.ndarray,
    count_fixed_response: bool = True,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The two Table 3 proxies conditioned on ``(S_p, S_r)``, fixed positions folded in.

    * ``"attention"``: ``a`` replaced by 1, i.e. ``sum_{j in S_r} A_p[j, i]`` and ``c_j + sum_{i in S_p} A_p[j, i]``.
    * ``"attention_x_a"``: the BRIDGE surrogate ``Delta_p(i | S_r)``, ``Delta_r(j | S_p)`` (§4.3-4.4).

    Args:
        a_p: (R, P) routing weights over all response-side rows and prompt-side columns (``P = prompt_len``),
            from :func:`raycurate.algorithms.routing.routing_weights`.
        c: (R,) response-history mass.
        a: (R,) full-prompt utilities of the response-side tokens.
        prompt_len: ``P``.
        prompt_idx: (p,) eligible prompt positions.
        response_idx: (r,) eligible response positions.
        S_p: (p,) bool selected eligible prompt tokens.
        S_r: (r,) bool selected eligible response tokens.
        count_fixed_response: whether the prompt scores include the fixed response tokens' terms (the folded
            prompt bias); set it as for :func:`exact_reference_scores`.

    Returns:
        ``{proxy name: (delta_p (p,), delta_r (r,))}`` float64, names in :data:`PROXIES` order.
    """
    a_p, c, a = (np.asarray(x, dtype=np.float64) for x in (a_p, c, a))
    if a_p.shape != (c.shape[0], prompt_len) or a.shape != c.shape:
        raise ValueError(f"need a_p (R, {prompt_len}), c (R,), a (R,); got {a_p.shape}, {c.shape}, {a.shape}")
    p_idx = _prompt_positions(prompt_idx, prompt_len)
    r_idx = _response_positions(response_idx, prompt_len, prompt_len + c.shape[0])
    s_p, s_r = _subset(S_p, p_idx.size, "S_p"), _subset(S_r, r_idx.size, "S_r")
    masks = _eligible_masks(prompt_len, c.shape[0], p_idx, r_idx)
    out = {}
    for name, weight in (("attention", np.ones_like(a)), ("attention_x_a", a)):
        beta_full = a_p.T * weight[None, :]  # (P, R): beta[i, j] = A_p[j, i] a_j (a = 1 for "attention")
        beta, gamma, bias = fold_fixed_positions(beta_full, c * weight, *masks)
        out[name] = _conditional(beta, gamma, bias if count_fixed_response else 0.0 * bias, s_p, s_r)
    return out


# ---------------------------------------------------------------------------------------- one example, table


@dataclass
class FidelityExample:
    """Reference and proxy scores of one diagnosed example (all over eligible positions).

    Attributes:
        b_p: prompt budget used for the Top-b metrics.
        b_r: response budget.
        reference: ``(delta_p_exact (p,), delta_r_exact (r,))``.
        proxies: ``{proxy name: (delta_p (p,), delta_r (r,))}``.
        S_p: (p,) bool conditioning prompt state.
        S_r: (r,) bool conditioning response state.
        beta: (p, r) surrogate interactions (folded), kept for :func:`ranking_shift`.
        gamma: (r,) surrogate history utilities (folded).
        prompt_bias: (p,) folded fixed-response routing term.
        prompt_idx: (p,) eligible prompt row positions (None when built by hand without a row).
        response_idx: (r,) eligible response row positions.
    """

    b_p: int
    b_r: int
    reference: tuple[np.ndarray, np.ndarray]
    proxies: dict[str, tuple[np.ndarray, np.ndarray]]
    S_p: np.ndarray
    S_r: np.ndarray
    beta: np.ndarray = field(repr=False)
    gamma: np.ndarray = field(repr=False)
    prompt_bias: np.ndarray = field(repr=False)
    prompt_idx: np.ndarray | None = None
    response_idx: np.ndarray | None = None

    def metrics(self) -> dict[tuple[str, str], dict[str, float]]:
        """``{(side, proxy): selection_metrics(reference, proxy, b_side)}`` for both sides and every proxy."""
        out = {}
        for name, scores in self.proxies.items():
            for k, (side, b) in enumerate(zip(SIDES, (self.b_p, self.b_r))):
                out[(side, name)] = selection_metrics(self.reference[k], scores[k], b)
        return out


def example_fidelity(
    model: nn.Module,
    input_ids: torch.Tensor,
    prompt_len: int,
    prompt_idx: Sequence[int] | np.ndarray,
    response_idx: Sequence[int] | np.ndarray,
    direction: Mapping[str, torch.Tensor],
    a_p: torch.Tensor | np.ndarray | None = None,
    c: torch.Tensor | np.ndarray | None = None,
    *,
    layer: int | None = None,
    rho_p: float = 0.75,
    rho_r: float = 0.75,
    rounds: int = 4,
    chunk: int = 16,
    count_fixed_response: bool = True,
    knockout: bool = True,
) -> FidelityExample:
    """Diagnose one example: surrogate selection, exact reference and the proxies at that state (§5.4).

    The full-prompt utilities ``a`` come from the same JVP pass that anchors ``beta^exact`` (so surrogate and
    reference share ``a_j(P)``); the state is the alternating BRIDGE selection (``rounds`` = T) of the surrogate
    at budgets ``budgets(p, r, rho_p, rho_r)``; references and proxies are conditioned on it.

    Args:
        model: Causal LM at theta_bar, in eval mode.
        input_ids: (n,) token ids, no padding.
        prompt_len: number of prompt-side positions.
        prompt_idx: (p,) eligible prompt positions.
        response_idx: (r,) eligible response positions.
        direction: ``{parameter name: v}``.
        a_p: (R, prompt_len) routing weights of the example (``routing.routing_weights``); with ``c``, or both
            None to compute them here from attention ``layer``.
        c: (R,) response-history mass.
        layer: routing layer when ``a_p``/``c`` are None (default: ``routing.default_routing_layer(model)``).
        rho_p: prompt retention ratio.
        rho_r: response supervision ratio.
        rounds: alternating rounds T.
        chunk: leave-one-out rows per JVP call.
        count_fixed_response: whether the prompt scores include the fixed response tokens (EOS, end-of-turn):
            in the selection state (``prompt_bias``, as ``SelectionSettings.fold_fixed_response``) and in the
            compared reference and proxies (see :func:`exact_reference_scores`).
        knockout: also diagnose the :data:`KNOCKOUT` proxy (``bridge.prompt_proxy = knockout_grad``): prompt side
            ``d/ds_i sum_{j in S_r (+ fixed)} a_j(s)`` at ``s = 1``
            (:func:`raycurate.algorithms.token_utility.knockout_prompt_scores`, one extra pass); its response side
            is the routing surrogate's ``Delta_r(. | S_p)`` (what the selection uses with that proxy), so it
            repeats ``attention_x_a``'s response row by construction.

    Returns:
        A :class:`FidelityExample` with proxies :data:`PROXIES` (+ :data:`KNOCKOUT`).
    """
    input_ids = _one_row(input_ids, prompt_len)
    n = int(input_ids.shape[0])
    p_idx = _prompt_positions(prompt_idx, prompt_len)
    r_idx = _response_positions(response_idx, prompt_len, n)
    if (a_p is None) != (c is None):
        raise ValueError("pass both a_p and c (from routing.routing_weights) or neither")
    if a_p is None:
        a_p, c = _routing(model, input_ids, prompt_len, layer)
    a_p, c = _numpy(a_p), _numpy(c)
    a_full, beta_exact = exact_interactions(model, input_ids, prompt_len, p_idx, direction, chunk)
    masks = _eligible_masks(prompt_len, n - prompt_len, p_idx, r_idx)
    beta, gamma, bias = fold_fixed_positions(a_p.T * a_full[None, :], c * a_full, *masks)
    b_p, b_r = budgets(p_idx.size, r_idx.size, rho_p, rho_r)
    if not count_fixed_response:
        bias = np.zeros_like(bias)  # the selection stage's default: fixed response tokens stay out of Delta_p
    state = select(beta, gamma, b_p, b_r, "alternating", rounds, prompt_bias=bias)
    s_p, s_r = state.prompt_mask, state.response_mask
    compacted = compacted_utilities(model, input_ids, prompt_len, _prompt_keep(p_idx, s_p, prompt_len), direction)
    reference = reference_from_interactions(beta_exact, compacted, prompt_len, r_idx, s_r, count_fixed_response)
    proxies = proxy_scores(a_p, c, a_full, prompt_len, p_idx, r_idx, s_p, s_r, count_fixed_response)
    if knockout:
        weights = np.zeros(n, dtype=np.float64)
        if count_fixed_response:
            weights[prompt_len:] = 1.0
        weights[r_idx] = s_r
        prompt_ko = knockout_scores(model, input_ids, p_idx, weights, direction)
        proxies[KNOCKOUT] = (prompt_ko, proxies["attention_x_a"][1])
    return FidelityExample(b_p, b_r, reference, proxies, s_p, s_r, beta, gamma, bias, p_idx, r_idx)


def knockout_scores(
    model: nn.Module,
    input_ids: torch.Tensor,
    prompt_idx: np.ndarray,
    response_weights: np.ndarray,
    direction: Mapping[str, torch.Tensor],
) -> np.ndarray:
    """Knock-out derivative prompt scores of one unpadded row at its eligible prompt positions.

    Args:
        model: Causal LM at theta_bar, in eval mode.
        input_ids: (n,) token ids.
        prompt_idx: (p,) eligible prompt positions.
        response_weights: (n,) weights of the response utilities (1 on the conditioning S_r).
        direction: ``{parameter name: v}``.

    Returns:
        (p,) float64 ``d/ds_i sum_t w_t a_t(s)`` at ``s = 1``.
    """
    import torch

    from raycurate.algorithms.token_utility import knockout_prompt_scores

    ids = input_ids[None, :]
    prompt_mask = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
    prompt_mask[0, torch.as_tensor(prompt_idx, dtype=torch.long, device=ids.device)] = True
    weights = torch.as_tensor(np.asarray(response_weights, dtype=np.float32), device=ids.device)[None, :]
    scores = knockout_prompt_scores(model, ids, torch.ones_like(ids), prompt_mask, weights, direction)[0]
    return scores.double().cpu().numpy()[prompt_idx]


def _routing(model: nn.Module, input_ids: torch.Tensor, prompt_len: int, layer: int | None):
    """(A_p (R, prompt_len), c (R,)) of one row from one attention layer (:mod:`raycurate.algorithms.routing`)."""
    import torch

    from raycurate.algorithms import routing

    layer = routing.default_routing_layer(model) if layer is None else layer
    ids = input_ids[None, :]
    attn = routing.attention_for_layer(model, ids, torch.ones_like(ids), layer)[0]  # (H, n, n)
    return routing.routing_weights(attn, prompt_len, ids.shape[1])


def _numpy(x: torch.Tensor | np.ndarray) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().double().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def fidelity_table(examples: Sequence[FidelityExample]) -> list[dict[str, float | int | str]]:
    """Paper Table 3: per-example metrics averaged over examples, per side and proxy.

    NaN metrics (undefined for an example, see the module docstring) are left out of that metric's mean; each
    row says how many examples each mean covers (``n_<metric>``).

    Args:
        examples: diagnosed examples (:func:`example_fidelity`), all with the same proxy names.

    Returns:
        Rows ``{"side", "proxy", "spearman", "top_b_overlap", "jaccard", "normalized_regret", "n_examples",
        "n_spearman", "n_top_b_overlap", "n_jaccard", "n_normalized_regret"}``, prompt rows first, proxies in the
        examples' order (Table 3 layout).
    """
    if not examples:
        raise ValueError("fidelity_table needs at least one diagnosed example")
    names = list(examples[0].proxies)
    if any(list(example.proxies) != names for example in examples):
        raise ValueError("examples carry different proxies; diagnose them all with the same proxy set")
    per_example = [example.metrics() for example in examples]
    rows = []
    for side in SIDES:
        for proxy in names:
            row: dict[str, float | int | str] = {"side": side, "proxy": proxy, "n_examples": len(examples)}
            for metric in METRICS:
                values = np.array([m[(side, proxy)][metric] for m in per_example])  # (N,)
                valid = values[~np.isnan(values)]
                row[metric] = float(valid.mean()) if valid.size else math.nan
                row[f"n_{metric}"] = int(valid.size)
            rows.append(row)
    return rows


# ------------------------------------------------------------------- state-recomputed response scoring (F.2)

STATE_METRICS = ("spearman", "top_b_overlap", "utility_retention", "normalized_regret")


def state_recomputed_fidelity(
    model: nn.Module,
    input_ids: torch.Tensor,
    prompt_len: int,
    direction: Mapping[str, torch.Tensor],
    example: FidelityExample,
    rounds: Sequence[int] = (1, 2, 4),
) -> dict[int, dict[str, float]]:
    """Fixed-surrogate vs state-recomputed response scores after T rounds (paper App. F.2, Table 18).

    For each T: ``S_p^(T)`` from the alternating selection on the example's surrogate (``T = 1`` is one-pass),
    surrogate ``Delta_r^(T)(j) = gamma_j + sum_{i in S_p^(T)} beta_ij`` vs the fresh reference ``a_j`` recomputed
    on the physically compacted prompt ``S_p^(T)`` (one JVP pass per T), at the example's response budget.

    Args:
        model: Causal LM at theta_bar, in eval mode.
        input_ids: (n,) token ids of the diagnosed example.
        prompt_len: number of prompt-side positions.
        direction: ``{parameter name: v}``.
        example: the :class:`FidelityExample` of this row from :func:`example_fidelity` (its beta, gamma, prompt
            bias, budgets and eligible positions).
        rounds: the T values, each >= 1.

    Returns:
        ``{T: {"spearman", "top_b_overlap", "utility_retention", "normalized_regret"}}``.
    """
    if example.prompt_idx is None or example.response_idx is None:
        raise ValueError("example has no eligible positions; build it with example_fidelity on this row")
    input_ids = _one_row(input_ids, prompt_len)
    p_idx = _prompt_positions(example.prompt_idx, prompt_len)
    r_pos = _response_positions(example.response_idx, prompt_len, int(input_ids.shape[0])) - prompt_len
    out = {}
    for t in rounds:
        state = select(example.beta, example.gamma, example.b_p, example.b_r, "alternating", int(t),
                       prompt_bias=example.prompt_bias)
        keep = _prompt_keep(p_idx, state.prompt_mask, prompt_len)
        fresh = compacted_utilities(model, input_ids, prompt_len, keep, direction)[r_pos]  # (r,)
        surrogate = state.response_scores  # (r,) Delta_r(. | S_p^(T))
        out[int(t)] = {
            "spearman": spearman(fresh, surrogate),
            "top_b_overlap": top_b_overlap(fresh, surrogate, example.b_r),
            "utility_retention": utility_retention(fresh, surrogate, example.b_r),
            "normalized_regret": normalized_regret(fresh, surrogate, example.b_r),
        }
    return out


def state_fidelity_table(per_example: Sequence[Mapping[int, Mapping[str, float]]]) -> list[dict[str, float]]:
    """Paper Table 18: means over examples of :func:`state_recomputed_fidelity`, one row per T (NaN skipped).

    Args:
        per_example: outputs of :func:`state_recomputed_fidelity`, all with the same T values.

    Returns:
        Rows ``{"T", <metric>, "n_<metric>"}`` in ascending T.
    """
    if not per_example:
        raise ValueError("state_fidelity_table needs at least one example")
    rows = []
    for t in sorted(per_example[0]):
        row: dict[str, float] = {"T": t}
        for metric in STATE_METRICS:
            values = np.array([m[t][metric] for m in per_example])  # (N,)
            valid = values[~np.isnan(values)]
            row[metric] = float(valid.mean()) if valid.size else math.nan
            row[f"n_{metric}"] = int(valid.size)
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------ ranking shift (Fig. 2(b))


def nested_random_masks(n: int, sizes: Sequence[int], rng: np.random.Generator) -> np.ndarray:
    """Random NESTED subsets: the first ``b`` entries of one seeded permutation for every size ``b``.

    Smaller subsets are contained in larger ones, so a retention curve shrinks one fixed random subset
    ("progressively smaller sets", paper Fig. 2(b)) instead of redrawing it at every ratio.

    Args:
        n: number of candidates.
        sizes: (k,) subset sizes, each in [0, n].
        rng: seeded generator (one permutation is drawn).

    Returns:
        (k, n) bool masks; row ``m`` has ``sizes[m]`` True.
    """
    order = rng.permutation(n)  # (n,)
    masks = np.zeros((len(sizes), n), dtype=bool)
    for m, b in enumerate(sizes):
        if not 0 <= int(b) <= n:
            raise ValueError(f"subset size {b} must lie in [0, {n}]")
        masks[m, order[:int(b)]] = True
    return masks


def ranking_shift(
    beta: np.ndarray,
    gamma: np.ndarray,
    prompt_bias: np.ndarray | None = None,
    retentions: Sequence[float] = DEFAULT_RETENTIONS,
    subset: Literal["top", "random"] = "random",
    seed: int | np.random.SeedSequence = 0,
) -> dict[str, np.ndarray]:
    """Ranking shift vs opposite-side retention for one example (paper §3 Finding 2, Fig. 2(b), App. C.1).

    Shift = 1 - Spearman between the full-retention ranking and the ranking conditioned on a retained
    opposite-side subset: prompt side ``1 - rho_s(Delta_p(. | R), Delta_p(. | S_r))`` with ``|S_r| =
    round(rho |R|)``; response side ``1 - rho_s(Delta_r(. | P), Delta_r(. | S_p))`` with ``|S_p| = round(rho |P|)``.
    The retained opposite subset is (decision; the paper says only "progressively smaller sets ... retained"):
    ``"random"`` (default, the Fig. 2(b) protocol), progressively smaller random NESTED subsets, the first ``b``
    entries of one permutation per side drawn with ``seed`` (:func:`nested_random_masks`); or ``"top"``, the
    full-state Top-b of that side (what full-state selection would retain; it hides the shift because the
    dropped tokens are the ones that contribute least).

    Args:
        beta: (p, r) interactions over eligible positions (folded; surrogate or exact).
        gamma: (r,) history utilities.
        prompt_bias: optional (p,) fixed-response term (default zero).
        retentions: opposite-side retention ratios in [0, 1].
        subset: ``"random"`` or ``"top"``.
        seed: RNG seed (or SeedSequence) for ``"random"``.

    Returns:
        ``{"retention": (k,), "prompt_shift": (k,), "response_shift": (k,)}`` float64; NaN where a ranking is
        constant (e.g. nothing retained on the opposite side and no bias).
    """
    if subset not in ("top", "random"):
        raise ValueError(f"unknown subset {subset!r}; choose 'top' or 'random'")
    beta = np.asarray(beta, dtype=np.float64)
    gamma = np.asarray(gamma, dtype=np.float64)
    bias = np.zeros(beta.shape[0]) if prompt_bias is None else np.asarray(prompt_bias, dtype=np.float64)
    if beta.ndim != 2 or gamma.shape != (beta.shape[1],) or bias.shape != (beta.shape[0],):
        raise ValueError(f"need beta (p, r), gamma (r,), prompt_bias (p,); got {beta.shape}, {gamma.shape}, "
                         f"{bias.shape}")
    p, r = beta.shape
    full_p, full_r = _conditional(beta, gamma, bias, np.ones(p, bool), np.ones(r, bool))  # (p,), (r,)
    sizes = [budgets(p, r, rho, rho) for rho in retentions]  # [(b_p, b_r)]
    if subset == "random":
        rng = np.random.default_rng(seed)
        kept_r = nested_random_masks(r, [b_r for _, b_r in sizes], rng)  # (k, r)
        kept_p = nested_random_masks(p, [b_p for b_p, _ in sizes], rng)  # (k, p)
    else:
        kept_r = np.stack([top_b(full_r, b_r) for _, b_r in sizes]) if sizes else np.zeros((0, r), bool)
        kept_p = np.stack([top_b(full_p, b_p) for b_p, _ in sizes]) if sizes else np.zeros((0, p), bool)
    prompt_shift, response_shift = [], []
    for m in range(len(sizes)):
        cond_p, _ = _conditional(beta, gamma, bias, np.ones(p, bool), kept_r[m])
        _, cond_r = _conditional(beta, gamma, bias, kept_p[m], np.ones(r, bool))
        prompt_shift.append(1.0 - spearman(full_p, cond_p))
        response_shift.append(1.0 - spearman(full_r, cond_r))
    return {
        "retention": np.asarray(retentions, dtype=np.float64),
        "prompt_shift": np.asarray(prompt_shift),
        "response_shift": np.asarray(response_shift),
    }


def mean_ranking_shift(curves: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Average :func:`ranking_shift` curves over examples (NaN entries left out), for Fig. 2(b).

    Args:
        curves: per-example outputs of :func:`ranking_shift` on the same retention grid.

    Returns:
        ``{"retention", "prompt_shift", "response_shift", "n_prompt", "n_response"}``: mean shifts (k,) and the
        number of examples each mean covers (k,).
    """
    if not curves:
        raise ValueError("mean_ranking_shift needs at least one curve")
    grid = np.asarray(curves[0]["retention"])
    if any(not np.array_equal(np.asarray(cv["retention"]), grid) for cv in curves):
        raise ValueError("curves use different retention grids; compute them with the same retentions")
    out: dict[str, np.ndarray] = {"retention": grid}
    for side in SIDES:
        stacked = np.stack([np.asarray(cv[f"{side}_shift"], dtype=np.float64) for cv in curves])  # (N, k)
        valid = ~np.isnan(stacked)
        count = valid.sum(axis=0)
        total = np.where(valid, stacked, 0.0).sum(axis=0)
        out[f"{side}_shift"] = np.where(count > 0, total / np.maximum(count, 1), np.nan)
        out[f"n_{side}"] = count
    return out
