"""Token-selection baselines on BRIDGE's machinery and budgets (paper §5.1, App. B.2, D.1).

Each returns :class:`TokenMasks` (``prompt_keep``, ``loss_mask``), the form of BRIDGE's row masks, with
:mod:`.selection`'s fixed positions, budgets and Top-b, so a baseline keeps as many tokens per row as BRIDGE at
the same ratios: :func:`random_masks` (App. B.2); RHO-1 (:func:`token_cleaning_masks`, per row) and Token Cleaning
(:func:`token_cleaning_global_masks`, one corpus-wide Top-B), both on the excess loss :func:`excess_loss_scores`;
the App. D.1 compositions :func:`independent_composition` and :func:`sequential_composition`, whose prompt
selector (LLMLingua-2 is not available offline) is :func:`random_scores` or :func:`surprisal_prompt_scores`.
The stages are in ``stages/bridge_compact.py``; decisions and results: docs/bridge.md, "Baselines".
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from raycurate.algorithms.bridge.selection import budgets, eligible_positions, to_row_masks, top_b

Side = Literal["prompt", "response"]
BudgetMode = Literal["ratio", "matched"]


@dataclass(frozen=True)
class TokenMasks:
    """Row masks of one example, in the form BRIDGE writes them.

    Attributes:
        prompt_keep: (prompt_len,) bool, kept prompt positions (fixed positions included).
        loss_mask: (n,) bool, supervised positions (fixed positions included, False on the prompt side).
        b_p: number of kept eligible prompt positions (the realised prompt budget).
        b_r: number of supervised eligible response positions (the realised response budget).
        prompt_scores: (prompt_len,) float64 scores the prompt side was selected on, or None (random, intact).
        response_scores: (n - prompt_len,) float64 scores the response side was selected on, or None.
    """

    prompt_keep: np.ndarray
    loss_mask: np.ndarray
    b_p: int
    b_r: int
    prompt_scores: np.ndarray | None = None
    response_scores: np.ndarray | None = None


@dataclass(frozen=True)
class _Layout:
    """Eligible positions of one row (see ``selection.eligible_positions``)."""

    n_tokens: int
    prompt_len: int
    prompt_idx: np.ndarray  # (p,) eligible prompt row positions
    response_idx: np.ndarray  # (r,) eligible response row positions

    @property
    def n_response(self) -> int:
        return self.n_tokens - self.prompt_len

    def masks(self, prompt_mask: np.ndarray, response_mask: np.ndarray, **scores: np.ndarray | None) -> TokenMasks:
        keep, loss = to_row_masks(self.n_tokens, self.prompt_len, self.prompt_idx, self.response_idx,
                                  prompt_mask, response_mask)
        return TokenMasks(keep, loss, int(prompt_mask.sum()), int(response_mask.sum()), **scores)


def _layout(
    n_tokens: int,
    prompt_len: int,
    has_bos: bool,
    fixed_prompt_mask: np.ndarray | None,
    fixed_response_mask: np.ndarray | None,
) -> _Layout:
    prompt_idx, response_idx = eligible_positions(n_tokens, prompt_len, has_bos, fixed_prompt_mask,
                                                  fixed_response_mask)
    return _Layout(int(n_tokens), int(prompt_len), prompt_idx, response_idx)


# --------------------------------------------------------------------------------------------- random


def example_rng(seed: int, example_id: str) -> np.random.Generator:
    """Per-example generator from ``(seed, example id)``, stable across processes and Python runs.

    The id is hashed with BLAKE2b (not Python's salted ``hash()``), so the same ``(seed, id)`` gives the same
    stream on every worker and in every run, independent of shard layout and row order.

    Args:
        seed: the run's selection seed, a non-negative integer.
        example_id: the row's ``id``.

    Returns:
        A fresh ``numpy.random.Generator`` (PCG64).
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    digest = hashlib.blake2b(str(example_id).encode("utf-8"), digest_size=8, person=b"raycurate.token").digest()
    return np.random.default_rng([int(seed), int.from_bytes(digest, "little")])


def random_masks(
    n_tokens: int,
    prompt_len: int,
    rho_p: float,
    rho_r: float,
    rng: np.random.Generator,
    *,
    has_bos: bool = True,
    fixed_prompt_mask: np.ndarray | None = None,
    fixed_response_mask: np.ndarray | None = None,
) -> TokenMasks:
    """Random baseline: uniform random subsets of the eligible positions with exactly BRIDGE's budgets.

    The prompt subset is drawn first, then the response subset, each uniformly among all subsets of its size.

    Args:
        n_tokens: row length n.
        prompt_len: number of prompt-side positions.
        rho_p: prompt retention ratio in [0, 1].
        rho_r: response supervision ratio in [0, 1].
        rng: the example's generator, normally ``example_rng(seed, example_id)``.
        has_bos: whether position 0 is a BOS token (kept, outside the budget).
        fixed_prompt_mask: optional (prompt_len,) bool, extra always-kept prompt positions.
        fixed_response_mask: optional (n - prompt_len,) bool, extra always-supervised response positions.

    Returns:
        :class:`TokenMasks` with ``b_p = round(rho_p * p)`` and ``b_r = round(rho_r * r)`` (half up).
    """
    layout = _layout(n_tokens, prompt_len, has_bos, fixed_prompt_mask, fixed_response_mask)
    b_p, b_r = budgets(layout.prompt_idx.size, layout.response_idx.size, rho_p, rho_r)
    return layout.masks(_random_subset(layout.prompt_idx.size, b_p, rng),
                        _random_subset(layout.response_idx.size, b_r, rng))


def _random_subset(n: int, b: int, rng: np.random.Generator) -> np.ndarray:
    mask = np.zeros(n, dtype=bool)  # (n,)
    mask[rng.permutation(n)[:b]] = True
    return mask


def random_scores(length: int, rng: np.random.Generator) -> np.ndarray:
    """I.i.d. uniform scores; Top-b of them is a uniform random subset (a random selector for compositions).

    Args:
        length: number of positions to score (e.g. ``prompt_len``).
        rng: the example's generator.

    Returns:
        (length,) float64 in [0, 1).
    """
    return rng.random(int(length))


# --------------------------------------------------------------------------------------------- scores


def excess_loss_scores(loss_base: np.ndarray, loss_ref: np.ndarray) -> np.ndarray:
    """RHO-1 excess loss ``l_base - l_ref`` per token; keep the HIGHEST (Lin et al., 2024, paper §5.1, App. B.2).

    RHO-1's Selective Language Modeling scores a token by the loss of the model being trained minus the loss of a
    reference model and trains on the top-k% of tokens by this score: tokens the reference has learned but the
    base model has not.  Here the base model is the pretrained ``theta_old`` and the reference defaults to the
    warmup checkpoint (docs/bridge.md, "Decisions the paper leaves open").

    Args:
        loss_base: (n,) per-position token losses of the base model (``losses.token_losses`` layout).
        loss_ref: (n,) per-position token losses of the reference model on the same row.

    Returns:
        (n,) float64 scores, higher = keep.
    """
    base, ref = _pair(loss_base, loss_ref)
    return base - ref


def token_influence(loss_base: np.ndarray, loss_ref: np.ndarray) -> np.ndarray:
    """Token Cleaning's influence ``l_ref - l_base`` per token; keep the LOWEST (Pang et al., 2025, App. B.2).

    Token Cleaning measures a token's quality by the influence of the model update on its loss, the loss change
    from the base model to the reference model.  Its sign convention is opposite to RHO-1's: a negative influence
    (the update lowered the token's loss) marks an informative token; their fixed-model cleaning keeps the tokens
    with the largest loss reduction.  ``-token_influence`` is therefore RHO-1's excess loss: the two scores are
    the same formula (the Token Cleaning code computes ``loss_base - loss_ref`` for both its method and its RHO
    baseline).  The methods differ in the ranking scope: RHO-1 ranks within a sample (within a batch in its
    pre-training form, with the model being trained as "base"), Token Cleaning over the whole data set
    (:func:`token_cleaning_global_masks`).

    Args:
        loss_base: (n,) per-position token losses of the base model.
        loss_ref: (n,) per-position token losses of the reference model.

    Returns:
        (n,) float64 influences, lower = keep.
    """
    base, ref = _pair(loss_base, loss_ref)
    return ref - base


RESPONSE_SCORERS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "rho1": excess_loss_scores,
    "token_cleaning": lambda loss_base, loss_ref: -token_influence(loss_base, loss_ref),
}


