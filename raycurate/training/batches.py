"""The token table a training worker reads, ``collate`` into padded batches, and the default SFT loss.

Every worker reads the needed columns of the whole token table (ids, input_ids, loss_mask, weight); fine up to a
few million short rows per node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

LossFn = Callable[[Any, dict[str, Any]], Any]
"""``(per_token (B, T), batch) -> ()`` loss of one micro-batch from its per-position losses
(:func:`raycurate.algorithms.losses.model_token_losses`; the engines form logits only over the supervised window)."""


@dataclass
class TokenTable:
    """The columns of the token-level table that training needs, as flat numpy arrays (rows sorted by id).

    Attributes:
        ids: (N,) example ids.
        token_values: (sum of lengths,) concatenated ``input_ids``.
        mask_values: (sum of lengths,) concatenated ``loss_mask``.
        offsets: (N + 1,) row ``i`` spans ``[offsets[i], offsets[i + 1])``.
        weights: (N,) float32 per-example weights (1.0 when the table has no ``weight`` column).
    """

    ids: np.ndarray
    token_values: np.ndarray
    mask_values: np.ndarray
    offsets: np.ndarray
    weights: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids (T_i,), loss_mask (T_i,)) of row ``i``."""
        lo, hi = self.offsets[i], self.offsets[i + 1]
        return self.token_values[lo:hi], self.mask_values[lo:hi]


def _flat_list_column(column: Any) -> tuple[np.ndarray, np.ndarray]:
    array = column.combine_chunks()
    lengths = array.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return array.flatten().to_numpy(zero_copy_only=False), offsets


def load_token_table(path: str) -> TokenTable:
    """Read ``id``, ``input_ids``, ``loss_mask`` and (if present) ``weight`` from a parquet file or directory.

    Raises:
        ValueError: When a required column is missing or a row's ``loss_mask`` is not aligned with its ids.
    """
    import pyarrow.compute as pc
    import pyarrow.dataset as pds

    dataset = pds.dataset(path, format="parquet")
    names = dataset.schema.names
    missing = [c for c in ("id", "input_ids", "loss_mask") if c not in names]
    if missing:
        raise ValueError(
            f"Token table {path} lacks columns {missing} (found {names}); train on the output of the tokenize "
            "stage (id, input_ids, prompt_len, loss_mask, weight)."
        )
    columns = ["id", "input_ids", "loss_mask"] + (["weight"] if "weight" in names else [])
    table = dataset.to_table(columns=columns).sort_by("id")
    tokens, offsets = _flat_list_column(table.column("input_ids"))
    masks, mask_offsets = _flat_list_column(table.column("loss_mask"))
    if not np.array_equal(offsets, mask_offsets):
        raise ValueError(f"Token table {path}: loss_mask and input_ids differ in length in some rows; re-tokenize.")
    if "weight" in names:
        weights = pc.fill_null(table.column("weight"), 1.0).to_numpy().astype(np.float32)
    else:
        weights = np.ones(table.num_rows, dtype=np.float32)
    return TokenTable(
        ids=np.asarray(table.column("id").to_pylist(), dtype=object),
        token_values=tokens.astype(np.int64),
        mask_values=masks.astype(np.int8),
        offsets=offsets,
        weights=weights,
    )


def stack_tables(first: TokenTable, second: TokenTable) -> TokenTable:
    """One table holding ``first``'s rows, then ``second``'s (row ``len(first) + j`` is ``second``'s row j)."""
    return TokenTable(
        ids=np.concatenate([first.ids, second.ids]),
        token_values=np.concatenate([first.token_values, second.token_values]),
        mask_values=np.concatenate([first.mask_values, second.mask_values]),
        offsets=np.concatenate([first.offsets, second.offsets[1:] + first.offsets[-1]]),
        weights=np.concatenate([first.weights, second.weights]),
    )


