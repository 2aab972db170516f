"""Masked, per-example weighted causal-LM losses (pure torch).

Convention of the token-level table: the loss at position ``t`` is the cross-entropy of predicting
``input_ids[:, t]`` from ``input_ids[:, :t]``, i.e. from ``logits[:, t - 1]``.  :func:`token_losses` is the
only place in raycurate where labels are shifted; everything downstream works on per-position losses that are
aligned with ``input_ids`` and ``loss_mask``.
"""

from __future__ import annotations

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
    per_token = token_losses(logits, input_ids, loss_mask)  # (B, T)
    counted = (loss_mask != 0).to(torch.float32)
    counted[:, 0] = 0.0
    return per_token.sum(dim=1) / counted.sum(dim=1).clamp_min(1.0)


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