def response_scores(variant: str, loss_base: np.ndarray, loss_ref: np.ndarray) -> np.ndarray:
    """Keep-high response scores of a named loss-difference baseline.

    Args:
        variant: "rho1" (excess loss) or "token_cleaning" (negated influence).
        loss_base: (n,) base-model token losses.
        loss_ref: (n,) reference-model token losses.

    Returns:
        (n,) float64 scores, higher = keep, for :func:`token_cleaning_masks`.
    """
    if variant not in RESPONSE_SCORERS:
        raise ValueError(f"unknown response scorer {variant!r}; choose one of {', '.join(sorted(RESPONSE_SCORERS))}")
    return RESPONSE_SCORERS[variant](loss_base, loss_ref)


def surprisal_prompt_scores(token_loss: np.ndarray, prompt_len: int) -> np.ndarray:
    """Self-information ``-log p(x_i | x_<i)`` of each prompt token under the base model; higher = keep.

    The offline stand-in for LLMLingua-2 (see the module docstring).  ``token_loss`` must be computed with the
    loss mask set on the prompt side (e.g. ``losses.token_losses(logits, ids, torch.ones_like(ids))``): the
    training row's mask is 0 there and would leave nothing to rank.  Position 0 has no prediction; it is scored as
    the most informative prompt token (it is normally the fixed BOS, so the score is then unused).

    Args:
        token_loss: (n,) per-position next-token losses of the base model over the row (or at least its prompt).
        prompt_len: number of prompt-side positions, >= 1.

    Returns:
        (prompt_len,) float64 surprisal scores.
    """
    loss = np.asarray(token_loss, dtype=np.float64)
    if loss.ndim != 1 or not 1 <= prompt_len <= loss.shape[0]:
        raise ValueError(f"token_loss must be a (n,) vector with n >= prompt_len = {prompt_len}; got shape "
                         f"{loss.shape}")
    scores = loss[:prompt_len].copy()  # (prompt_len,)
    if prompt_len > 1:
        if not np.any(scores[1:]):
            raise ValueError("every prompt-side token loss is 0: the losses were computed with the response-only "
                             "loss mask; recompute them with the mask set on the prompt side")
        scores[0] = scores[1:].max()
    _require_finite(scores, "token_loss")
    return scores


