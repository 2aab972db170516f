"""Compact SFT rows for BRIDGE's final training (paper §4.5, App. B.2, D.1).

:func:`compact_example` / :func:`compact_table_rows` physically remove the prompt tokens the selection dropped and
keep the whole response as causal history, with ``loss_mask`` on the selected response positions and the EOS
(App. B.2).  Row contract as :mod:`raycurate.data.tokenize` writes it (prompt ``[0, prompt_len)``, response after,
``prompt_offsets`` two per prompt token, ``-1`` for template tokens).  No loss change is needed:
:func:`raycurate.algorithms.losses.example_losses` already averages over each row's supervised positions.
The stage is ``stages/bridge_compact.py``; decisions in docs/bridge.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

COMPACTED_FIELDS = ("input_ids", "prompt_len", "loss_mask", "prompt_offsets")


def compact_example(
    input_ids: list[int],
    prompt_len: int,
    prompt_keep: np.ndarray,
    response_loss: np.ndarray,
    prompt_offsets: list[int] | None = None,
) -> dict[str, Any]:
    """Physically compact one token row: drop unkept prompt tokens, keep the whole response, mask the loss.

    The caller's ``prompt_keep`` decides everything on the prompt side, so it must already hold the fixed positions
    (BOS, template tokens): :func:`raycurate.algorithms.bridge.selection.to_row_masks` produces masks of that form.  The
    last position (EOS) is always supervised, whatever ``response_loss`` says there (it is a fixed position, App.
    G.1); every other response position is supervised exactly when ``response_loss`` is True there.

    Args:
        input_ids: (n,) token ids of the row.
        prompt_len: number of prompt-side positions, 1 <= prompt_len < n.
        prompt_keep: (prompt_len,) bool, True for the prompt tokens to keep (at least one).
        response_loss: (n,) bool loss mask over the row; must be False on the whole prompt side.
        prompt_offsets: optional (2 * prompt_len,) flat character offsets of the prompt tokens.

    Returns:
        ``{"input_ids": list[int] (m,), "prompt_len": int (kept prompt count k), "loss_mask": list[int] (m,) 0/1,
        "prompt_offsets": list[int] (2k,) or None}`` with ``m = k + (n - prompt_len)``.  Position ``k + t`` of the
        new row is response position ``prompt_len + t`` of the old one.
    """
    ids = np.asarray(input_ids, dtype=np.int64)  # (n,)
    keep, loss = _check_masks(ids.shape[0], prompt_len, prompt_keep, response_loss)
    kept_idx = np.flatnonzero(keep)  # (k,) old prompt positions that survive
    new_ids = np.concatenate([ids[kept_idx], ids[prompt_len:]])  # (m,)
    new_loss = np.concatenate([np.zeros(kept_idx.size, dtype=np.int64), loss[prompt_len:].astype(np.int64)])
    new_loss[-1] = 1  # EOS is always supervised
    return {
        "input_ids": new_ids.tolist(),
        "prompt_len": int(kept_idx.size),
        "loss_mask": new_loss.tolist(),
        "prompt_offsets": _kept_offsets(prompt_offsets, kept_idx, prompt_len),
    }


def compact_table_rows(
    rows: Iterable[Mapping[str, Any]],
    masks: Mapping[str, tuple[np.ndarray, np.ndarray]],
) -> list[dict[str, Any]]:
    """Apply :func:`compact_example` to token-table rows, matching masks to rows by ``id``.

    Every field other than ``input_ids``, ``prompt_len``, ``loss_mask`` and ``prompt_offsets`` passes through
    unchanged (``id``, ``weight``, ``response_offsets`` (the response is complete, so its offsets stay valid),
    ``domain``, ...).  ``n_tokens_full`` records the row length before compaction (for the executed-token counts of
    paper Table 7).

    Args:
        rows: token rows with ``id``, ``input_ids`` (n,), ``prompt_len`` and optionally ``prompt_offsets``.
        masks: ``id -> (prompt_keep (prompt_len,) bool, loss_mask (n,) bool)``, e.g. from a selection artifact.

    Returns:
        The compacted rows, in input order.
    """
    rows = list(rows)
    missing = [str(r.get("id")) for r in rows if r.get("id") not in masks]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"no selection masks for {len(missing)} of {len(rows)} rows (ids: {shown}); select these "
                         "rows first or drop them from the table before compaction")
    out = []
    for row in rows:
        prompt_keep, loss_mask = masks[row["id"]]
        compact = compact_example(row["input_ids"], int(row["prompt_len"]), prompt_keep, loss_mask,
                                  row.get("prompt_offsets"))
        new_row = {k: v for k, v in row.items() if k not in COMPACTED_FIELDS}
        if "prompt_offsets" not in row:
            compact.pop("prompt_offsets")
        new_row.update(compact, n_tokens_full=len(row["input_ids"]))
        out.append(new_row)
    return out


def _check_masks(
    n: int, prompt_len: int, prompt_keep: np.ndarray, response_loss: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(prompt_len, bool) or int(prompt_len) != prompt_len or not 1 <= prompt_len < n:
        raise ValueError(f"need 1 <= prompt_len < len(input_ids) (got prompt_len={prompt_len!r}, n={n}): every row "
                         "has a prompt side and a response side ending with EOS")
    keep = np.asarray(prompt_keep, dtype=bool)
    loss = np.asarray(response_loss, dtype=bool)
    if keep.shape != (prompt_len,):
        raise ValueError(f"prompt_keep has shape {keep.shape}; pass one flag per prompt position, ({prompt_len},)")
    if loss.shape != (n,):
        raise ValueError(f"response_loss has shape {loss.shape}; pass a loss mask over the whole row, ({n},), as "
                         "selection.to_row_masks returns it")
    if not keep.any():
        raise ValueError("prompt_keep drops every prompt token; keep at least the fixed positions (BOS, template "
                         "tokens) so that the first response token has a context to be predicted from")
    if loss[:prompt_len].any():
        raise ValueError("response_loss is True on the prompt side; compact SFT supervises response positions "
                         "only, so clear the prompt side of the loss mask")
    return keep, loss


def _kept_offsets(prompt_offsets: list[int] | None, kept_idx: np.ndarray, prompt_len: int) -> list[int] | None:
    if prompt_offsets is None:
        return None
    offsets = np.asarray(prompt_offsets, dtype=np.int64)
    if offsets.shape != (2 * prompt_len,):
        raise ValueError(f"prompt_offsets has {offsets.size} values; the contract is two (start, end) per prompt "
                         f"token, 2 * prompt_len = {2 * prompt_len}")
    return offsets.reshape(prompt_len, 2)[kept_idx].reshape(-1).tolist()  # (2k,)
