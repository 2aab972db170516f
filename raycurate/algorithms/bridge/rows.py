"""BRIDGE per-example pipeline: utilities + routing -> interactions -> budgets -> coupled selection -> closure.

The scoring actor calls :func:`score_rows` on a batch of token rows (the model's part: utilities, routing, the
optional knock-out scores); the selection actor calls :func:`select_rows` on the stored scores (budgets, coupled
selection, closure; no model).  :func:`score_and_select_rows` chains both in memory.  Everything here is pure
torch / numpy (the model is an argument), so the row logic runs and is tested without Ray.  The O(p r)
interaction matrix lives only inside :func:`select_example`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from raycurate.algorithms.bridge.alignment import spans_from_flat
from raycurate.algorithms.bridge.closure import final_answer_covered, project_response
from raycurate.algorithms.bridge.routing import attention_for_layer, interaction_terms, routing_weights
from raycurate.algorithms.bridge.selection import (
    BUDGET_MODES,
    Schedule,
    SelectionResult,
    budgets,
    corpus_budgets,
    eligible_positions,
    fold_fixed_positions,
    knockout_update,
    select,
    supervise_first,
    to_row_masks,
    top_b,
)
from raycurate.algorithms.bridge.token_utility import knockout_prompt_scores, token_utilities
from raycurate.algorithms.losses import pad_rows

SCHEDULES: tuple[Schedule, ...] = ("independent", "one_pass", "alternating")
PROMPT_PROXIES = ("routing", "knockout_grad")


@dataclass(frozen=True)
class SelectionSettings:
    """What :func:`select_example` needs besides the scores (a plain mirror of the BRIDGE config)."""

    rho_p: float = 0.75
    rho_r: float = 0.75
    schedule: Schedule = "alternating"
    rounds: int = 4
    closure: bool = True
    closure_tau: float | None = None
    closure_alpha: float = 0.5
    max_unit_tokens: int = 96
    min_unit_tokens: int = 4
    fold_fixed_response: bool = False
    prompt_proxy: str = "routing"
    budget: str = "per_example"
    row_floor: float = 0.0
    first_tokens: int = 0

    def __post_init__(self) -> None:
        if self.prompt_proxy not in PROMPT_PROXIES:
            raise ValueError(f"prompt_proxy={self.prompt_proxy!r} is unknown; choose one of "
                             f"{', '.join(PROMPT_PROXIES)}")
        if self.budget not in BUDGET_MODES:
            raise ValueError(f"budget={self.budget!r} is unknown; choose one of {', '.join(BUDGET_MODES)}")
        if not 0.0 <= self.row_floor <= self.rho_r:
            raise ValueError(f"row_floor={self.row_floor!r} must lie in [0, rho_r={self.rho_r}]: it is the share of "
                             "every row supervised before the corpus-wide allocation")


def fixed_masks(prompt_len: int, n: int, prompt_offsets: Sequence[int],
                response_offsets: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Fixed (always kept / always supervised) positions: template and special tokens, whose offsets are -1.

    Args:
        prompt_len: Prompt-side positions p.
        n: Row length.
        prompt_offsets: Flat (start, end) char offsets of the p prompt-side tokens.
        response_offsets: Flat (start, end) char offsets of the n - p response-side tokens.

    Returns:
        (fixed_prompt (p,) bool, fixed_response (n - p,) bool).
    """
    prompt = np.asarray(prompt_offsets, dtype=np.int64).reshape(-1, 2)[:, 0] < 0
    response = np.asarray(response_offsets, dtype=np.int64).reshape(-1, 2)[:, 0] < 0
    if prompt.shape[0] != prompt_len or response.shape[0] != n - prompt_len:
        raise ValueError(f"offsets do not match the row: {prompt.shape[0]} prompt / {response.shape[0]} response "
                         f"offsets for prompt_len={prompt_len}, n={n}; re-run tokenization")
    return prompt, response


@dataclass
class ExampleState:
    """Surrogate interactions, budgets and the routing selection of one example (before closure)."""

    prompt_idx: np.ndarray
    response_idx: np.ndarray
    beta: np.ndarray
    gamma: np.ndarray
    bias: np.ndarray | None
    b_p: int
    b_r: int
    result: SelectionResult