# --------------------------------------------------------------------------------------------- budgets


def one_sided_matched_budget(
    n_prompt_eligible: int,
    n_response_eligible: int,
    rho_p: float,
    rho_r: float,
    side: Side,
) -> tuple[int, int]:
    """Budgets of a one-sided selector matched to a two-sided one (App. B.2).

    "One-sided baselines keep the other side intact and match the combined context and supervision count as
    closely as feasible": the two-sided methods keep ``B = b_p + b_r`` eligible positions in total, with
    ``(b_p, b_r) = budgets(p, r, rho_p, rho_r)`` (App. B.2's ``B^match = 0.75 |P| + 0.75 |R|``, rounded per side as
    the two-sided methods realise it).  The intact side counts in full, so the selected side gets
    ``B - n_other``, clipped to ``[0, n_side]`` when that is infeasible (e.g. a long prompt leaves no room for
    supervision at all: then 0, the closest feasible count).

    Args:
        n_prompt_eligible: p, eligible prompt positions.
        n_response_eligible: r, eligible response positions.
        rho_p: the two-sided prompt ratio being matched.
        rho_r: the two-sided response ratio being matched.
        side: the side the one-sided selector chooses on; the other is kept intact.

    Returns:
        (b_p, b_r): the intact side's full count and the selected side's matched budget.
    """
    b_p, b_r = budgets(n_prompt_eligible, n_response_eligible, rho_p, rho_r)
    total = b_p + b_r
    if side == "response":
        return int(n_prompt_eligible), int(np.clip(total - n_prompt_eligible, 0, n_response_eligible))
    if side == "prompt":
        return int(np.clip(total - n_response_eligible, 0, n_prompt_eligible)), int(n_response_eligible)
    raise ValueError(f"side must be 'prompt' or 'response', got {side!r}")


