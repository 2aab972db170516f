"""P2D stage helpers: seeded samples, the proxy's full-batch recipe, selection reasons, AER arithmetic."""

from __future__ import annotations

import pytest

from raycurate.config.train import TrainConfig, full_batch_train_config
from raycurate.stages.p2d import aer_table, selection_rows
from raycurate.stages.rows import precision, score_separation, seeded_sample


def test_seeded_sample_is_reproducible_sorted_and_distinct():
    ids = [f"ex{i:03d}" for i in range(50)]
    a, b = seeded_sample(ids, 10, seed=3), seeded_sample(ids, 10, seed=3)
    assert a == b == sorted(set(a)) and len(a) == 10
    assert seeded_sample(ids, 10, seed=4) != a
    with pytest.raises(ValueError, match="cannot sample"):
        seeded_sample(ids, 51, seed=0)


def test_full_batch_recipe_takes_one_step_per_epoch_over_all_rows():
    cfg = full_batch_train_config(TrainConfig(num_workers=2, micro_batch_size=4), rows=100, steps=20, lr=2e-5)
    assert cfg.effective_batch_size == 100 and cfg.micro_batch_size == 2  # 100 = 2 workers x 25 accum x 2
    assert cfg.max_steps == 20 and cfg.epochs == 20 and cfg.lr == 2e-5 and cfg.warmup_ratio == 0.0
    assert cfg.checkpoint_every_steps == 20  # one checkpoint, not one per one-step epoch
    with pytest.raises(ValueError, match="not divisible"):
        full_batch_train_config(TrainConfig(num_workers=2), rows=101, steps=20, lr=2e-5)


def test_selection_rows_rank_and_explain_every_decision():
    rows = selection_rows(["a", "b", "c"], [0.2, 0.9, 0.5], {"b"}, {"a": True, "b": False})
    assert [r["rank"] for r in rows] == [3, 1, 2]
    assert rows[1]["selected"] and rows[1]["reason"].startswith("selected: rank 1 of 3")
    assert not rows[2]["selected"] and "below the top 1" in rows[2]["reason"]
    assert rows[2]["clean"] is None


def test_precision_counts_clean_rows_among_labelled_ones():
    assert precision(["a", "b", "c"], {"a": True, "b": False, "c": True}) == pytest.approx(2 / 3)
    assert precision(["a"], {}) is None


def test_aer_is_selection_plus_adaptation_over_full_sft():
    seconds = {"p2d_heads": 10.0, "p2d_probe": 30.0, "train_p2d": 20.0, "train_mixed": 120.0}
    aer = aer_table(seconds, selection_stages=["p2d_heads", "p2d_probe"], adaptation_stage="train_p2d",
                    full_sft_stage="train_mixed")
    assert aer["aer"] == pytest.approx((10 + 30 + 20) / 120)
    with pytest.raises(ValueError, match="train_full"):
        aer_table(seconds, selection_stages=[], adaptation_stage="train_p2d", full_sft_stage="train_full")


def test_score_separation_is_the_auroc_of_s_final_over_labelled_rows():
    ids = ["a", "b", "c", "d", "e"]
    labels = {"a": True, "b": False, "c": True, "d": False, "e": None}  # e: unlabelled, left out
    kinds = {"a": "none", "b": "swapped_entity", "c": "none", "d": "truncated", "e": "none"}
    out = score_separation(ids, [0.9, 0.1, 0.4, 0.5, 0.0], labels, kinds, seed=0)
    # clean scores {0.9, 0.4} vs corrupted {0.1, 0.5}: 3 of 4 pairs ordered -> 0.75
    assert out["auroc"] == 0.75
    assert out["auroc_by_kind"]["swapped_entity"]["auroc"] == 1.0 and out["auroc_by_kind"]["truncated"]["auroc"] == 0.5
    assert score_separation(ids, [0.0] * 5, {"a": True}, kinds, seed=0) == {}  # one class only
