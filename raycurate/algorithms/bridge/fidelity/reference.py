"""Exact conditional reference scores of one example (paper App. F.1, F.2): leave-one-out interactions
``beta^exact`` and the response utilities recomputed on a physically compacted prompt."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from raycurate.algorithms.bridge.fidelity.eligible import (
    eligible_subset,
    fixed_response_mask,
    kept_prompt_mask,
    one_row,
    prompt_positions,
    response_positions,
)

if TYPE_CHECKING:
    import torch
    from torch import nn


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

    from raycurate.algorithms.bridge.token_utility import token_utilities

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
        direction: ``{parameter name: v}`` (:func:`raycurate.algorithms.bridge.token_utility.scoring_direction`).
        chunk: leave-one-out rows per JVP call (memory knob), >= 1.

    Returns:
        ``a`` (R,) float64 utilities of the response-side tokens on the full prompt (``R = n - prompt_len``), and
        ``beta_exact`` (p, R) float64.
    """
    import torch

    input_ids = one_row(input_ids, prompt_len)
    idx = prompt_positions(prompt_idx, prompt_len)
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

    input_ids = one_row(input_ids, prompt_len)
    keep = np.asarray(prompt_keep, dtype=bool)
    if keep.shape != (prompt_len,):
        raise ValueError(f"prompt_keep has shape {keep.shape}; it needs one flag per prompt position ({prompt_len},)")
    if not keep.any():
        raise ValueError("the compacted prompt is empty; keep at least one prompt token (BOS is fixed)")
    kept = torch.as_tensor(np.flatnonzero(keep), device=input_ids.device)
    row = torch.cat([input_ids[:prompt_len][kept], input_ids[prompt_len:]])  # (|kept| + R,)
    return _response_utilities(model, row[None, :], int(kept.numel()), direction)[0].double().cpu().numpy()


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
    supervised = fixed_response_mask(response_idx, prompt_len, n) & count_fixed_response  # (R,)
    supervised[response_idx - prompt_len] = eligible_subset(S_r, response_idx.size, "S_r")
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
    input_ids = one_row(input_ids, prompt_len)
    p_idx = prompt_positions(prompt_idx, prompt_len)
    r_idx = response_positions(response_idx, prompt_len, input_ids.shape[0])
    s_p = eligible_subset(S_p, p_idx.size, "S_p")
    _, beta_exact = exact_interactions(model, input_ids, prompt_len, p_idx, direction, chunk)
    compacted = compacted_utilities(model, input_ids, prompt_len, kept_prompt_mask(p_idx, s_p, prompt_len), direction)
    return reference_from_interactions(beta_exact, compacted, prompt_len, r_idx, S_r, count_fixed_response)