def _one_sided_budgets(
    layout: _Layout, side: Side, rho: float, budget: BudgetMode, rho_other: float | None
) -> tuple[int, int]:
    p, r = layout.prompt_idx.size, layout.response_idx.size
    if budget == "ratio":
        return (budgets(p, r, rho, 1.0)[0], r) if side == "prompt" else (p, budgets(p, r, 1.0, rho)[1])
    if budget == "matched":
        if rho_other is None:
            raise ValueError("budget='matched' needs the two-sided ratio of the other side too (rho_p for a response "
                             "selector, rho_r for a prompt selector)")
        rho_p, rho_r = (rho, rho_other) if side == "prompt" else (rho_other, rho)
        return one_sided_matched_budget(p, r, rho_p, rho_r, side)
    raise ValueError(f"budget must be 'ratio' or 'matched', got {budget!r}")


def global_response_budgets(scores: Sequence[np.ndarray], total: int) -> np.ndarray:
    """Per-row budgets of ONE corpus-wide Top-``total`` over all rows' response scores (Token Cleaning's ranking).

    Token Cleaning's fixed-model cleaning ranks the tokens of the whole data set by one score and keeps the top
    share ("global" in its code, ``select_token_level=global``), where RHO-1 as a fine-tuning baseline ranks within
    each sample (``sample``).  The ``total`` highest scores over all rows are taken, ties broken by (row, position),
    and returned as per-row counts; Top-``b_i`` of each row's own scores (:func:`top_b`, ties by position) then
    selects exactly those positions, because a row's part of a global Top-k is a prefix of its own ranking.

    Args:
        scores: one (r_i,) array of finite keep-high scores per row, over its eligible response positions.
        total: corpus budget, ``0 <= total <= sum_i r_i`` (e.g. the sum of the per-row matched budgets).

    Returns:
        (rows,) int64 budgets with ``sum == total`` and ``0 <= b_i <= r_i``.
    """
    arrays = [_row_vector(np.asarray(x, dtype=np.float64).reshape(-1), "scores") for x in scores]
    sizes = np.array([a.size for a in arrays], dtype=np.int64)  # (rows,)
    if not 0 <= int(total) <= int(sizes.sum()):
        raise ValueError(f"total={total} must lie in [0, {int(sizes.sum())}] (all rows' eligible response positions)")
    out = np.zeros(len(arrays), dtype=np.int64)
    if int(total) == 0:
        return out
    pool = np.concatenate(arrays)  # (sum r_i,) in (row, position) order
    rows = np.repeat(np.arange(len(arrays)), sizes)
    # Stable descending sort: equal scores keep (row, position) order, the same order top_b uses within a row.
    taken = rows[np.argsort(-pool, kind="stable")[: int(total)]]
    out += np.bincount(taken, minlength=len(arrays))
    return out


# --------------------------------------------------------------------------------------------- one-sided


