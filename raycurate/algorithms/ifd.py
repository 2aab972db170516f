"""Instruction-Following Difficulty, the IFD data baseline of P2D (Li et al., 2024, "Cherry LLM"; docs/p2d.md).

``IFD(x, y) = L(y | x) / L(y)``: the model's mean response-token loss with the instruction in context, divided by
its mean loss on the response alone.  A ratio near or above 1 means the instruction hardly helps to predict the
response; higher = harder to follow, and IFD selection keeps the highest scores.  Cherry LLM additionally treats
IFD >= 1 as a misaligned pair (the instruction makes the response *less* likely); :func:`ifd_scores` reports it and
leaves the policy to the caller.  Both losses are mean cross-entropies over the same response tokens (e.g.
:func:`raycurate.algorithms.losses.example_losses` with the response as loss mask, once after the prompt and once
after the sequence's BOS and the chat template's assistant header only, see
:func:`raycurate.data.chat_layout.response_alone`).
"""

from __future__ import annotations

import torch


def ifd_scores(conditional_loss: torch.Tensor, unconditional_loss: torch.Tensor) -> torch.Tensor:
    """Per-example IFD ratio.

    Args:
        conditional_loss: (N,) mean response loss given the instruction, L(y | x) > 0.
        unconditional_loss: (N,) mean loss of the response alone, L(y) > 0.

    Returns:
        (N,) float64 ``conditional_loss / unconditional_loss``; higher = harder.
    """
    conditional = torch.as_tensor(conditional_loss, dtype=torch.float64)
    unconditional = torch.as_tensor(unconditional_loss, dtype=torch.float64)
    if conditional.shape != unconditional.shape or conditional.dim() != 1:
        raise ValueError(
            f"conditional and unconditional losses must be matching (N,) vectors, got {tuple(conditional.shape)} "
            f"and {tuple(unconditional.shape)}"
        )
    for name, values in (("conditional", conditional), ("unconditional", unconditional)):
        bad = torch.nonzero(~(torch.isfinite(values) & (values > 0))).flatten()
        if bad.numel():
            raise ValueError(
                f"{name} losses must be finite and > 0; examples {bad[:5].tolist()} are not (an empty response has "
                "no loss: drop such examples before scoring)"
            )
    return conditional / unconditional
