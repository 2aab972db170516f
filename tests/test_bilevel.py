"""Bilevel math (raycurate.algorithms.bilevel): data weights, gamma schedule, the omega step by hand, importance
weights, masked question sets, response masks, and the single label shift."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from raycurate.algorithms import bilevel as bl
from raycurate.algorithms import bmo
from raycurate.algorithms.losses import example_losses, token_losses
from raycurate.models.generation import left_pad

# ------------------------------------------------------------------------------------------ data weights + gamma


def test_data_weights_are_n_times_softmax_over_all_candidates():
    omega = np.array([0.3, -1.2, 2.0, 0.0, 0.7])
    sigma = bl.data_weights(omega)
    assert sigma.sum() == pytest.approx(5.0, abs=1e-12)
    assert sigma.mean() == pytest.approx(1.0, abs=1e-12)
    assert sigma[2] / sigma[3] == pytest.approx(math.exp(2.0))
    assert bl.data_weights(np.zeros(7)).tolist() == [1.0] * 7  # uniform logits: every weight exactly 1
    # The batch view keeps the all-N normalisation (never renormalised over the batch).
    assert bl.batch_weights(omega, np.array([2, 0])).tolist() == [sigma[2], sigma[0]]
    assert bl.data_weights(omega + 100.0) == pytest.approx(sigma)  # shift invariant, no overflow
    with pytest.raises(ValueError, match="non-finite"):
        bl.data_weights(np.array([0.0, np.nan]))


def test_gamma_schedule_follows_rho_plus_point_one_per_epoch():
    assert bl.gamma_schedule(0) == pytest.approx(0.1 / 0.9)
    assert bl.gamma_schedule(1) == pytest.approx(0.2 / 0.8)
    assert bl.gamma_schedule(2) == pytest.approx(0.3 / 0.7)
    assert bl.gamma_schedule(8) == pytest.approx(0.9 / 0.1)
    assert bl.gamma_schedule(50) == pytest.approx(9.0)  # capped at rho_max = 0.9
    assert bl.gamma_schedule(3, rho0=0.5, rho_step=0.0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match=r"must lie in \(0, 1\)"):
        bl.gamma_schedule(0, rho0=1.0)


# ------------------------------------------------------------------------------------------ the omega step by hand


def test_omega_gradient_and_adam_step_on_a_five_example_toy():
    # N = 5, omega = 0 -> p = 0.2, sigma = 1 everywhere.  Batch {1, 3} with losses 2.0 and 0.5, gamma = 0.5, B = 2.
    # S = sum_b sigma l = 2.5; gamma/B = 0.25.
    #   sampled j=1: 0.25 * (1 * 2.0 - 0.2 * 2.5) = 0.375
    #   sampled j=3: 0.25 * (1 * 0.5 - 0.2 * 2.5) = 0.0
    #   others:      0.25 * (        - 0.2 * 2.5) = -0.125
    omega = np.zeros(5)
    grad = bl.omega_gradient(omega, np.array([1, 3]), np.array([2.0, 0.5]), gamma=0.5)
    assert grad == pytest.approx([-0.125, 0.375, -0.125, 0.0, -0.125], abs=1e-15)
    assert grad.sum() == pytest.approx(0.0, abs=1e-15)

    # Adam step 1 (lr 0.1): m_hat = g, v_hat = g^2, so omega -= 0.1 * g / (|g| + 1e-8).
    omega1, state1 = bl.adam_update(omega, grad, bl.AdamState.zeros(5), lr=0.1)
    step1 = 0.1 * 0.125 / (0.125 + 1e-8)
    assert omega1 == pytest.approx([step1, -0.1 * 0.375 / (0.375 + 1e-8), step1, 0.0, step1], abs=1e-15)
    assert state1.step == 1
    assert state1.exp_avg == pytest.approx(0.1 * grad)
    assert state1.exp_avg_sq == pytest.approx(0.001 * grad**2)

    # Step 2 at omega1, batch {0, 4} with losses 1.0 and 3.0, gamma = 0.5.
    e_up, e_down = math.exp(step1), math.exp(omega1[1])
    z = 3 * e_up + e_down + 1.0
    p = np.array([e_up, e_down, e_up, 1.0, e_up]) / z
    s = 5 * p[0] * 1.0 + 5 * p[4] * 3.0
    g2 = 0.25 * np.array([5 * p[0] * 1.0 - p[0] * s, -p[1] * s, -p[2] * s, -p[3] * s, 5 * p[4] * 3.0 - p[4] * s])
    grad2 = bl.omega_gradient(omega1, np.array([0, 4]), np.array([1.0, 3.0]), gamma=0.5)
    assert grad2 == pytest.approx(g2, rel=1e-12)
    m = 0.9 * 0.1 * grad + 0.1 * g2
    v = 0.999 * 0.001 * grad**2 + 0.001 * g2**2
    expected = omega1 - 0.1 * (m / (1 - 0.9**2)) / (np.sqrt(v / (1 - 0.999**2)) + 1e-8)
    omega2, state2 = bl.adam_update(omega1, grad2, state1, lr=0.1)
    assert omega2 == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert state2.step == 2


def test_omega_gradient_matches_autograd_through_the_full_softmax():
    rng = np.random.default_rng(3)
    omega = rng.normal(size=9)
    idx, losses, gamma = np.array([4, 0, 7]), rng.uniform(0.5, 3.0, size=3), 0.25
    w = torch.tensor(omega, requires_grad=True)
    sigma = 9 * torch.softmax(w, dim=0)
    (gamma * (sigma[torch.from_numpy(idx)] * torch.from_numpy(losses)).mean()).backward()
    assert bl.omega_gradient(omega, idx, losses, gamma) == pytest.approx(w.grad.numpy(), rel=1e-12, abs=1e-15)
    assert np.all(w.grad.numpy()[[1, 2, 3, 5, 6, 8]] != 0)  # non-sampled logits get gradient too


def test_adam_update_is_pure_and_bit_identical_on_repeat():
    rng = np.random.default_rng(0)
    omega, grad = rng.normal(size=6), rng.normal(size=6)
    state = bl.AdamState.zeros(6)
    omega_copy = omega.copy()
    a, sa = bl.adam_update(omega, grad, state)
    b, sb = bl.adam_update(omega, grad, state)
    assert np.array_equal(a, b) and np.array_equal(sa.exp_avg_sq, sb.exp_avg_sq)
    assert np.array_equal(omega, omega_copy) and state.step == 0 and not state.exp_avg.any()
    with pytest.raises(ValueError, match="same shape"):
        bl.adam_update(omega, grad[:5], state)


def test_sgd_update_keeps_the_loss_magnitude_that_adam_normalises_away():
    # Two sampled logits with losses 1 and 4 (gamma 1, B 2, N 4): gradients 0.5 * (l - 0.25 * 5) = [-0.125, 1.375].
    grad = bl.omega_gradient(np.zeros(4), np.array([0, 1]), np.array([1.0, 4.0]), gamma=1.0)
    assert grad == pytest.approx([-0.125, 1.375, -0.625, -0.625])
    assert bl.sgd_update(np.zeros(4), grad, lr=2.0) == pytest.approx([0.25, -2.75, 1.25, 1.25])
    adam, _ = bl.adam_update(np.zeros(4), grad, bl.AdamState.zeros(4), lr=1.0)
    assert np.abs(adam) == pytest.approx([1.0] * 4, abs=1e-6)  # first Adam step: lr * sign(grad), magnitude lost


def test_sampled_gradient_has_the_exact_gradients_expectation_over_all_batches():
    # N = 6, B = 3: averaging over all 20 batches (uniform without replacement), the sampled-row estimator and the
    # exact mini-batch gradient agree -- both equal the full-data gradient gamma/N sigma_j (l_j - sum_i p_i l_i).
    from itertools import combinations

    rng = np.random.default_rng(0)
    omega, losses, gamma = rng.normal(size=6), rng.uniform(0.5, 3.0, size=6), 0.4
    dense, sparse = np.zeros(6), np.zeros(6)
    batches = list(combinations(range(6), 3))
    for batch in batches:
        idx = np.array(batch)
        dense += bl.omega_gradient(omega, idx, losses[idx], gamma)
        sparse[idx] += bl.sampled_omega_gradient(omega, idx, losses[idx], gamma)
    sigma, p = bl.data_weights(omega), bl.data_weights(omega) / 6
    full = gamma / 6 * sigma * (losses - p @ losses)
    assert dense / len(batches) == pytest.approx(full, rel=1e-12, abs=1e-15)
    assert sparse / len(batches) == pytest.approx(full, rel=1e-12, abs=1e-15)


def test_sampled_gradient_by_hand():
    # N = 4, omega = 0 (sigma = 1), batch {0, 2} with losses 1 and 3, gamma = 1, B = 2:
    #   beta_0 = (1 + 3/1 * 3) / 4 = 2.5 -> g_0 = 0.5 * (1 - 2.5) = -0.75
    #   beta_2 = (3 + 3/1 * 1) / 4 = 1.5 -> g_2 = 0.5 * (3 - 1.5) = 0.75
    grad = bl.sampled_omega_gradient(np.zeros(4), np.array([0, 2]), np.array([1.0, 3.0]), gamma=1.0)
    assert grad == pytest.approx([-0.75, 0.75])
    assert bl.sparse_sgd_update(np.zeros(4), np.array([0, 2]), grad, lr=2.0) == pytest.approx([1.5, 0, -1.5, 0])
    with pytest.raises(ValueError, match=">= 2 distinct"):
        bl.sampled_omega_gradient(np.zeros(4), np.array([1, 1]), np.array([1.0, 2.0]), gamma=1.0)


def test_median_baseline_by_hand():
    # Batch losses 1, 2, 3, 10 (sigma 1, gamma 1, B 4): each row against the median of the other three,
    # 3, 3, 2, 2 -> 0.25 * (1-3, 2-3, 3-2, 10-2).  The outlier does not lift its batch-mates.
    grad = bl.sampled_omega_gradient(np.zeros(5), np.array([0, 1, 2, 3]), np.array([1.0, 2.0, 3.0, 10.0]), 1.0,
                                     baseline="median")
    assert grad == pytest.approx([-0.5, -0.25, 0.25, 2.0])
    mean = bl.sampled_omega_gradient(np.zeros(5), np.array([0, 1, 2, 3]), np.array([1.0, 2.0, 3.0, 10.0]), 1.0)
    assert mean[2] < 0  # with the mean, row 2 (loss 3) looks better than average because of the outlier
    with pytest.raises(ValueError, match="unknown omega baseline"):
        bl.sampled_omega_gradient(np.zeros(5), np.array([0, 1]), np.array([1.0, 2.0]), 1.0, baseline="mode")


def test_sparse_adam_moves_and_counts_only_the_sampled_rows():
    state = bl.AdamState.zeros(5)
    omega1, state1 = bl.sparse_adam_update(np.zeros(5), np.array([1, 3]), np.array([0.2, -0.4]), state, lr=0.1)
    # First sighting of a row: m_hat = g, v_hat = g^2 -> step lr * sign(g); nothing else moves.
    assert omega1 == pytest.approx([0.0, -0.1, 0.0, 0.1, 0.0], abs=1e-8)
    assert state1.row_steps.tolist() == [0, 1, 0, 1, 0] and state1.step == 1
    assert state1.exp_avg[[0, 2, 4]].tolist() == [0.0] * 3 and state1.exp_avg_sq[[0, 2, 4]].tolist() == [0.0] * 3
    # Row 3 again (its 2nd update, bias correction with t = 2) and row 0 for the first time (t = 1).
    omega2, state2 = bl.sparse_adam_update(omega1, np.array([3, 0]), np.array([0.1, 0.3]), state1, lr=0.1)
    m3 = 0.9 * 0.1 * -0.4 + 0.1 * 0.1
    v3 = 0.999 * 0.001 * 0.16 + 0.001 * 0.01
    assert omega2[3] == pytest.approx(0.1 - 0.1 * (m3 / (1 - 0.81)) / (np.sqrt(v3 / (1 - 0.999**2)) + 1e-8))
    assert omega2[0] == pytest.approx(-0.1, abs=1e-8)
    assert omega2[1] == omega1[1] and state2.exp_avg[1] == state1.exp_avg[1]  # row 1 untouched
    assert state2.row_steps.tolist() == [1, 1, 0, 2, 0] and state2.step == 2
    assert state1.row_steps.tolist() == [0, 1, 0, 1, 0]  # pure: the input state is not modified


def test_update_omega_dispatches_to_the_named_optimizer():
    omega, idx, losses = np.array([0.1, -0.2, 0.3, 0.0]), np.array([0, 2]), np.array([1.0, 2.5])
    state = bl.AdamState.zeros(4)
    grad = bl.omega_gradient(omega, idx, losses, 0.5)
    rows = bl.sampled_omega_gradient(omega, idx, losses, 0.5)
    assert np.array_equal(bl.update_omega("sgd", omega, idx, losses, 0.5, state, 2.0)[0],
                          bl.sgd_update(omega, grad, 2.0))
    assert np.array_equal(bl.update_omega("adam", omega, idx, losses, 0.5, state, 0.1)[0],
                          bl.adam_update(omega, grad, state, 0.1)[0])
    assert np.array_equal(bl.update_omega("sparse_sgd", omega, idx, losses, 0.5, state, 2.0, baseline="mean")[0],
                          bl.sparse_sgd_update(omega, idx, rows, 2.0))
    assert np.array_equal(bl.update_omega("sparse_adam", omega, idx, losses, 0.5, state, 0.1, baseline="mean")[0],
                          bl.sparse_adam_update(omega, idx, rows, state, 0.1)[0])
    with pytest.raises(ValueError, match="unknown omega optimizer"):
        bl.update_omega("rmsprop", omega, idx, losses, 0.5, state, 0.1)


def test_omega_gradient_rejects_mismatched_losses():
    with pytest.raises(ValueError, match="one loss per sampled candidate"):
        bl.omega_gradient(np.zeros(4), np.array([0, 1]), np.array([1.0]), gamma=1.0)
    with pytest.raises(ValueError, match=r"must lie in \[0, 4\)"):
        bl.omega_gradient(np.zeros(4), np.array([4]), np.array([1.0]), gamma=1.0)


# ------------------------------------------------------------------------------------------ labels shifted once


def _peaked_logits(input_ids: torch.Tensor, vocab: int, peak: float = 40.0) -> torch.Tensor:
    """Logits that put (almost) all mass on the correct *next* token: logits[:, t] peaks at input_ids[:, t + 1]."""
    batch, length = input_ids.shape
    logits = torch.zeros(batch, length, vocab)
    logits[:, :-1].scatter_(2, input_ids[:, 1:].unsqueeze(-1), peak)
    return logits


def test_losses_and_logprobs_vanish_only_with_a_single_label_shift():
    input_ids = torch.tensor([[1, 5, 9, 4, 7, 2], [1, 8, 3, 3, 6, 2]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
    logits = _peaked_logits(input_ids, vocab=12)
    # Shifted once (inside token_losses): every supervised token is predicted with probability ~1.
    assert example_losses(logits, input_ids, mask).max() < 1e-12
    assert bmo.token_logprobs(logits, input_ids, mask).abs().max() < 1e-12
    # Shifted twice (pre-shifted labels handed to a loss that shifts again): far from 0, so the checks above fail
    # for any code path that shifts twice.
    twice = token_losses(logits[:, :-1], input_ids[:, 1:], mask[:, 1:])
    assert (twice.sum(dim=1) / mask[:, 2:].sum(dim=1)).min() > 10.0


# ------------------------------------------------------------------------------------------ importance weights


def test_importance_weights_are_exactly_one_when_theta_equals_theta_old():
    torch.manual_seed(0)
    logits = torch.randn(3, 20, 30)
    ids = torch.randint(0, 30, (3, 20))
    mask = torch.zeros(3, 20, dtype=torch.long)
    mask[:, 8:] = 1
    logp = bmo.token_logprobs(logits, ids, mask)
    old = bmo.token_logprobs(logits.clone(), ids, mask)
    clip = bmo.importance_weights(logp, old, mask, mode="clip")
    assert torch.equal(clip[:, 8:], torch.ones(3, 12, dtype=torch.float64))
    assert torch.equal(clip[:, :8], torch.zeros(3, 8, dtype=torch.float64))
    seq = bmo.importance_weights(logp, old, mask, mode="self_normalize", group=torch.tensor([0, 0, 0]))
    assert torch.equal(seq, torch.ones(3, dtype=torch.float64))


def test_importance_weights_stay_finite_for_512_token_responses():
    gen = torch.Generator().manual_seed(1)
    batch, length = 6, 512 + 16
    new = -torch.rand(batch, length, generator=gen) * 30.0  # sequence log-ratios in the thousands
    old = -torch.rand(batch, length, generator=gen) * 30.0
    mask = torch.zeros(batch, length)
    mask[:, 16:] = 1
    group = torch.tensor([0, 0, 0, 1, 1, 2])
    seq = bmo.importance_weights(new, old, mask, mode="self_normalize", group=group)
    assert torch.isfinite(seq).all()
    assert seq[:3].sum().item() == pytest.approx(3.0) and seq[3:5].sum().item() == pytest.approx(2.0)
    assert seq[5].item() == 1.0  # a question with one response: weight 1
    log_ratio = ((new - old) * mask).sum(dim=1).double()
    expected = 3 * torch.softmax(log_ratio[:3], dim=0)
    assert torch.allclose(seq[:3], expected)
    clip = bmo.importance_weights(new, old, mask, mode="clip", clip=2.0)
    assert torch.isfinite(clip).all()
    on = clip[:, 16:]
    assert on.min() >= 0.5 - 1e-12 and on.max() <= 2.0 + 1e-12
    with pytest.raises(ValueError, match="unknown importance weight mode"):
        bmo.importance_weights(new, old, mask, mode="pg")


def test_grouped_response_losses_by_hand():
    # Row 0: an offline question (slot 0); rows 1-2: two generated responses of a masked question (slot 1).
    per_token = torch.tensor([[0.0, 2.0, 4.0, 0.0], [0.0, 0.0, 1.0, 3.0], [0.0, 0.0, 2.0, 2.0]], requires_grad=True)
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1], [0, 0, 1, 1]])
    # logp_new = -per_token; row 1 unchanged since generation, row 2's last token is 4x likelier now.
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, -1.0, -3.0], [0.0, 0.0, -2.0, -2.0 - math.log(4.0)]])
    generated, slot = torch.tensor([False, True, True]), torch.tensor([0, 1, 1])
    # clip (bound 2): row 1 r = [1, 1] -> (1 + 3) / 2 = 2; row 2 r = [1, 2] -> (2 + 2 * 2) / 2 = 3; slot 1 -> 2.5.
    weighted, plain = bmo.grouped_response_losses(per_token, mask, old, generated, slot, 2, mode="clip", clip=2.0)
    assert weighted.tolist() == pytest.approx([3.0, 2.5])
    assert plain.tolist() == pytest.approx([3.0, 2.0])  # eq. 10c: unweighted mean over the G responses
    # self-normalised: sequence log ratios [0, log 4] -> 2 * softmax = [0.4, 1.6]; (0.4 * 2 + 1.6 * 2) / 2 = 2.0.
    weighted_sn, _ = bmo.grouped_response_losses(per_token, mask, old, generated, slot, 2, mode="self_normalize")
    assert weighted_sn.tolist() == pytest.approx([3.0, 2.0])
    weighted.sum().backward()  # the weights are constants; the losses carry the graph
    assert per_token.grad[2].tolist() == pytest.approx([0.0, 0.0, 0.25, 0.5])  # r_t / (n_g * G)
    assert not plain.requires_grad


# ------------------------------------------------------------------------------------------ masking


def test_dynamic_masking_picks_exactly_the_bottom_r_with_ties_by_index():
    sigma = np.array([1.0, 0.5, 0.5, 2.0, 0.1, 0.5])
    assert bmo.masked_questions_dynamic(sigma, 0.5).tolist() == [1, 2, 4]  # 0.1, then the first two 0.5s
    assert bmo.masked_questions_dynamic(sigma, 0.0).tolist() == []
    assert bmo.masked_questions_dynamic(sigma, 1.0).tolist() == list(range(6))
    assert bmo.masked_count(25, 0.1) == 3  # 2.5 rounds up


def test_fixed_masking_is_seeded_and_sized_by_ratio():
    a = bmo.masked_questions_fixed(40, 0.1, seed=5)
    assert len(a) == 4 and len(set(a.tolist())) == 4 and a.tolist() == sorted(a.tolist())
    assert np.array_equal(a, bmo.masked_questions_fixed(40, 0.1, seed=5))
    assert not np.array_equal(a, bmo.masked_questions_fixed(40, 0.1, seed=6))
    with pytest.raises(ValueError, match=r"must lie in \[0, 1\]"):
        bmo.masked_questions_fixed(40, 1.5, seed=0)


# ------------------------------------------------------------------------------------------ response mask


def test_response_mask_of_a_left_padded_generation_batch_excludes_every_prompt_token():
    prompts = [[11, 12], [21, 22, 23, 24], [31, 32, 33]]
    generated = [[41, 42, 2], [51], [61, 2]]
    prompt_ids, prompt_mask = left_pad(prompts, pad_id=0)  # (3, 4)
    width = max(len(g) for g in generated)
    gen_ids = torch.tensor([g + [0] * (width - len(g)) for g in generated])
    gen_mask = torch.tensor([[1] * len(g) + [0] * (width - len(g)) for g in generated])
    ids = torch.cat([prompt_ids, gen_ids], dim=1)  # (3, 7)
    attention = torch.cat([prompt_mask, gen_mask], dim=1)
    mask = bmo.response_mask_from_prompt(prompt_ids.shape[1], ids.shape[1], attention)
    assert mask.tolist() == [
        [False, False, False, False, True, True, True],
        [False, False, False, False, True, False, False],
        [False, False, False, False, True, True, False],
    ]
    prompt_tokens = {t for p in prompts for t in p}
    assert not any(int(t) in prompt_tokens for t in ids[mask])
    assert sorted(ids[mask].tolist()) == sorted(t for g in generated for t in g)
    with pytest.raises(ValueError, match="expected"):
        bmo.response_mask_from_prompt(4, 8, attention)