def token_cleaning_masks(
    response_scores: np.ndarray,
    prompt_len: int,
    rho_r: float,
    *,
    budget: BudgetMode = "ratio",
    rho_p: float | None = None,
    has_bos: bool = True,
    fixed_prompt_mask: np.ndarray | None = None,
    fixed_response_mask: np.ndarray | None = None,
) -> TokenMasks:
    """One-sided response selection (RHO-1 / Token Cleaning): Top-b of the response scores, prompt intact.

    Args:
        response_scores: (n,) keep-high scores over the row (e.g. :func:`response_scores`); only the eligible
            response positions are read.
        prompt_len: number of prompt-side positions.
        rho_r: with ``budget="ratio"``, the share of eligible response tokens to supervise; with "matched", the
            two-sided response ratio being matched.
        budget: "ratio" (``b_r = round(rho_r r)``) or "matched" (:func:`one_sided_matched_budget`, App. B.2).
        rho_p: the two-sided prompt ratio being matched (needed for ``budget="matched"``).
        has_bos: whether position 0 is a BOS token.
        fixed_prompt_mask: optional (prompt_len,) bool, extra always-kept prompt positions.
        fixed_response_mask: optional (n - prompt_len,) bool, extra always-supervised response positions.

    Returns:
        :class:`TokenMasks` with every prompt token kept (``b_p = p``).
    """
    scores = _row_vector(response_scores, "response_scores")
    layout = _layout(scores.shape[0], prompt_len, has_bos, fixed_prompt_mask, fixed_response_mask)
    b_p, b_r = _one_sided_budgets(layout, "response", rho_r, budget, rho_p)
    response_side = scores[prompt_len:]
    return layout.masks(np.ones(b_p, dtype=bool), top_b(scores[layout.response_idx], b_r),
                        response_scores=response_side)


def token_cleaning_global_masks(
    response_scores: Sequence[np.ndarray] | Sequence[Sequence[float]],
    prompt_lens: Sequence[int],
    rho_p: float,
    rho_r: float,
    *,
    has_bos: Sequence[bool] | None = None,
    fixed_prompt_masks: Sequence[np.ndarray | None] | None = None,
    fixed_response_masks: Sequence[np.ndarray | None] | None = None,
) -> list[TokenMasks]:
    """Token Cleaning with its own corpus-wide threshold (Pang et al., 2025, fixed-model cleaning), prompt intact.

    The corpus budget is the sum of the rows' one-sided matched budgets (:func:`one_sided_matched_budget`; with
    ``rho_p = 1`` exactly BRIDGE's per-row ``round(rho_r r)``), so the total number of supervised tokens equals
    the per-example selectors'; it goes to the highest scores over all rows (:func:`global_response_budgets`), so
    a row whose tokens all score low may get none and a high-scoring row all of its tokens.

    Args:
        response_scores: one (n_i,) keep-high score vector per row over its positions (only the eligible response
            positions are read), e.g. :func:`response_scores` ``("token_cleaning", ...)``.
        prompt_lens: prompt length of each row.
        rho_p: the two-sided prompt ratio being matched.
        rho_r: the two-sided response ratio being matched.
        has_bos: per row, whether position 0 is a BOS token (default: all True).
        fixed_prompt_masks: per row, optional (prompt_len,) bool extra always-kept prompt positions.
        fixed_response_masks: per row, optional (n - prompt_len,) bool extra always-supervised response positions.

    Returns:
        One :class:`TokenMasks` per row, ``b_p = p``; ``sum b_r`` equals the sum of the matched budgets.
    """
    k = len(response_scores)
    if len(prompt_lens) != k:
        raise ValueError(f"{k} score rows but {len(prompt_lens)} prompt lengths; pass one per row")
    bos = [True] * k if has_bos is None else list(has_bos)
    fixed_p = [None] * k if fixed_prompt_masks is None else list(fixed_prompt_masks)
    fixed_r = [None] * k if fixed_response_masks is None else list(fixed_response_masks)
    rows, layouts, matched = [], [], []
    for i in range(k):
        scores = _row_vector(response_scores[i], "response_scores")
        layout = _layout(scores.shape[0], int(prompt_lens[i]), bool(bos[i]), fixed_p[i], fixed_r[i])
        rows.append(scores)
        layouts.append(layout)
        matched.append(_one_sided_budgets(layout, "response", rho_r, "matched", rho_p))
    row_budgets = global_response_budgets([s[lay.response_idx] for s, lay in zip(rows, layouts)],
                                          sum(b_r for _, b_r in matched))
    return [lay.masks(np.ones(b_p, dtype=bool), top_b(s[lay.response_idx], int(b)),
                      response_scores=s[lay.prompt_len:])
            for s, lay, (b_p, _), b in zip(rows, layouts, matched, row_budgets)]


