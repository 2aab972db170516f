"""Head sensitivity scores (exact W1 on the index support, ablation scorers) and top-rho_P selection (SPEC §5)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import wasserstein_distance

from raycurate.algorithms.p2d.head_scoring import (
    head_distributions,
    head_order,
    head_overlap,
    head_ranks,
    heads_table,
    n_selected,
    score_heads,
    score_heads_streaming,
    select_heads,
    selected_pairs,
    wasserstein1_index,
)


@pytest.mark.parametrize("support", [2, 3, 7, 50])
def test_w1_equals_scipy_on_the_index_support(support):
    gen = torch.Generator().manual_seed(support)
    p = head_distributions(torch.randn(4, support, generator=gen), tau=0.5)
    q = head_distributions(torch.randn(4, support, generator=gen), tau=0.5)
    ours = wasserstein1_index(p, q)
    grid = np.linspace(0.0, 1.0, support)
    for row in range(4):
        expected = wasserstein_distance(grid, grid, u_weights=p[row].numpy(), v_weights=q[row].numpy())
        assert ours[row].item() == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_w1_hand_values():
    end_points = wasserstein1_index(torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 0.0, 1.0]))
    assert end_points.item() == pytest.approx(1.0)  # all mass moves from x=0 to x=1
    neighbours = wasserstein1_index(torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0]))
    assert neighbours.item() == pytest.approx(0.5)  # one grid step of 1 / (D - 1)
    p = head_distributions(torch.randn(3, 9))
    assert torch.equal(wasserstein1_index(p, p), torch.zeros(3, dtype=torch.float64))
    assert wasserstein1_index(torch.ones(2, 1), torch.ones(2, 1)).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("tau", [1.0, 0.5, 0.1])
def test_w1_of_a_delta_on_the_last_index_by_hand(tau):
    # base: all-zero vector -> uniform; proxy: +1 on the last index -> weight E = e^{1/tau} there.
    # CDF gap at i < D-1 is (i + 1) (1/D - 1/(D - 1 + E)); summing and dividing by D - 1 gives
    # W1 = (1 - D / (D - 1 + E)) / 2.
    support = 10
    base = torch.zeros(support)
    proxy = torch.zeros(support)
    proxy[-1] = 1.0
    expected = 0.5 * (1.0 - support / (support - 1 + math.exp(1.0 / tau)))
    assert score_heads(base, proxy, tau=tau).item() == pytest.approx(expected, rel=1e-12)


def test_smaller_tau_sharpens_distributions_and_raises_w1_of_a_concentrated_delta():
    proxy = torch.zeros(10)
    proxy[-1] = 1.0
    scores = [score_heads(torch.zeros(10), proxy, tau=tau).item() for tau in (10.0, 1.0, 0.1, 0.01)]
    assert scores == sorted(scores) and scores[0] < 0.01 and scores[-1] == pytest.approx(0.5, abs=1e-12)
    vec = torch.tensor([0.0, 0.2, 1.0])
    assert head_distributions(vec, tau=0.1).max() > head_distributions(vec, tau=1.0).max()


def test_ablation_scorers_by_hand():
    base = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    proxy = torch.tensor([[0.0, 1.0], [2.0, 2.0]])
    assert score_heads(base, proxy, method="cosine").tolist() == pytest.approx([1.0, 0.0])  # orthogonal, parallel
    assert score_heads(base, proxy, method="l2").tolist() == pytest.approx([math.sqrt(2.0), math.sqrt(2.0)])
    # KL(P_proxy || P_base) with tau = 1 on D = 2: P_base = (a, 1-a), a = e/(e+1); P_proxy = (1-a, a)
    a = math.e / (math.e + 1)
    kl = (1 - a) * math.log((1 - a) / a) + a * math.log(a / (1 - a))
    assert score_heads(base[:1], proxy[:1], method="kl", tau=1.0).item() == pytest.approx(kl)
    assert score_heads(base, base, method="kl").tolist() == [0.0, 0.0]


def test_score_errors_list_valid_methods_and_shapes():
    with pytest.raises(ValueError, match="valid methods"):
        score_heads(torch.zeros(2, 3), torch.zeros(2, 3), method="cka")
    with pytest.raises(ValueError, match="same shape"):
        score_heads(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="tau must be > 0"):
        score_heads(torch.zeros(2, 3), torch.zeros(2, 3), tau=0.0)


def test_streaming_scores_equal_batched_scores():
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(3, 4, 20, generator=gen)
    proxy = base + 0.1 * torch.randn(3, 4, 20, generator=gen)
    streamed = score_heads_streaming(zip(base, proxy, strict=True))
    assert streamed.shape == (3, 4)
    assert torch.allclose(streamed, score_heads(base, proxy), rtol=1e-14, atol=0)


@pytest.mark.parametrize(
    "n_layers, n_heads, ratio, expected",
    [
        (4, 4, 0.1, 2),  # ceil(1.6)
        (10, 10, 0.07, 7),  # 0.07 * 100 = 7.000000000000001 must not become 8
        (28, 28, 0.1, 79),  # Qwen2.5-7B: ceil(78.4)
        (2, 2, 0.01, 1),  # at least one head
        (2, 3, 1.0, 6),
    ],
)
def test_select_heads_keeps_exactly_ceil_ratio_heads(n_layers, n_heads, ratio, expected):
    scores = torch.rand(n_layers, n_heads, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mask = select_heads(scores, ratio)
    assert mask.dtype == torch.bool and mask.shape == (n_layers, n_heads)
    assert int(mask.sum()) == expected == n_selected(n_layers * n_heads, ratio)
    if (~mask).any():
        assert scores[mask].min() >= scores[~mask].max()


def test_select_heads_breaks_ties_by_flat_layer_major_index():
    scores = torch.tensor([[0.5, 1.0, 0.5], [1.0, 0.5, 0.5]])
    mask = select_heads(scores, 3 / 6)  # two 1.0s, then the first 0.5 in layer-major order: (0, 0)
    assert selected_pairs(mask) == [(0, 0), (0, 1), (1, 0)]
    assert head_order(scores).tolist() == [1, 3, 0, 2, 4, 5]
    assert head_ranks(scores).tolist() == [[3, 1, 4], [2, 5, 6]]


def test_select_heads_validates_ratio_and_nan():
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        select_heads(torch.zeros(2, 2), 0.0)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        select_heads(torch.zeros(2, 2), 1.5)
    with pytest.raises(ValueError, match="NaN"):
        select_heads(torch.tensor([[0.0, float("nan")]]), 0.5)


def test_head_overlap_and_table():
    a = torch.tensor([[True, True], [False, True]])
    b = torch.tensor([[True, False], [True, True]])
    assert head_overlap(a, b) == pytest.approx(2 / 3)
    assert head_overlap(a, a) == 1.0
    with pytest.raises(ValueError, match="selects no heads"):
        head_overlap(torch.zeros(2, 2, dtype=torch.bool), b)
    scores = torch.tensor([[0.1, 0.4], [0.3, 0.2]])
    table = heads_table(scores, select_heads(scores, 0.5))
    assert table[1] == {"layer": 0, "head": 1, "score": pytest.approx(0.4), "rank": 1, "selected": True}
    assert [(row["layer"], row["head"], row["rank"], row["selected"]) for row in table] == [
        (0, 0, 4, False),
        (0, 1, 1, True),
        (1, 0, 2, True),
        (1, 1, 3, False),
    ]


def test_chunked_w1_equals_the_two_step_definition(monkeypatch):
    import raycurate.algorithms.p2d.head_scoring as head_scoring

    monkeypatch.setattr(head_scoring, "_CHUNK_ELEMENTS", 40)  # 2 rows of D = 17 per chunk: 3 chunks for 6 heads
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(2, 3, 17, generator=gen, dtype=torch.float64)
    proxy = base + 0.3 * torch.randn(2, 3, 17, generator=gen, dtype=torch.float64)
    base_before, proxy_before = base.clone(), proxy.clone()
    expected = wasserstein1_index(head_distributions(base), head_distributions(proxy))
    torch.testing.assert_close(score_heads(base, proxy), expected, rtol=1e-12, atol=0)
    # float64 inputs are not copied by .to(float64); the in-place arithmetic must still leave them untouched
    assert torch.equal(base, base_before) and torch.equal(proxy, proxy_before)
