"""BRIDGE fidelity diagnostics: metrics, exact leave-one-out references, proxies, Table 3, Fig. 2(b)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
stats = pytest.importorskip("scipy.stats")

from raycurate.algorithms import ranking as rk  # noqa: E402
from raycurate.algorithms.bridge import fidelity as fd  # noqa: E402
from raycurate.algorithms.bridge import token_utility as tu  # noqa: E402
from raycurate.algorithms.bridge.selection import budgets, eligible_positions, fold_fixed_positions, select  # noqa: E402
from raycurate.models.tiny import build_tiny_model  # noqa: E402
from raycurate.models.tokenizer import train_tokenizer  # noqa: E402

WORDS = "the a cat dog sat ran on to mat park with ball add two three numbers sum is then multiply".split()
ATOL, RTOL = 2e-5, 1e-5  # float32 JVP vs per-token backward; batch-size-dependent matmul kernels


# ----------------------------------------------------------------------------------------------- metrics


@pytest.mark.parametrize("seed", range(6))
def test_spearman_and_ranks_match_scipy_with_ties(seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 5, size=17).astype(float)  # many ties
    y = x + rng.integers(-3, 4, size=17)
    np.testing.assert_allclose(rk.average_ranks(x), stats.rankdata(x))
    assert rk.spearman(x, y) == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)
    z = rng.normal(size=40)
    assert rk.spearman(z, -z ** 3) == pytest.approx(-1.0)


def test_average_ranks_by_hand():
    np.testing.assert_array_equal(rk.average_ranks(np.array([3.0, 1.0, 3.0, 2.0, 3.0])), [4, 1, 4, 2, 4])
    np.testing.assert_array_equal(rk.average_ranks(np.array([0.5, 0.5])), [1.5, 1.5])


def test_spearman_is_nan_when_undefined():
    assert math.isnan(rk.spearman(np.ones(4), np.arange(4.0)))  # constant ranking
    assert math.isnan(rk.spearman(np.array([1.0]), np.array([2.0])))  # n < 2
    with pytest.raises(ValueError, match="same candidates"):
        rk.spearman(np.ones(3), np.ones(4))
    with pytest.raises(ValueError, match="finite"):
        rk.spearman(np.array([1.0, np.nan]), np.ones(2))


def test_set_metrics_by_hand():
    ref = np.array([5.0, 4.0, 3.0, 2.0, 1.0])
    proxy = np.array([1.0, 4.0, 3.0, 2.0, 5.0])
    # Top-2(ref) = {0, 1}, Top-2(proxy) = {4, 1}: one shared of 2, union 3
    assert rk.top_b_overlap(ref, proxy, 2) == 0.5
    assert rk.jaccard(ref, proxy, 2) == pytest.approx(1 / 3)
    # U_ref(S_ref) = 9, U_ref(S_proxy) = 4 + 1 = 5 -> regret 4/9, retention 5/9
    assert rk.normalized_regret(ref, proxy, 2) == pytest.approx(4 / 9)
    assert rk.utility_retention(ref, proxy, 2) == pytest.approx(5 / 9)
    assert rk.normalized_regret(ref, proxy, 2) == pytest.approx(1 - rk.utility_retention(ref, proxy, 2))
    # b = n: every metric is perfect
    assert rk.top_b_overlap(ref, proxy, 5) == 1.0 and rk.normalized_regret(ref, proxy, 5) == 0.0


def test_set_metrics_use_the_position_tie_break_of_top_b():
    ref = np.array([0.0, 0.0, 1.0, 1.0])
    proxy = np.array([2.0, 2.0, 2.0, 2.0])  # all tied: Top-2 = {0, 1} (earlier positions first)
    assert rk.top_b_overlap(ref, proxy, 2) == 0.0  # Top-2(ref) = {2, 3}
    assert rk.normalized_regret(ref, proxy, 2) == 1.0  # (2 - 0) / 2


def test_regret_with_negative_best_utility_and_degenerate_cases():
    ref, proxy = np.array([-1.0, -2.0, -3.0]), np.array([-3.0, -2.0, -1.0])
    # S_ref = {0} (U = -1), S_proxy = {2} (U = -3): regret (-1 - -3) / |-1| = 2; retention undefined
    assert rk.normalized_regret(ref, proxy, 1) == pytest.approx(2.0)
    assert math.isnan(rk.utility_retention(ref, proxy, 1))
    zero_best = np.array([1.0, -1.0, -1.0])  # Top-2 = {0, 1}: U_ref(S_ref) = 0
    assert math.isnan(rk.normalized_regret(zero_best, np.array([0.0, 1.0, 1.0]), 2))  # proxy {1, 2}: loss 2
    assert rk.normalized_regret(zero_best, zero_best, 2) == 0.0  # optimal: zero regret at any scale
    for metric in (rk.top_b_overlap, rk.jaccard):
        assert math.isnan(metric(ref, proxy, 0))
    assert rk.normalized_regret(ref, proxy, 0) == 0.0
    with pytest.raises(ValueError, match="budget"):
        rk.top_b_overlap(ref, proxy, 4)


@pytest.mark.parametrize("seed", range(4))
def test_identical_proxy_and_reference_are_perfect(seed):
    ref = np.random.default_rng(seed).normal(size=23)
    metrics = rk.selection_metrics(ref, ref.copy(), 9)
    assert metrics == {"spearman": pytest.approx(1.0), "top_b_overlap": 1.0, "jaccard": 1.0,
                       "normalized_regret": 0.0}
    # a strictly increasing transform keeps every metric perfect; a reversal makes Spearman -1
    assert rk.selection_metrics(ref, np.exp(ref), 9)["spearman"] == pytest.approx(1.0)
    assert rk.spearman(ref, -ref) == pytest.approx(-1.0)


# ------------------------------------------------------------------------------------------ proxies (pure)


def hand_routing():
    """Row: BOS p1 p2 | r0 r1 EOS (prompt_len 3, R = 3); eligible prompt {1, 2}, eligible response {3, 4}."""
    a_p = np.array([[0.1, 0.2, 0.3],  # r0 (query 3)
                     [0.2, 0.1, 0.4],  # r1
                     [0.3, 0.3, 0.1]])  # EOS
    c = np.array([0.0, 0.2, 0.1])
    a = np.array([2.0, -1.0, 0.5])
    return a_p, c, a


def test_proxy_scores_by_hand_with_fixed_positions_folded():
    a_p, c, a = hand_routing()
    prompt_idx, response_idx = np.array([1, 2]), np.array([3, 4])
    S_p, S_r = np.array([False, True]), np.array([True, False])
    out = fd.proxy_scores(a_p, c, a, 3, prompt_idx, response_idx, S_p, S_r)
    assert list(out) == list(fd.PROXIES)
    att_p, att_r = out["attention"]
    # prompt i: sum over S_r = {r0} plus fixed EOS of A_p[j, i]: p1 -> 0.2 + 0.3, p2 -> 0.3 + 0.1
    np.testing.assert_allclose(att_p, [0.5, 0.4])
    # response j: c_j + A_p[j, BOS] (fixed, kept) + A_p[j, p2] (S_p): r0 -> 0 + 0.1 + 0.3, r1 -> 0.2 + 0.2 + 0.4
    np.testing.assert_allclose(att_r, [0.4, 0.8])
    sur_p, sur_r = out["attention_x_a"]
    np.testing.assert_allclose(sur_p, [0.2 * 2 + 0.3 * 0.5, 0.3 * 2 + 0.1 * 0.5])
    np.testing.assert_allclose(sur_r, [2 * (0.0 + 0.1 + 0.3), -1 * (0.2 + 0.2 + 0.4)])
    # paper protocol (EOS not counted): prompt scores sum over S_r only; response scores unchanged
    paper = fd.proxy_scores(a_p, c, a, 3, prompt_idx, response_idx, S_p, S_r, count_fixed_response=False)
    np.testing.assert_allclose(paper["attention"][0], [0.2, 0.3])
    np.testing.assert_allclose(paper["attention_x_a"][0], [0.2 * 2, 0.3 * 2])
    np.testing.assert_allclose(paper["attention_x_a"][1], sur_r)


# ---------------------------------------------------------------------------------------- model fixtures


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny-model passes run fastest on one thread; the test machine's 2 cores are shared (restored after)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tokenizer():
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(60)]
    return train_tokenizer(texts, vocab_size=300)


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_model("tiny-llama", tokenizer, seed=5).eval()


@pytest.fixture(scope="module")
def direction(model):
    gen = torch.Generator().manual_seed(7)
    params = tu.scoring_parameters(model, last_layers=2)
    return {name: torch.randn(p.shape, generator=gen) for name, p in params.items()}


@pytest.fixture(scope="module")
def example(tokenizer):
    """n = 13: BOS + 6 prompt tokens (prompt_len 7) | 5 response tokens + EOS."""
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(7, len(tokenizer), (13,), generator=gen)
    ids[0], ids[-1] = tokenizer.bos_token_id, tokenizer.eos_token_id
    prompt_idx, response_idx = eligible_positions(13, 7, has_bos=True)
    return ids, 7, prompt_idx, response_idx


def loop_utilities(model, row: torch.Tensor, response_start: int, direction) -> torch.Tensor:
    """Per-token backward utilities of one row's response side (the slow reference, one row at a time)."""
    ids = row[None, :]
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, response_start:] = 1
    return tu.reference_token_utilities(model, ids, torch.ones_like(ids), loss_mask, direction)[0, response_start:]


