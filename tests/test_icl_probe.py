"""ICL probing math (prompt rounds, spans, head-restricted demonstration weights, scores) and the IFD baseline."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from raycurate.algorithms.ifd import ifd_scores
from raycurate.algorithms.p2d.icl_probe import (
    IclPrompt,
    aggregate_example_scores,
    answer_token_logprobs,
    assemble_prompt,
    demo_appearances,
    demo_attention_weights,
    exact_match_score,
    gold_loglik_score,
    icl_rounds,
    n_top,
    rouge_l_f1,
    select_top,
)


@pytest.mark.parametrize("n_examples", [8, 10, 13, 1000])  # 13 and 8 leave a remainder; 1000 hits rejection sampling
@pytest.mark.parametrize("n_rounds", [1, 3])
def test_every_example_is_a_counted_demo_exactly_n_rounds_times(n_examples, n_rounds):
    prompts = icl_rounds(n_examples, n_rounds, seed=7)
    assert len(prompts) == n_rounds * math.ceil(n_examples / 5)
    assert demo_appearances(prompts, n_examples).tolist() == [n_rounds] * n_examples
    for prompt in prompts:
        assert len(prompt.demos) == 5 and len(set(prompt.demos)) == 5
        assert len(prompt.queries) == 3 and len(set(prompt.queries)) == 3
        assert not set(prompt.demos) & set(prompt.queries)  # never its own query, disjoint
        assert all(0 <= i < n_examples for i in prompt.demos + prompt.queries)


def test_fillers_complete_the_last_prompt_without_counting():
    prompts = icl_rounds(12, 1, demos_per_prompt=5, queries_per_prompt=2, seed=0)
    assert [sum(p.counted) for p in prompts] == [5, 5, 2]
    counted_demos = [d for p in prompts for d, c in zip(p.demos, p.counted, strict=True) if c]
    assert sorted(counted_demos) == list(range(12))  # the round is one permutation of the pool
    last = prompts[-1]
    fillers = {d for d, c in zip(last.demos, last.counted, strict=True) if not c}
    assert len(fillers) == 3 and not fillers & {d for d, c in zip(last.demos, last.counted, strict=True) if c}


def test_rounds_are_seeded():
    assert icl_rounds(23, 2, seed=5) == icl_rounds(23, 2, seed=5)
    assert icl_rounds(23, 2, seed=5) != icl_rounds(23, 2, seed=6)


def test_rounds_reject_too_small_pools_and_bad_counts():
    with pytest.raises(ValueError, match="needs 5 demonstrations \\+ 3 disjoint queries"):
        icl_rounds(7, 1, seed=0)
    with pytest.raises(ValueError, match="n_rounds must be an integer >= 1"):
        icl_rounds(10, 0, seed=0)
    with pytest.raises(ValueError, match="overlap"):
        IclPrompt(demos=(1, 2), queries=(2,))
    assert IclPrompt(demos=(1, 2), queries=(3,)).counted == (True, True)


def test_assemble_prompt_spans():
    out = assemble_prompt([100, 101], [[1, 2, 3], [4]], [[5, 6], [7]], [[8], [9, 9]])
    assert out["input_ids"] == [100, 101, 1, 2, 3, 4, 5, 6, 8, 7, 9, 9]
    assert out["demo_spans"] == [(2, 5), (5, 6)]
    assert out["query_spans"] == [(6, 8), (9, 10)]
    assert out["answer_spans"] == [(8, 9), (10, 12)]
    assert out["query_block"] == (6, 12)
    plain = assemble_prompt([], [[1]], [[2, 3]])
    assert plain["answer_spans"] == [] and plain["query_block"] == (1, 3)
    with pytest.raises(ValueError, match="demonstration 1 has no tokens"):
        assemble_prompt([], [[1], []], [[2]])
    with pytest.raises(ValueError, match="one per query"):
        assemble_prompt([], [[1]], [[2]], [[3], [4]])


def hand_attention() -> dict[int, torch.Tensor]:
    """Two layers, 2 heads, T = 6: demo A = positions [0, 2), demo B = [2, 5), query row 5."""
    attn = {layer: torch.zeros(2, 6, 6, dtype=torch.float64) for layer in (0, 1)}
    row = lambda *values: torch.tensor(values, dtype=torch.float64)  # noqa: E731
    attn[0][1, 5] = row(0.1, 0.1, 0.2, 0.2, 0.2, 0.2)  # (layer 0, head 1): A 0.2, B 0.6
    attn[1][0, 5] = row(0.3, 0.3, 0.1, 0.1, 0.1, 0.1)  # (layer 1, head 0): A 0.6, B 0.3
    attn[0][0, 5] = row(1.0, 0, 0, 0, 0, 0)  # an unselected head: must be ignored
    attn[1][1, 5] = row(0, 0, 0, 0, 1.0, 0)
    return attn


def test_demo_weights_sum_selected_heads_per_layer_and_divide_by_length():
    selected = torch.tensor([[False, True], [True, False]])
    weights = demo_attention_weights(hand_attention(), selected, slice(5, 6), [(0, 2), (2, 5)])
    # A: (0.2 + 0.6) / 2 = 0.4; B: (0.6 + 0.3) / 3 = 0.3; normalised: 4/7, 3/7
    assert weights.tolist() == pytest.approx([4 / 7, 3 / 7], rel=1e-12)
    only_layer0 = torch.tensor([[False, True], [False, False]])
    # A: 0.2 / 2 = 0.1, B: 0.6 / 3 = 0.2
    assert demo_attention_weights(
        hand_attention(), only_layer0, torch.tensor([5]), [(0, 2), (2, 5)]
    ).tolist() == pytest.approx([1 / 3, 2 / 3])


def test_demo_weights_accept_precut_query_rows_and_check_inputs():
    selected = torch.tensor([[False, True], [True, False]])
    cut = {layer: weights[:, 5:6] for layer, weights in hand_attention().items()}  # (H, Tq=1, T)
    assert demo_attention_weights(cut, selected, slice(None), [(0, 2), (2, 5)]).tolist() == pytest.approx(
        [4 / 7, 3 / 7]
    )
    with pytest.raises(KeyError, match="layer 1 is missing"):
        demo_attention_weights({0: hand_attention()[0]}, selected, slice(5, 6), [(0, 2), (2, 5)])
    with pytest.raises(ValueError, match="at least one head"):
        demo_attention_weights(hand_attention(), torch.zeros(2, 2, dtype=torch.bool), slice(5, 6), [(0, 2)])
    with pytest.raises(ValueError, match="batch dimension"):
        demo_attention_weights({0: torch.zeros(1, 2, 6, 6)}, torch.tensor([[True, False]]), slice(5, 6), [(0, 2)])


def test_query_scores_by_hand():
    assert rouge_l_f1("a b c d".split(), "a c d e".split()) == pytest.approx(0.75)  # LCS = a c d
    assert rouge_l_f1([1, 2], [1, 2, 3, 4]) == pytest.approx(2 * 1 * 0.5 / 1.5)
    assert rouge_l_f1([], [1]) == 0.0 and rouge_l_f1([1], [2]) == 0.0
    assert exact_match_score("so 3 + 4 = 7\n#### 7.0", "#### 7") == 1.0
    assert exact_match_score("#### 8", "#### 7") == 0.0
    assert exact_match_score(" 1,234 ", "1234") == 1.0
    assert gold_loglik_score([math.log(0.5), math.log(0.125)]) == pytest.approx(0.25)  # sqrt(0.5 * 0.125)


def test_answer_token_logprobs_are_teacher_forced():
    logits = torch.zeros(4, 3)
    logits[1, 2] = math.log(2.0)  # position 1 predicts token 2 at p = 2 / 4
    logits[2] = torch.tensor([0.0, math.log(3.0), 0.0])  # position 2 predicts token 1 at p = 3 / 5
    input_ids = torch.tensor([0, 0, 2, 1])
    got = answer_token_logprobs(logits, input_ids, (2, 4))
    assert got.tolist() == pytest.approx([math.log(0.5), math.log(0.6)], rel=1e-6)
    with pytest.raises(ValueError, match="1 <= start"):
        answer_token_logprobs(logits, input_ids, (0, 2))


def test_aggregate_is_the_mean_of_score_times_weight():
    appearances = [(0, 0.5, 0.2), (0, 1.0, 0.4), (2, 0.8, 0.5)]
    scores = aggregate_example_scores(appearances, 3)
    assert scores[0] == pytest.approx((0.1 + 0.4) / 2) and scores[2] == pytest.approx(0.4)
    assert np.isnan(scores[1])
    with pytest.raises(ValueError, match="outside the pool"):
        aggregate_example_scores([(3, 1.0, 1.0)], 3)
    with pytest.raises(ValueError, match="no score"):
        select_top(scores, 0.5)


def test_select_top_rounds_half_up_and_breaks_ties_by_index():
    assert [n_top(10, r) for r in (0.1, 0.25, 0.35, 0.01, 1.0)] == [1, 3, 4, 1, 10]
    scores = np.array([0.2, 0.9, 0.2, 0.9, 0.1])
    assert select_top(scores, 0.6).tolist() == [1, 3, 0]
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        select_top(scores, 0.0)


def test_ifd_is_the_conditional_over_unconditional_loss():
    got = ifd_scores(torch.tensor([1.0, 3.0]), torch.tensor([2.0, 2.0]))
    assert got.dtype == torch.float64 and got.tolist() == [0.5, 1.5]
    with pytest.raises(ValueError, match="finite and > 0; examples \\[1\\]"):
        ifd_scores(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="matching"):
        ifd_scores(torch.ones(2), torch.ones(3))


def test_query_centred_scores_take_out_each_querys_own_difficulty():
    from raycurate.algorithms.p2d.icl_probe import query_centred_scores

    queries = [["q1", "q2"], ["q1", "q3"], ["q2", "q3"]]
    scores = [[0.9, 0.1], [0.7, 0.5], [0.3, 0.5]]
    # query means q1 0.8, q2 0.2, q3 0.5 -> prompts (0.1 - 0.1) / 2, (-0.1 + 0) / 2, (0.1 + 0) / 2
    assert query_centred_scores(queries, scores).tolist() == pytest.approx([0.0, -0.05, 0.05])
    with pytest.raises(ValueError, match="query scores"):
        query_centred_scores([["q1"]], [[0.1, 0.2]])
