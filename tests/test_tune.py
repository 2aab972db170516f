"""`raycurate tune`: a 3-trial grid on the tiny model shares the cache, writes the table and the best config."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import yaml

from raycurate.cli.main import main
from raycurate.pipelines.sweep import best_trial, manifest_value

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_manifest_value_and_best_trial():
    manifest = {"results": {"heldout": {"p2d": {"gold_loss": 1.5, "rows": 6}}}, "flag": True}
    assert manifest_value(manifest, "results.heldout.p2d.gold_loss") == 1.5
    assert manifest_value(manifest, "results.heldout.bridge.gold_loss") is None
    assert manifest_value(manifest, "flag") is None
    rows = [{"trial": 0, "metric": 2.0, "status": "done"}, {"trial": 1, "metric": 1.0, "status": "done"},
            {"trial": 2, "metric": 1.0, "status": "done"}, {"trial": 3, "metric": None, "status": "error"}]
    assert best_trial(rows, "min")["trial"] == 1
    assert best_trial(rows, "max")["trial"] == 0
    assert best_trial(rows[3:], "min") is None


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(1800)
def test_two_trial_sweep_scores_once_and_writes_table_and_best_config(tmp_path, ray_local, capsys):
    sweep = tmp_path / "tune" / "ratio.yaml"
    sweep.parent.mkdir()
    overrides = [
        f"run.runs_dir={tmp_path}", "data.corpus_rows=80", "data.heldout_rows=4", "data.corpus_bad_lines=0",
        "model.pretrain_steps=10", "model.pretrain_rows=300", f"model.cache_dir={tmp_path / 'cache'}",
        "eval.max_new_tokens=4", "train.micro_batch_size=2", "train.effective_batch_size=4",
        "train.num_workers=1", "train.launcher=task",
        "p2d.proxy_examples=8", "p2d.proxy_steps=2", "p2d.epochs=1", "p2d.rounds=1", "p2d.baselines=[]",
        "data.validation_questions=4", "eval.split=validation",
    ]
    sweep.write_text(yaml.safe_dump({
        "name": "ratio", "job": str(ROOT / "jobs/p2d_demo.yaml"), "overrides": overrides,
        "metric": "results.validation.p2d.gold_loss", "mode": "min", "search": "grid",
        "params": {"p2d.data_ratio": {"grid": [0.1, 0.3]}},
    }))
    assert main(["tune", str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "trials: 2 (2 finished)" in out

    run_dir = tmp_path / "ratio"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    stages = manifest["stages"]
    assert stages["p2d_probe"]["executions"] == 1  # scoring ran once for the whole sweep
    assert stages["p2d_heads"]["executions"] == 1
    assert stages["p2d_select"]["executions"] == 2  # selection re-ran per trial
    table = pq.read_table(run_dir / "tune/results.parquet").to_pylist()
    assert sorted(r["param.p2d.data_ratio"] for r in table) == [0.1, 0.3]
    assert all(r["status"] == "done" and r["metric"] > 0 for r in table)
    assert (run_dir / "tune/results.csv").exists()
    best = yaml.safe_load((run_dir / "tune/best.yaml").read_text())
    best_row = min(table, key=lambda r: (r["metric"], r["trial"]))
    assert best["p2d"]["data_ratio"] == best_row["param.p2d.data_ratio"]
    assert manifest["tune"]["best"]["metric"] == pytest.approx(best_row["metric"])


def test_bridge_budget_sweep_trials_share_one_scoring_pass():
    """Every trial of tune/bridge_budgets.yaml hashes bridge_score (and everything upstream of it) the same, so the
    trials, sharing one run directory, run the model once and re-run only bridge_select."""
    import dataclasses
    import itertools

    from raycurate.config.loader import config_hash
    from raycurate.config.sweep import job_path, load_sweep
    from raycurate.pipelines.sweep import job_config, trial_overrides
    from raycurate.stages.bridge import score_config, selection_settings

    path = ROOT / "tune/bridge_budgets.yaml"
    sweep = load_sweep(path)
    keys = sorted(sweep.params)
    trials = [dict(zip(keys, values)) for values in itertools.product(*(sweep.params[k]["grid"] for k in keys))]
    assert len(trials) == 6
    scoring, selecting = set(), set()
    for params in trials:
        cfg = job_config(job_path(sweep, path).resolve(), trial_overrides(sweep, params, None, "runs"))
        bridge = cfg.bridge
        upstream = (dataclasses.replace(cfg.train, epochs=bridge.warmup_epochs, max_steps=None), cfg.data, cfg.model,
                    {k: getattr(bridge, k) for k in ("last_layers", "lam", "validation_rows")}, score_config(bridge))
        scoring.add(config_hash(upstream, []))
        selecting.add(config_hash(dataclasses.asdict(selection_settings(bridge)), []))
    assert len(scoring) == 1 and len(selecting) == 6
