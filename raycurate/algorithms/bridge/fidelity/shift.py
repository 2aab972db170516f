"""Ranking shift vs opposite-side retention (paper §3 Finding 2, Fig. 2(b), App. C.1)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np

from raycurate.algorithms.bridge.fidelity.eligible import SIDES
from raycurate.algorithms.bridge.fidelity.proxies import conditional_scores
from raycurate.algorithms.bridge.selection import budgets, top_b
from raycurate.algorithms.ranking import spearman

DEFAULT_RETENTIONS = (1.0, 0.9, 0.75, 0.5, 0.25, 0.1)


def nested_random_masks(n: int, sizes: Sequence[int], rng: np.random.Generator) -> np.ndarray:
    """Random NESTED subsets: the first ``b`` entries of one seeded permutation for every size ``b``.

    Smaller subsets are contained in larger ones, so a retention curve shrinks one fixed random subset
    ("progressively smaller sets", paper Fig. 2(b)) instead of redrawing it at every ratio.

    Args:
        n: number of candidates.
        sizes: (k,) subset sizes, each in [0, n].
        rng: seeded generator (one permutation is drawn).

    Returns:
        (k, n) bool masks; row ``m`` has ``sizes[m]`` True.
    """
    order = rng.permutation(n)  # (n,)
    masks = np.zeros((len(sizes), n), dtype=bool)
    for m, b in enumerate(sizes):
        if not 0 <= int(b) <= n:
            raise ValueError(f"subset size {b} must lie in [0, {n}]")
        masks[m, order[:int(b)]] = True
    return masks


def ranking_shift(
    beta: np.ndarray,
    gamma: np.ndarray,
    prompt_bias: np.ndarray | None = None,
    retentions: Sequence[float] = DEFAULT_RETENTIONS,
    subset: Literal["top", "random"] = "random",
    seed: int | np.random.SeedSequence = 0,
) -> dict[str, np.ndarray]:
    """Ranking shift vs opposite-side retention for one example (paper §3 Finding 2, Fig. 2(b), App. C.1).

    Shift = 1 - Spearman between the full-retention ranking and the ranking conditioned on a retained
    opposite-side subset: prompt side ``1 - rho_s(Delta_p(. | R), Delta_p(. | S_r))`` with ``|S_r| =
    round(rho |R|)``; response side ``1 - rho_s(Delta_r(. | P), Delta_r(. | S_p))`` with ``|S_p| = round(rho |P|)``.
    The retained opposite subset is (decision; the paper says only "progressively smaller sets ... retained"):
    ``"random"`` (default, the Fig. 2(b) protocol), progressively smaller random NESTED subsets, the first ``b``
    entries of one permutation per side drawn with ``seed`` (:func:`nested_random_masks`); or ``"top"``, the
    full-state Top-b of that side (what full-state selection would retain; it hides the shift because the
    dropped tokens are the ones that contribute least).

    Args:
        beta: (p, r) interactions over eligible positions (folded; surrogate or exact).
        gamma: (r,) history utilities.
        prompt_bias: optional (p,) fixed-response term (default zero).
        retentions: opposite-side retention ratios in [0, 1].
        subset: ``"random"`` or ``"top"``.
        seed: RNG seed (or SeedSequence) for ``"random"``.

    Returns:
        ``{"retention": (k,), "prompt_shift": (k,), "response_shift": (k,)}`` float64; NaN where a ranking is
        constant (e.g. nothing retained on the opposite side and no bias).
    """
    if subset not in ("top", "random"):
        raise ValueError(f"unknown subset {subset!r}; choose 'top' or 'random'")
    beta = np.asarray(beta, dtype=np.float64)
    gamma = np.asarray(gamma, dtype=np.float64)
    bias = np.zeros(beta.shape[0]) if prompt_bias is None else np.asarray(prompt_bias, dtype=np.float64)
    if beta.ndim != 2 or gamma.shape != (beta.shape[1],) or bias.shape != (beta.shape[0],):
        raise ValueError(f"need beta (p, r), gamma (r,), prompt_bias (p,); got {beta.shape}, {gamma.shape}, "
                         f"{bias.shape}")
    p, r = beta.shape
    full_p, full_r = conditional_scores(beta, gamma, bias, np.ones(p, bool), np.ones(r, bool))  # (p,), (r,)
    sizes = [budgets(p, r, rho, rho) for rho in retentions]  # [(b_p, b_r)]
    if subset == "random":
        rng = np.random.default_rng(seed)
        kept_r = nested_random_masks(r, [b_r for _, b_r in sizes], rng)  # (k, r)
        kept_p = nested_random_masks(p, [b_p for b_p, _ in sizes], rng)  # (k, p)
    else:
        kept_r = np.stack([top_b(full_r, b_r) for _, b_r in sizes]) if sizes else np.zeros((0, r), bool)
        kept_p = np.stack([top_b(full_p, b_p) for b_p, _ in sizes]) if sizes else np.zeros((0, p), bool)
    prompt_shift, response_shift = [], []
    for m in range(len(sizes)):
        cond_p, _ = conditional_scores(beta, gamma, bias, np.ones(p, bool), kept_r[m])
        _, cond_r = conditional_scores(beta, gamma, bias, kept_p[m], np.ones(r, bool))
        prompt_shift.append(1.0 - spearman(full_p, cond_p))
        response_shift.append(1.0 - spearman(full_r, cond_r))
    return {
        "retention": np.asarray(retentions, dtype=np.float64),
        "prompt_shift": np.asarray(prompt_shift),
        "response_shift": np.asarray(response_shift),
    }


def mean_ranking_shift(curves: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Average :func:`ranking_shift` curves over examples (NaN entries left out), for Fig. 2(b).

    Args:
        curves: per-example outputs of :func:`ranking_shift` on the same retention grid.

    Returns:
        ``{"retention", "prompt_shift", "response_shift", "n_prompt", "n_response"}``: mean shifts (k,) and the
        number of examples each mean covers (k,).
    """
    if not curves:
        raise ValueError("mean_ranking_shift needs at least one curve")
    grid = np.asarray(curves[0]["retention"])
    if any(not np.array_equal(np.asarray(cv["retention"]), grid) for cv in curves):
        raise ValueError("curves use different retention grids; compute them with the same retentions")
    out: dict[str, np.ndarray] = {"retention": grid}
    for side in SIDES:
        stacked = np.stack([np.asarray(cv[f"{side}_shift"], dtype=np.float64) for cv in curves])  # (N, k)
        valid = ~np.isnan(stacked)
        count = valid.sum(axis=0)
        total = np.where(valid, stacked, 0.0).sum(axis=0)
        out[f"{side}_shift"] = np.where(count > 0, total / np.maximum(count, 1), np.nan)
        out[f"n_{side}"] = count
    return out
