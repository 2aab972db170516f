"""LESS's warmup (Xia et al., 2024): a short AdamW fine-tuning of the LoRA parameters whose Adam moments turn the
candidates' gradients into LESS's training features (:func:`raycurate.algorithms.less.gradient_features`)."""

from __future__ import annotations

from typing import Any


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