def surrogate_state(utilities: np.ndarray, a_p: np.ndarray, c: np.ndarray, row: Mapping[str, Any],
                    settings: SelectionSettings) -> ExampleState:
    """Eligible positions, folded interactions, budgets and the routing surrogate's selection of one example.

    Args:
        utilities: (n,) token utilities a_t (non-zero on the response side only).
        a_p: (r_all, p) prompt routing weights of every response-side position (``routing_weights``).
        c: (r_all,) response-history mass.
        row: Token row with ``input_ids``, ``prompt_len``, ``prompt_offsets``, ``response_offsets``.
        settings: Budgets and schedule.

    Returns:
        An :class:`ExampleState`.
    """
    n, p = len(row["input_ids"]), int(row["prompt_len"])
    fixed_prompt, fixed_response = fixed_masks(p, n, row["prompt_offsets"], row["response_offsets"])
    has_bos = bool(fixed_prompt[0])
    prompt_idx, response_idx = eligible_positions(n, p, has_bos, fixed_prompt, fixed_response)
    a_resp = torch.as_tensor(utilities[p:n], dtype=torch.float32)
    beta_full, gamma_full = interaction_terms(torch.as_tensor(a_p), a_resp, torch.as_tensor(c))
    prompt_eligible = np.zeros(p, dtype=bool)
    prompt_eligible[prompt_idx] = True
    response_eligible = np.zeros(n - p, dtype=bool)
    response_eligible[response_idx - p] = True
    bias: np.ndarray | None
    beta, gamma, bias = fold_fixed_positions(beta_full.double().numpy(), gamma_full.double().numpy(),
                                             prompt_eligible, response_eligible)
    if not settings.fold_fixed_response:
        # Paper protocol: EOS / end-of-turn are fixed and excluded from Delta_p.  Their utilities are often orders of
        # magnitude above content tokens, so folding them in would let EOS attention decide the prompt selection.
        bias = None
    b_p, b_r = budgets(len(prompt_idx), len(response_idx), settings.rho_p, settings.rho_r)
    result = select(beta, gamma, b_p, b_r, settings.schedule, settings.rounds, prompt_bias=bias)
    return ExampleState(prompt_idx, response_idx, beta, gamma, bias, b_p, b_r, result)


def knockout_weights(state: ExampleState, n: int, prompt_len: int, settings: SelectionSettings) -> np.ndarray:
    """(n,) response weights of the knock-out proxy: 1 on the routing state's S_r, and on the fixed response tokens
    (EOS, end-of-turn) only when ``settings.fold_fixed_response`` (as Delta_p counts them); 0 elsewhere."""
    weights = np.zeros(n, dtype=np.float32)
    if settings.fold_fixed_response:
        weights[prompt_len:] = 1.0
    weights[state.response_idx] = state.result.response_mask.astype(np.float32)
    return weights


