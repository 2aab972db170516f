"""Scoring selectors against the embedded corpus's ground truth at token level (pure numpy).

A corrupted row labels where its response departs from the clean one (``label.corrupted_spans``, char spans). A
response token is *corrupted* when its character span overlaps one of them; a token-level selector should take
the loss off those tokens and leave it on the others. :func:`dropped_counts` counts both per row, so a selector's
share of corrupted tokens dropped can be compared with its share of other tokens dropped (what random masks at the
same ratio give for both).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def corrupted_tokens(response_offsets: Sequence[int], spans: Sequence[Sequence[int]]) -> np.ndarray:
    """Which response-side tokens overlap a corrupted char span.

    Args:
        response_offsets: Flattened ``start, end`` char offsets per response-side token (``2 * R`` values;
            ``-1, -1`` for template markup and special tokens, which are never corrupted).
        spans: Char ``[start, end)`` spans of the response.

    Returns:
        (R,) bool.
    """
    offsets = np.asarray(response_offsets, dtype=np.int64).reshape(-1, 2)  # (R, 2)
    hit = np.zeros(len(offsets), dtype=bool)
    real = offsets[:, 0] >= 0
    for start, end in spans:
        hit |= real & (offsets[:, 0] < end) & (offsets[:, 1] > start)
    return hit


def dropped_counts(loss_mask: Sequence[int], prompt_len: int, response_offsets: Sequence[int],
                   spans: Sequence[Sequence[int]]) -> dict[str, int]:
    """Per row: corrupted and other response tokens, and how many of each lost their loss.

    Args:
        loss_mask: (T,) the selector's loss mask over the whole row.
        prompt_len: Prompt tokens at the front of the row.
        response_offsets: The row's response offsets (``2 * (T - prompt_len)`` values).
        spans: The row's corrupted char spans.

    Returns:
        ``{"corrupted", "corrupted_dropped", "other", "other_dropped"}`` token counts.
    """
    mask = np.asarray(loss_mask, dtype=bool)[prompt_len:]  # (R,)
    bad = corrupted_tokens(response_offsets, spans)
    if bad.shape != mask.shape:
        raise ValueError(f"{mask.size} response positions but {bad.size} response offsets")
    return {"corrupted": int(bad.sum()), "corrupted_dropped": int((bad & ~mask).sum()),
            "other": int((~bad).sum()), "other_dropped": int((~bad & ~mask).sum())}


def corrupted_token_ranks(suspicion: Sequence[float], eligible: Sequence[bool],
                          bad: Sequence[bool]) -> np.ndarray | None:
    """Where a row's corrupted tokens rank among its eligible response tokens under a token score.

    A token's rank is the share of the row's other eligible tokens that are more suspect than it (ties count half):
    0 for the most suspect token, 1 for the least.  A score blind to the corruption puts corrupted tokens at 0.5 on
    average; one that sees it puts them near 0.

    Args:
        suspicion: (R,) per response-side token, higher = more suspect (a loss; a BRIDGE utility negated).
        eligible: (R,) tokens the score ranks (supervised response tokens with a finite score).
        bad: (R,) corrupted tokens (:func:`corrupted_tokens`).

    Returns:
        (C,) the ranks of the eligible corrupted tokens, or None when the row has none or fewer than two eligible
        tokens.
    """
    s = np.asarray(suspicion, dtype=np.float64)
    keep = np.asarray(eligible, dtype=bool) & np.isfinite(s)
    hit = np.asarray(bad, dtype=bool)[keep]
    s = s[keep]
    if s.size < 2 or not hit.any():
        return None
    more = (s[None, :] > s[:, None]).sum(axis=1)  # (R',) eligible tokens more suspect than each token
    ties = (s[None, :] == s[:, None]).sum(axis=1) - 1
    return ((more + 0.5 * ties) / (s.size - 1))[hit]
