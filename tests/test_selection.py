"""BRIDGE budgets, fixed positions and the coupled selection schedules (paper §4.4, App. A.4, C.2, G.1)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from raycurate.algorithms.bridge.selection import (
    budgets,
    eligible_positions,
    fold_fixed_positions,
    select,
    surrogate_utility,
    to_row_masks,
    top_b,
)

# Hand-computed 4 x 3 example (p = 4 prompt tokens, r = 3 response tokens, b_p = b_r = 2).
BETA = np.array([[0, 3, 0],
                 [2, 3, -1],
                 [1, -1, -2],
                 [-1, 3, 2]], dtype=float)
GAMMA = np.array([0, -1, 1], dtype=float)


def mask(n: int, *on: int) -> np.ndarray:
    out = np.zeros(n, dtype=bool)
    out[list(on)] = True
    return out


# ---------------------------------------------------------------- budgets and fixed positions


@pytest.mark.parametrize(
    ("n_p", "n_r", "rho_p", "rho_r", "expected"),
    [
        (4, 3, 0.75, 0.75, (3, 2)),  # 3.0 -> 3; 2.25 -> 2
        (2, 5, 0.75, 0.5, (2, 3)),  # 1.5 -> 2 and 2.5 -> 3: half up, not banker's (round(2.5) == 2)
        (90, 10, 0.35, 0.45, (32, 5)),  # 0.35 * 90 = 31.499999999999996 in floats: still a half, rounds up
        (0, 0, 0.75, 0.75, (0, 0)),  # n = 0
        (7, 9, 0.0, 1.0, (0, 9)),  # b = 0 and b = n
        (1, 1, 0.49, 0.5, (0, 1)),
    ],
)
def test_budgets_round_half_up_within_bounds(n_p, n_r, rho_p, rho_r, expected):
    assert budgets(n_p, n_r, rho_p, rho_r) == expected


@pytest.mark.parametrize(("args", "match"), [((-1, 3, 0.5, 0.5), "non-negative"), ((3, 3, 1.2, 0.5), r"\[0, 1\]"),
                                             ((3, 3, 0.5, -0.1), r"\[0, 1\]"), ((2.5, 3, 0.5, 0.5), "integer")])
def test_budgets_reject_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        budgets(*args)


def test_eligible_positions_exclude_bos_and_eos():
    # row: BOS p p p | r r r EOS  (n = 8, prompt_len = 4)
    prompt_idx, response_idx = eligible_positions(8, 4, has_bos=True)
    assert prompt_idx.tolist() == [1, 2, 3]
    assert response_idx.tolist() == [4, 5, 6]
    prompt_idx, _ = eligible_positions(8, 4, has_bos=False)
    assert prompt_idx.tolist() == [0, 1, 2, 3]


def test_eligible_positions_honour_template_masks():
    # BOS <user> w w <assistant> | r r <end> EOS
    prompt_idx, response_idx = eligible_positions(
        9, 5, has_bos=True,
        fixed_prompt_mask=np.array([0, 1, 0, 0, 1], dtype=bool),
        fixed_response_mask=np.array([0, 0, 1, 0], dtype=bool),
    )
    assert prompt_idx.tolist() == [2, 3]
    assert response_idx.tolist() == [5, 6]


@pytest.mark.parametrize(("n", "prompt_len"), [(4, 4), (4, 0), (3, 5)])
def test_eligible_positions_reject_rows_without_both_sides(n, prompt_len):
    with pytest.raises(ValueError, match="prompt_len"):
        eligible_positions(n, prompt_len, has_bos=True)


def test_eligible_positions_reject_wrong_mask_length():
    with pytest.raises(ValueError, match="fixed_prompt_mask"):
        eligible_positions(8, 4, has_bos=True, fixed_prompt_mask=np.zeros(3, dtype=bool))


def test_to_row_masks_puts_fixed_positions_back():
    prompt_idx, response_idx = eligible_positions(8, 4, has_bos=True)  # [1, 2, 3], [4, 5, 6]
    keep, loss = to_row_masks(8, 4, prompt_idx, response_idx, mask(3, 0, 2), mask(3, 1))
    assert keep.tolist() == [True, True, False, True]  # BOS kept; position 2 dropped
    assert loss.tolist() == [False] * 4 + [False, True, False, True]  # EOS supervised


def test_fold_fixed_positions_adds_constant_contributions():
    # prompt side: BOS(fixed), x, y ; response side: u, v, EOS(fixed)
    beta_full = np.arange(9, dtype=float).reshape(3, 3)  # rows BOS, x, y; columns u, v, EOS
    gamma_full = np.array([10.0, 20.0, 30.0])
    beta, gamma, bias = fold_fixed_positions(beta_full, gamma_full, np.array([0, 1, 1], bool),
                                             np.array([1, 1, 0], bool))
    assert beta.tolist() == [[3, 4], [6, 7]]
    assert gamma.tolist() == [10 + 0, 20 + 1]  # + beta of the kept BOS
    assert bias.tolist() == [5, 8]  # beta toward the supervised EOS
    # The folded scores are exact marginal gains over the retained row (fixed positions always in).
    for s_p, s_r in [(mask(2, 0), mask(2, 1)), (mask(2, 0, 1), mask(2, 0))]:
        full_p, full_r = np.r_[True, s_p], np.r_[s_r, True]
        constant = gamma_full[2] + beta_full[0, 2]
        assert surrogate_utility(s_p, s_r, beta, gamma, bias) + constant == pytest.approx(
            surrogate_utility(full_p, full_r, beta_full, gamma_full))


# ---------------------------------------------------------------- top-b


def test_top_b_breaks_ties_by_position():
    assert top_b(np.array([1.0, 1.0, 1.0, 1.0]), 2).tolist() == [True, True, False, False]
    assert top_b(np.array([0.0, 2.0, 2.0, 1.0]), 1).tolist() == [False, True, False, False]
    assert top_b(np.array([-1.0, 0.0, -0.0, 3.0]), 2).tolist() == [False, True, False, True]


def test_top_b_edge_budgets():
    scores = np.array([0.3, -2.0, 5.0])
    assert top_b(scores, 0).tolist() == [False, False, False]
    assert top_b(scores, 3).tolist() == [True, True, True]
    assert top_b(np.zeros(0), 0).shape == (0,)
    with pytest.raises(ValueError, match="budget"):
        top_b(scores, 4)


# ---------------------------------------------------------------- the three schedules, by hand


def test_surrogate_utility_by_hand():
    # gamma_1 + gamma_2 + beta[0,1] + beta[0,2] + beta[3,1] + beta[3,2] = -1 + 1 + 3 + 0 + 3 + 2
    assert surrogate_utility(mask(4, 0, 3), mask(3, 1, 2), BETA, GAMMA) == 8.0
    assert surrogate_utility(mask(4), mask(3), BETA, GAMMA) == 0.0


def test_independent_schedule_by_hand():
    # Delta_p(i | R) = row sums = [3, 4, -2, 4] -> {1, 3};  Delta_r(j | P) = gamma + column sums = [2, 7, 0] -> {0, 1}
    # U = gamma_0 + gamma_1 + beta[1,0] + beta[1,1] + beta[3,0] + beta[3,1] = 0 - 1 + 2 + 3 - 1 + 3 = 6
    res = select(BETA, GAMMA, 2, 2, "independent")
    assert res.prompt_mask.tolist() == mask(4, 1, 3).tolist()
    assert res.response_mask.tolist() == mask(3, 0, 1).tolist()
    assert res.prompt_scores.tolist() == [3, 4, -2, 4]
    assert res.response_scores.tolist() == [2, 7, 0]
    assert res.u_sur == [6.0]
    assert (res.rounds_run, res.converged) == (0, False)


def test_one_pass_schedule_by_hand():
    # S_r^0 = Top gamma = {0, 2}
    # Delta_p(i | {0,2}) = [0, 1, -1, 1] -> S_p = {1, 3}; U = gamma_0 + gamma_2 + (2 - 1) + (-1 + 2) = 3
    # Delta_r(j | {1,3}) = gamma + [1, 6, 1] = [1, 5, 2] -> S_r = {1, 2}; U = 5 + 2 = 7
    res = select(BETA, GAMMA, 2, 2, "one_pass", rounds=99)  # rounds is ignored: T = 1
    assert res.prompt_mask.tolist() == mask(4, 1, 3).tolist()
    assert res.response_mask.tolist() == mask(3, 1, 2).tolist()
    assert res.prompt_scores.tolist() == [0, 1, -1, 1]
    assert res.response_scores.tolist() == [1, 5, 2]
    assert res.u_sur == [3.0, 7.0]
    assert (res.rounds_run, res.converged) == (1, False)


def test_alternating_schedule_by_hand():
    # Round 1 = one-pass: S_p = {1, 3}, S_r = {1, 2}, U: 3, 7.
    # Round 2: Delta_p(i | {1,2}) = [3, 2, -3, 5] -> S_p = {0, 3}; U = gamma_1 + gamma_2 + 3 + 5 = 8
    #          Delta_r(j | {0,3}) = gamma + [-1, 6, 2] = [-1, 5, 3] -> S_r = {1, 2}; U = 5 + 3 = 8
    # S_r did not change, so round 3 would reproduce both sets: early stop after 2 of 4 rounds.
    res = select(BETA, GAMMA, 2, 2, "alternating", rounds=4)
    assert res.prompt_mask.tolist() == mask(4, 0, 3).tolist()
    assert res.response_mask.tolist() == mask(3, 1, 2).tolist()
    assert res.prompt_scores.tolist() == [3, 2, -3, 5]
    assert res.response_scores.tolist() == [-1, 5, 3]
    assert res.u_sur == [3.0, 7.0, 8.0, 8.0]
    assert (res.rounds_run, res.converged) == (2, True)
    assert res.realised_budgets == (2, 2)
    # Independent (6) < one-pass (7) < alternating (8) here; 8 is the optimum over all 6 x 3 feasible pairs.
    assert max(surrogate_utility(mask(4, *a), mask(3, *b), BETA, GAMMA)
               for a in itertools.combinations(range(4), 2) for b in itertools.combinations(range(3), 2)) == 8.0


def test_independent_can_beat_one_pass():
    """Only one_pass <= alternating is guaranteed; independent is typically, not always, lower (by hand)."""
    beta = np.array([[2, -1, 0], [2, -1, -1], [-2, 1, -2], [0, -1, -1]], dtype=float)
    gamma = np.array([-1, 0, 0], dtype=float)
    # independent: row sums [1, 0, -3, -2] -> {0,1}; gamma + col sums [1, -2, -4] -> {0,1}; U = -1 + 0 + 2 = 1
    assert select(beta, gamma, 2, 2, "independent").u_sur == [1.0]
    # S_r^0 = Top [-1, 0, 0] = {1, 2}; Delta_p = [-1, -2, -1, -2] -> {0, 2}, U = -2;
    # Delta_r = [-1, 0, -2] -> {0, 1}, U = -1.   Round 2: Delta_p = [1, 1, -1, -1] -> {0, 1}, U = 1;
    # Delta_r = [3, -2, -1] -> {0, 2}, U = 2.    Round 3: Delta_p = [2, 1, -4, -1] -> {0, 1}, U = 2; S_r unchanged.
    assert select(beta, gamma, 2, 2, "one_pass").u_sur == [-2.0, -1.0]
    two = select(beta, gamma, 2, 2, "alternating", rounds=2)
    assert two.u_sur == [-2.0, -1.0, 1.0, 2.0]
    assert (two.rounds_run, two.converged) == (2, False)  # the cap, not a detected fixed point
    four = select(beta, gamma, 2, 2, "alternating", rounds=4)
    assert four.u_sur == [-2.0, -1.0, 1.0, 2.0, 2.0, 2.0]
    assert (four.rounds_run, four.converged) == (3, True)
    assert four.prompt_mask.tolist() == mask(4, 0, 1).tolist()
    assert four.response_mask.tolist() == mask(3, 0, 2).tolist()


# ---------------------------------------------------------------- properties on random instances


def random_instance(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    p, r = int(rng.integers(0, 30)), int(rng.integers(0, 30))
    kind = rng.integers(3)
    if kind == 0:  # attention-shaped: beta_ij = A_ji a_j with signed utilities
        attn = rng.dirichlet(np.ones(p + 1), size=r)[:, :p] if p else np.zeros((r, 0))  # (r, p)
        a = rng.normal(size=r)
        beta, gamma = (attn * a[:, None]).T, a * rng.uniform(0, 1, size=r)
    elif kind == 1:  # arbitrary signs and scales
        beta, gamma = rng.normal(size=(p, r)) * rng.exponential(), rng.normal(size=r)
    else:  # small integers: many exact ties
        beta, gamma = rng.integers(-2, 3, size=(p, r)).astype(float), rng.integers(-2, 3, size=r).astype(float)
    bias = rng.normal(size=p) if rng.random() < 0.3 else None
    return beta, gamma, bias, int(rng.integers(0, p + 1)), int(rng.integers(0, r + 1))


def test_u_sur_non_decreasing_and_budgets_exact_on_random_instances():
    rng = np.random.default_rng(20240611)
    for _ in range(200):
        beta, gamma, bias, b_p, b_r = random_instance(rng)
        scale = 1.0 + np.abs(beta).sum() + np.abs(gamma).sum()
        res = select(beta, gamma, b_p, b_r, "alternating", rounds=int(rng.integers(1, 9)), prompt_bias=bias)
        assert np.all(np.diff(res.u_sur) >= -1e-12 * scale), res.u_sur
        assert res.realised_budgets == (b_p, b_r)
        assert len(res.u_sur) == 2 * res.rounds_run
        # the recorded values are the surrogate of the recorded state
        assert res.u_sur[-1] == pytest.approx(
            surrogate_utility(res.prompt_mask, res.response_mask, beta, gamma, bias), rel=1e-9, abs=1e-9)
        # final response scores are exactly the conditional scores of the final prompt subset
        bias0 = np.zeros(beta.shape[0]) if bias is None else bias
        np.testing.assert_allclose(res.response_scores, gamma + res.prompt_mask @ beta, rtol=1e-12, atol=1e-12)
        if res.converged:  # a fixed point: S_p is a Top set of its scores under the final S_r
            np.testing.assert_allclose(res.prompt_scores, bias0 + beta @ res.response_mask, rtol=1e-12,
                                       atol=1e-12)
        ind = select(beta, gamma, b_p, b_r, "independent", prompt_bias=bias)
        assert ind.realised_budgets == (b_p, b_r)


def test_one_pass_never_beats_alternating():
    rng = np.random.default_rng(7)
    for _ in range(200):
        beta, gamma, bias, b_p, b_r = random_instance(rng)
        one = select(beta, gamma, b_p, b_r, "one_pass", prompt_bias=bias)
        alt = select(beta, gamma, b_p, b_r, "alternating", rounds=4, prompt_bias=bias)
        assert alt.u_sur[:2] == one.u_sur  # alternating starts with the one-pass round
        assert alt.u_sur[-1] >= one.u_sur[-1] - 1e-12 * (1 + np.abs(beta).sum() + np.abs(gamma).sum())


def test_same_input_same_output():
    rng = np.random.default_rng(3)
    beta, gamma, bias, b_p, b_r = random_instance(rng)
    first = select(beta, gamma, b_p, b_r, prompt_bias=bias)
    again = select(beta.copy(), gamma.copy(), b_p, b_r, prompt_bias=None if bias is None else bias.copy())
    assert np.array_equal(first.prompt_mask, again.prompt_mask)
    assert np.array_equal(first.response_mask, again.response_mask)
    assert first.u_sur == again.u_sur


def test_empty_sides_and_extreme_budgets():
    beta = np.zeros((0, 3))
    res = select(beta, np.array([1.0, 3.0, 2.0]), 0, 2, "alternating")
    assert res.response_mask.tolist() == [False, True, True]
    assert res.prompt_mask.shape == (0,)
    res = select(np.ones((3, 0)), np.zeros(0), 3, 0, "alternating")
    assert res.prompt_mask.tolist() == [True, True, True]
    assert res.u_sur == [0.0, 0.0] and res.converged
    full = select(BETA, GAMMA, 4, 3, "alternating")
    assert full.prompt_mask.all() and full.response_mask.all()
    assert full.u_sur[-1] == GAMMA.sum() + BETA.sum()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(b_p=5, b_r=1), "budgets"),
        (dict(b_p=1, b_r=-1), "budgets"),
        (dict(b_p=1.5, b_r=1), "budgets"),
        (dict(b_p=1, b_r=1, schedule="greedy"), "one of independent, one_pass, alternating"),
        (dict(b_p=1, b_r=1, rounds=0), "rounds"),
    ],
)
def test_select_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        select(BETA, GAMMA, **kwargs)


def test_select_rejects_non_finite_and_misshaped_inputs():
    bad = BETA.copy()
    bad[1, 1] = np.nan
    with pytest.raises(ValueError, match="finite"):
        select(bad, GAMMA, 1, 1)
    with pytest.raises(ValueError, match="gamma"):
        select(BETA, GAMMA[:2], 1, 1)


def test_select_accepts_finite_inputs_whose_sum_overflows():
    big = np.full((2, 3), 1e308)  # finite entries, but beta.sum() is inf
    res = select(big, np.zeros(3), 1, 2)
    assert res.realised_budgets == (1, 2)
