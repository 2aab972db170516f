"""bridge.budget = corpus: one response budget over all rows (issue #26)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from raycurate.algorithms.bridge.rows import SelectionSettings, corpus_response_masks, select_example
from raycurate.algorithms.bridge.selection import corpus_budgets


def test_corpus_budgets_by_hand():
    scores = [np.array([3.0, 2.0, 1.0]), np.array([-1.0, -2.0]), np.array([5.0, 0.0, 0.0, 0.0])]
    # 9 positions, B = floor(0.5 * 9 + 0.5) = 5: the top five scores are 5 (row 2), 3, 2, 1 (row 0), 0 (row 2,
    # first position among equal scores); the negative row gets nothing.
    assert corpus_budgets(scores, 0.5).tolist() == [3, 0, 2]
    # floor 0.5: floor(1.5), floor(1.0), floor(2.0) = 1, 1, 2 first (4); the fifth goes to row 0's next best (2).
    assert corpus_budgets(scores, 0.5, floor=0.5).tolist() == [2, 1, 2]
    assert corpus_budgets(scores, 1.0).tolist() == [3, 2, 4]
    assert corpus_budgets(scores, 0.0).tolist() == [0, 0, 0]


def test_corpus_budget_met_exactly_floor_respected_and_deterministic():
    rng = np.random.default_rng(7)
    sizes = rng.integers(0, 30, size=200)
    scores = [rng.normal(size=s) * rng.uniform(0.1, 3.0) for s in sizes]
    for rho, floor in ((0.75, 0.0), (0.5, 0.25), (0.3, 0.3), (0.9, 0.1)):
        b = corpus_budgets(scores, rho, floor)
        assert int(b.sum()) == int(np.floor(rho * sizes.sum() + 0.5))
        assert np.all(b >= np.floor(floor * sizes + 1e-9)) and np.all(b <= sizes)
        assert corpus_budgets(scores, rho, floor).tolist() == b.tolist()


def test_corpus_budgets_take_a_prefix_of_each_rows_ranking():
    rng = np.random.default_rng(3)
    scores = [rng.normal(size=12) for _ in range(20)]
    b = corpus_budgets(scores, 0.4)
    threshold = np.sort(np.concatenate(scores))[::-1][int(b.sum()) - 1]
    for row, k in zip(scores, b):
        ranked = np.sort(row)[::-1]
        assert np.all(ranked[:k] >= threshold) and np.all(ranked[k:] <= threshold)


@pytest.mark.parametrize("rho, floor", [(0.5, 0.6), (1.2, 0.0), (0.5, -0.1)])
def test_corpus_budgets_reject_bad_shares(rho, floor):
    with pytest.raises(ValueError, match="floor <= rho"):
        corpus_budgets([np.ones(3)], rho, floor)


def test_settings_reject_unknown_budget_and_floor_above_rho():
    with pytest.raises(ValueError, match="budget"):
        SelectionSettings(budget="global")
    with pytest.raises(ValueError, match="row_floor"):
        SelectionSettings(rho_r=0.5, row_floor=0.6)


def _row(i: int) -> dict:
    # [BOS] p1 p2 p3 p4 | r1 r2 r3 r4 <eot> [EOS]; response "a = 1.\n#### 1" in 4 tokens (as test_bridge_rows).
    return {"id": f"r{i}", "input_ids": [1, 10, 11, 12, 13, 20, 21, 22, 23, 3, 2], "prompt_len": 5,
            "prompt_offsets": [-1, -1, 0, 2, 3, 5, 6, 8, 9, 11],
            "response_offsets": [0, 1, 2, 3, 4, 6, 7, 13, -1, -1, -1, -1], "response": "a = 1.\n#### 1",
            "domain": "math"}


@pytest.mark.parametrize("closure", [False, True])
def test_corpus_response_masks_meet_the_corpus_budget(closure):
    rng = np.random.default_rng(0)
    rows = [_row(i) for i in range(6)]
    settings = SelectionSettings(rho_r=0.5, closure=closure, budget="corpus", row_floor=0.25)
    per_example = [select_example(np.concatenate([np.zeros(5), rng.normal(size=6) + (i - 3)]),
                                  rng.random((6, 5)) * 0.1, rng.random(6) * 0.3, row, settings)
                   for i, row in enumerate(rows)]
    results = corpus_response_masks(rows, [r["response_scores"] for r in per_example], settings)
    # 6 rows x 4 eligible response tokens: B = 12; floor(0.25 * 4) = 1 per row.
    assert sum(r["supervised_response"] for r in results) == 12
    assert all(r["supervised_response"] == r["b_r"] >= 1 for r in results)
    assert all(r["response_mask"].shape == (4,) and r["response_idx"].tolist() == [5, 6, 7, 8] for r in results)
    # rows built with higher utilities (later rows) get at least as much as the lowest ones
    assert results[-1]["b_r"] >= results[0]["b_r"]
    again = corpus_response_masks(rows, [r["response_scores"] for r in per_example], settings)
    assert [r["response_mask"].tolist() for r in again] == [r["response_mask"].tolist() for r in results]


def test_corpus_budget_with_uniform_scores_equals_per_example_counts():
    rows = [_row(i) for i in range(4)]
    settings = dataclasses.replace(SelectionSettings(rho_r=0.5), budget="corpus", row_floor=0.5, closure=False)
    results = corpus_response_masks(rows, [np.zeros(4)] * 4, settings)
    assert [r["b_r"] for r in results] == [2, 2, 2, 2]
    assert [r["response_mask"].tolist() for r in results] == [[True, True, False, False]] * 4


def test_select_stage_rewrite_meets_the_corpus_budget_on_token_rows(tmp_path):
    """``apply_corpus_budget`` on stored per-example selections of real token rows (synthetic scores): the eligible
    supervised total is round(rho_r * eligible), the prompt side and the fixed EOS / end-of-turn are untouched."""
    import pyarrow.parquet as pq

    from raycurate.algorithms.bridge.rows import RowScores, select_rows
    from raycurate.data.corpus import generate_corpus
    from raycurate.data.tokenize import token_table, tokenize_record
    from raycurate.models.loading import embedded_model_dir, load_tokenizer
    from raycurate.stages.bridge import apply_corpus_budget, read_token_rows, selection_table

    tokenizer = load_tokenizer(embedded_model_dir())
    rows = [r for r in (tokenize_record(tokenizer, r, 384) for r in generate_corpus(12, seed=0)) if "input_ids" in r]
    table = token_table(rows)
    rng = np.random.default_rng(0)
    scores = []
    for r in rows:
        n, p = len(r["input_ids"]), int(r["prompt_len"])
        scores.append(RowScores(rng.normal(size=n - p).astype(np.float32), rng.random((n - p, p)).astype(np.float32),
                                rng.random(n - p).astype(np.float32)))
    settings = SelectionSettings(rho_p=0.75, rho_r=0.5, budget="corpus")
    per_example = select_rows(rows, scores, settings)
    (tmp_path / "sel").mkdir()
    full = selection_table(table, per_example)
    pq.write_table(full.slice(0, 5), tmp_path / "sel" / "part-00000.parquet")
    pq.write_table(full.slice(5), tmp_path / "sel" / "part-00001.parquet")
    apply_corpus_budget(tmp_path / "sel", settings)
    after = read_token_rows(tmp_path / "sel")
    eligible = sum(r["eligible_response"] for r in per_example)
    assert sum(r["sel_supervised_response"] for r in after) == int(np.floor(0.5 * eligible + 0.5))
    assert sum(r["sel_b_r"] for r in after) == int(np.floor(0.5 * eligible + 0.5))
    for before, r in zip(per_example, after):
        p = int(r["prompt_len"])
        assert r["sel_prompt_keep"] == before["prompt_keep"].tolist()
        assert r["sel_loss_mask"][:p] == [0] * p and r["sel_loss_mask"][-1] == 1
        assert sum(r["sel_loss_mask"]) - r["sel_supervised_response"] == sum(before["loss_mask"]) - before[
            "supervised_response"]  # the fixed positions


def test_supervise_first_swaps_in_the_leading_positions_by_hand():
    from raycurate.algorithms.bridge.selection import supervise_first

    mask = np.array([False, True, True, False, True, True])
    scores = np.array([0.0, 5.0, 1.0, 9.0, 1.0, -2.0])
    # position 0 replaces the lowest-scoring selected one outside the lead: 5 (score -2)
    assert supervise_first(mask, scores, 1).tolist() == [True, True, True, False, True, False]
    # protecting position 5: the next lowest are 2 and 4 (score 1); the later one (4) goes first
    protected = np.array([False, False, False, False, False, True])
    assert supervise_first(mask, scores, 1, protected).tolist() == [True, True, True, False, False, True]
    # k = 0 and an already supervised lead change nothing; the size is always kept
    assert supervise_first(mask, scores, 0).tolist() == mask.tolist()
    assert supervise_first(mask, scores, 3).sum() == mask.sum()
    # nothing outside the lead to swap out: the lead stays partly out rather than growing the selection
    assert supervise_first(np.array([False, True]), np.array([0.0, 1.0]), 2).tolist() == [False, True]
    assert supervise_first(np.array([False, False]), np.array([0.0, 1.0]), 1).tolist() == [False, False]


def test_first_tokens_setting_supervises_the_first_token_and_keeps_the_answer_line():
    row = _row(0)
    for seed in range(20):
        rng = np.random.default_rng(seed)
        utilities = np.concatenate([np.zeros(5), rng.normal(size=6)])
        utilities[5] = -50.0  # the first response token scores lowest: without the setting it is never supervised
        args = (utilities, rng.random((6, 5)) * 0.1, rng.random(6) * 0.3, row)
        off = select_example(*args, SelectionSettings(rho_r=0.5))
        on = select_example(*args, SelectionSettings(rho_r=0.5, first_tokens=1))
        assert off["loss_mask"][5] == 0 and on["loss_mask"][5] == 1
        assert on["supervised_response"] == off["supervised_response"] == 2
        assert on["loss_mask"][8] == 1  # the "#### 1" token (final-answer line) stays