# ------------------------------------------------------------------------------------------ exact reference


def test_leave_one_out_rows_remove_exactly_one_position():
    ids = torch.tensor([10, 11, 12, 13, 14])
    rows = fd.leave_one_out_rows(ids, [0, 2, 4])
    assert rows.tolist() == [[11, 12, 13, 14], [10, 11, 13, 14], [10, 11, 12, 13]]


def test_exact_interactions_equal_a_loop_of_separate_passes(model, direction, example):
    ids, prompt_len, prompt_idx, _ = example
    a_full, beta = fd.exact_interactions(model, ids, prompt_len, prompt_idx, direction, chunk=4)  # 2 chunks: 4 + 2
    expected_a = loop_utilities(model, ids, prompt_len, direction)  # (R,)
    np.testing.assert_allclose(a_full, expected_a.double().numpy(), rtol=RTOL, atol=ATOL)
    assert beta.shape == (6, 6)
    # beta is a difference of two float32 utilities of size up to max|a| (~10 here); each side carries rounding of
    # ~1e-6 max|a| that depends on which attention kernel ran (fused or MATH), so the tolerance scales with max|a|.
    beta_atol = 1e-5 * float(expected_a.abs().max())
    for m, i in enumerate(prompt_idx):
        removed = torch.cat([ids[:i], ids[i + 1:]])  # T_i(P): token i physically gone, later positions shift
        a_without = loop_utilities(model, removed, prompt_len - 1, direction)
        np.testing.assert_allclose(beta[m], (expected_a - a_without).double().numpy(), rtol=RTOL, atol=beta_atol)
    assert np.abs(beta).max() > 1e-3  # removing a prompt token does change the utilities
    _, beta_one = fd.exact_interactions(model, ids, prompt_len, prompt_idx, direction, chunk=1)
    np.testing.assert_allclose(beta_one, beta, rtol=RTOL, atol=ATOL)  # chunking changes nothing


