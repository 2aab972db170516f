"""Masked, per-example weighted causal-LM losses (pure torch).

Convention of the token-level table: the loss at position ``t`` is the cross-entropy of predicting
``input_ids[:, t]`` from ``input_ids[:, :t]``, i.e. from ``logits[:, t - 1]``.  :func:`token_losses` is the
only place in raycurate where labels are shifted; everything downstream works on per-position losses that are
aligned with ``input_ids`` and ``loss_mask``.  :func:`pad_rows` right-pads token rows into the batch every
model pass of the stages takes (SFT, BRIDGE, BDS, LESS, P2D).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F


def token_losses(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Per-position next-token cross-entropy, aligned with ``input_ids``.

    Args:
        logits: (B, T, V) model outputs; ``logits[:, t]`` predicts ``input_ids[:, t + 1]``.
        input_ids: (B, T) token ids.
        loss_mask: (B, T) 1 where ``input_ids[:, t]`` is a supervised target, else 0 (any int/bool/float dtype).

    Returns:
        (B, T) float32 losses; 0 at t = 0 (nothing predicts the first token) and wherever ``loss_mask`` is 0.
    """
    batch, length, vocab = logits.shape
    losses = logits.new_zeros((batch, length), dtype=torch.float32)
    if length < 2:
        return losses
    pred = logits[:, :-1].float().reshape(-1, vocab)  # (B*(T-1), V)
    target = input_ids[:, 1:].reshape(-1)  # (B*(T-1),)
    shifted = F.cross_entropy(pred, target, reduction="none").view(batch, length - 1)  # (B, T-1)
    losses[:, 1:] = shifted
    return losses * (loss_mask != 0).to(losses.dtype)


