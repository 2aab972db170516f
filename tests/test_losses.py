"""Masked, weighted causal-LM losses: hand-computed values and the single-shift convention."""

from __future__ import annotations

import math

import pytest
import torch

from raycurate.algorithms.losses import example_losses, token_losses, weighted_batch_loss


def _log_softmax_at(row: list[float], index: int) -> float:
    return row[index] - math.log(sum(math.exp(v) for v in row))


def test_token_losses_hand_computed_v3():
    # One example, T=3, V=3. Position t is predicted by logits[t-1].
    logits = torch.tensor([[[0.0, 0.0, 0.0], [1.0, 2.0, 3.0], [5.0, 5.0, 5.0]]])  # (1, 3, 3)
    input_ids = torch.tensor([[2, 1, 0]])
    loss_mask = torch.tensor([[1, 1, 1]])
    got = token_losses(logits, input_ids, loss_mask)
    expected = [0.0, -_log_softmax_at([0.0, 0.0, 0.0], 1), -_log_softmax_at([1.0, 2.0, 3.0], 0)]
    assert got.shape == (1, 3)
    assert got[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert expected[1] == pytest.approx(math.log(3.0))


def test_token_losses_match_independent_loop_not_double_shift():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 5, generator=gen)
    input_ids = torch.randint(0, 5, (2, 6), generator=gen)
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 1, 0]])
    got = token_losses(logits, input_ids, loss_mask)
    log_probs = torch.log_softmax(logits, dim=-1)
    for b in range(2):
        for t in range(6):
            expected = -log_probs[b, t - 1, input_ids[b, t]].item() if t > 0 and loss_mask[b, t] else 0.0
            assert got[b, t].item() == pytest.approx(expected, abs=1e-5), (b, t)
    # A second shift (predicting input_ids[t+1] from logits[t-1]) would give different numbers.
    double = -log_probs[0, 1, input_ids[0, 3]].item()
    assert got[0, 2].item() != pytest.approx(double, abs=1e-3)


def test_masked_positions_contribute_zero_and_do_not_change_example_loss():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 5, 4, generator=gen)
    input_ids = torch.tensor([[0, 1, 2, 3, 1]])
    mask = torch.tensor([[0, 0, 1, 0, 1]])
    per_token = token_losses(logits, input_ids, mask)
    assert per_token[0, [0, 1, 3]].tolist() == [0.0, 0.0, 0.0]
    changed = logits.clone()
    changed[0, 2] += 100.0  # logits[2] predict position 3, which is masked out
    assert example_losses(changed, input_ids, mask).item() == pytest.approx(
        example_losses(logits, input_ids, mask).item(), abs=1e-6
    )
    expected = (per_token[0, 2] + per_token[0, 4]).item() / 2
    assert example_losses(logits, input_ids, mask).item() == pytest.approx(expected, abs=1e-6)


def test_example_without_supervised_positions_has_zero_loss():
    logits = torch.randn(2, 3, 4)
    input_ids = torch.tensor([[1, 2, 3], [1, 2, 3]])
    mask = torch.tensor([[1, 0, 0], [0, 0, 1]])  # row 0: only position 0, which has no prediction
    losses = example_losses(logits, input_ids, mask)
    assert losses[0].item() == 0.0
    assert losses[1].item() > 0.0


def test_weighted_batch_loss_unit_weights_is_mean_and_weights_stay_per_sample():
    per_example = torch.tensor([1.0, 2.0, 6.0])
    assert weighted_batch_loss(per_example, torch.ones(3)).item() == pytest.approx(3.0)
    assert weighted_batch_loss(per_example, None).item() == pytest.approx(3.0)
    # (0*1 + 1*2 + 0.5*6) / 3, not renormalised by the weight sum.
    assert weighted_batch_loss(per_example, torch.tensor([0.0, 1.0, 0.5])).item() == pytest.approx(5.0 / 3.0)
    with pytest.raises(ValueError, match="one weight per example"):
        weighted_batch_loss(per_example, torch.ones(2))


def test_gradient_flows_only_through_supervised_logits():
    logits = torch.randn(1, 4, 3, requires_grad=True)
    input_ids = torch.tensor([[0, 1, 2, 0]])
    mask = torch.tensor([[0, 0, 1, 0]])
    weighted_batch_loss(example_losses(logits, input_ids, mask)).backward()
    grad_norm_per_position = logits.grad[0].abs().sum(dim=-1)  # (T,)
    assert grad_norm_per_position[1].item() > 0  # logits[1] predict the supervised position 2
    assert grad_norm_per_position[[0, 2, 3]].tolist() == [0.0, 0.0, 0.0]
