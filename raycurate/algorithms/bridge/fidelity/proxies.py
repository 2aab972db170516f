"""The proxies compared with the exact reference (paper Table 3): "Attention", "Attention x a" (the BRIDGE
surrogate) and, beyond the paper, the first-order prompt knock-out derivative."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from raycurate.algorithms.bridge.fidelity.eligible import (
    eligible_masks,
    eligible_subset,
    prompt_positions,
    response_positions,
)
from raycurate.algorithms.bridge.selection import fold_fixed_positions

if TYPE_CHECKING:
    import torch
    from torch import nn

PROXIES = ("attention", "attention_x_a")
KNOCKOUT = "knockout_grad"  # beyond the paper: first-order prompt knock-out derivative (example_fidelity only)


def conditional_scores(beta: np.ndarray, gamma: np.ndarray, bias: np.ndarray, s_p: np.ndarray, s_r: np.ndarray):
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
            from :func:`raycurate.algorithms.bridge.routing.routing_weights`.
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
    p_idx = prompt_positions(prompt_idx, prompt_len)
    r_idx = response_positions(response_idx, prompt_len, prompt_len + c.shape[0])
    s_p, s_r = eligible_subset(S_p, p_idx.size, "S_p"), eligible_subset(S_r, r_idx.size, "S_r")
    masks = eligible_masks(prompt_len, c.shape[0], p_idx, r_idx)
    out = {}
    for name, weight in (("attention", np.ones_like(a)), ("attention_x_a", a)):
        beta_full = a_p.T * weight[None, :]  # (P, R): beta[i, j] = A_p[j, i] a_j (a = 1 for "attention")
        beta, gamma, bias = fold_fixed_positions(beta_full, c * weight, *masks)
        out[name] = conditional_scores(beta, gamma, bias if count_fixed_response else 0.0 * bias, s_p, s_r)
    return out


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

    from raycurate.algorithms.bridge.token_utility import knockout_prompt_scores

    ids = input_ids[None, :]
    prompt_mask = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
    prompt_mask[0, torch.as_tensor(prompt_idx, dtype=torch.long, device=ids.device)] = True
    weights = torch.as_tensor(np.asarray(response_weights, dtype=np.float32), device=ids.device)[None, :]
    scores = knockout_prompt_scores(model, ids, torch.ones_like(ids), prompt_mask, weights, direction)[0]
    return scores.double().cpu().numpy()[prompt_idx]
