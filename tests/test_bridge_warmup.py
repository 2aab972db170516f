"""``bridge.warmup_epochs = 0``: no warmup SFT, theta_bar is the base model (it crashed in the warmup's export)."""

from __future__ import annotations

import dataclasses

import pytest

from raycurate.config.schema import JobConfig


@pytest.mark.parametrize("epochs, theta_bar, trained", [(1, "bridge_warmup", ["bridge_warmup"]), (0, "base_model", [])])
def test_warmup_epochs_zero_scores_at_the_base_model(monkeypatch, epochs, theta_bar, trained):
    import raycurate.stages.bridge as bridge_stages
    import raycurate.stages.bridge_compact as compact
    import raycurate.stages.model_stages as model_stages
    import raycurate.stages.rows as rows
    from raycurate.pipelines.bridge import run_bridge_core

    calls: dict[str, list] = {"train": [], "direction": [], "score": []}
    monkeypatch.setattr(rows, "filter_tokens_stage", lambda *a, **k: {"metrics": {"rows_kept": 8}})
    monkeypatch.setattr(model_stages, "train_stage", lambda run, stage, **k: calls["train"].append(stage))
    monkeypatch.setattr(bridge_stages, "direction_stage",
                        lambda run, **k: calls["direction"].append(k["warmup_stage"]))
    monkeypatch.setattr(bridge_stages, "score_stage", lambda run, **k: calls["score"].append(k["warmup_stage"]))
    monkeypatch.setattr(bridge_stages, "select_stage", lambda run, **k: {"metrics": {}})
    monkeypatch.setattr(compact, "compact_stage", lambda *a, **k: None)
    cfg = JobConfig()
    cfg = dataclasses.replace(cfg, bridge=dataclasses.replace(cfg.bridge, warmup_epochs=epochs))
    assert run_bridge_core(None, cfg) == "bridge_compact"  # type: ignore[arg-type]
    assert calls == {"train": trained, "direction": [theta_bar], "score": [theta_bar]}


def test_full_batch_warmup_takes_the_minibatch_step_count_on_the_whole_split():
    from raycurate.config.bridge import BridgeConfig
    from raycurate.config.train import TrainConfig
    from raycurate.pipelines.bridge import warmup_train_config

    train = TrainConfig(num_workers=1, micro_batch_size=8, effective_batch_size=32, lr=1e-3, seed=5)
    minibatch = warmup_train_config(train, BridgeConfig(warmup_epochs=2), warmup_rows=139)
    assert (minibatch.epochs, minibatch.max_steps, minibatch.effective_batch_size) == (2, None, 32)
    full = warmup_train_config(train, BridgeConfig(warmup_epochs=2, warmup_batch="full"), warmup_rows=139)
    # 139 // 32 = 4 minibatch steps per epoch -> 8 full-batch steps; 139 is prime, so 139 micro-batches of 1
    assert (full.max_steps, full.effective_batch_size, full.micro_batch_size, full.lr) == (8, 139, 1, 1e-3)
    assert full.warmup_ratio == 0.0 and full.seed == 5