def select_example(
    utilities: np.ndarray,
    a_p: np.ndarray,
    c: np.ndarray,
    row: Mapping[str, Any],
    settings: SelectionSettings,
    prompt_scores: np.ndarray | None = None,
) -> dict[str, Any]:
    """Budgets, coupled selection and closure for one example.

    Args:
        utilities: (n,) token utilities a_t (non-zero on the response side only).
        a_p: (r_all, p) prompt routing weights of every response-side position (``routing_weights``).
        c: (r_all,) response-history mass.
        row: Token row with ``input_ids``, ``prompt_len``, ``prompt_offsets``, ``response_offsets``, ``response``
            and ``domain``.
        settings: Budgets, schedule, closure options.
        prompt_scores: optional (n,) knock-out prompt scores (``settings.prompt_proxy = "knockout_grad"``),
            conditioned on the routing selection's S_r (:func:`knockout_weights`); they replace Delta_p in one
            final coupled update (:func:`raycurate.algorithms.bridge.selection.knockout_update`).

    Returns:
        ``prompt_keep`` (p,) int8, ``loss_mask`` (n,) int8, ``response_scores`` (r,) float32 (final conditional
        scores of the eligible response tokens), ``u_sur`` (after every update), ``u_sur_by_schedule`` (final U_sur
        of each schedule on the same routing interactions), budgets and closure diagnostics.
    """
    n, p = len(row["input_ids"]), int(row["prompt_len"])
    state = surrogate_state(utilities, a_p, c, row, settings)
    prompt_idx, response_idx, beta, gamma, bias = (state.prompt_idx, state.response_idx, state.beta, state.gamma,
                                                   state.bias)
    b_p, b_r, result = state.b_p, state.b_r, state.result
    if prompt_scores is not None and len(prompt_idx) and len(response_idx):
        result = knockout_update(result, np.asarray(prompt_scores, dtype=np.float64)[prompt_idx], beta, gamma,
                                 b_p, b_r, prompt_bias=bias)
    by_schedule = {
        name: (state.result if name == settings.schedule else select(beta, gamma, b_p, b_r, name, settings.rounds,
                                                                 prompt_bias=bias)).u_sur[-1]
        for name in SCHEDULES
    } if len(prompt_idx) and len(response_idx) else {name: 0.0 for name in SCHEDULES}
    response_mask, closure_info = project_response_mask(row, response_idx, result.response_scores,
                                                        result.response_mask, b_r, settings)
    prompt_keep, loss_mask = to_row_masks(n, p, prompt_idx, response_idx, result.prompt_mask, response_mask)
    return {
        "prompt_keep": prompt_keep.astype(np.int8),
        "loss_mask": loss_mask.astype(np.int8),
        "response_scores": np.asarray(result.response_scores, dtype=np.float32),
        "u_sur": [float(u) for u in result.u_sur],
        "u_sur_by_schedule": {k: float(v) for k, v in by_schedule.items()},
        "b_p": int(b_p), "b_r": int(b_r),
        "eligible_prompt": int(len(prompt_idx)), "eligible_response": int(len(response_idx)),
        "kept_prompt": int(result.prompt_mask.sum()), "supervised_response": int(response_mask.sum()),
        "rounds_run": int(result.rounds_run),
        **closure_info,
    }


def project_response_mask(row: Mapping[str, Any], response_idx: np.ndarray, scores: np.ndarray,
                          token_mask: np.ndarray, b_r: int,
                          settings: SelectionSettings) -> tuple[np.ndarray, dict[str, Any]]:
    """The closure projection of one row's response selection (or the token mask itself with closure off).

    Args:
        row: Token row with ``prompt_len``, ``response_offsets``, ``response`` and ``domain``.
        response_idx: (r,) eligible response row positions.
        scores: (r,) final conditional response scores.
        token_mask: (r,) bool pre-projection selection with at most ``b_r`` positions.
        b_r: Response budget.
        settings: Closure options.

    Returns:
        ((r,) bool response mask, closure diagnostics: ``closure_fallback``, ``final_answer_kept``,
        ``final_answer_kept_score_only``, ``utility_retained``, ``closure_solver``).
    """
    p = int(row["prompt_len"])
    info = {"closure_fallback": True, "final_answer_kept": -1, "final_answer_kept_score_only": -1,
            "utility_retained": float("nan"), "closure_solver": "off"}
    if not settings.closure or not len(response_idx):
        return _first_tokens(row, response_idx, scores, np.asarray(token_mask, dtype=bool), settings), info
    eligible_offsets = spans_from_flat(row["response_offsets"])[np.asarray(response_idx) - p]  # (r, 2)
    projected = project_response(
        row["response"], row.get("domain"), eligible_offsets, scores, b_r,
        token_mask=token_mask, max_unit_tokens=settings.max_unit_tokens,
        min_unit_tokens=settings.min_unit_tokens, tau=settings.closure_tau, alpha=settings.closure_alpha,
    )
    score_only = final_answer_covered(token_mask, projected.units) if projected.units else None
    return _first_tokens(row, response_idx, scores, projected.mask, settings), {
        "closure_fallback": bool(projected.fallback),
        "final_answer_kept": int(projected.final_answer_kept) if projected.has_final_answer else -1,
        "final_answer_kept_score_only": -1 if score_only is None else int(score_only),
        "utility_retained": float(projected.utility_retained),
        "closure_solver": projected.solver,
    }


