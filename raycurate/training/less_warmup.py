"""LESS's model work (Xia et al., 2024) on a LoRA-wrapped model: the warmup (:func:`warmup_lora`, a short AdamW
fine-tuning whose Adam moments turn the candidates' gradients into training features) and :func:`less_model_scores`
(warmup, gradient features, projection, scores).  The pure math is :mod:`raycurate.algorithms.less`; the stage
(:func:`raycurate.stages.bilevel_select.less_select_stage`) loads the model and keeps the top k.
"""

from __future__ import annotations

import math
import time
from typing import Any


def less_model_scores(model: Any, candidate_rows: list[dict], validation_rows: list[dict], *, pad_id: int, dim: int,
                      warmup_fraction: float, warmup_epochs: int, lr: float, batch_size: int, seed: int,
                      device: Any) -> dict[str, Any]:
    """LESS scores of the candidates: warmup on a seeded share of them, their Adam-direction LoRA gradients and the
    validation rows' plain LoRA gradients through one seeded projection, mean cosine to the validation features.

    Args:
        model: The base model with a freshly attached LoRA adapter (its only trainable parameters).
        candidate_rows: Token rows (``input_ids``, ``loss_mask``) of the candidates, in output order.
        validation_rows: Token rows of the validation (target) examples.
        pad_id: Padding token id.
        dim: Projection dimension d (also used when the LoRA parameter count P <= d: one code path).
        warmup_fraction: Share of the candidates (seeded random draw, at least one) the warmup trains on.
        warmup_epochs: Warmup epochs.
        lr: Warmup AdamW learning rate.
        batch_size: Warmup rows per step.
        seed: Seed of the warmup subset and order, and of the projection.
        device: Device of the model (the projection is built there).

    Returns:
        ``scores`` ((N,) list in candidate order), ``lora_parameters``, ``warmup_rows``, ``warmup_losses`` (per
        epoch), ``warmup_seconds`` and ``feature_seconds``.
    """
    import numpy as np

    from raycurate.algorithms.less import Projector, gradient_features, less_scores, trainable_named

    n_warm = max(1, math.floor(warmup_fraction * len(candidate_rows) + 0.5))
    warm = np.sort(np.random.default_rng(seed).choice(len(candidate_rows), size=n_warm, replace=False))

    started = time.time()
    optimizer, epoch_losses = warmup_lora(model, [candidate_rows[i] for i in warm], pad_id=pad_id,
                                          epochs=warmup_epochs, lr=lr, batch_size=batch_size, seed=seed)
    warmup_seconds = time.time() - started

    started = time.time()
    params = [p for _, p in trainable_named(model)]
    n_params = sum(p.numel() for p in params)
    projector = Projector(n_params, dim, seed, device)  # also when n_params <= dim: one code path
    group = optimizer.param_groups[0]
    train = gradient_features(model, candidate_rows, pad_id=pad_id, projector=projector,
                              moments=adam_moments(optimizer, params), betas=group["betas"], eps=group["eps"])
    val = gradient_features(model, validation_rows, pad_id=pad_id, projector=projector)
    scores = less_scores(train, val)  # (N,)
    return {"scores": scores.tolist(), "lora_parameters": n_params, "warmup_rows": n_warm,
            "warmup_losses": epoch_losses, "warmup_seconds": round(warmup_seconds, 3),
            "feature_seconds": round(time.time() - started, 3)}


def warmup_lora(model: Any, rows: list[dict], *, pad_id: int, epochs: int, lr: float, batch_size: int,
                seed: int) -> tuple[Any, list[float]]:
    """LESS warmup: AdamW on the LoRA parameters over ``rows`` for ``epochs`` epochs (constant lr, no decay).

    Args:
        model: A model whose trainable parameters are the LoRA adapter.
        rows: Token rows (``input_ids``, ``loss_mask``) of the warmup subset.
        pad_id: Padding token id.
        epochs: Passes over ``rows``, each in a fresh seeded order.
        lr: AdamW learning rate.
        batch_size: Rows per optimizer step.
        seed: Seed of the row order.

    Returns:
        (the optimizer, holding Adam's moments for every LoRA parameter; the mean loss of each epoch).
    """
    import numpy as np
    import torch

    from raycurate.algorithms.less import trainable_named
    from raycurate.algorithms.losses import model_example_losses, pad_rows

    params = [p for _, p in trainable_named(model)]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)  # LESS trains with HF's default decay 0
    device = params[0].device
    rng = np.random.default_rng(seed)
    epoch_losses = []
    model.train()
    for _ in range(epochs):
        order = rng.permutation(len(rows))
        losses = []
        for lo in range(0, len(rows), batch_size):
            batch = {k: v.to(device) for k, v in pad_rows([rows[i] for i in order[lo:lo + batch_size]],
                                                          pad_id).items()}
            loss = model_example_losses(model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"]).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        epoch_losses.append(sum(losses) / len(losses))
    model.eval()
    return optimizer, epoch_losses


def adam_moments(optimizer: Any, params: list[Any]) -> tuple[Any, Any]:
    """Adam's ``exp_avg`` and ``exp_avg_sq`` flattened in the order of ``params`` (zeros for a parameter that never
    received a step).

    Returns:
        ((P,), (P,)) float32 tensors on the parameters' device.
    """
    import torch

    avg, avg_sq = [], []
    for p in params:
        state = optimizer.state.get(p, {})
        avg.append(state.get("exp_avg", torch.zeros_like(p)).reshape(-1).float())
        avg_sq.append(state.get("exp_avg_sq", torch.zeros_like(p)).reshape(-1).float())
    return torch.cat(avg), torch.cat(avg_sq)
