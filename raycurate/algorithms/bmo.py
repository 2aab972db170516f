"""BMO math (bilevel-data-curation Algorithm 1, eqs. 8-10): importance weights and masking; decisions in
docs/bilevel.md.

* :func:`token_logprobs` and :func:`importance_weights` of generated responses (``clip`` or ``self_normalize``,
  optionally per question group), :func:`grouped_response_losses` for the weighted generated-response loss.
* :func:`masked_questions_fixed` / :func:`masked_questions_dynamic` (the lowest BDS data weights) for the masked
  set, and :func:`response_mask_from_prompt` for the response positions of a left-padded generation batch.

Labels shift only in :func:`raycurate.algorithms.losses.token_losses`, which :func:`token_logprobs` builds on.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from raycurate.algorithms.losses import token_losses

IMPORTANCE_MODES = ("clip", "self_normalize")

# Added before flooring a count so an exact half (ratio * n = k + 0.5 in decimal) rounds up even when the float
# product lands a hair below it (the same convention as raycurate.algorithms.bridge.selection.budgets).
_HALF_UP_SLACK = 1e-9


# --------------------------------------------------------------------------------------------- BMO: importance weights


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Log-probability of each supervised token under the model, aligned with ``input_ids``.

    ``logprobs[:, t] = log pi(input_ids[:, t] | input_ids[:, :t])`` where ``loss_mask`` is set, else 0.  Labels are
    shifted once, inside :func:`raycurate.algorithms.losses.token_losses`.

    Args:
        logits: (B, T, V) model outputs.
        input_ids: (B, T) token ids.
        loss_mask: (B, T) 1 at the response tokens.

    Returns:
        (B, T) float32 log-probabilities (<= 0).
    """
    return -token_losses(logits, input_ids, loss_mask)


def importance_weights(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "clip",
    clip: float = 2.0,
    group: torch.Tensor | None = None,
) -> torch.Tensor:
    """Importance weights ``r = pi_theta / pi_old`` of generated responses, computed in log space (Corollary 5).

    Both modes are treated as constants by the caller's loss (eq. 9 multiplies the gradient by r; this function
    detaches its inputs) and are exactly 1 when ``logp_new == logp_old``.

    * ``"clip"`` -- per token: ``r_t = exp(clamp(logp_new_t - logp_old_t, -log clip, log clip))``, i.e. the ratio
      truncated to ``[1/clip, clip]``; 0 outside ``mask``.  Returns (B, T).
    * ``"self_normalize"`` -- per sequence (Lemma 4): ``s_g = sum_t mask (logp_new - logp_old)``, then per
      question ``w_g = G * softmax_g(s_g)`` over that question's G responses (``group`` says which rows share a
      question), so the weights of one question average 1 and follow the implicit BMO weight lambda_{i,g}.  With
      G = 1 every weight is 1.  Returns (B,).

    Args:
        logp_new: (B, T) token log-probs under the current policy (from :func:`token_logprobs`).
        logp_old: (B, T) token log-probs kept at generation time.
        mask: (B, T) 1 at response tokens.
        mode: ``"clip"`` or ``"self_normalize"``.
        clip: Ratio bound of ``"clip"``, > 1.
        group: (B,) question id of each row for ``"self_normalize"``; None = every row its own question.

    Returns:
        float64 weights: (B, T) for ``"clip"``, (B,) for ``"self_normalize"``; finite for any response length.
    """
    if logp_new.shape != logp_old.shape or logp_new.shape != mask.shape or logp_new.ndim != 2:
        raise ValueError(
            f"logp_new {tuple(logp_new.shape)}, logp_old {tuple(logp_old.shape)} and mask {tuple(mask.shape)} must "
            "all be (B, T)"
        )
    on = (mask != 0).to(torch.float64)
    log_ratio = (logp_new.detach().to(torch.float64) - logp_old.detach().to(torch.float64)) * on  # (B, T)
    if mode == "clip":
        if not clip > 1.0:
            raise ValueError(f"clip must be > 1 (the ratio is truncated to [1/clip, clip]), got {clip}")
        bound = math.log(clip)
        return torch.exp(log_ratio.clamp(-bound, bound)) * on
    if mode == "self_normalize":
        return _group_softmax_times_size(log_ratio.sum(dim=1), group)
    raise ValueError(f"unknown importance weight mode {mode!r}; use one of {IMPORTANCE_MODES}")


