"""LESS pure pieces (raycurate.algorithms.less): Adam directions, seeded projections, scores and top-p by hand."""

from __future__ import annotations

import math

import pytest
import torch

from raycurate.algorithms import less


def test_adam_preconditioned_by_hand():
    grad = torch.tensor([[1.0, -2.0], [0.0, 0.0]])
    exp_avg, exp_avg_sq = torch.tensor([0.5, 0.0]), torch.tensor([1.0, 4.0])
    # m' = 0.9 m + 0.1 g = [0.55, -0.2]; v' = 0.999 v + 0.001 g^2 = [1.0, 4.0]; m' / sqrt(v') = [0.55, -0.1].
    direction = less.adam_preconditioned(grad, exp_avg, exp_avg_sq, eps=0.0)
    assert direction[0].tolist() == pytest.approx([0.55, -0.1], rel=1e-6)
    # A zero gradient still moves along the stored momentum: [0.45, 0] / sqrt([0.999, 3.996]).
    assert direction[1].tolist() == pytest.approx([0.45 / math.sqrt(0.999), 0.0], rel=1e-6)
    # Bias-corrected as update 2 (the warmup optimizer took 1 step).
    corrected = less.adam_preconditioned(grad, exp_avg, exp_avg_sq, eps=0.0, step=1)
    assert corrected[0, 0].item() == pytest.approx((0.55 / 0.19) / math.sqrt(1.0 / (1 - 0.999**2)), rel=1e-6)
    with pytest.raises(ValueError, match="same parameter order"):
        less.adam_preconditioned(grad, exp_avg[:1], exp_avg_sq)


def test_random_projection_is_seeded_scaled_and_blockwise_identical():
    proj = less.random_projection(5000, 8, seed=1)
    assert proj.shape == (5000, 8)
    assert proj.unique().tolist() == pytest.approx([-1 / math.sqrt(8), 1 / math.sqrt(8)])
    assert torch.equal(proj, less.random_projection(5000, 8, seed=1))
    assert not torch.equal(proj, less.random_projection(5000, 8, seed=2))
    # The first rows do not depend on dim_in (blocks are generated independently).
    assert torch.equal(less.random_projection(10, 8, seed=1), proj[:10])
    feats = torch.randn(3, 5000, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(less.project_in_blocks(feats, 8, seed=1), less.project(feats, proj), rtol=1e-5,
                               atol=1e-4)
    gauss = less.random_projection(4000, 64, seed=0, kind="gaussian")
    assert gauss.std().item() == pytest.approx(1 / 8, rel=0.02)
    with pytest.raises(ValueError, match="unknown projection kind"):
        less.random_projection(4, 2, seed=0, kind="sparse")


def test_projection_preserves_inner_products_roughly():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(1, 2000, generator=gen), torch.randn(1, 2000, generator=gen)
    b = a + 0.5 * b  # correlated
    proj = less.random_projection(2000, 1024, seed=3)
    cos_full = torch.nn.functional.cosine_similarity(a, b).item()
    cos_proj = torch.nn.functional.cosine_similarity(less.project(a, proj), less.project(b, proj)).item()
    assert cos_proj == pytest.approx(cos_full, abs=0.05)


def test_less_scores_by_hand():
    train = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]])
    val = torch.tensor([[5.0, 0.0], [1.0, 1.0]])
    r = 1 / math.sqrt(2)
    # cosines: row 0 -> [1, r], row 1 -> [0, r], row 2 -> [r, 1]
    assert less.less_scores(train, val).tolist() == pytest.approx([(1 + r) / 2, r / 2, (r + 1) / 2], rel=1e-6)
    by_task = less.less_scores(train, val, val_tasks=torch.tensor([0, 1]))
    assert by_task.tolist() == pytest.approx([1.0, r, 1.0], rel=1e-6)
    combined = less.combine_checkpoint_scores([torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])], [1e-5, 3e-5])
    assert combined.tolist() == pytest.approx([0.25, 0.75])


def test_select_top_fraction_counts_and_ties():
    scores = torch.tensor([0.1, 0.9, 0.5, 0.9, 0.2])
    assert less.select_top_fraction(scores, 0.4).tolist() == [1, 3]
    assert less.select_top_fraction(scores, 0.5).tolist() == [1, 2, 3]  # 2.5 rounds up to 3
    assert less.select_top_fraction(torch.ones(4), 0.5).tolist() == [0, 1]  # ties by index
    assert less.select_top_fraction(scores, 0.0).tolist() == []
    with pytest.raises(ValueError, match=r"fraction must lie in \[0, 1\]"):
        less.select_top_fraction(scores, 1.2)
