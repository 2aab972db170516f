"""`pipeline: bilevel` end to end on a small corpus: BDS weights, online generations, baselines, losses."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from raycurate.cli.main import main

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(2400)]


def test_bilevel_pipeline_end_to_end(tmp_path, ray_local):
    args = [
        "run", "jobs/bilevel_demo.yaml", f"run.runs_dir={tmp_path}", "run.name=bilevel", "data.corpus_rows=160",
        "data.heldout_rows=6", "data.corpus_bad_lines=0", "model.pretrain_steps=10", "model.pretrain_rows=300",
        f"model.cache_dir={tmp_path / 'cache'}", "eval.max_new_tokens=8", "run.progress=false",
        "train.micro_batch_size=2", "train.effective_batch_size=8", "bilevel.epochs=1",
        "train.num_workers=1", "train.launcher=task",  # one reused Ray task per training: no Ray Train start-up
        "data.split_ratios={warmup: 0.05, validation: 0.25, selection: 0.70}",
        "bilevel.generation_every=3", "bilevel.max_new_tokens=8", "bilevel.less_dim=64",
        "bilevel.methods=[bds,online,mix_1,dsir,less]",
    ]
    assert main(args) == 0
    run_dir = tmp_path / "bilevel"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    stages = manifest["stages"]
    assert all(rec["status"] == "done" for rec in stages.values())

    candidates = stages["bilevel_candidate_rows"]["metrics"]["rows_kept"]
    weights = pq.read_table(run_dir / "train_bilevel_bds/weights.parquet").to_pylist()
    last = max(w["step"] for w in weights)
    final = [w for w in weights if w["step"] == last]
    assert len(final) == candidates
    assert sum(w["sigma"] for w in final) == pytest.approx(candidates)  # N softmax: mean weight 1

    generations = pq.read_table(run_dir / "train_bilevel_online/generations.parquet").to_pylist()
    assert generations and all(g["importance_weight"] > 0 for g in generations)
    assert stages["train_bilevel_online"]["metrics"]["generation_rounds"] >= 1

    bilevel = manifest["bilevel"]
    assert set(bilevel["losses"]) == {"bds", "online", "mix_1", "dsir", "less"}
    assert all(v["train_loss"] > 0 and v["validation_loss"] > 0 for v in bilevel["losses"].values())
    bds = bilevel["methods"]["bds"]
    assert 0.0 <= bds["auroc"] <= 1.0 and bds["auroc_ci95"][0] <= bds["auroc"] <= bds["auroc_ci95"][1]
    assert bds["auroc_by_kind"] and -1.0 <= bds["spearman_first_step"] <= 1.0
    assert stages["bilevel_mix_1_rows"]["metrics"]["validation"] == 0
    for method in ("dsir", "less"):
        picked = pq.read_table(run_dir / f"bilevel_{method}_select/selection.parquet").to_pylist()
        assert sum(r["selected"] for r in picked) == int(0.5 * candidates + 0.5)  # halves round up
