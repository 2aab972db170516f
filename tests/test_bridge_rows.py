"""BRIDGE per-example composition: budgets, fixed positions, monotone U_sur, closure wiring, relevance counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raycurate.algorithms.bridge.rows import (
    SelectionSettings,
    fixed_masks,
    prompt_relevance_drops,
    score_and_select_rows,
    select_example,
)


def _row() -> dict:
    # [BOS] p1 p2 p3 p4 | r1 r2 r3 r4 [EOS]; response text "a = 1.\n#### 1" split into 4 tokens.
    response = "a = 1.\n#### 1"
    return {
        "input_ids": [1, 10, 11, 12, 13, 20, 21, 22, 23, 2],
        "prompt_len": 5,
        "prompt_offsets": [-1, -1, 0, 2, 3, 5, 6, 8, 9, 11],
        "response_offsets": [0, 1, 2, 3, 4, 6, 7, 13, -1, -1],
        "response": response,
        "domain": "math",
    }


def _scores(seed: int = 0):
    rng = np.random.default_rng(seed)
    utilities = np.zeros(10)
    utilities[5:] = rng.normal(size=5)
    a_p = rng.random((5, 5))
    a_p /= a_p.sum(axis=1, keepdims=True) * 2
    c = rng.random(5) * 0.3
    return utilities, a_p, c


def test_fixed_masks_from_offsets():
    fixed_p, fixed_r = fixed_masks(5, 10, _row()["prompt_offsets"], _row()["response_offsets"])
    assert fixed_p.tolist() == [True, False, False, False, False]
    assert fixed_r.tolist() == [False, False, False, False, True]
    with pytest.raises(ValueError, match="re-run tokenization"):
        fixed_masks(4, 10, _row()["prompt_offsets"], _row()["response_offsets"])


@pytest.mark.parametrize("closure", [False, True])
def test_select_example_budgets_fixed_positions_and_monotone_usur(closure):
    utilities, a_p, c = _scores()
    out = select_example(utilities, a_p, c, _row(), SelectionSettings(rho_p=0.5, rho_r=0.5, closure=closure))
    assert out["eligible_prompt"] == 4 and out["eligible_response"] == 4
    assert (out["b_p"], out["b_r"]) == (2, 2)
    assert out["prompt_keep"].shape == (5,) and out["loss_mask"].shape == (10,)
    assert out["prompt_keep"][0] == 1 and out["prompt_keep"][1:].sum() == 2
    assert out["loss_mask"][:5].sum() == 0 and out["loss_mask"][-1] == 1
    assert out["loss_mask"][5:9].sum() == 2 == out["supervised_response"]
    assert all(b >= a - 1e-12 for a, b in zip(out["u_sur"], out["u_sur"][1:]))
    assert out["u_sur_by_schedule"]["alternating"] >= out["u_sur_by_schedule"]["one_pass"] - 1e-12
    if closure:
        assert out["final_answer_kept"] in (0, 1) and not out["closure_fallback"]


def test_closure_keeps_the_final_answer_when_it_fits():
    utilities, a_p, c = _scores()
    utilities[8] = -5.0  # the "#### 1" token scores worst, so score-only selection drops it
    settings = SelectionSettings(rho_p=0.5, rho_r=0.5, closure=True, min_unit_tokens=1)  # no merging on 4 tokens
    out = select_example(utilities, a_p, c, _row(), settings)
    assert out["final_answer_kept"] == 1 and out["loss_mask"][8] == 1
    assert out["final_answer_kept_score_only"] == 0


def test_same_inputs_same_selection():
    utilities, a_p, c = _scores(3)
    settings = SelectionSettings(rho_p=0.5, rho_r=0.75)
    first, second = (select_example(utilities, a_p, c, _row(), settings) for _ in range(2))
    assert first["prompt_keep"].tolist() == second["prompt_keep"].tolist()
    assert first["loss_mask"].tolist() == second["loss_mask"].tolist()


def test_prompt_relevance_drops_by_hand():
    counts = prompt_relevance_drops([1, 0, 1, 0], [-1, -1, 0, 4, 5, 9, 10, 14], [[0, 9]], [[10, 20]])
    assert counts == {"relevant_total": 2, "relevant_dropped": 1, "distractor_total": 1, "distractor_dropped": 1}


def test_score_and_select_rows_on_a_tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from raycurate.algorithms.bridge.token_utility import scoring_parameters

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    direction = {k: torch.randn_like(v) for k, v in scoring_parameters(model, 1).items()}
    row = dict(_row(), loss_mask=[0] * 5 + [1] * 5)
    results = score_and_select_rows(model, direction, 1, [row, row], SelectionSettings(rho_p=0.5, rho_r=0.5),
                                    micro_batch=1)
    assert len(results) == 2
    assert results[0]["loss_mask"].tolist() == results[1]["loss_mask"].tolist()
    assert results[0]["b_p"] == 2 and results[0]["supervised_response"] == 2


def test_knockout_prompt_scores_replace_delta_p_in_one_final_update():
    from raycurate.algorithms.bridge.rows import knockout_weights, surrogate_state
    from raycurate.algorithms.bridge.selection import top_b

    utilities, a_p, c = _scores(1)
    settings = SelectionSettings(rho_p=0.5, rho_r=0.5, closure=False)
    state = surrogate_state(utilities, a_p, c, _row(), settings)
    weights = knockout_weights(state, 10, 5, settings)  # S_r of the routing state; EOS not folded by default
    assert weights[:5].sum() == 0 and weights[-1] == 0 and weights[5:9].sum() == 2
    assert knockout_weights(state, 10, 5, SelectionSettings(fold_fixed_response=True))[-1] == 1
    prompt_scores = np.array([0.0, -3.0, 5.0, -1.0, 4.0])  # row positions; BOS (0) is fixed
    out = select_example(utilities, a_p, c, _row(), settings, prompt_scores=prompt_scores)
    assert out["prompt_keep"].tolist() == [1, 0, 1, 0, 1]  # Top-2 knock-out scores among eligible 1..4
    s_p = np.array([False, True, False, True])  # eligible prompt positions 1..4
    expected_r = top_b(state.gamma + s_p.astype(float) @ state.beta, 2)
    assert out["loss_mask"][5:9].astype(bool).tolist() == expected_r.tolist()
    assert out["rounds_run"] == state.result.rounds_run + 1
    assert len(out["u_sur"]) == len(state.result.u_sur) + 1
    routing = select_example(utilities, a_p, c, _row(), settings)
    assert out["u_sur_by_schedule"] == routing["u_sur_by_schedule"]  # schedule comparison stays on routing
    with pytest.raises(ValueError, match="prompt_proxy"):
        SelectionSettings(prompt_proxy="loo")


def test_score_and_select_rows_with_the_knockout_proxy():
    from transformers import LlamaConfig, LlamaForCausalLM

    from raycurate.algorithms.bridge.token_utility import scoring_parameters

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    direction = {k: torch.randn_like(v) for k, v in scoring_parameters(model, 1).items()}
    row = dict(_row(), loss_mask=[0] * 5 + [1] * 5)
    short = dict(row, input_ids=row["input_ids"][:4] + row["input_ids"][5:], prompt_len=4,
                 prompt_offsets=row["prompt_offsets"][:8], loss_mask=[0] * 4 + [1] * 5)  # one prompt token fewer
    settings = SelectionSettings(rho_p=0.5, rho_r=0.5, prompt_proxy="knockout_grad")
    batched = score_and_select_rows(model, direction, 1, [row, short], settings, micro_batch=2)
    alone = score_and_select_rows(model, direction, 1, [short], settings, micro_batch=1)
    assert batched[1]["prompt_keep"].tolist() == alone[0]["prompt_keep"].tolist()
    assert batched[0]["prompt_keep"].sum() == 1 + batched[0]["b_p"] == 3
    assert batched[0]["rounds_run"] >= 2


def test_response_side_note_and_report_show_both_proxies_and_both_shifts(tmp_path):
    import json

    from raycurate.report.html import section_bridge
    from raycurate.stages.bridge_diagnostics import response_side_note

    def row(side, proxy, rho):
        return {"side": side, "proxy": proxy, "spearman": rho, "top_b_overlap": 0.5, "jaccard": 0.3,
                "normalized_regret": 0.1, "n_examples": 2}

    table = [row("prompt", "attention", 0.01), row("prompt", "attention_x_a", 0.02),
             row("prompt", "knockout_grad", 0.6), row("response", "attention", 0.05),
             row("response", "attention_x_a", 0.93), row("response", "knockout_grad", 0.93)]
    note = response_side_note(table)
    assert (note["response_attention_x_a"], note["response_attention_alone"]) == (0.93, 0.05)
    assert (note["prompt_routing"], note["prompt_knockout_grad"]) == (0.02, 0.6)
    assert "0.93" in note["text"] and "Attention alone gives 0.05" in note["text"]
    curve = {"retention": [1.0, 0.5], "prompt_shift": [0.0, 0.32], "response_shift": [0.0, 0.1]}
    top = {"retention": [1.0, 0.5], "prompt_shift": [0.0, 0.05], "response_shift": [0.0, 0.01]}
    (tmp_path / "bridge_diagnostics").mkdir()
    (tmp_path / "bridge_diagnostics" / "fidelity.json").write_text(json.dumps(
        {"examples": 2, "table": table, "response_side_note": note, "ranking_shift": curve,
         "ranking_shift_top": top}))
    html = section_bridge(tmp_path, {"stages": {"bridge_select": {"status": "done", "metrics": {}}}})
    assert "knockout_grad" in html and "Attention alone gives 0.05" in html
    assert "prompt shift (random subsets)" in html and "prompt shift (top-b)" in html
    assert "0.320" in html and "0.050" in html


def test_prompt_proxy_config_option_reaches_the_selection_settings():
    from raycurate.config.bridge import BridgeConfig
    from raycurate.config.loader import ConfigError, from_dict
    from raycurate.stages.bridge import selection_settings

    cfg = from_dict(BridgeConfig, {"prompt_proxy": "knockout_grad"})
    assert selection_settings(cfg).prompt_proxy == "knockout_grad"
    assert selection_settings(from_dict(BridgeConfig, {})).prompt_proxy == "routing"  # the paper's default
    with pytest.raises(ConfigError, match="prompt_proxy"):
        from_dict(BridgeConfig, {"prompt_proxy": "loo"})
