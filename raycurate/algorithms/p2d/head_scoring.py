"""Task sensitivity of attention heads from base vs proxy weights, and the top-rho_P selection (P2D §3.2.1).

A head's weight vector (:mod:`raycurate.models.heads`) becomes ``P = softmax(vec / tau)`` on the index support
``i / (D - 1)`` (:func:`head_distributions`); its score is the exact 1-Wasserstein distance between base and proxy,
``sum_i |cumsum(P - Q)_i| / (D - 1)`` in float64 (:func:`wasserstein1_index`), or an ablation (``cosine``, ``l2``,
``kl``); higher = more task-sensitive.  Every scorer maps (..., D) to (...), so :func:`score_heads_streaming` scores
one layer at a time.  :func:`select_heads` / :func:`heads_table` keep the top rho_P heads of the whole model.
Decisions (GQA slices, float64, budget, ties): docs/p2d.md, "Head score".
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

import torch

METHODS = ("w1", "cosine", "l2", "kl")
Method = Literal["w1", "cosine", "l2", "kl"]
DEFAULT_TAU = 0.1

# Rows of (N, D) head vectors are scored in chunks of about this many elements (32 MiB of float64), so the float64
# temporaries of a 7B layer (28 x 1.4M weights) stay small and are reused instead of being re-faulted in per layer.
_CHUNK_ELEMENTS = 1 << 22

# Subtracted before ceil in ``n_selected`` so that 0.07 * 100 = 7.000000000000001 selects 7 heads, not 8.
_CEIL_SLACK = 1e-9


def head_distributions(vectors: torch.Tensor, tau: float = DEFAULT_TAU) -> torch.Tensor:
    """Per-head distributions over the index support.

    Args:
        vectors: (..., D) head weight vectors (any float dtype).
        tau: Softmax temperature, > 0; smaller tau concentrates the mass on the largest weights.

    Returns:
        (..., D) float64 ``softmax(vectors / tau)``; each row sums to 1.
    """
    _check_tau(tau)
    return torch.softmax(vectors.to(torch.float64) / tau, dim=-1)


def wasserstein1_index(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Exact W1 between distributions on the support ``linspace(0, 1, D)``.

    Args:
        p: (..., D) probabilities, rows summing to 1.
        q: (..., D) probabilities of the same shape.

    Returns:
        (...) float64 distances in [0, 1]; 0 when D = 1 (a single support point).
    """
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}")
    support = p.shape[-1]
    if support < 2:
        return torch.zeros(p.shape[:-1], dtype=torch.float64, device=p.device)
    cdf_gap = torch.cumsum(p.to(torch.float64) - q.to(torch.float64), dim=-1)  # (..., D)
    # The last entry is CDF_P(1) - CDF_Q(1) = 0 and has no interval after it.
    return cdf_gap[..., :-1].abs().sum(dim=-1) / (support - 1)


def score_heads(
    base: torch.Tensor, proxy: torch.Tensor, method: Method = "w1", tau: float = DEFAULT_TAU
) -> torch.Tensor:
    """Task sensitivity of each head: how far its proxy weights moved from the base weights.

    Args:
        base: (..., D) head vectors of the base model, e.g. (L, H, D) or one layer's (H, D).
        proxy: (..., D) head vectors of the proxy (briefly fine-tuned) model, same shape.
        method: ``"w1"`` (paper), ``"cosine"``, ``"l2"`` or ``"kl"``.
        tau: Softmax temperature for ``w1`` and ``kl`` (ignored by ``cosine`` and ``l2``).

    Returns:
        (...) float64 scores, higher = more task-sensitive.
    """
    if base.shape != proxy.shape:
        raise ValueError(
            f"base and proxy head vectors must have the same shape, got {tuple(base.shape)} and "
            f"{tuple(proxy.shape)}; build both with the same config, layers and include_o"
        )
    if method == "w1":
        _check_tau(tau)
        return _w1_of_vectors(base, proxy, tau)
    if method == "kl":
        _check_tau(tau)
        log_base = torch.log_softmax(base.to(torch.float64) / tau, dim=-1)
        log_proxy = torch.log_softmax(proxy.to(torch.float64) / tau, dim=-1)
        return (log_proxy.exp() * (log_proxy - log_base)).sum(dim=-1)
    base64, proxy64 = base.to(torch.float64), proxy.to(torch.float64)
    if method == "cosine":
        return 1.0 - torch.nn.functional.cosine_similarity(base64, proxy64, dim=-1)
    if method == "l2":
        return torch.linalg.vector_norm(proxy64 - base64, dim=-1)
    raise ValueError(f"unknown head scoring method {method!r}; valid methods: {list(METHODS)}")


def _softmax64_(vectors: torch.Tensor, tau: float) -> torch.Tensor:
    """(n, D) -> float64 softmax(vectors / tau) along D, computed in place on a fresh float64 copy."""
    x = vectors.to(torch.float64, copy=True).div_(tau)
    x.sub_(x.amax(dim=-1, keepdim=True)).exp_()
    return x.div_(x.sum(dim=-1, keepdim=True))