def _first_tokens(row: Mapping[str, Any], response_idx: np.ndarray, scores: np.ndarray, mask: np.ndarray,
                  settings: SelectionSettings) -> np.ndarray:
    """``settings.first_tokens``: the row's first eligible response tokens swapped into ``mask`` (same size); the
    final-answer line (from the last ``####`` on) is never swapped out."""
    if settings.first_tokens <= 0 or not len(response_idx):
        return mask
    p = int(row["prompt_len"])
    starts = spans_from_flat(row["response_offsets"])[np.asarray(response_idx) - p][:, 0]  # (r,)
    marker = str(row.get("response") or "").rfind("####")
    protected = starts >= marker if marker >= 0 else None
    return supervise_first(mask, scores, settings.first_tokens, protected)


def corpus_response_masks(rows: Sequence[Mapping[str, Any]], response_scores: Sequence[np.ndarray],
                          settings: SelectionSettings) -> list[dict[str, Any]]:
    """``bridge.budget = corpus``: one response budget over all rows, allocated by the rows' final conditional
    response scores (:func:`raycurate.algorithms.bridge.selection.corpus_budgets` at ``rho_r`` with ``row_floor``), then
    each row's Top-b_i (and closure) at its own b_i.  The prompt selections are the per-example ones.

    Args:
        rows: Token rows (``input_ids``, ``prompt_len``, ``prompt_offsets``, ``response_offsets``, ``response``,
            ``domain``), every row of the corpus (the allocation is global).
        response_scores: per row the (r,) scores of its eligible response positions (``select_example``'s
            ``response_scores``).
        settings: rho_r, row_floor and the closure options.

    Returns:
        Per row ``response_mask`` (r,) bool over its eligible positions, ``b_r``, ``supervised_response`` and the
        closure diagnostics of :func:`project_response_mask`.
    """
    if len(rows) != len(response_scores):
        raise ValueError(f"{len(rows)} rows but {len(response_scores)} score arrays")
    allotted = corpus_budgets(response_scores, settings.rho_r, settings.row_floor)
    out = []
    for row, scores, b in zip(rows, response_scores, allotted):
        n, p = len(row["input_ids"]), int(row["prompt_len"])
        fixed_prompt, fixed_response = fixed_masks(p, n, row["prompt_offsets"], row["response_offsets"])
        _, response_idx = eligible_positions(n, p, bool(fixed_prompt[0]), fixed_prompt, fixed_response)
        scores = np.asarray(scores, dtype=np.float64)
        if scores.shape != response_idx.shape:
            raise ValueError(f"row {row.get('id')}: {scores.shape[0]} response scores for {response_idx.shape[0]} "
                             "eligible response positions; re-run bridge_select")
        mask, info = project_response_mask(row, response_idx, scores, top_b(scores, int(b)), int(b), settings)
        out.append({"response_mask": mask, "response_idx": response_idx, "b_r": int(b),
                    "supervised_response": int(mask.sum()), **info})
    return out


@dataclass
class RowScores:
    """What the model contributes to one example's selection (everything else is budget arithmetic).

    Attributes:
        utilities: (r,) token utilities a_j of the response-side positions p..n-1 (EOS included).
        a_p: (r, p) prompt routing weights of every response-side position (:func:`routing_weights`).
        c: (r,) response-history mass.
        prompt_scores: optional (n,) knock-out prompt scores (``prompt_proxy = "knockout_grad"``); they are
            conditioned on the routing selection's S_r, so they depend on the budgets and the schedule.
    """

    utilities: np.ndarray
    a_p: np.ndarray
    c: np.ndarray
    prompt_scores: np.ndarray | None = None


SCORE_DTYPES = ("float16", "float32")