def test_exact_reference_scores_sum_over_s_r_and_recompute_on_the_compacted_prompt(model, direction, example):
    ids, prompt_len, prompt_idx, response_idx = example
    S_p = np.array([True, False, True, True, False, True])
    S_r = np.array([False, True, True, False, True])
    delta_p, delta_r = fd.exact_reference_scores(model, ids, prompt_len, prompt_idx, response_idx, direction,
                                                 S_p, S_r, chunk=3)
    _, beta = fd.exact_interactions(model, ids, prompt_len, prompt_idx, direction)
    supervised = np.r_[S_r, True]  # eligible response tokens 0..4, then the fixed EOS (always supervised)
    np.testing.assert_allclose(delta_p, beta[:, supervised].sum(axis=1), atol=1e-9)
    paper_p, paper_r = fd.exact_reference_scores(model, ids, prompt_len, prompt_idx, response_idx, direction,
                                                 S_p, S_r, count_fixed_response=False)
    np.testing.assert_allclose(paper_p, beta[:, np.r_[S_r, False]].sum(axis=1), atol=1e-9)  # S_r only
    np.testing.assert_allclose(paper_r, delta_r, atol=1e-9)
    compact = torch.cat([ids[:1], ids[1:7][torch.from_numpy(S_p)], ids[7:]])  # BOS + S_p + full response
    assert compact.shape[0] == 1 + 4 + 6
    expected = loop_utilities(model, compact, 5, direction)[:-1]  # eligible response = all but EOS
    np.testing.assert_allclose(delta_r, expected.double().numpy(), rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="S_p"):
        fd.exact_reference_scores(model, ids, prompt_len, prompt_idx, response_idx, direction, S_p[:3], S_r)


