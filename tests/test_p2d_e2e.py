"""`pipeline: p2d` end to end on a small corpus: heads.json, ICL probes, selection with reasons, variants, AER."""

from __future__ import annotations

import json
import math

import pyarrow.parquet as pq
import pytest

from raycurate.cli.main import main

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(1800)]


def test_p2d_pipeline_end_to_end(tmp_path, ray_local, monkeypatch):
    run_dir = tmp_path / "p2d"
    args = [
        "run", "jobs/p2d_demo.yaml", f"run.runs_dir={tmp_path}", "run.name=p2d", "data.corpus_rows=120",
        "data.heldout_rows=6", "data.corpus_bad_lines=0", "model.pretrain_steps=10", "model.pretrain_rows=300",
        f"model.cache_dir={tmp_path / 'cache'}", "eval.max_new_tokens=8", "run.progress=false",
        "train.micro_batch_size=2", "train.effective_batch_size=4", "train.max_steps=2",
        "train.num_workers=1", "train.launcher=task", "p2d.proxy_examples=16",
        "p2d.proxy_steps=2", "p2d.epochs=1", "p2d.rounds=2", "p2d.baselines=[random_heads,lora,full_data]",
    ]
    assert main(args) == 0
    manifest = json.loads((run_dir / "manifest.json").read_text())
    stages = manifest["stages"]
    assert all(rec["status"] == "done" for rec in stages.values())

    heads = json.loads((run_dir / "p2d_heads/heads.json").read_text())
    n = heads["n_layers"] * heads["n_heads"]
    assert len(heads["heads"]) == n and sum(h["selected"] for h in heads["heads"]) == math.ceil(0.1 * n)

    accepted = manifest["rows"]["accepted"]
    selection = pq.read_table(run_dir / "p2d_select/selection.parquet").to_pylist()
    assert len(selection) == accepted and all(r["reason"] for r in selection)
    assert sum(r["selected"] for r in selection) == stages["p2d_rows"]["metrics"]["rows_kept"]
    probes = pq.read_table(run_dir / "p2d_probe/probes").to_pylist()
    appearances = {}
    for p in probes:
        assert not set(p["demos"]) & set(p["queries"])
        assert sum(p["demo_weights"]) == pytest.approx(1.0)
        for d in p["demos"]:
            appearances[d] = appearances.get(d, 0) + 1
    assert len(appearances) == accepted and set(appearances.values()) == {2}

    assert stages["train_p2d"]["metrics"]["adapter"] == "head_delta"
    assert stages["train_p2d_lora"]["metrics"]["adapter"] == "lora"
    assert (stages["train_p2d"]["metrics"]["trainable_parameters"]
            < stages["train_p2d_lora"]["metrics"]["trainable_parameters"])
    assert set(manifest["results"]["heldout"]) == {"p2d", "p2d_random_heads", "p2d_lora", "p2d_full_data"}
    aer = manifest["p2d"]["aer"]
    assert aer["full_sft_stage"] == "train_p2d_full_data" and aer["aer"] > 0
    _probes_of_a_ray_data_pool_equal_the_warm_tasks(run_dir, manifest, monkeypatch)


def _probes_of_a_ray_data_pool_equal_the_warm_tasks(run_dir, manifest, monkeypatch) -> None:
    """The demo-sized model probes on warm in-memory tasks, a real model on a Ray Data actor pool: one table."""
    import numpy as np

    import raycurate.models.loading as loading
    from raycurate.config.loader import load_config
    from raycurate.config.pool import ActorPoolConfig
    from raycurate.config.schema import JobConfig
    from raycurate.rundir import RunDir
    from raycurate.stages.p2d import probe_stage

    warm = pq.read_table(run_dir / "p2d_probe/probes")
    upstream = manifest["stages"]["p2d_probe"]["upstream"]
    cfg = load_config(JobConfig, str(run_dir / "config.yaml"), [])
    monkeypatch.setattr(loading, "is_small_checkpoint", lambda *_args, **_kwargs: False)
    probe_stage(RunDir(run_dir), "p2d_probe_ray_data", pool_stage=upstream[0], base_stage="base_model",
                heads_stage_name="p2d_heads", p2d_cfg=cfg.p2d, pool_cfg=ActorPoolConfig(num_actors=1),
                max_new_tokens=cfg.eval.max_new_tokens, query_stage=(upstream[3:] or [None])[0])
    pooled = pq.read_table(run_dir / "p2d_probe_ray_data/probes")
    assert pooled.schema == warm.schema
    for name in warm.column_names:
        got, want = pooled.column(name).to_pylist(), warm.column(name).to_pylist()
        if name in ("score", "query_scores", "demo_weights"):
            assert np.allclose(np.hstack(got), np.hstack(want), atol=1e-5), name
        else:
            assert got == want, name