def quantize(x: np.ndarray, dtype: str) -> tuple[np.ndarray, float]:
    """Store-side encoding of a score array: ``(values, scale)`` with ``x ~= values * scale``.

    ``float32`` keeps the values exactly (scale 1).  ``float16`` divides by the array's max |x| first (scale), so
    a row's values neither overflow nor underflow half precision whatever their magnitude; the relative error of
    an entry is then <= 2^-11 of the row's max |x| (finer for entries within 2^-14 of it).
    """
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float32":
        return x, 1.0
    if dtype != "float16":
        raise ValueError(f"score dtype {dtype!r} is unknown; choose one of {', '.join(SCORE_DTYPES)}")
    peak = float(np.max(np.abs(x))) if x.size else 0.0
    scale = peak if peak > 0 and np.isfinite(peak) else 1.0
    return (x / np.float32(scale)).astype(np.float16), scale


def dequantize(values: np.ndarray, scale: float) -> np.ndarray:
    """Inverse of :func:`quantize` (float32)."""
    values = np.asarray(values)
    if values.dtype == np.float32 and scale == 1.0:
        return values
    return values.astype(np.float32) * np.float32(scale)


def round_trip(scores: RowScores, dtype: str) -> RowScores:
    """``scores`` as the selection reads them back after storing them in ``dtype`` (exact for float32)."""

    def rt(x: np.ndarray) -> np.ndarray:
        return dequantize(*quantize(x, dtype))

    prompt_scores = None if scores.prompt_scores is None else rt(scores.prompt_scores)
    return RowScores(rt(scores.utilities), rt(scores.a_p), rt(scores.c), prompt_scores)


def score_rows(
    model: torch.nn.Module,
    direction: Mapping[str, torch.Tensor],
    routing_layer: int,
    rows: Sequence[Mapping[str, Any]],
    settings: SelectionSettings,
    *,
    pad_id: int = 0,
    micro_batch: int = 8,
) -> list[RowScores]:
    """Token utilities (one JVP pass) and routing (one attention layer) per micro-batch: the model's part.

    With ``settings.prompt_proxy == "knockout_grad"`` one more double-backward pass per micro-batch scores the
    prompt tokens by the knock-out derivative conditioned on the routing selection's S_r (which depends on the
    budgets and schedule in ``settings``); otherwise ``settings`` is not read.

    Args:
        model: Scoring model at theta_bar, eval mode.
        direction: Scoring direction v over the final layers' parameters.
        routing_layer: Attention layer read for routing weights.
        rows: Token rows (data contract).
        settings: Selection settings (only read for the knock-out proxy).
        pad_id: Padding token id.
        micro_batch: Rows per forward pass.

    Returns:
        One :class:`RowScores` per row, in order.
    """
    out: list[RowScores] = []
    for start in range(0, len(rows), micro_batch):
        chunk = rows[start:start + micro_batch]
        batch = pad_rows(chunk, pad_id)
        utilities = token_utilities(model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"],
                                    direction)  # (B, T)
        with torch.no_grad():
            attn = attention_for_layer(model, batch["input_ids"], batch["attention_mask"], routing_layer)
        routed = []
        for i, row in enumerate(chunk):
            n = len(row["input_ids"])
            a_p, c = routing_weights(attn[i], int(row["prompt_len"]), n)
            routed.append((utilities[i, :n].detach().cpu().numpy(), a_p.cpu().numpy(), c.cpu().numpy()))
        knockout = (_knockout_batch(model, direction, chunk, routed, batch, settings)
                    if settings.prompt_proxy == "knockout_grad" else [None] * len(chunk))
        for row, (a, a_p, c), scores in zip(chunk, routed, knockout):
            out.append(RowScores(np.asarray(a[int(row["prompt_len"]):], dtype=np.float32), a_p, c, scores))
    return out


def full_utilities(scores: RowScores, n: int) -> np.ndarray:
    """(n,) utilities with zeros on the prompt side (what :func:`select_example` takes)."""
    utilities = np.zeros(n, dtype=np.float32)
    utilities[n - len(scores.utilities):] = scores.utilities
    return utilities


def select_rows(rows: Sequence[Mapping[str, Any]], scores: Sequence[RowScores],
                settings: SelectionSettings) -> list[dict[str, Any]]:
    """:func:`select_example` for every row from its stored :class:`RowScores` (no model)."""
    if len(rows) != len(scores):
        raise ValueError(f"{len(rows)} rows but {len(scores)} score records")
    return [select_example(full_utilities(s, len(row["input_ids"])), s.a_p, s.c, row, settings,
                           prompt_scores=s.prompt_scores) for row, s in zip(rows, scores)]


