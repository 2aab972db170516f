"""Loss-based token baselines as the pipeline runs them: RHO-1, Token Cleaning, Independent and Sequential."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from raycurate.algorithms.bridge.selection import budgets
from raycurate.stages.bridge_compact import loss_baseline_columns, token_cleaning_global_columns


def _rows() -> list[dict]:
    # [BOS] p1..p4 | r1..r4 [EOS] with distinct tokens so the models' losses differ per position.
    rows = []
    for k in range(2):
        rows.append({
            "input_ids": [1, 10 + k, 11, 12, 13, 20, 21 + k, 22, 23, 2],
            "prompt_len": 5,
            "loss_mask": [0] * 5 + [1] * 5,
            "prompt_offsets": [-1, -1, 0, 2, 3, 5, 6, 8, 9, 11],
            "response_offsets": [0, 1, 2, 3, 4, 6, 7, 13, -1, -1],
        })
    return rows


def _model(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


@pytest.fixture(scope="module")
def models():
    return _model(0), _model(1)


@pytest.mark.parametrize("method", ["independent", "sequential"])
def test_two_sided_compositions_meet_bridge_budgets(models, method):
    base, reference = models
    cols = loss_baseline_columns(method, base, reference, _rows(), rho_p=0.5, rho_r=0.5, pad_id=0)
    b_p, b_r = budgets(4, 4, 0.5, 0.5)  # 4 eligible prompt tokens (BOS fixed), 4 eligible response (EOS fixed)
    for keep, loss in zip(cols["prompt_keep"], cols["loss_mask"]):
        assert keep[0] == 1 and sum(keep[1:]) == b_p
        assert sum(loss[:5]) == 0 and loss[-1] == 1 and sum(loss[5:9]) == b_r


@pytest.mark.parametrize("method", ["rho1", "token_cleaning"])
def test_one_sided_baselines_keep_the_prompt_and_match_the_combined_budget(models, method):
    base, reference = models
    cols = loss_baseline_columns(method, base, reference, _rows(), rho_p=0.5, rho_r=0.5, pad_id=0)
    for keep, loss in zip(cols["prompt_keep"], cols["loss_mask"]):
        assert all(keep)  # prompt intact
        assert sum(loss[5:9]) == 0  # B = 2 + 2 = 4 total, all 4 prompt tokens kept -> nothing left for the response
        assert loss[-1] == 1


def test_rho1_ranks_response_tokens_by_excess_loss(models):
    from raycurate.stages.bridge_compact import row_token_losses

    base, reference = models
    rows = _rows()
    cols = loss_baseline_columns("rho1", base, reference, rows, rho_p=0.5, rho_r=1.0, pad_id=0)
    losses = row_token_losses({"base": base, "reference": reference}, rows, 0)
    # rho_r = 1 with rho_p = 0.5: B = 2 + 4 = 6, prompt keeps 4 -> 2 response tokens, the top-2 excess loss
    excess = (losses["base"][0] - losses["reference"][0]).numpy()[5:9]
    chosen = np.flatnonzero(np.asarray(cols["loss_mask"][0][5:9]))
    assert sorted(chosen.tolist()) == sorted(np.argsort(-excess, kind="stable")[:2].tolist())


def test_sequential_rescores_under_the_compacted_prompt(models):
    base, reference = models
    rows = _rows()
    seq = loss_baseline_columns("sequential", base, reference, rows, rho_p=0.25, rho_r=0.5, pad_id=0)
    ind = loss_baseline_columns("independent", base, reference, rows, rho_p=0.25, rho_r=0.5, pad_id=0)
    assert seq["prompt_keep"] == ind["prompt_keep"]  # same prompt selector, chosen first
    again = loss_baseline_columns("sequential", base, reference, rows, rho_p=0.25, rho_r=0.5, pad_id=0)
    assert again == seq


def test_token_cleaning_stage_ranks_the_corpus_with_rho1s_total(models):
    from raycurate.stages.bridge_compact import (
        row_token_losses,
        token_cleaning_global_columns,
        token_cleaning_row_scores,
    )

    base, reference = models
    rows = _rows()
    scores = token_cleaning_row_scores(base, reference, rows, pad_id=0)
    losses = row_token_losses({"base": base, "reference": reference}, rows, 0)
    assert np.allclose(scores[1], (losses["base"][1] - losses["reference"][1]).numpy())
    cols = token_cleaning_global_columns(rows, scores, rho_p=1.0, rho_r=0.5)
    rho1 = loss_baseline_columns("rho1", base, reference, rows, rho_p=1.0, rho_r=0.5, pad_id=0)
    assert sum(sum(m[5:9]) for m in cols["loss_mask"]) == sum(sum(m[5:9]) for m in rho1["loss_mask"]) == 4
    # The 4 supervised response positions are the 4 highest excess losses over both rows.
    pool = [(scores[i][j], i, j) for i in range(2) for j in range(5, 9)]
    top = {(i, j) for _, i, j in sorted(pool, key=lambda t: -t[0])[:4]}
    assert {(i, j) for i in range(2) for j in range(5, 9) if cols["loss_mask"][i][j]} == top
    assert all(all(k) for k in cols["prompt_keep"]) and all(m[-1] == 1 for m in cols["loss_mask"])


def test_token_cleaning_stage_writes_masks_in_the_row_order_of_its_score_parts(models, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raycurate.config.bridge import BridgeConfig
    from raycurate.stages.bridge_compact import _write_token_cleaning_global, token_cleaning_row_scores

    base, reference = models
    rows = _rows()
    scores = token_cleaning_row_scores(base, reference, rows, pad_id=0)

    class TwoParts:  # what the actor pool's dataset writes: one part per row here
        def write_parquet(self, path: str) -> None:
            Path(path).mkdir()
            for i, (r, s) in enumerate(zip(rows, scores)):
                pq.write_table(pa.Table.from_pylist([{**r, "id": f"r{i}", "token_cleaning_scores": s}]),
                               Path(path) / f"part-{i}.parquet")

    (tmp_path / "masks").mkdir()  # the stage body creates it before the pool runs
    _write_token_cleaning_global(TwoParts(), tmp_path, BridgeConfig(rho_p=1.0, rho_r=0.5))
    written = [pq.read_table(p).to_pylist()[0] for p in sorted((tmp_path / "masks").glob("*.parquet"))]
    assert [r["id"] for r in written] == ["r0", "r1"] and "token_cleaning_scores" not in written[0]
    expected = token_cleaning_global_columns(rows, scores, rho_p=1.0, rho_r=0.5)
    assert [r["token_cleaning_loss_mask"] for r in written] == expected["loss_mask"]
    assert sum(sum(r["token_cleaning_loss_mask"][5:9]) for r in written) == 4