def prompt_selector_masks(
    prompt_scores: np.ndarray,
    n_tokens: int,
    rho_p: float,
    *,
    budget: BudgetMode = "ratio",
    rho_r: float | None = None,
    has_bos: bool = True,
    fixed_prompt_mask: np.ndarray | None = None,
    fixed_response_mask: np.ndarray | None = None,
) -> TokenMasks:
    """One-sided prompt compression (the LLMLingua-2 slot): Top-b of the prompt scores, every response token supervised.

    Args:
        prompt_scores: (prompt_len,) keep-high prompt scores (e.g. :func:`surprisal_prompt_scores`).
        n_tokens: row length n.
        rho_p: with ``budget="ratio"``, the share of eligible prompt tokens to keep; with "matched", the two-sided
            prompt ratio being matched.
        budget: "ratio" or "matched" (:func:`one_sided_matched_budget`).
        rho_r: the two-sided response ratio being matched (needed for ``budget="matched"``).
        has_bos: whether position 0 is a BOS token.
        fixed_prompt_mask: optional (prompt_len,) bool, extra always-kept prompt positions.
        fixed_response_mask: optional (n - prompt_len,) bool, extra always-supervised response positions.

    Returns:
        :class:`TokenMasks` with every eligible response token supervised (``b_r = r``).
    """
    scores = _row_vector(prompt_scores, "prompt_scores")
    layout = _layout(n_tokens, scores.shape[0], has_bos, fixed_prompt_mask, fixed_response_mask)
    b_p, b_r = _one_sided_budgets(layout, "prompt", rho_p, budget, rho_r)
    return layout.masks(top_b(scores[layout.prompt_idx], b_p), np.ones(b_r, dtype=bool), prompt_scores=scores)


# --------------------------------------------------------------------------------------------- compositions


def independent_composition(
    prompt_scores: np.ndarray,
    response_scores: np.ndarray,
    n_tokens: int,
    rho_p: float,
    rho_r: float,
    *,
    has_bos: bool = True,
    fixed_prompt_mask: np.ndarray | None = None,
    fixed_response_mask: np.ndarray | None = None,
) -> TokenMasks:
    """Independent composition of two single-side selectors (App. D.1, "LLM+TC (Ind.)").

    ``S_p = f_p(P, R; rho_p)`` and ``S_r = f_r(P, R; rho_r)``: both score arrays were computed on the original
    example (full prompt, full response), and each side takes the Top-b of its own scores under its matched
    per-side budget; neither side sees the other's selection.

    Args:
        prompt_scores: (prompt_len,) keep-high prompt scores computed on the full example.
        response_scores: (n,) keep-high scores over the full row (only the response side is read) or
            (n - prompt_len,) response-side scores, computed on the full example.
        n_tokens: row length n.
        rho_p: prompt retention ratio.
        rho_r: response supervision ratio.
        has_bos: whether position 0 is a BOS token.
        fixed_prompt_mask: optional (prompt_len,) bool, extra always-kept prompt positions.
        fixed_response_mask: optional (n - prompt_len,) bool, extra always-supervised response positions.

    Returns:
        :class:`TokenMasks` with the budgets of ``budgets(p, r, rho_p, rho_r)``.
    """
    p_scores = _row_vector(prompt_scores, "prompt_scores")
    prompt_len = p_scores.shape[0]
    layout = _layout(n_tokens, prompt_len, has_bos, fixed_prompt_mask, fixed_response_mask)
    r_scores = _response_side(response_scores, prompt_len, layout.n_response, "response_scores")
    b_p, b_r = budgets(layout.prompt_idx.size, layout.response_idx.size, rho_p, rho_r)
    s_p = top_b(p_scores[layout.prompt_idx], b_p)
    s_r = top_b(r_scores[layout.response_idx - prompt_len], b_r)
    return layout.masks(s_p, s_r, prompt_scores=p_scores, response_scores=r_scores)


