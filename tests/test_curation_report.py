""""Did curation help?": paired comparisons from the held-out predictions of a run, and the seed summary."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raycurate.pipelines.proving_ground import seed_config, summarize_seeds
from raycurate.report.curation import curation_comparisons, heldout_scores, section_curation
from raycurate.report.html import render_report

N = 200


def _write_eval(root: Path, stages: dict, model: str, correct: np.ndarray, sampled: np.ndarray | None) -> None:
    folder = root / f"eval_{model}"
    folder.mkdir()
    rows = {"id": [f"q{i:03d}" for i in range(N)][::-1], "correct": correct[::-1].astype(bool).tolist()}
    if sampled is not None:
        rows["sampled_accuracy"] = sampled[::-1].tolist()  # stored in another order: joined on the id
    pq.write_table(pa.table(rows), folder / "predictions.parquet")
    stages[f"eval_{model}"] = {"status": "done", "outputs": {"predictions": f"eval_{model}/predictions.parquet"},
                               "seconds": 2.0}


@pytest.fixture
def run_dir(tmp_path) -> Path:
    ones = np.ones(N)
    mixed = np.r_[np.full(100, 0.5), np.zeros(100)]  # mean 0.25
    clean = np.r_[np.full(100, 0.5), np.full(100, 0.5)]  # mean 0.5: oracle gap +0.25
    bridge = np.r_[np.full(100, 0.5), np.full(50, 0.5), np.zeros(50)]  # mean 0.375: half the gap
    random = mixed.copy()
    stages: dict = {"train_bridge": {"status": "done", "seconds": 10.0},
                    "bridge_select": {"status": "done", "seconds": 5.0, "metrics": {
                        "distractor_dropped_share": 0.6, "relevant_dropped_share": 0.2,
                        "prompt_budget_ratio": 0.5, "response_budget_ratio": 0.75}}}
    for model, sampled in (("mixed", mixed), ("clean", clean), ("bridge", bridge), ("random", random)):
        _write_eval(tmp_path, stages, model, ones, sampled)
    manifest = {"run": "t", "pipeline": "demo", "stages": stages}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    return tmp_path


def test_comparisons_are_paired_on_question_ids_with_hand_computed_values(run_dir):
    manifest = json.loads((run_dir / "manifest.json").read_text())
    result = curation_comparisons(run_dir, manifest)
    assert result["metric"] == "sampled_accuracy" and result["questions"] == N
    assert result["models"]["mixed"]["value"] == pytest.approx(0.25)
    assert result["oracle"]["value"] == pytest.approx(0.25) and result["oracle"]["low"] > 0
    (bridge,) = result["methods"]
    assert bridge["model"] == "bridge" and bridge["baseline"] == "random"
    assert bridge["vs_baseline"]["value"] == pytest.approx(0.125) and bridge["vs_baseline"]["low"] > 0
    assert bridge["gap_closed"] == pytest.approx(0.5)
    assert bridge["seconds"] == pytest.approx(10.0 + 5.0 + 2.0)  # bridge_select + train_bridge + eval_bridge
    assert bridge["selection"]["value"] == 0.6 and bridge["selection"]["reference"] == 0.2


def test_greedy_exact_match_is_used_when_no_model_sampled(tmp_path):
    stages: dict = {}
    for model in ("mixed", "clean"):
        _write_eval(tmp_path, stages, model, np.arange(N) % 2, None)
    metric, _, scores = heldout_scores(tmp_path, {"stages": stages})
    assert metric == "correct" and scores["clean"].mean() == pytest.approx(0.5)


def test_no_mixed_model_means_no_section(tmp_path):
    assert curation_comparisons(tmp_path, {"stages": {}}) == {}
    assert section_curation(tmp_path, {"stages": {}}) == ""


def test_report_answers_the_question_before_timings(run_dir):
    html = render_report(run_dir)
    assert "Did curation help?" in html and "Oracle gap" in html
    assert html.index("Did curation help?") < html.index("Stage timings")


def test_seed_summary_pools_per_seed_differences(run_dir):
    manifest = json.loads((run_dir / "manifest.json").read_text())
    metric, label, scores = heldout_scores(run_dir, manifest)
    flat = {m: np.full(N, 0.3) for m in scores}  # a second seed on which nothing differs
    summary = summarize_seeds({0: (label, scores), 1: (label, flat)})
    oracle = summary["comparisons"]["oracle: clean vs mixed"]
    assert oracle["per_seed"]["0"]["value"] == pytest.approx(0.25) and oracle["per_seed"]["1"]["value"] == 0.0
    assert oracle["pooled"]["value"] == pytest.approx(0.125) and oracle["seeds_excluding_zero"] == 1
    assert set(summary["comparisons"]) == {"oracle: clean vs mixed", "bridge vs mixed", "bridge vs random"}


def test_seed_config_puts_each_seed_in_its_own_run_under_the_job():
    from raycurate.config.schema import JobConfig

    child = seed_config(JobConfig(pipeline="proving_ground"), 2)
    assert (child.pipeline, child.data.corpus_seed, child.run.runs_dir, child.run.name) == (
        "demo", 2, "runs/demo", "seed-2")


def test_p2d_selection_precision_carries_a_bootstrap_interval(tmp_path):
    from raycurate.report.curation import selection_quality

    manifest = {"stages": {"p2d_select": {"metrics": {"precision_selected": 0.9, "selected": 100, "pool": 1000,
                                                       "precision_pool": 0.7}}}}
    sel = selection_quality(manifest, "p2d")
    assert sel["value"] == 0.9 and sel["low"] < 0.9 < sel["high"] and sel["high"] - sel["low"] < 0.14
    manifest["stages"]["p2d_select"]["metrics"].update(auroc=0.612, auroc_ci95=[0.571, 0.655])
    assert selection_quality(manifest, "p2d")["budget"] == (
        "100 of 1000 rows; AUROC of P2D's row score, clean vs corrupted, 0.61 [0.57, 0.66]")


def test_proving_ground_runs_the_demo_per_seed_and_writes_the_pooled_summary(tmp_path, monkeypatch):
    from raycurate.config.schema import JobConfig, ProvingGroundConfig, RunConfig
    from raycurate.pipelines import demo, proving_ground, run_pipeline

    seen = []

    def fake_demo(cfg):  # writes what a demo run leaves for the comparisons: eval predictions + manifest
        seen.append((cfg.pipeline, cfg.data.corpus_seed, cfg.run.name))
        root = Path(cfg.run.runs_dir) / cfg.run.name
        root.mkdir(parents=True)
        stages: dict = {}
        gain = 0.5 if cfg.data.corpus_seed == 0 else 0.0
        _write_eval(root, stages, "mixed", np.zeros(N), np.full(N, 0.25))
        _write_eval(root, stages, "clean", np.zeros(N), np.full(N, 0.25 + gain))
        return {"stages": stages}

    monkeypatch.setattr(demo, "run_demo", fake_demo)
    cfg = JobConfig(pipeline="proving_ground", run=RunConfig(name="pg", runs_dir=str(tmp_path)),
                    proving_ground=ProvingGroundConfig(seeds=[0, 5]))
    summary = proving_ground.run_proving_ground(cfg, run_pipeline)
    assert seen == [("demo", 0, "seed-0"), ("demo", 5, "seed-5")]
    oracle = summary["comparisons"]["oracle: clean vs mixed"]
    assert oracle["pooled"]["value"] == pytest.approx(0.25) and oracle["seeds_excluding_zero"] == 1
    assert json.loads((tmp_path / "pg" / "proving_ground.json").read_text()) == summary
    assert "seed 5" in (tmp_path / "pg" / "report.html").read_text()


def test_bds_weights_show_auroc_with_interval_per_kind_and_the_sampling_order_check(tmp_path):
    from raycurate.report.curation import selection_quality
    from raycurate.report.sections import section_bilevel

    bds = {"auroc": 0.8, "auroc_ci95": [0.78, 0.82], "weights_by_label": {"clean": [1.0], "corrupted": [0.5]},
           "auroc_by_kind": {"truncated": {"auroc": 0.95, "rows": 40, "ci95": [0.9, 0.98]}},
           "spearman_first_step": 0.02}
    manifest = {"bilevel": {"methods": {"bds": bds}}}
    sel = selection_quality(manifest, "bilevel_bds")
    assert (sel["value"], sel["low"], sel["high"]) == (0.8, 0.78, 0.82)
    html = section_bilevel(tmp_path, manifest)
    assert "0.800 [0.780, 0.820]" in html and "truncated" in html and "+0.020" in html


def test_token_baselines_sit_beside_bridge_against_random_tokens(run_dir):
    # Hand-made per-question sampled scores: random tokens 0.25 (the fixture's), RHO-1 0.125, Token Cleaning 0.5.
    manifest = json.loads((run_dir / "manifest.json").read_text())
    stages = manifest["stages"]
    ones = np.ones(N)
    rho1 = np.r_[np.full(25, 1.0), np.zeros(175)]  # mean 0.125: 25 x (+0.5) and 75 x (-0.5) against random
    tc = np.full(N, 0.5)
    _write_eval(run_dir, stages, "rho1", ones, rho1)
    _write_eval(run_dir, stages, "token_cleaning", ones, tc)
    stages["train_rho1"] = {"status": "done", "seconds": 3.0}
    stages["baseline_rho1_masks"] = {"status": "done", "seconds": 4.0}
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    result = curation_comparisons(run_dir, manifest)
    by_model = {m["model"]: m for m in result["methods"]}
    assert list(by_model) == ["bridge", "rho1", "token_cleaning"]  # independent / sequential did not run
    assert by_model["rho1"]["baseline"] == "random"
    assert by_model["rho1"]["vs_baseline"]["value"] == pytest.approx(0.125 - 0.25)
    assert by_model["rho1"]["vs_baseline"]["high"] < 0
    assert by_model["token_cleaning"]["vs_baseline"]["value"] == pytest.approx(0.25) and \
        by_model["token_cleaning"]["vs_baseline"]["low"] > 0
    assert by_model["rho1"]["seconds"] == pytest.approx(3.0 + 4.0)
    html = section_curation(run_dir, manifest)
    assert "RHO-1 (excess loss, per example)" in html and "Token Cleaning (excess loss, corpus-wide)" in html
    # The proving ground pools each against random tokens and BRIDGE minus each, seed by seed.
    _, label, scores = heldout_scores(run_dir, manifest)
    summary = summarize_seeds({0: (label, scores), 1: (label, scores)})
    pooled = summary["comparisons"]["bridge vs rho1"]["pooled"]
    assert pooled["value"] == pytest.approx(0.375 - 0.125) and pooled["low"] > 0
    assert summary["comparisons"]["token_cleaning vs random"]["pooled"]["value"] == pytest.approx(0.25)
    assert "bridge vs independent" not in summary["comparisons"]  # not evaluated: no pair


def test_train_seeds_repeat_each_corpus_seed_and_add_a_t_interval_over_runs(tmp_path, monkeypatch):
    from raycurate.config.schema import JobConfig, ProvingGroundConfig, RunConfig
    from raycurate.pipelines import demo, proving_ground, run_pipeline

    seen = []

    def fake_demo(cfg):
        seen.append((cfg.data.corpus_seed, cfg.train.seed, cfg.run.name))
        root = Path(cfg.run.runs_dir) / cfg.run.name
        root.mkdir(parents=True)
        stages: dict = {}
        gain = {0: 0.5, 1: 0.0}[cfg.train.seed]  # the clean arm's gain depends on the training seed alone
        _write_eval(root, stages, "mixed", np.zeros(N), np.full(N, 0.25))
        _write_eval(root, stages, "clean", np.zeros(N), np.full(N, 0.25 + gain))
        return {"stages": stages}

    monkeypatch.setattr(demo, "run_demo", fake_demo)
    cfg = JobConfig(pipeline="proving_ground", run=RunConfig(name="pg", runs_dir=str(tmp_path)),
                    proving_ground=ProvingGroundConfig(seeds=[0, 5], train_seeds=[0, 1]))
    summary = proving_ground.run_proving_ground(cfg, run_pipeline)
    assert seen == [(0, 0, "seed-0"), (0, 1, "seed-0-train-1"), (5, 0, "seed-5"), (5, 1, "seed-5-train-1")]
    assert summary["seeds"] == [0, "0-train-1", 5, "5-train-1"]
    oracle = summary["comparisons"]["oracle: clean vs mixed"]
    assert oracle["pooled"]["value"] == pytest.approx(0.25)
    # per-run differences 0.5, 0, 0.5, 0: mean 0.25, sd 0.2887, t(0.975, 3 df) 3.1824 -> half-width 0.4594
    assert oracle["over_runs"]["value"] == pytest.approx(0.25)
    assert oracle["over_runs"]["high"] - 0.25 == pytest.approx(3.1824 * 0.28868 / 2, rel=1e-3)
    html = (tmp_path / "pg" / "report.html").read_text()
    assert "over runs (t, 95%)" in html and "seed 5-train-1" in html


def test_fewer_than_three_runs_have_no_t_interval():
    flat = {"mixed": np.zeros(4), "clean": np.ones(4)}
    summary = summarize_seeds({0: ("sampled", flat), 1: ("sampled", flat)})
    assert summary["comparisons"]["oracle: clean vs mixed"]["over_runs"] is None


def test_console_summary_leads_with_the_gains_that_hold_and_marks_the_rest():
    from raycurate.report.curation import console_summary

    def est(value, low, high):
        return {"value": value, "low": low, "high": high, "n": 400}

    manifest = {"results": {"curation": {"metric_label": "sampled exact match", "questions": 400, "methods": [
        {"label": "BRIDGE", "baseline": "random", "vs_mixed": est(0.01, -0.02, 0.04),
         "vs_baseline": est(-0.1, -0.2, -0.05)},
        {"label": "Curation", "baseline": "curate_random", "vs_mixed": est(0.178, 0.144, 0.214),
         "vs_baseline": est(0.146, 0.109, 0.185)},
    ]}}}
    lines = console_summary(manifest)
    assert lines[0].startswith("Did curation help? sampled exact match on 400 held-out questions")
    assert lines[1] == "  Curation: +17.8 [+14.4, +21.4]; vs random rows +14.6 [+10.9, +18.5]"
    assert lines[2] == "  BRIDGE: +1.0 [-2.0, +4.0] (within noise); vs random -10.0 [-20.0, -5.0] (worse)"
    assert console_summary({"results": {}}) == []