def _group_softmax_times_size(scores: torch.Tensor, group: torch.Tensor | None) -> torch.Tensor:
    """``G_q * softmax`` of ``scores`` (B,) within each group q; exactly 1 where a group's scores are all equal."""
    if group is None:
        return torch.ones_like(scores)
    if group.shape != scores.shape:
        raise ValueError(f"group has shape {tuple(group.shape)}; pass one question id per row ({tuple(scores.shape)})")
    weights = torch.empty_like(scores)
    for q in torch.unique(group):
        rows = group == q
        s = scores[rows]
        shifted = s - s.max()  # exactly 0 for equal scores
        # log w = shifted - (log sum exp(shifted) - log G): both logs equal log G exactly when all scores tie.
        log_norm = torch.log(torch.exp(shifted).sum()) - math.log(int(rows.sum()))
        weights[rows] = torch.exp(shifted - log_norm)
    return weights


def grouped_response_losses(
    per_token: torch.Tensor,
    loss_mask: torch.Tensor,
    old_logp: torch.Tensor,
    generated: torch.Tensor,
    group: torch.Tensor,
    num_groups: int,
    mode: str = "clip",
    clip: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-question losses of a batch that mixes offline rows and generated responses (eq. 9 and 10c).

    Each question (group) is one offline row, or the G generated responses of a masked question.  The theta-step
    loss of a masked question is ``1/G sum_g r_g l_g`` (eq. 9): with ``"self_normalize"`` r_g is the per-sequence
    weight of :func:`importance_weights` and ``l_g`` the mean token loss; with ``"clip"`` the per-token ratios
    weight the token losses, ``l_g = sum_t r_t l_t / n_g``.  Offline rows keep their plain mean token loss.  The
    omega coefficient (eq. 10c) is the unweighted mean ``1/G sum_g l_g``.

    Args:
        per_token: (R, T) token losses from :func:`raycurate.algorithms.losses.token_losses` (with graph).
        loss_mask: (R, T) supervised positions (the response of a generated row).
        old_logp: (R, T) generation-time token log-probs of generated rows (anything on offline rows).
        generated: (R,) bool, True for generated rows.
        group: (R,) int64 question slot of each row in ``[0, num_groups)``.
        num_groups: S, the number of questions in the batch.
        mode: Importance weight mode (:data:`IMPORTANCE_MODES`).
        clip: Ratio bound of ``"clip"``.

    Returns:
        (S,) weighted losses (with graph) and (S,) plain mean losses (detached).
    """
    counted = (loss_mask != 0).to(per_token.dtype)
    counted[:, 0] = 0.0  # position 0 has no prediction
    row_plain = per_token.sum(dim=1) / counted.sum(dim=1).clamp_min(1.0)  # (R,)
    generated = generated.to(torch.bool)
    on_generated = (loss_mask != 0) & generated.unsqueeze(1)  # (R, T)
    logp_new = -per_token.detach()  # token_losses is -log p on supervised positions, 0 elsewhere
    if mode == "clip":
        ratio = importance_weights(logp_new, old_logp, on_generated, mode="clip", clip=clip).to(per_token.dtype)
        row_generated = (ratio * per_token).sum(dim=1) / counted.sum(dim=1).clamp_min(1.0)
        row_weighted = torch.where(generated, row_generated, row_plain)
    elif mode == "self_normalize":
        weight = importance_weights(logp_new, old_logp, on_generated, mode="self_normalize", group=group)
        row_weighted = weight.to(per_token.dtype) * row_plain  # an offline row is alone in its group: weight 1
    else:
        raise ValueError(f"unknown importance weight mode {mode!r}; use one of {IMPORTANCE_MODES}")
    sizes = torch.zeros(num_groups, dtype=per_token.dtype, device=per_token.device).index_add_(
        0, group, torch.ones_like(row_plain))
    if (sizes == 0).any():
        raise ValueError("every group in [0, num_groups) needs at least one row")
    zeros = torch.zeros(num_groups, dtype=per_token.dtype, device=per_token.device)
    weighted = zeros.index_add(0, group, row_weighted) / sizes
    plain = zeros.index_add(0, group, row_plain.detach()) / sizes
    return weighted, plain


# --------------------------------------------------------------------------------------------- BMO: masking


def masked_count(n: int, ratio: float) -> int:
    """Number of masked questions ``round(ratio * n)``, halves rounded up, in [0, n]."""
    if isinstance(n, bool) or int(n) != n or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    if not 0.0 <= float(ratio) <= 1.0:
        raise ValueError(f"the online sample ratio R must lie in [0, 1], got {ratio!r}")
    return min(int(n), math.floor(float(ratio) * int(n) + 0.5 + _HALF_UP_SLACK))


def masked_questions_fixed(n: int, ratio: float, seed: int) -> np.ndarray:
    """Fixed random masked set I_M (Algorithm 1 default): ``round(ratio * n)`` questions drawn once.

    Args:
        n: Number of candidate questions.
        ratio: Online sample ratio R.
        seed: Seed of the draw (same seed, same set).

    Returns:
        (round(ratio * n),) sorted int64 indices.
    """
    k = masked_count(n, ratio)
    return np.sort(np.random.default_rng(seed).choice(n, size=k, replace=False)).astype(np.int64)


def masked_questions_dynamic(sigma: np.ndarray, ratio: float) -> np.ndarray:
    """Dynamic masked set (paper §5.2): the bottom ``round(ratio * N)`` questions by weight, ties by index.

    Args:
        sigma: (N,) current data weights (or logits; only the order matters).
        ratio: Online sample ratio R.

    Returns:
        (round(ratio * N),) sorted int64 indices.
    """
    sigma = np.asarray(sigma, dtype=np.float64)
    if sigma.ndim != 1:
        raise ValueError(f"sigma must be 1-D, got shape {sigma.shape}")
    k = masked_count(sigma.size, ratio)
    order = np.argsort(sigma, kind="stable")  # ascending; equal weights keep index order
    return np.sort(order[:k]).astype(np.int64)


def response_mask_from_prompt(
    padded_prompt_len: int, total_len: int, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Response positions of a left-padded generation batch: every position at or after the padded prompt width.

    ``generate`` on a left-padded batch returns ``[pad..., prompt | response..., pad...]`` with the prompt block
    ``padded_prompt_len`` wide for every row, so the response starts at that column whatever a row's own prompt
    length is (using the unpadded prompt length instead would count prompt tokens of shorter prompts as response).

    Args:
        padded_prompt_len: Width P of the left-padded prompt block.
        total_len: T, the width of the generated batch (prompt block + generated tokens).
        attention_mask: (B, T) 1 at real tokens (prompt and generated), 0 at left and right padding.

    Returns:
        (B, T) bool, True at generated (non-padding) tokens only.
    """
    if attention_mask.ndim != 2 or attention_mask.shape[1] != total_len:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, expected (B, {total_len}); pass the mask of "
            "the whole generated sequence (prompt mask + generated-token mask)"
        )
    if not 0 <= padded_prompt_len <= total_len:
        raise ValueError(f"padded_prompt_len={padded_prompt_len} must lie in [0, total_len={total_len}]")
    columns = torch.arange(total_len, device=attention_mask.device)
    return (columns >= padded_prompt_len).unsqueeze(0) & (attention_mask != 0)