def sequential_composition(
    prompt_scores: np.ndarray,
    rescore_response: Callable[[np.ndarray], np.ndarray],
    n_tokens: int,
    rho_p: float,
    rho_r: float,
    *,
    has_bos: bool = True,
    fixed_prompt_mask: np.ndarray | None = None,
    fixed_response_mask: np.ndarray | None = None,
) -> TokenMasks:
    """Sequential one-way conditioning, prompt then response (App. D.1, "LLM -> TC (Seq.)").

    The prompt selector picks ``S_p`` first; the response scores are then recomputed under the compacted prompt
    (the context used in final training) by ``rescore_response`` and the response selector takes their Top-b.
    ``S_p`` is not revisited (a single dependency ``S_p -> S_r``; BRIDGE alternates instead).  This function only
    orchestrates: the caller's callable runs the models, e.g. builds the row with
    :func:`raycurate.algorithms.bridge.compaction.compact_example` and returns
    ``response_scores(variant, loss_base, loss_ref)`` on it.

    Args:
        prompt_scores: (prompt_len,) keep-high prompt scores computed on the full example.
        rescore_response: called once with the row's ``prompt_keep`` (prompt_len,) bool (fixed positions kept);
            returns keep-high scores either over the compacted row, shape (k + n - prompt_len,) with k kept prompt
            tokens, or over the response side only, shape (n - prompt_len,).
        n_tokens: row length n of the original (uncompacted) row.
        rho_p: prompt retention ratio.
        rho_r: response supervision ratio.
        has_bos: whether position 0 is a BOS token.
        fixed_prompt_mask: optional (prompt_len,) bool, extra always-kept prompt positions.
        fixed_response_mask: optional (n - prompt_len,) bool, extra always-supervised response positions.

    Returns:
        :class:`TokenMasks`; ``response_scores`` are the recomputed (conditioned) ones.
    """
    p_scores = _row_vector(prompt_scores, "prompt_scores")
    prompt_len = p_scores.shape[0]
    layout = _layout(n_tokens, prompt_len, has_bos, fixed_prompt_mask, fixed_response_mask)
    b_p, b_r = budgets(layout.prompt_idx.size, layout.response_idx.size, rho_p, rho_r)
    s_p = top_b(p_scores[layout.prompt_idx], b_p)
    prompt_keep = to_row_masks(n_tokens, prompt_len, layout.prompt_idx, layout.response_idx, s_p,
                               np.zeros(layout.response_idx.size, dtype=bool))[0]
    rescored = rescore_response(prompt_keep.copy())
    r_scores = _response_side(rescored, int(prompt_keep.sum()), layout.n_response, "rescore_response(...)")
    s_r = top_b(r_scores[layout.response_idx - prompt_len], b_r)
    return layout.masks(s_p, s_r, prompt_scores=p_scores, response_scores=r_scores)


# --------------------------------------------------------------------------------------------- helpers


def _pair(loss_base: np.ndarray, loss_ref: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    base = _row_vector(loss_base, "loss_base")
    ref = _row_vector(loss_ref, "loss_ref")
    if base.shape != ref.shape:
        raise ValueError(f"loss_base {base.shape} and loss_ref {ref.shape} must come from the same row; compute both "
                         "with losses.token_losses on identical input_ids and loss_mask")
    return base, ref


def _row_vector(x: np.ndarray | Sequence[float], name: str) -> np.ndarray:
    out = np.asarray(x, dtype=np.float64)
    if out.ndim != 1:
        raise ValueError(f"{name} must be a 1-D vector over row positions, got shape {out.shape}")
    _require_finite(out, name)
    return out


def _require_finite(x: np.ndarray, name: str) -> None:
    if not np.isfinite(x.sum()):
        raise ValueError(f"{name} holds NaN or inf; fix or drop this example's scores before selection")


def _response_side(scores: np.ndarray, prefix_len: int, n_response: int, name: str) -> np.ndarray:
    """Response-side scores (n_response,) from scores over the response side or over a whole row.

    A row has ``prefix_len >= 1`` prompt tokens before its ``n_response`` response tokens, so the two accepted
    lengths never coincide.
    """
    out = _row_vector(scores, name)
    if out.shape[0] == n_response:
        return out
    if out.shape[0] == prefix_len + n_response:
        return out[prefix_len:]
    raise ValueError(f"{name} has {out.shape[0]} entries; expected the response side ({n_response}) or the whole "
                     f"row ({prefix_len} prompt + {n_response} response = {prefix_len + n_response})")
