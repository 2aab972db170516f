"""One diagnosed example (surrogate selection state, exact reference, proxies) and its aggregation into paper
Table 3; the state-recomputed response scoring of App. F.2 and its Table 18."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from raycurate.algorithms.bridge.fidelity.eligible import (
    SIDES,
    eligible_masks,
    kept_prompt_mask,
    one_row,
    prompt_positions,
    response_positions,
)
from raycurate.algorithms.bridge.fidelity.proxies import KNOCKOUT, knockout_scores, proxy_scores
from raycurate.algorithms.bridge.fidelity.reference import (
    compacted_utilities,
    exact_interactions,
    reference_from_interactions,
)
from raycurate.algorithms.bridge.selection import budgets, fold_fixed_positions, select
from raycurate.algorithms.ranking import (
    METRICS,
    normalized_regret,
    selection_metrics,
    spearman,
    top_b_overlap,
    utility_retention,
)

if TYPE_CHECKING:
    import torch
    from torch import nn


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
            (:func:`raycurate.algorithms.bridge.token_utility.knockout_prompt_scores`, one extra pass); its response
            side is the routing surrogate's ``Delta_r(. | S_p)`` (what the selection uses with that proxy), so it
            repeats ``attention_x_a``'s response row by construction.

    Returns:
        A :class:`FidelityExample` with proxies :data:`PROXIES` (+ :data:`KNOCKOUT`).
    """
    input_ids = one_row(input_ids, prompt_len)
    n = int(input_ids.shape[0])
    p_idx = prompt_positions(prompt_idx, prompt_len)
    r_idx = response_positions(response_idx, prompt_len, n)
    if (a_p is None) != (c is None):
        raise ValueError("pass both a_p and c (from routing.routing_weights) or neither")
    if a_p is None or c is None:  # both None (checked above)
        a_p, c = _routing(model, input_ids, prompt_len, layer)
    a_p, c = _numpy(a_p), _numpy(c)
    a_full, beta_exact = exact_interactions(model, input_ids, prompt_len, p_idx, direction, chunk)
    masks = eligible_masks(prompt_len, n - prompt_len, p_idx, r_idx)
    beta, gamma, bias = fold_fixed_positions(a_p.T * a_full[None, :], c * a_full, *masks)
    b_p, b_r = budgets(p_idx.size, r_idx.size, rho_p, rho_r)
    if not count_fixed_response:
        bias = np.zeros_like(bias)  # the selection stage's default: fixed response tokens stay out of Delta_p
    state = select(beta, gamma, b_p, b_r, "alternating", rounds, prompt_bias=bias)
    s_p, s_r = state.prompt_mask, state.response_mask
    compacted = compacted_utilities(model, input_ids, prompt_len, kept_prompt_mask(p_idx, s_p, prompt_len), direction)
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


def _routing(model: nn.Module, input_ids: torch.Tensor, prompt_len: int, layer: int | None):
    """(A_p (R, prompt_len), c (R,)) of one row from one attention layer (:mod:`..routing`)."""
    import torch

    from raycurate.algorithms.bridge import routing

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
    input_ids = one_row(input_ids, prompt_len)
    p_idx = prompt_positions(example.prompt_idx, prompt_len)
    r_pos = response_positions(example.response_idx, prompt_len, int(input_ids.shape[0])) - prompt_len
    out = {}
    for t in rounds:
        state = select(example.beta, example.gamma, example.b_p, example.b_r, "alternating", int(t),
                       prompt_bias=example.prompt_bias)
        keep = kept_prompt_mask(p_idx, state.prompt_mask, prompt_len)
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
