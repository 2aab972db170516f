"""`pipeline: curate` end to end on a tiny corpus.

* steps [bds, bridge] with compare: true: the composition is BDS's top rows with BRIDGE's masks, every arm is cut
  to the composition's response tokens, and the manifest's composition block carries each arm's paired CI
  (recomputed here from the predictions);
* steps [dedup, p2d, bridge] with compare: false: dedup drops the pool's near-duplicates, P2D keeps the top
  keep_fraction of the rest by its probing score, BRIDGE's masks on those rows, one SFT and its evaluation."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from raycurate.algorithms.composition import keep_count, ranked_ids
from raycurate.cli.main import main

# The tiny settings both cases share.
TINY = [
    "run.progress=false", "data.corpus_rows=120", "data.heldout_rows=8", "data.corpus_bad_lines=0",
    "data.split_ratios={warmup: 0.1, validation: 0.2, selection: 0.7}",
    "tokenize.num_actors=1", "bridge_pool.num_actors=1", "eval.pool.num_actors=1", "eval.max_new_tokens=8",
    "eval.samples=2", "eval.lm_eval_tasks=[]", "train.engine=ddp", "train.num_workers=1", "train.launcher=task",
    "train.micro_batch_size=4", "train.effective_batch_size=8", "train.max_steps=2", "bridge.micro_batch=16",
]

# [bds, bridge]: eight single-worker trainings (BRIDGE warmup, BDS, four arm SFTs, the mixed and clean references)
# in one reused Ray task each (train.launcher=task: no Ray Train start-up per stage) and seven evaluations (the arms,
# base, mixed, clean) on the committed 2-layer model. [dedup, p2d, bridge]: three (P2D proxy, BRIDGE warmup, the
# composition) and one evaluation.
pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(1200)]


def _rows(folder: Path, columns: list[str]) -> list[dict]:
    return [r for part in sorted(folder.glob("*.parquet")) for r in pq.read_table(part, columns=columns).to_pylist()]


def test_curate_bds_then_bridge_matches_token_budgets_and_records_paired_cis(tmp_path, ray_local):
    args = ["run", "jobs/curate_proving_ground.yaml", "pipeline=curate", f"run.runs_dir={tmp_path}",
            "run.name=curate", *TINY]
    started = time.time()
    assert main(args) == 0
    print(f"[timing] curate e2e: {time.time() - started:.1f} s")
    run_dir = tmp_path / "curate"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    stages = manifest["stages"]
    assert all(rec["status"] == "done" for rec in stages.values())
    models = ("curate", "curate_bds", "curate_bridge", "curate_random")
    assert {f"train_{m}" for m in models} | {f"eval_{m}" for m in models} | {
        "curate_bds", "bridge_score", "bridge_select", "curate_bridge_select", "curate_rows"} <= set(stages)
    # the references: base evaluated, mixed = SFT on the whole pool, clean = SFT on its clean rows
    assert {"eval_base", "train_mixed", "eval_mixed", "train_clean", "eval_clean"} <= set(stages)
    pool_labels = [r["label"]["clean"] for r in _rows(run_dir / "curate_pool_rows/tokens", ["label"])]
    clean_rows = stages["curate_clean_rows"]["metrics"]
    assert (clean_rows["rows_in"], clean_rows["rows_kept"]) == (len(pool_labels), sum(pool_labels))

    block = manifest["results"]["composition"]
    pool = sorted(r["id"] for r in _rows(run_dir / "curate_pool_rows/tokens", ["id"]))
    assert block["pool_rows"] == len(pool) and block["steps"] == ["bds", "bridge"]

    # the composition = the top keep_fraction of the pool by the final BDS weight, with BRIDGE's compacted masks
    weights = pq.read_table(run_dir / "curate_bds/weights.parquet").to_pylist()
    last = max(w["step"] for w in weights)
    sigma = {w["id"]: w["sigma"] for w in weights if w["step"] == last}
    expected = sorted(ranked_ids(pool, sigma, 0)[:keep_count(0.6, len(pool))])
    composed = {r["id"]: r for r in _rows(run_dir / "curate_rows/tokens", ["id", "loss_mask", "weight"])}
    assert sorted(composed) == expected and block["step_info"]["bds"]["kept_rows"] == len(expected)
    compact = {r["id"]: r["loss_mask"] for r in _rows(run_dir / "bridge_compact/tokens", ["id", "loss_mask"])}
    assert all(composed[i]["loss_mask"] == compact[i] for i in expected)
    assert all(r["weight"] == 1.0 for r in composed.values())  # bds_mode: select trains unweighted
    budget = sum(sum(r["loss_mask"]) for r in composed.values())
    assert block["budget_tokens"] == budget > 0

    # matched budgets: example-level arms are within half a row of T (closest prefix); BRIDGE alone within the
    # per-row rounding of its budgets, 0.5 token per pool row at most
    arms = block["arms"]
    assert set(arms) == {"composition", "bds", "bridge", "random"}
    full = {r["id"]: sum(r["loss_mask"]) for r in _rows(run_dir / "curate_pool_rows/tokens", ["id", "loss_mask"])}
    for arm in ("bds", "random"):
        ids = [r["id"] for r in _rows(run_dir / f"curate_{arm}_rows/tokens", ["id"])]
        assert arms[arm]["response_tokens"] == sum(full[i] for i in ids)
        assert abs(arms[arm]["response_tokens"] - budget) <= max(full.values()) / 2
    bds_ids = {r["id"] for r in _rows(run_dir / "curate_bds_rows/tokens", ["id"])}
    assert set(ranked_ids(pool, sigma, 0)[:len(bds_ids)]) == bds_ids  # BDS alone: its top-ranked rows
    assert arms["bridge"]["rows"] == len(pool) and 0 < arms["bridge"]["rho_r"] < 0.75
    assert abs(arms["bridge"]["response_tokens"] - budget) <= 0.5 * len(pool)

    # paired CIs of composition minus each arm, recomputed from the held-out predictions
    def scores(model: str) -> np.ndarray:
        table = pq.read_table(run_dir / f"eval_{model}/predictions.parquet").sort_by("id")
        return np.asarray(table["sampled_accuracy"].to_pylist(), dtype=float)

    assert block["metric"] == "sampled_accuracy" and block["questions"] == 8
    for arm, model in (("bds", "curate_bds"), ("bridge", "curate_bridge"), ("random", "curate_random")):
        ci = arms[arm]["vs_composition"]
        assert ci["value"] == pytest.approx(float(np.mean(scores("curate") - scores(model))))
        assert ci["low"] <= ci["value"] <= ci["high"] and ci["n"] == 8
    by_metric = block["by_metric"]
    assert list(by_metric) == ["correct", "sampled_accuracy"]
    for metric in by_metric.values():
        assert {"base", "mixed", "clean", "curate", "curate_bds", "curate_random"} <= set(metric["models"])
        assert metric["oracle"] is not None and "bds vs random" in metric["pairs"]
    report = (run_dir / "report.html").read_text()
    assert "<h2 id='composition'>Composition</h2>" in report and "Oracle gap in greedy exact match" in report
    assert "<h3>Absolute scores</h3>" in report and str(tmp_path) not in report


def test_curate_dedup_then_p2d_then_bridge_keeps_what_each_step_says(tmp_path, ray_local):
    args = ["run", "jobs/curate_proving_ground.yaml", "pipeline=curate", f"run.runs_dir={tmp_path}",
            "run.name=curate3", *TINY, "curate.steps=[dedup, p2d, bridge]", "curate.keep_fraction=0.5",
            "curate.compare=false", "p2d.proxy_examples=16", "p2d.proxy_steps=2", "p2d.rounds=1",
            "p2d_pool.num_actors=1"]
    started = time.time()
    assert main(args) == 0
    print(f"[timing] curate dedup+p2d+bridge e2e: {time.time() - started:.1f} s")
    run_dir = tmp_path / "curate3"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    stages = manifest["stages"]
    assert all(rec["status"] == "done" for rec in stages.values())
    assert {"curate_dedup", "p2d_heads", "p2d_probe", "p2d_select", "bridge_select", "bridge_compact", "curate_rows",
            "train_curate", "eval_curate"} <= set(stages)
    assert not {"curate_bds", "train_curate_random", "train_mixed"} & set(stages)  # no BDS, compare: false
    block = manifest["results"]["composition"]
    pool = sorted(r["id"] for r in _rows(run_dir / "curate_pool_rows/tokens", ["id"]))
    assert block["steps"] == ["dedup", "p2d", "bridge"] and block["pool_rows"] == len(pool)
    assert set(block["arms"]) == {"composition"}

    # dedup: each flagged pool row has an exact 3-gram Jaccard >= 0.9 with an earlier row; the rest go on
    duplicates = pq.read_table(run_dir / "curate_dedup/duplicates.parquet").to_pylist()
    assert sorted(r["id"] for r in duplicates) == pool
    flagged = {r["id"] for r in duplicates if r["duplicate"]}
    assert flagged and all(r["jaccard"] >= 0.9 and r["duplicate_of"] for r in duplicates if r["duplicate"])
    survivors = [i for i in pool if i not in flagged]
    info = block["step_info"]
    assert info["dedup"]["kept_rows"] == len(survivors) == len(pool) - stages["curate_dedup"]["metrics"]["flagged"]

    # p2d: the top keep_fraction of the survivors by s_final (ties in the seeded order), trained with BRIDGE's masks
    s_final = {r["id"]: r["s_final"] for r in pq.read_table(run_dir / "p2d_select/selection.parquet").to_pylist()}
    assert set(s_final) == set(pool)  # P2D scored the whole pool once
    expected = sorted(ranked_ids(survivors, s_final, 0)[:keep_count(0.5, len(survivors))])
    composed = {r["id"]: r["loss_mask"] for r in _rows(run_dir / "curate_rows/tokens", ["id", "loss_mask"])}
    assert sorted(composed) == expected and info["p2d"]["kept_rows"] == len(expected)
    assert not flagged & set(composed)
    compact = {r["id"]: r["loss_mask"] for r in _rows(run_dir / "bridge_compact/tokens", ["id", "loss_mask"])}
    assert all(composed[i] == compact[i] for i in expected)
    assert block["budget_tokens"] == sum(sum(m) for m in composed.values()) > 0
    assert manifest["results"]["heldout"]["curate"]["rows"] == 8