def test_compacted_prompt_keeping_everything_reproduces_the_full_utilities(model, direction, example):
    ids, prompt_len, prompt_idx, _ = example
    a_full, _ = fd.exact_interactions(model, ids, prompt_len, prompt_idx[:1], direction)
    kept_all = fd.compacted_utilities(model, ids, prompt_len, np.ones(prompt_len, bool), direction)
    np.testing.assert_allclose(kept_all, a_full, atol=1e-6)
    with pytest.raises(ValueError, match="empty"):
        fd.compacted_utilities(model, ids, prompt_len, np.zeros(prompt_len, bool), direction)


# ------------------------------------------------------------------------------- one example, Table 3, Fig 2b


def test_example_fidelity_state_proxies_and_table(model, direction, example):
    ids, prompt_len, prompt_idx, response_idx = example
    rng = np.random.default_rng(3)
    a_p = rng.dirichlet(np.ones(13), size=6)[:, :prompt_len]  # (R, P) rows of a causal softmax, not renormalised
    c = rng.uniform(0.0, 0.2, size=6)
    ex = fd.example_fidelity(model, ids, prompt_len, prompt_idx, response_idx, direction, a_p, c,
                             rho_p=0.5, rho_r=0.6, rounds=4, chunk=6)
    assert (ex.b_p, ex.b_r) == (3, 3)  # round(0.5 * 6), round(0.6 * 5)
    # the conditioning state is the alternating BRIDGE selection on the surrogate
    a_full, beta_exact = fd.exact_interactions(model, ids, prompt_len, prompt_idx, direction)
    masks = (np.arange(7) >= 1, np.arange(6) < 5)
    beta, gamma, bias = fold_fixed_positions(a_p.T * a_full, c * a_full, *masks)
    state = select(beta, gamma, 3, 3, "alternating", 4, prompt_bias=bias)
    np.testing.assert_array_equal(ex.S_p, state.prompt_mask)
    np.testing.assert_array_equal(ex.S_r, state.response_mask)
    # "Attention x a" at the final state equals the selection's own last scores
    np.testing.assert_allclose(ex.proxies["attention_x_a"][1], state.response_scores, atol=1e-9)
    np.testing.assert_allclose(ex.reference[0], beta_exact[:, np.r_[ex.S_r, True]].sum(axis=1), atol=1e-9)

    # a proxy identical to the reference scores perfectly on both sides
    ex.proxies["oracle"] = ex.reference
    rows = fd.fidelity_table([ex, ex])
    assert [(r["side"], r["proxy"]) for r in rows] == [
        (side, proxy) for side in fd.SIDES for proxy in ("attention", "attention_x_a", fd.KNOCKOUT, "oracle")]
    oracle = [r for r in rows if r["proxy"] == "oracle"]
    for r in oracle:
        assert r["spearman"] == pytest.approx(1.0) and r["top_b_overlap"] == 1.0 and r["jaccard"] == 1.0
        assert r["normalized_regret"] == 0.0 and r["n_examples"] == r["n_spearman"] == 2
    single = fd.fidelity_table([ex])
    assert all(a[m] == pytest.approx(b[m], nan_ok=True) for a, b in zip(rows, single) for m in rk.METRICS)