def score_and_select_rows(
    model: torch.nn.Module,
    direction: Mapping[str, torch.Tensor],
    routing_layer: int,
    rows: Sequence[Mapping[str, Any]],
    settings: SelectionSettings,
    *,
    pad_id: int = 0,
    micro_batch: int = 8,
    score_dtype: str = "float32",
) -> list[dict[str, Any]]:
    """Scoring and per-example selection in one call (in memory): :func:`score_rows` then :func:`select_rows`.

    The pipeline runs the two halves as separate stages (``bridge_score`` stores the scores in
    ``bridge.score_dtype``, ``bridge_select`` reads them); with the same ``score_dtype`` this function returns the
    same selection bit for bit.  ``float32`` (the default here) is the unquantized selection.

    Returns:
        One :func:`select_example` result per row, in order.
    """
    scores = score_rows(model, direction, routing_layer, rows, settings, pad_id=pad_id, micro_batch=micro_batch)
    return select_rows(rows, [round_trip(s, score_dtype) for s in scores], settings)


def _knockout_batch(model: torch.nn.Module, direction: Mapping[str, torch.Tensor], chunk: Sequence[Mapping[str, Any]],
                    routed: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], batch: Mapping[str, torch.Tensor],
                    settings: SelectionSettings) -> list[np.ndarray]:
    """Knock-out prompt scores of a micro-batch (one double-backward pass), each conditioned on its example's
    routing selection S_r; returns (n,) score rows."""
    shape = batch["input_ids"].shape
    prompt_mask = torch.zeros(shape, dtype=torch.bool)
    weights = torch.zeros(shape, dtype=torch.float32)
    for i, (row, (a, a_p, c)) in enumerate(zip(chunk, routed)):
        n, p = len(row["input_ids"]), int(row["prompt_len"])
        state = surrogate_state(a, a_p, c, row, settings)
        prompt_mask[i, torch.as_tensor(state.prompt_idx, dtype=torch.long)] = True
        weights[i, :n] = torch.as_tensor(knockout_weights(state, n, p, settings))
    device = batch["input_ids"].device
    scores = knockout_prompt_scores(model, batch["input_ids"], batch["attention_mask"], prompt_mask.to(device),
                                    weights.to(device), direction)  # (B, T)
    return [scores[i, :len(row["input_ids"])].cpu().numpy() for i, row in enumerate(chunk)]


def prompt_relevance_drops(prompt_keep: Sequence[int], prompt_offsets: Sequence[int],
                           relevant_spans: Sequence[Sequence[int]],
                           distractor_spans: Sequence[Sequence[int]]) -> dict[str, int]:
    """Count dropped vs total prompt tokens inside labelled relevant and distractor sentences.

    A token belongs to a span when its character start lies inside it.

    Args:
        prompt_keep: (p,) 1 where the prompt-side token is kept.
        prompt_offsets: Flat (start, end) char offsets of the p prompt-side tokens (-1 for template tokens).
        relevant_spans: Char [start, end) spans of relevant sentences.
        distractor_spans: Char [start, end) spans of distractor sentences.

    Returns:
        ``relevant_total``, ``relevant_dropped``, ``distractor_total``, ``distractor_dropped``.
    """
    starts = np.asarray(prompt_offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
    dropped = np.asarray(prompt_keep, dtype=bool) == 0

    def inside(spans: Sequence[Sequence[int]]) -> np.ndarray:
        hit = np.zeros(starts.shape[0], dtype=bool)
        for lo, hi in spans:
            hit |= (starts >= lo) & (starts < hi)
        return hit

    relevant, distractor = inside(relevant_spans), inside(distractor_spans)
    return {
        "relevant_total": int(relevant.sum()), "relevant_dropped": int((relevant & dropped).sum()),
        "distractor_total": int(distractor.sum()), "distractor_dropped": int((distractor & dropped).sum()),
    }
