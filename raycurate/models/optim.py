"""Optimizer building blocks shared by every training loop: the LR schedule and the weight-decay split.

Both are pure (no Ray, no I/O) and sit in the models layer so that the pre-training recipe
(:mod:`raycurate.models.pretrain`), the benchmarks and the Ray Train stages can all use the same definitions.
"""

from __future__ import annotations

import math
from typing import Any


def cosine_with_warmup(step: int, warmup_steps: int, total: int, floor: float = 0.0) -> float:
    """LR multiplier of optimizer step ``step`` (0-based): linear warmup, then cosine decay towards ``floor``.

    Warmup uses ``(step + 1) / (warmup_steps + 1)`` so the first step already learns; the decay runs over the
    remaining ``total - warmup_steps`` steps and stays at ``floor`` after them.

    Args:
        step: 0-based optimizer step.
        warmup_steps: Steps of linear warmup (0 = none).
        total: Total optimizer steps.
        floor: Multiplier the cosine decays to (0 = decay to zero).

    Returns:
        The multiplier in ``[floor, 1]`` (below ``floor`` only during warmup).
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    progress = (step - warmup_steps) / max(1, total - warmup_steps)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def decay_param_groups(model: Any, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW parameter groups: weight decay on matrices only; biases and norm scales (1-D) are not decayed.

    Args:
        model: A ``torch.nn.Module``; only parameters with ``requires_grad`` are grouped.
        weight_decay: Decay of the matrix group.

    Returns:
        ``[{"params": matrices, "weight_decay": weight_decay}, {"params": vectors, "weight_decay": 0.0}]``
        without empty groups (adapters have no 1-D parameters; DeepSpeed drops empty groups).
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.ndim >= 2]
    no_decay = [p for p in trainable if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