def test_example_fidelity_computes_routing_itself_and_state_recomputed_scores(model, direction, example):
    from raycurate.algorithms.bridge import routing

    ids, prompt_len, prompt_idx, response_idx = example
    attn = routing.attention_for_layer(model, ids[None], torch.ones(1, 13, dtype=torch.long), layer=-1)[0]
    a_p, c = routing.routing_weights(attn, prompt_len, 13)
    given = fd.example_fidelity(model, ids, prompt_len, prompt_idx, response_idx, direction, a_p, c)
    own = fd.example_fidelity(model, ids, prompt_len, prompt_idx, response_idx, direction)  # last full layer
    for name in fd.PROXIES:
        for k in range(2):
            np.testing.assert_allclose(own.proxies[name][k], given.proxies[name][k], atol=1e-9)
    with pytest.raises(ValueError, match="both"):
        fd.example_fidelity(model, ids, prompt_len, prompt_idx, response_idx, direction, a_p)
    # knock-out proxy: conditioned on the state's S_r plus the fixed response tokens; response row = surrogate's
    assert list(own.proxies) == [*fd.PROXIES, fd.KNOCKOUT]
    weights = np.zeros(13)
    weights[prompt_len:] = 1.0
    weights[response_idx] = own.S_r
    np.testing.assert_allclose(own.proxies[fd.KNOCKOUT][0],
                               fd.knockout_scores(model, ids, np.asarray(prompt_idx), weights, direction), rtol=1e-6)
    np.testing.assert_array_equal(own.proxies[fd.KNOCKOUT][1], own.proxies["attention_x_a"][1])
    assert np.any(own.proxies[fd.KNOCKOUT][0] != 0)
    plain = fd.example_fidelity(model, ids, prompt_len, prompt_idx, response_idx, direction, knockout=False)
    assert list(plain.proxies) == list(fd.PROXIES)

    # F.2: at the example's own state (T = 4) the fresh scores are its response-side reference
    states = fd.state_recomputed_fidelity(model, ids, prompt_len, direction, own, rounds=(1, 4))
    at_4 = rk.selection_metrics(own.reference[1], own.proxies["attention_x_a"][1], own.b_r)
    for metric in ("spearman", "top_b_overlap", "normalized_regret"):
        assert states[4][metric] == pytest.approx(at_4[metric], nan_ok=True)
    table = fd.state_fidelity_table([states, states])
    assert [row["T"] for row in table] == [1, 4]
    assert table[1]["spearman"] == pytest.approx(states[4]["spearman"], nan_ok=True)
    assert table[0]["n_top_b_overlap"] == 2


def test_fidelity_table_means_skip_undefined_metrics():
    def make(ref_p, proxy_p):
        ref_r = np.array([1.0, 2.0, 3.0])
        return fd.FidelityExample(1, 1, (ref_p, ref_r), {"x": (proxy_p, ref_r)}, np.ones(3, bool),
                                  np.ones(3, bool), np.zeros((3, 3)), np.zeros(3), np.zeros(3))

    first = make(np.array([3.0, 2.0, 1.0]), np.array([1.0, 2.0, 3.0]))  # Spearman -1, overlap 0, regret 2/3
    second = make(np.array([3.0, 2.0, 1.0]), np.array([5.0, 5.0, 5.0]))  # constant proxy: Spearman NaN
    (prompt_row, response_row) = fd.fidelity_table([first, second])
    assert prompt_row["spearman"] == pytest.approx(-1.0) and prompt_row["n_spearman"] == 1
    assert prompt_row["top_b_overlap"] == pytest.approx(0.5) and prompt_row["n_top_b_overlap"] == 2
    assert prompt_row["normalized_regret"] == pytest.approx(1 / 3)  # mean of 2/3 and 0
    assert response_row["spearman"] == pytest.approx(1.0) and response_row["n_spearman"] == 2
    with pytest.raises(ValueError, match="at least one"):
        fd.fidelity_table([])


