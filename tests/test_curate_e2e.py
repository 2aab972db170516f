"""`pipeline: curate` end to end with steps [bds, bridge] and compare: true on a tiny corpus: the composition is
BDS's top rows with BRIDGE's masks, every arm is cut to the composition's response tokens, and the manifest's
composition block carries each arm's paired CI (recomputed here from the predictions)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from raycurate.algorithms.composition import keep_count, ranked_ids
from raycurate.cli.main import main

# Eight single-worker trainings (BRIDGE warmup, BDS, four arm SFTs, the mixed and clean references) in one reused Ray
# task each (train.launcher=task: no Ray Train start-up per stage) and seven evaluations (the arms, base, mixed,
# clean) on the committed 2-layer model.
pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(1200)]


def _rows(folder: Path, columns: list[str]) -> list[dict]:
    return [r for part in sorted(folder.glob("*.parquet")) for r in pq.read_table(part, columns=columns).to_pylist()]


def test_curate_bds_then_bridge_matches_token_budgets_and_records_paired_cis(tmp_path, ray_local):
    args = [
        "run", "jobs/curate_proving_ground.yaml", "pipeline=curate", f"run.runs_dir={tmp_path}", "run.name=curate",
        "run.progress=false", "data.corpus_rows=120", "data.heldout_rows=8", "data.corpus_bad_lines=0",
        "data.split_ratios={warmup: 0.1, validation: 0.2, selection: 0.7}",
        "tokenize.num_actors=1", "bridge_pool.num_actors=1", "eval.pool.num_actors=1", "eval.max_new_tokens=8",
        "eval.samples=2", "eval.lm_eval_tasks=[]", "train.engine=ddp", "train.num_workers=1", "train.launcher=task",
        "train.micro_batch_size=4", "train.effective_batch_size=8", "train.max_steps=2", "bridge.micro_batch=16",
    ]
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
