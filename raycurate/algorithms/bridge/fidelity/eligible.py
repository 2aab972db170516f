"""The eligible-position and fixed-position conventions that the fidelity references and proxies share.

Candidates are the *eligible* positions (``selection.eligible_positions``); fixed prompt tokens (BOS, template)
stay in every compacted prompt and fixed response tokens (EOS, end-of-turn) are always supervised (see
:mod:`raycurate.algorithms.bridge.fidelity`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

SIDES = ("prompt", "response")


def one_row(input_ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """``input_ids`` as one (n,) row (a (1, n) batch is unwrapped), checked against ``prompt_len``."""
    if input_ids.dim() == 2 and input_ids.shape[0] == 1:
        input_ids = input_ids[0]
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be one unpadded example of shape (n,), got {tuple(input_ids.shape)}")
    if not 1 <= prompt_len < input_ids.shape[0]:
        raise ValueError(f"need 1 <= prompt_len < n, got prompt_len={prompt_len}, n={input_ids.shape[0]}")
    return input_ids


def prompt_positions(prompt_idx: Sequence[int] | np.ndarray, prompt_len: int) -> np.ndarray:
    """(p,) int64 eligible prompt positions, checked to increase strictly inside ``[0, prompt_len)``."""
    idx = np.asarray(prompt_idx, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= prompt_len or np.any(np.diff(idx) <= 0)):
        raise ValueError(f"prompt_idx must be strictly increasing positions in [0, {prompt_len}); use "
                         "selection.eligible_positions")
    return idx


def response_positions(response_idx: Sequence[int] | np.ndarray, prompt_len: int, n: int) -> np.ndarray:
    """(r,) int64 eligible response positions, checked to increase strictly inside ``[prompt_len, n)``."""
    idx = np.asarray(response_idx, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < prompt_len or idx.max() >= n or np.any(np.diff(idx) <= 0)):
        raise ValueError(f"response_idx must be strictly increasing positions in [{prompt_len}, {n}); use "
                         "selection.eligible_positions")
    return idx


def fixed_response_mask(response_idx: np.ndarray, prompt_len: int, n: int) -> np.ndarray:
    """(R,) bool over response-side positions: True at the fixed (non-eligible, always supervised) ones."""
    fixed = np.ones(n - prompt_len, dtype=bool)
    fixed[response_idx - prompt_len] = False
    return fixed


def kept_prompt_mask(prompt_idx: np.ndarray, s_p: np.ndarray, prompt_len: int) -> np.ndarray:
    """(prompt_len,) bool: fixed prompt positions plus the selected eligible ones."""
    keep = np.ones(prompt_len, dtype=bool)
    keep[prompt_idx] = s_p
    return keep


def eligible_subset(mask: np.ndarray | Sequence[bool], size: int, name: str) -> np.ndarray:
    """``mask`` as a (size,) bool selection over the eligible positions; ``name`` labels the error."""
    out = np.asarray(mask, dtype=bool)
    if out.shape != (size,):
        raise ValueError(f"{name} has shape {out.shape}; it must be a mask over the {size} eligible positions")
    return out


def eligible_masks(prompt_len: int, n_response: int, prompt_idx: np.ndarray, response_idx: np.ndarray):
    """(prompt_len,) and (n_response,) bool masks, True at the eligible prompt / response-side positions."""
    prompt_eligible = np.zeros(prompt_len, dtype=bool)
    prompt_eligible[prompt_idx] = True
    response_eligible = np.zeros(n_response, dtype=bool)
    response_eligible[response_idx - prompt_len] = True
    return prompt_eligible, response_eligible