def test_ranking_shift_by_hand():
    beta = np.array([[3.0, 0.0],
                     [0.0, 2.0],
                     [1.0, 1.0]])
    gamma = np.zeros(2)
    curve = fd.ranking_shift(beta, gamma, retentions=(1.0, 0.5), subset="top")
    # full-state: Delta_p(.|R) = [3, 2, 2], Delta_r(.|P) = [4, 3]
    # rho 0.5 prompt side: S_r = Top-1 Delta_r = {r0} -> Delta_p = [3, 0, 1]: ranks [3, 1.5, 1.5] vs [3, 1, 2]
    r_full, r_cond = np.array([3, 1.5, 1.5]), np.array([3, 1, 2])
    expected = 1 - np.corrcoef(r_full, r_cond)[0, 1]
    np.testing.assert_allclose(curve["prompt_shift"], [0.0, expected])
    # rho 0.5 response side: b_p = round(1.5) = 2, S_p = Top-2 [3, 2, 2] = {p0, p1} -> Delta_r = [3, 2]: same order
    np.testing.assert_allclose(curve["response_shift"], [0.0, 0.0])


def test_ranking_shift_properties():
    rng = np.random.default_rng(0)
    u, v = rng.uniform(0.1, 1.0, size=8), rng.uniform(0.1, 1.0, size=6)
    separable = fd.ranking_shift(np.outer(u, v), np.zeros(6), retentions=(1.0, 0.75, 0.5, 0.25))
    # beta = u v^T with v > 0: any non-empty S_r scales Delta_p by a positive constant -> no prompt shift
    np.testing.assert_allclose(separable["prompt_shift"], 0.0, atol=1e-12)
    np.testing.assert_allclose(separable["response_shift"], 0.0, atol=1e-12)
    beta, gamma = rng.normal(size=(10, 8)), rng.normal(size=8)
    first = fd.ranking_shift(beta, gamma, subset="random", seed=4)
    again = fd.ranking_shift(beta, gamma, subset="random", seed=4)
    np.testing.assert_array_equal(first["prompt_shift"], again["prompt_shift"])  # same seed, same subsets
    assert first["prompt_shift"][0] == 0.0 and np.all(first["prompt_shift"][1:] >= 0)
    top = fd.ranking_shift(beta, gamma, subset="top")
    mean = fd.mean_ranking_shift([first, top])
    np.testing.assert_allclose(mean["response_shift"], (first["response_shift"] + top["response_shift"]) / 2)
    empty = fd.ranking_shift(beta, gamma, retentions=(0.0,))  # nothing retained, no bias: constant Delta_p
    assert math.isnan(empty["prompt_shift"][0])
    assert fd.mean_ranking_shift([empty])["n_prompt"][0] == 0
    with pytest.raises(ValueError, match="subset"):
        fd.ranking_shift(beta, gamma, subset="bottom")


def test_random_subsets_are_nested_and_seeded():
    sizes = [10, 9, 7, 5, 2, 1, 0]
    masks = fd.nested_random_masks(10, sizes, np.random.default_rng(3))
    assert masks.shape == (7, 10) and list(masks.sum(axis=1)) == sizes
    for larger, smaller in zip(masks[:-1], masks[1:]):
        assert not np.any(smaller & ~larger)  # every smaller subset lies inside the larger one
    np.testing.assert_array_equal(masks, fd.nested_random_masks(10, sizes, np.random.default_rng(3)))
    assert not np.array_equal(masks, fd.nested_random_masks(10, sizes, np.random.default_rng(4)))
    with pytest.raises(ValueError, match="size"):
        fd.nested_random_masks(3, [4], np.random.default_rng(0))


def test_random_ranking_shift_reuses_one_permutation_per_side():
    rng = np.random.default_rng(1)
    beta, gamma = rng.normal(size=(9, 7)), rng.normal(size=7)
    retentions = (1.0, 0.75, 0.5, 0.25)
    curve = fd.ranking_shift(beta, gamma, retentions=retentions, subset="random", seed=11)
    # by hand: the same generator order (response permutation first, then prompt) and Top-b prefixes
    gen = np.random.default_rng(11)
    sizes = [budgets(9, 7, rho, rho) for rho in retentions]
    kept_r = fd.nested_random_masks(7, [b for _, b in sizes], gen)
    full_p = beta.sum(axis=1)
    expected = [1.0 - rk.spearman(full_p, beta @ kept_r[m].astype(float)) for m in range(len(sizes))]
    np.testing.assert_allclose(curve["prompt_shift"], expected)
    assert curve["prompt_shift"][0] == 0.0