def collate(table: TokenTable, rows: np.ndarray, pad_id: int = 0) -> dict[str, Any]:
    """Right-pad the given rows into a batch.

    Args:
        table: The token table.
        rows: (B,) row indices.
        pad_id: Token id written at padded positions (they are masked out of attention and loss).

    Returns:
        ``input_ids`` (B, T) int64, ``attention_mask`` (B, T) int64, ``loss_mask`` (B, T) int8,
        ``weight`` (B,) float32 torch tensors; T = longest row.
    """
    import torch

    pairs = [table.row(int(i)) for i in rows]
    width = max(len(ids) for ids, _ in pairs)
    input_ids = np.full((len(pairs), width), pad_id, dtype=np.int64)
    attention = np.zeros((len(pairs), width), dtype=np.int64)
    loss_mask = np.zeros((len(pairs), width), dtype=np.int8)
    for b, (ids, mask) in enumerate(pairs):
        input_ids[b, : len(ids)] = ids
        attention[b, : len(ids)] = 1
        loss_mask[b, : len(ids)] = mask
    return {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(attention),
        "loss_mask": torch.from_numpy(loss_mask),
        "weight": torch.from_numpy(table.weights[np.asarray(rows, dtype=np.int64)]),
    }


def to_device(batch: dict[str, Any], device: Any) -> dict[str, Any]:
    """Every tensor of ``batch`` on ``device`` (non-blocking copies)."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def batch_token_losses(model: Any, batch: dict[str, Any], length_groups: int = 1) -> Any:
    """(B, T) per-position losses of a collated batch; logits only over its supervised window.

    Args:
        model: The causal LM, or a DDP / DeepSpeed / PEFT wrapper that forwards keyword arguments to it.
        batch: Output of :func:`collate` (``input_ids``, ``attention_mask``, ``loss_mask``) on the model's device.
        length_groups: Forwards of rows of similar length (``train.length_groups``;
            :func:`~raycurate.algorithms.losses.grouped_model_token_losses`); 1 is one forward.
    """
    from raycurate.algorithms.losses import grouped_model_token_losses

    return grouped_model_token_losses(model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"],
                                      length_groups)


def supervised_counts(table: TokenTable) -> np.ndarray:
    """(N,) supervised targets per row: nonzero ``loss_mask`` entries from position 1 on (position 0 has no
    prediction), as :func:`batch_token_losses` counts them."""
    supervised = (table.mask_values != 0).astype(np.int64)
    starts = table.offsets[:-1]
    return np.add.reduceat(supervised, starts) - supervised[starts]


def token_sft_loss(per_token: Any, batch: dict[str, Any]) -> Any:
    """Token-normalised loss (``train.loss_normalization=token``): ``sum_i w_i sum_t l_it / token_norm``.

    ``batch["token_norm"]`` is the supervised-token count of the whole effective batch divided by the micro-steps
    and ranks it is averaged over, so after that averaging every supervised token of the step weighs the same.

    Args:
        per_token: (B, T) per-position losses (0 where ``loss_mask`` is 0).
        batch: Output of :func:`collate` plus ``token_norm`` () float, on the losses' device.

    Returns:
        () scalar loss.
    """
    return (per_token.sum(dim=1) * batch["weight"].to(per_token.dtype)).sum() / batch["token_norm"]


def sft_loss(per_token: Any, batch: dict[str, Any]) -> Any:
    """Default loss: per-example masked mean token loss, weighted per example (``sum w_i l_i / B``).

    Args:
        per_token: (B, T) per-position losses (0 where ``loss_mask`` is 0).
        batch: Output of :func:`collate` on the losses' device.

    Returns:
        () scalar loss.
    """
    from raycurate.algorithms.losses import mean_supervised_loss, weighted_batch_loss

    per_example = mean_supervised_loss(per_token, batch["loss_mask"])  # (B,)
    return weighted_batch_loss(per_example, batch["weight"])
