"""Token-selection baselines: exact budgets, fixed positions, seeding, score conventions, compositions."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from raycurate.algorithms.bridge.token_baselines import (
    TokenMasks,
    example_rng,
    excess_loss_scores,
    global_response_budgets,
    independent_composition,
    one_sided_matched_budget,
    prompt_selector_masks,
    random_masks,
    random_scores,
    response_scores,
    sequential_composition,
    surprisal_prompt_scores,
    token_cleaning_global_masks,
    token_cleaning_masks,
    token_influence,
)

# Row: [BOS] p1..p8 | r1..r12 [EOS]  -> p = 8 eligible prompt, r = 12 eligible response positions.
N, PLEN = 22, 9


def _assert_fixed(m: TokenMasks, n: int = N, plen: int = PLEN) -> None:
    assert m.prompt_keep.shape == (plen,) and m.loss_mask.shape == (n,)
    assert m.prompt_keep[0] and m.loss_mask[-1] and not m.loss_mask[:plen].any()


# ------------------------------------------------------------------------------------------- random


@pytest.mark.parametrize("rho_p, rho_r, b_p, b_r", [(0.75, 0.75, 6, 9), (0.5, 0.25, 4, 3), (0.0, 1.0, 0, 12)])
def test_random_masks_exact_budgets(rho_p, rho_r, b_p, b_r):
    m = random_masks(N, PLEN, rho_p, rho_r, example_rng(0, "ex"))
    _assert_fixed(m)
    assert (m.b_p, m.b_r) == (b_p, b_r)
    assert m.prompt_keep.sum() == b_p + 1 and m.loss_mask.sum() == b_r + 1  # + BOS, + EOS


def test_random_masks_respect_extra_fixed_positions():
    fixed_p = np.zeros(PLEN, bool)
    fixed_p[[1, 2]] = True  # template tokens
    fixed_r = np.zeros(N - PLEN, bool)
    fixed_r[-2] = True  # end-of-turn marker
    for i in range(20):
        m = random_masks(N, PLEN, 0.5, 0.5, example_rng(1, str(i)), fixed_prompt_mask=fixed_p,
                         fixed_response_mask=fixed_r)
        assert m.prompt_keep[[0, 1, 2]].all() and m.loss_mask[[-2, -1]].all()
        assert (m.b_p, m.b_r) == (3, 6)  # round(0.5 * 6) = 3, round(0.5 * 11) = 5.5 -> 6


def test_random_masks_reproducible_per_seed_and_id_and_different_across_ids():
    a1 = random_masks(N, PLEN, 0.5, 0.5, example_rng(7, "row-1"))
    a2 = random_masks(N, PLEN, 0.5, 0.5, example_rng(7, "row-1"))
    b = random_masks(N, PLEN, 0.5, 0.5, example_rng(7, "row-2"))
    c = random_masks(N, PLEN, 0.5, 0.5, example_rng(8, "row-1"))
    assert np.array_equal(a1.prompt_keep, a2.prompt_keep) and np.array_equal(a1.loss_mask, a2.loss_mask)
    for other in (b, c):
        assert not (np.array_equal(a1.prompt_keep, other.prompt_keep) and np.array_equal(a1.loss_mask, other.loss_mask))


def test_example_rng_does_not_depend_on_python_hash_seed():
    code = ("from raycurate.algorithms.bridge.token_baselines import example_rng;"
            "print(example_rng(3, 'some-id').integers(0, 2**31, 4).tolist())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(h), "PATH": ""}).stdout for h in (0, 1, 2)}
    assert len(outs) == 1
    assert outs.pop().strip() == str(example_rng(3, "some-id").integers(0, 2**31, 4).tolist())


def test_example_rng_rejects_negative_seed():
    with pytest.raises(ValueError, match="non-negative"):
        example_rng(-1, "x")


def test_random_masks_are_uniform():
    # p = 4 eligible prompt positions, b_p = 2: each is kept with probability 1/2; 6 pairs equally likely.
    rng = example_rng(0, "uniform")
    counts = np.zeros(4)
    pairs = {}
    for _ in range(3000):
        keep = random_masks(8, 5, 0.5, 0.5, rng).prompt_keep[1:]
        counts += keep
        pairs[tuple(keep)] = pairs.get(tuple(keep), 0) + 1
    assert np.allclose(counts / 3000, 0.5, atol=0.04)
    assert len(pairs) == 6 and all(abs(v / 3000 - 1 / 6) < 0.03 for v in pairs.values())


def test_random_scores_topb_is_random_subset_generator():
    s = random_scores(5, example_rng(0, "s"))
    assert s.shape == (5,) and ((0 <= s) & (s < 1)).all()


# ------------------------------------------------------------------------------------------- scores


def test_excess_loss_ranking_by_hand():
    base = np.array([0.0, 2.0, 1.0, 3.0, 0.5, 4.0])
    ref = np.array([0.0, 0.5, 1.5, 1.0, 0.5, 3.9])
    assert np.allclose(excess_loss_scores(base, ref), [0.0, 1.5, -0.5, 2.0, 0.0, 0.1])
    assert np.allclose(token_influence(base, ref), [0.0, -1.5, 0.5, -2.0, 0.0, -0.1])
    assert np.array_equal(response_scores("rho1", base, ref), response_scores("token_cleaning", base, ref))
    # Row [BOS] p | r1 r2 r3 EOS: prompt_len 2; eligible response positions 2, 3, 4 (EOS at 5 is fixed).
    m = token_cleaning_masks(excess_loss_scores(base, ref), 2, 0.5)
    # eligible response positions 2, 3, 4 with scores -0.5, 2.0, 0.0; b_r = round(1.5) = 2 -> positions 3 and 4.
    assert m.loss_mask.tolist() == [False, False, False, True, True, True]
    assert m.prompt_keep.tolist() == [True, True] and (m.b_p, m.b_r) == (1, 2)


def test_response_scores_unknown_variant_lists_names():
    with pytest.raises(ValueError, match="rho1, token_cleaning"):
        response_scores("ssToken", np.zeros(3), np.zeros(3))


def test_loss_vectors_must_match():
    with pytest.raises(ValueError, match="same row"):
        excess_loss_scores(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError, match="NaN"):
        excess_loss_scores(np.array([0.0, np.nan]), np.zeros(2))


def test_surprisal_prompt_scores():
    loss = np.array([0.0, 1.0, 3.0, 0.2, 9.0, 9.0])  # prompt_len 4; the response part is ignored
    assert surprisal_prompt_scores(loss, 4).tolist() == [3.0, 1.0, 3.0, 0.2]
    with pytest.raises(ValueError, match="response-only loss mask"):
        surprisal_prompt_scores(np.array([0.0, 0.0, 0.0, 1.0]), 3)


# ------------------------------------------------------------------------------------------- budgets


def test_one_sided_matched_budget_by_hand():
    # p = 8, r = 12, rho = 0.75: two-sided (6, 9), B = 15.
    assert one_sided_matched_budget(8, 12, 0.75, 0.75, "response") == (8, 7)  # 15 - 8
    assert one_sided_matched_budget(8, 12, 0.75, 0.75, "prompt") == (3, 12)  # 15 - 12
    # p = 3, r = 3: two-sided round(2.25) = 2 per side, B = 4 -> the selected side gets 4 - 3 = 1.
    assert one_sided_matched_budget(3, 3, 0.75, 0.75, "response") == (3, 1)
    # Infeasible: a long prompt (40) swallows B = round(30) + round(3) = 33 -> supervise nothing (closest).
    assert one_sided_matched_budget(40, 4, 0.75, 0.75, "response") == (40, 0)
    # ... and the other way the prompt side is clipped at 0.
    assert one_sided_matched_budget(4, 40, 0.75, 0.75, "prompt") == (0, 40)
    with pytest.raises(ValueError, match="side"):
        one_sided_matched_budget(3, 3, 0.75, 0.75, "both")


def test_token_cleaning_masks_ratio_and_matched_budgets():
    scores = np.arange(N, dtype=float)  # later positions score higher
    ratio = token_cleaning_masks(scores, PLEN, 0.75)
    _assert_fixed(ratio)
    assert ratio.prompt_keep.all() and (ratio.b_p, ratio.b_r) == (8, 9)
    assert ratio.loss_mask[PLEN:-1].tolist() == [False] * 3 + [True] * 9  # the top 9 are the last 9
    matched = token_cleaning_masks(scores, PLEN, 0.75, budget="matched", rho_p=0.75)
    assert matched.prompt_keep.all() and (matched.b_p, matched.b_r) == (8, 7)
    assert matched.b_p + matched.b_r == sum((6, 9))  # same combined count as a two-sided method at 0.75 / 0.75
    with pytest.raises(ValueError, match="rho_p"):
        token_cleaning_masks(scores, PLEN, 0.75, budget="matched")


def test_global_response_budgets_by_hand():
    # Pool (row, pos: score): (0,0) 5, (0,1) 1, (1,0) 4, (1,1) 4, (1,2) 0, (2,0) -1 -> top 4: 5, 4, 4, 1.
    scores = [np.array([5.0, 1.0]), np.array([4.0, 4.0, 0.0]), np.array([-1.0])]
    assert global_response_budgets(scores, 4).tolist() == [2, 2, 0]
    assert global_response_budgets(scores, 0).tolist() == [0, 0, 0]
    assert global_response_budgets(scores, 6).tolist() == [2, 3, 1]
    # A tie at the threshold goes to the earlier row: top 2 of [3], [3] -> row 0 first.
    assert global_response_budgets([np.array([3.0]), np.array([3.0])], 1).tolist() == [1, 0]
    with pytest.raises(ValueError, match="total=7"):
        global_response_budgets(scores, 7)


def test_token_cleaning_global_differs_from_per_example_rho1():
    # Two rows [BOS] p | r1 r2 r3 r4 EOS (prompt_len 2, 4 eligible response positions each), rho_p 1, rho_r 0.5:
    # per example both rows supervise 2; globally the 4 best of the pool all lie in row 0.
    row0 = np.array([0.0, 0.0, 9.0, 8.0, 7.0, 6.0, 0.0])
    row1 = np.array([0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 0.0])
    per_row = [token_cleaning_masks(r, 2, 0.5, budget="matched", rho_p=1.0) for r in (row0, row1)]
    assert [m.b_r for m in per_row] == [2, 2]
    assert per_row[1].loss_mask.tolist() == [False, False, False, False, True, True, True]
    glob = token_cleaning_global_masks([row0, row1], [2, 2], 1.0, 0.5)
    assert [m.b_r for m in glob] == [4, 0] and sum(m.b_r for m in glob) == sum(m.b_r for m in per_row)
    assert glob[0].loss_mask.tolist() == [False, False, True, True, True, True, True]
    assert glob[1].loss_mask.tolist() == [False] * 6 + [True]  # nothing but the fixed EOS
    assert all(m.prompt_keep.all() for m in glob)
    # When one row holds every score, the global and per-row selections coincide.
    alone = token_cleaning_global_masks([row1], [2], 1.0, 0.5)[0]
    assert alone.loss_mask.tolist() == per_row[1].loss_mask.tolist()
    with pytest.raises(ValueError, match="prompt lengths"):
        token_cleaning_global_masks([row0], [2, 2], 1.0, 0.5)


def test_prompt_selector_masks_keep_the_whole_response():
    scores = np.array([0.0, 5, 1, 4, 2, 8, 3, 7, 6])  # over the 9 prompt positions
    m = prompt_selector_masks(scores, N, 0.5)
    _assert_fixed(m)
    assert (m.b_p, m.b_r) == (4, 12) and m.loss_mask[PLEN:].all()
    assert np.flatnonzero(m.prompt_keep).tolist() == [0, 1, 5, 7, 8]  # BOS + scores 5, 8, 7, 6
    assert prompt_selector_masks(scores, N, 0.75, budget="matched", rho_r=0.75).b_p == 3


# ------------------------------------------------------------------------------------------- compositions


def test_independent_composition_uses_each_sides_own_scores():
    p_scores = np.array([0.0, 5, 1, 4, 2, 8, 3, 7, 6])
    r_full = np.r_[np.zeros(PLEN), np.arange(12, 0, -1.0), 0.0]  # response: earlier = higher
    m = independent_composition(p_scores, r_full, N, 0.5, 0.25)
    _assert_fixed(m)
    assert (m.b_p, m.b_r) == (4, 3)
    assert np.flatnonzero(m.prompt_keep).tolist() == [0, 1, 5, 7, 8]
    assert np.flatnonzero(m.loss_mask).tolist() == [9, 10, 11, N - 1]
    same = independent_composition(p_scores, r_full[PLEN:], N, 0.5, 0.25)  # response side only
    assert np.array_equal(same.loss_mask, m.loss_mask)
    with pytest.raises(ValueError, match="expected the response side"):
        independent_composition(p_scores, r_full[:-1], N, 0.5, 0.25)


def test_sequential_composition_rescores_under_the_compacted_prompt():
    p_scores = np.array([0.0, 5, 1, 4, 2, 8, 3, 7, 6])
    calls = []

    def rescore(prompt_keep: np.ndarray) -> np.ndarray:
        calls.append(prompt_keep.copy())
        k = int(prompt_keep.sum())
        # Scores over the compacted row (k kept prompt + 13 response); prefer late response tokens.
        return np.r_[np.full(k, 99.0), np.arange(13, dtype=float)]

    m = sequential_composition(p_scores, rescore, N, 0.5, 0.25)
    assert len(calls) == 1
    assert np.flatnonzero(calls[0]).tolist() == [0, 1, 5, 7, 8]  # the compacted prompt: BOS + top-4 by score
    assert np.array_equal(calls[0], m.prompt_keep)
    _assert_fixed(m)
    assert (m.b_p, m.b_r) == (4, 3)
    assert np.flatnonzero(m.loss_mask).tolist() == [18, 19, 20, N - 1]  # top 3 eligible (EOS excluded) + EOS
    assert np.array_equal(m.response_scores, np.arange(13, dtype=float))


def test_sequential_differs_from_independent_when_the_prompt_changes_the_scores():
    p_scores = np.array([0.0, 5, 1, 4, 2, 8, 3, 7, 6])
    full = np.r_[np.zeros(PLEN), np.arange(12, 0, -1.0), 0.0]  # full-prompt scores: early tokens best

    def rescore(prompt_keep: np.ndarray) -> np.ndarray:
        # Under the compacted prompt the late tokens become the best ones (response side only).
        return np.arange(13, dtype=float) if not prompt_keep.all() else full[PLEN:]

    ind = independent_composition(p_scores, full, N, 0.5, 0.25)
    seq = sequential_composition(p_scores, rescore, N, 0.5, 0.25)
    assert np.array_equal(ind.prompt_keep, seq.prompt_keep)
    assert not np.array_equal(ind.loss_mask, seq.loss_mask)
    assert (ind.b_p, ind.b_r) == (seq.b_p, seq.b_r)


def test_sequential_rejects_scores_of_the_wrong_length():
    with pytest.raises(ValueError, match="compacted|whole row"):
        sequential_composition(np.arange(PLEN, dtype=float), lambda keep: np.zeros(N), N, 0.5, 0.5)


def test_at_rho_p_1_the_compositions_reduce_to_per_example_rho1():
    # With every prompt token kept, "independent" has no prompt selection left and "sequential" rescores the
    # uncompacted row: both select RHO-1's per-example Top-b (so the demo's rho_p = 1 runs them for nothing).
    scores = np.array([0.0, 3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 0.0])
    prompt = np.arange(PLEN, dtype=float)
    rho1 = token_cleaning_masks(scores, PLEN, 0.75, budget="matched", rho_p=1.0)
    ind = independent_composition(prompt, scores, N, 1.0, 0.75)
    seq = sequential_composition(prompt, lambda keep: scores, N, 1.0, 0.75)
    for m in (ind, seq):
        assert m.prompt_keep.all() and m.loss_mask.tolist() == rho1.loss_mask.tolist()