def _w1_of_vectors(base: torch.Tensor, proxy: torch.Tensor, tau: float) -> torch.Tensor:
    """``wasserstein1_index(head_distributions(base), head_distributions(proxy))`` in row chunks, in place."""
    support = base.shape[-1]
    flat_base, flat_proxy = base.reshape(-1, support), proxy.reshape(-1, support)  # (N, D)
    scores = torch.zeros(flat_base.shape[0], dtype=torch.float64, device=base.device)
    if support < 2:
        return scores.view(base.shape[:-1])
    rows = max(1, _CHUNK_ELEMENTS // support)
    for start in range(0, flat_base.shape[0], rows):
        gap = _softmax64_(flat_base[start : start + rows], tau)
        gap.sub_(_softmax64_(flat_proxy[start : start + rows], tau)).cumsum_(dim=-1)  # CDF_P - CDF_Q
        scores[start : start + rows] = gap[:, :-1].abs_().sum(dim=-1) / (support - 1)
    return scores.view(base.shape[:-1])


def score_heads_streaming(
    layer_pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], method: Method = "w1", tau: float = DEFAULT_TAU
) -> torch.Tensor:
    """Score heads layer by layer, holding one layer's vectors at a time.

    Args:
        layer_pairs: Iterable over layers of ``(base (H, D), proxy (H, D))``.
        method: See :func:`score_heads`.
        tau: See :func:`score_heads`.

    Returns:
        (L, H) float64 scores, layers in iteration order.
    """
    scores = [score_heads(base, proxy, method=method, tau=tau) for base, proxy in layer_pairs]
    if not scores:
        raise ValueError("no layers to score; layer_pairs was empty")
    return torch.stack(scores)


def n_selected(n_heads: int, ratio: float) -> int:
    """Number of heads kept at ``ratio``: ``ceil(ratio * n_heads)``, at least 1."""
    if not 0.0 < float(ratio) <= 1.0:
        raise ValueError(f"head ratio must lie in (0, 1], got {ratio!r}; it is the fraction of heads to keep")
    return max(1, math.ceil(float(ratio) * n_heads - _CEIL_SLACK))


def head_order(scores: torch.Tensor) -> torch.Tensor:
    """Flat (layer-major) head indices from most to least sensitive; ties go to the lower flat index.

    Args:
        scores: (L, H) scores without NaN.

    Returns:
        (L * H,) int64 flat indices ``layer * H + head``.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be (L, H), got shape {tuple(scores.shape)}")
    if torch.isnan(scores).any():
        raise ValueError("head scores contain NaN; check the base and proxy weights for non-finite values")
    return torch.sort(scores.flatten(), descending=True, stable=True).indices


def head_ranks(scores: torch.Tensor) -> torch.Tensor:
    """(L, H) int64 rank of every head, 1 = most sensitive (same tie rule as :func:`head_order`)."""
    order = head_order(scores)
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(1, order.numel() + 1)
    return ranks.view(scores.shape)


def select_heads(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """The top ``ceil(ratio * L * H)`` heads (at least 1): H_T.

    Args:
        scores: (L, H) sensitivity scores.
        ratio: Head ratio rho_P in (0, 1].

    Returns:
        (L, H) bool mask with exactly ``n_selected(L * H, ratio)`` True; ties broken by flat index (layer-major).
    """
    order = head_order(scores)
    mask = torch.zeros(order.numel(), dtype=torch.bool)
    mask[order[: n_selected(order.numel(), ratio)]] = True
    return mask.view(scores.shape)


def selected_pairs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """``[(layer, head), ...]`` of the True entries of an (L, H) mask, layer-major."""
    return [(int(layer), int(head)) for layer, head in torch.nonzero(mask, as_tuple=False).tolist()]


def head_overlap(mask_a: torch.Tensor, mask_b: torch.Tensor) -> float:
    """Fraction of the heads in ``mask_a`` that ``mask_b`` also selects, ``|A ∩ B| / |A|``.

    Args:
        mask_a: (L, H) bool, the reference selection (must select at least one head).
        mask_b: (L, H) bool, same shape.

    Returns:
        Overlap in [0, 1] (for equal-size selections, as across two proxy seeds, it is symmetric).
    """
    if mask_a.shape != mask_b.shape:
        raise ValueError(f"masks must have the same shape, got {tuple(mask_a.shape)} and {tuple(mask_b.shape)}")
    size = int(mask_a.sum())
    if size == 0:
        raise ValueError("mask_a selects no heads; the overlap |A ∩ B| / |A| is undefined")
    return int((mask_a & mask_b).sum()) / size


def heads_table(scores: torch.Tensor, mask: torch.Tensor) -> list[dict[str, float | int | bool]]:
    """Rows for ``heads.json``: one per head, layer-major.

    Args:
        scores: (L, H) sensitivity scores.
        mask: (L, H) bool selection (e.g. from :func:`select_heads`).

    Returns:
        ``[{"layer", "head", "score", "rank", "selected"}, ...]`` with rank 1 = most sensitive.
    """
    if scores.shape != mask.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and mask {tuple(mask.shape)} must have the same shape")
    ranks = head_ranks(scores)
    n_heads = scores.shape[1]
    return [
        {
            "layer": flat // n_heads,
            "head": flat % n_heads,
            "score": float(score),
            "rank": int(rank),
            "selected": bool(chosen),
        }
        for flat, (score, rank, chosen) in enumerate(
            zip(scores.flatten().tolist(), ranks.flatten().tolist(), mask.flatten().tolist(), strict=True)
        )
    ]


def _check_tau(tau: float) -> None:
    if not float(tau) > 0.0:
        raise ValueError(f"tau must be > 0, got {tau!r}; the paper uses 0.1")