def example_losses(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean token loss over each example's supervised positions.

    Args:
        logits: (B, T, V) model outputs.
        input_ids: (B, T) token ids.
        loss_mask: (B, T) supervised-target mask; position 0 never counts (it has no prediction).

    Returns:
        (B,) float32 mean loss per example; 0 for an example without supervised positions.
    """
    return mean_supervised_loss(token_losses(logits, input_ids, loss_mask), loss_mask)


def mean_supervised_loss(per_token: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """(B,) mean of (B, T) per-position losses over each row's supervised positions (t = 0 never counts)."""
    counted = (loss_mask != 0).to(torch.float32)
    counted[:, 0] = 0.0
    return per_token.sum(dim=1) / counted.sum(dim=1).clamp_min(1.0)


def logit_window(supervised: torch.Tensor) -> tuple[int, int] | None:
    """The positions ``[start, stop)`` whose logits predict every supervised target of a batch.

    ``logits[:, t]`` predicts ``input_ids[:, t + 1]``, so the window runs from one before the first supervised
    column to the last one (its own logit is not needed but keeps the window aligned with ``input_ids``).

    Args:
        supervised: (B, T) nonzero where ``input_ids[:, t]`` is a supervised target; column 0 is ignored.

    Returns:
        ``(start, stop)`` with ``start >= 0``, or None when no position from t = 1 on is supervised.
    """
    cols = (supervised[:, 1:] != 0).any(dim=0).nonzero().squeeze(1) + 1  # supervised columns, >= 1
    if cols.numel() == 0:
        return None
    return int(cols[0]) - 1, int(cols[-1]) + 1


def window_token_losses(
    window_logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, window: tuple[int, int]
) -> torch.Tensor:
    """:func:`token_losses` from the logits of a window of positions only, placed back on the whole row.

    Args:
        window_logits: (B, W, V) logits of positions ``start .. stop - 1`` (``W = stop - start``).
        input_ids: (B, T) token ids.
        loss_mask: (B, T) supervised-target mask.
        window: ``(start, stop)`` from :func:`logit_window` on ``loss_mask``.

    Returns:
        (B, T) float32 losses, equal to :func:`token_losses` on the full logits.
    """
    start, stop = window
    losses = window_logits.new_zeros(input_ids.shape, dtype=torch.float32)
    losses[:, start:stop] = token_losses(window_logits, input_ids[:, start:stop], loss_mask[:, start:stop])
    return losses


def model_token_losses(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """Per-position losses of one causal-LM forward that forms logits only over the supervised window.

    Equal to ``token_losses(model(...).logits, ...)`` but without the vocabulary projection and softmax of the
    positions before the first and after the last supervised target (``logits_to_keep``; the prompt side of an
    SFT row).  Gradients flow when the caller enables them.

    Args:
        model: A Hugging Face causal LM (``logits_to_keep`` and ``use_cache`` keywords), or a PEFT wrapper of one.
        input_ids: (B, T) token ids, right-padded.
        attention_mask: (B, T) 1 on real tokens.
        loss_mask: (B, T) supervised-target mask (0 on padding).

    Returns:
        (B, T) float32 losses; 0 at unsupervised positions and at t = 0.
    """
    window = logit_window(loss_mask)
    if window is None:
        return torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    keep = torch.arange(*window, device=input_ids.device)  # (W,)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=keep).logits
    return window_token_losses(logits, input_ids, loss_mask, window)


def grouped_model_token_losses(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
    groups: int
) -> torch.Tensor:
    """:func:`model_token_losses` in ``groups`` forwards of rows of similar length, each cut to its longest row.

    A right-padded batch computes every row at the longest row's width; on the real proving ground's rows (~89
    tokens, 50-158) a batch of 8 is ~43% padding, 2 groups of 4 ~19%.  The per-position losses are the same up to
    floating-point summation order (each row sees only its own tokens either way), so the caller's loss and its one
    backward are unchanged.  Rows keep their places in the returned tensor.

    Args:
        model, input_ids, attention_mask, loss_mask: As :func:`model_token_losses` (right-padded).
        groups: Forwards to split the batch into (rows sorted by length, split as evenly as possible); 1 is one
            forward of the whole batch.

    Returns:
        (B, T) float32 losses, as :func:`model_token_losses`.
    """
    if groups <= 1 or input_ids.shape[0] < 2:
        return model_token_losses(model, input_ids, attention_mask, loss_mask)
    losses = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    for rows, width in length_groups(attention_mask.sum(dim=1), groups):
        losses[rows, :width] = model_token_losses(model, input_ids[rows, :width], attention_mask[rows, :width],
                                                  loss_mask[rows, :width])
    return losses


def length_groups(lengths: torch.Tensor, groups: int) -> list[tuple[torch.Tensor, int]]:
    """The rows of each forward of :func:`grouped_model_token_losses` and the width it is cut to.

    Args:
        lengths: (B,) real tokens per row.
        groups: Groups wanted; at most B are made.

    Returns:
        ``[(rows (G_i,) indices, longest length among them)]``, rows sorted by length (stable) and split as evenly as
        ``torch.tensor_split`` does (the first groups one row longer).
    """
    split = torch.tensor_split(torch.argsort(lengths, stable=True), min(groups, lengths.shape[0]))
    return [(rows, int(lengths[rows].max())) for rows in split]


def model_example_losses(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """(B,) :func:`example_losses` of one forward of ``model``, logits only over the supervised window."""
    return mean_supervised_loss(model_token_losses(model, input_ids, attention_mask, loss_mask), loss_mask)


def weighted_batch_loss(per_example: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Batch loss ``sum_i w_i * l_i / B``: each weight scales its own example, no renormalisation.

    Args:
        per_example: (B,) per-example losses.
        weights: (B,) per-example weights, or None for weight 1 everywhere (then this is the plain mean).

    Returns:
        () scalar loss.
    """
    if weights is None:
        return per_example.mean()
    if weights.shape != per_example.shape:
        raise ValueError(
            f"weights has shape {tuple(weights.shape)} but per_example has {tuple(per_example.shape)}; "
            "pass one weight per example."
        )
    return (weights.to(per_example.dtype) * per_example).sum() / per_example.numel()


def pad_rows(rows: Sequence[Mapping[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad token rows into a batch.

    Returns:
        ``input_ids``, ``attention_mask``, ``loss_mask``: (B, T) long tensors.
    """
    width = max(len(r["input_ids"]) for r in rows)
    batch = {k: torch.zeros((len(rows), width), dtype=torch.long) for k in ("input_ids", "attention_mask",
                                                                          "loss_mask")}
    batch["input_ids"].fill_(pad_id)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        batch["input_ids"][i, :n] = torch.as_tensor(r["input_ids"])
        batch["attention_mask"][i, :n] = 1
        batch["loss_mask"][i, :n] = torch.as_tensor(r["loss_mask"])
    return batch
