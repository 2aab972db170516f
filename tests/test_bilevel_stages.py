"""Bilevel stage helpers: direct-mixing weights, method names, the BDS stage hash, masked questions of the generation
hook, and the notes on the train settings the bilevel methods replace or ignore."""

from __future__ import annotations

import numpy as np
import pytest

from raycurate.algorithms.ranking import auroc
from raycurate.config.bilevel import BilevelConfig
from raycurate.config.loader import config_hash
from raycurate.config.train import TrainConfig
from raycurate.pipelines.bilevel import check_methods
from raycurate.stages.bilevel import PoolGenerationHook, bds_hash_config, mixing_weights


def test_mixing_weights_realise_equation_3():
    # 30 candidates, 10 validation rows, rho = 0.5: mean over the union of w_i l_i must equal
    # 0.5 * mean(candidate losses) + 0.5 * mean(validation losses)
    w_c, w_v = mixing_weights(30, 10, 0.5)
    assert (w_c, w_v) == pytest.approx((0.5 * 40 / 30, 0.5 * 40 / 10))
    rng = np.random.default_rng(0)
    cand, val = rng.random(30), rng.random(10)
    union = np.concatenate([w_c * cand, w_v * val]).mean()
    assert union == pytest.approx(0.5 * cand.mean() + 0.5 * val.mean())
    assert mixing_weights(30, 10, 1.0) == pytest.approx((40 / 30, 0.0))
    with pytest.raises(ValueError, match="rho"):
        mixing_weights(30, 10, 0.0)


def test_method_names_are_checked_early():
    check_methods(["bds", "online", "mix_0.5", "mix_1", "random", "dsir", "less"])
    for bad in (["mix_2"], ["mix_x"], ["bdss"]):
        with pytest.raises(ValueError, match="unknown entry"):
            check_methods(bad)


def test_bds_hash_config_keeps_the_keys_and_values_runs_were_hashed_with():
    # The BDS stage hashes these (the fields of the former BDSSettings): a change re-trains finished runs and
    # restarts checkpointed ones from step 0.
    offline = bds_hash_config(BilevelConfig(), TrainConfig(effective_batch_size=32), online=False)
    assert offline == {"omega_lr": 100.0, "omega_optimizer": "sparse_sgd", "omega_baseline": "median",
                       "omega_betas": (0.9, 0.999), "omega_eps": 1e-8, "rho0": 0.1, "rho_step": 0.1, "rho_max": 0.9,
                       "val_batch": 16, "cand_batch": 16, "variant": "exact", "seed": 0, "generation_every": None,
                       "importance": "clip", "importance_clip": 2.0}
    assert config_hash({"bds": offline}) == "cba6dbbfbd197ba1"  # computed from BDSSettings before the change
    online = bds_hash_config(BilevelConfig(val_batch=8, generation_every=7), TrainConfig(effective_batch_size=32), True)
    assert (online["val_batch"], online["cand_batch"], online["generation_every"]) == (8, 24, 7)


def _hook(mask: str) -> PoolGenerationHook:
    return PoolGenerationHook("c", "m", None, "/tmp", ratio=0.2, mask=mask, samples=1, temperature=0.8,
                              max_new_tokens=8, seed=3)


def test_generation_hook_masks_fixed_or_bottom_sigma():
    omega = np.array([0.5, -2.0, 0.1, 3.0, -1.0, 0.0, 1.0, 2.0, -0.5, 0.2])
    assert sorted(_hook("dynamic").masked(omega).tolist()) == [1, 4]  # the two lowest weights
    fixed = _hook("fixed").masked(omega)
    assert len(fixed) == 2 and fixed.tolist() == _hook("fixed").masked(-omega).tolist()  # independent of omega


def test_bds_hash_config_carries_the_signal_preserving_omega_optimizer():
    settings = bds_hash_config(BilevelConfig(), TrainConfig(effective_batch_size=32), online=False)
    assert (settings["omega_optimizer"], settings["omega_lr"], settings["omega_baseline"]) == ("sparse_sgd", 100.0,
                                                                                               "median")
    paper = bds_hash_config(BilevelConfig(omega_optimizer="adam", omega_lr=1e-4), TrainConfig(), online=False)
    assert (paper["omega_optimizer"], paper["omega_lr"]) == ("adam", 1e-4)


def test_auroc_by_kind_and_bootstrap_interval_by_hand():
    from raycurate.algorithms.ranking import auroc_by_kind, bootstrap_auroc_ci

    # clean 3, 4; truncated 1 (below both: AUROC 1); near_duplicate 3.5 (between: AUROC 1/2).
    scores = np.array([3.0, 4.0, 1.0, 3.5])
    kinds = np.array(["none", "none", "truncated", "near_duplicate"])
    assert auroc_by_kind(scores, kinds) == {"near_duplicate": 0.5, "truncated": 1.0}
    assert auroc_by_kind(scores, np.array(["a"] * 4)) == {}
    rng = np.random.default_rng(0)
    clean = rng.random(400) < 0.7
    noisy = clean + rng.normal(size=400)
    low, high = bootstrap_auroc_ci(noisy, clean, np.random.default_rng(1), resamples=300)
    assert low < auroc(noisy, clean) < high and high - low < 0.15
    assert (low, high) == bootstrap_auroc_ci(noisy, clean, np.random.default_rng(1), resamples=300)  # seeded
    perfect = bootstrap_auroc_ci(clean.astype(float), clean, np.random.default_rng(1), resamples=50)
    assert perfect == (1.0, 1.0)


def test_label_separation_reports_each_kind_and_the_score_without_near_duplicates():
    from raycurate.algorithms.ranking import label_separation

    # 6 clean rows score 1..6; truncated rows score 0 (always below), near-duplicates 3.5 (mid-way).
    scores = np.array([1, 2, 3, 4, 5, 6, 0, 0, 3.5, 3.5], dtype=float)
    clean = np.array([True] * 6 + [False] * 4)
    kinds = np.array(["none"] * 6 + ["truncated"] * 2 + ["near_duplicate"] * 2)
    out = label_separation(scores, clean, kinds, seed=0, resamples=50)
    assert out["auroc_by_kind"]["truncated"]["auroc"] == 1.0 and out["auroc_by_kind"]["truncated"]["rows"] == 2
    assert out["auroc_by_kind"]["near_duplicate"]["auroc"] == 0.5
    assert out["auroc"] == pytest.approx(0.75) and out["auroc_excluding_near_duplicate"] == 1.0
    low, high = out["auroc_ci95"]
    assert low <= 0.75 <= high


def test_the_configs_omega_choices_are_the_ones_the_algorithm_implements():
    from raycurate.algorithms import bilevel as algorithm
    from raycurate.config import bilevel as config

    assert set(config.OMEGA_OPTIMIZERS) == set(algorithm.OMEGA_OPTIMIZERS)
    assert set(config.OMEGA_BASELINES) == set(algorithm.OMEGA_BASELINES)


def _overrides(*overrides: str) -> list[str]:
    from raycurate.config.job import build_job_config
    from raycurate.pipelines.bilevel import bilevel_overrides

    return bilevel_overrides(build_job_config(None, overrides=["pipeline=bilevel", *overrides]))


def test_the_train_settings_bilevel_replaces_or_ignores_are_logged(caplog):
    import logging

    from raycurate.config.job import build_job_config
    from raycurate.pipelines.bilevel import bilevel_train_config

    lr_epochs = ("train.lr=2e-05 -> bilevel.lr=5e-06, train.epochs=1 -> bilevel.epochs=3 (bilevel.* replaces train.* "
                 "for every bilevel method)")
    normalization = "train.loss_normalization=token does not apply to BDS"
    notes = _overrides()
    assert notes[0] == lr_epochs and notes[1].startswith(normalization) and len(notes) == 2
    with caplog.at_level(logging.INFO, logger="raycurate"):
        train = bilevel_train_config(build_job_config(None, overrides=["pipeline=bilevel"]))
    assert (train.lr, train.epochs, train.loss_normalization) == (5e-6, 3, "token")
    assert f"bilevel: {lr_epochs}" in caplog.text and f"bilevel: {normalization}" in caplog.text
    # no BDS training, or nothing replaced: no note
    assert _overrides("bilevel.methods=[random, dsir]") == [lr_epochs]
    assert _overrides("train.lr=5e-6", "train.epochs=3", "train.loss_normalization=example") == []


def test_a_train_lora_adapter_note_says_which_adapter_each_bilevel_method_trains():
    assert _overrides("train.adapter=lora")[-1] == ("train.adapter=lora (train.lora_*) -> bilevel.adapter=lora with "
                                                    "bilevel.lora_r=16, bilevel.lora_alpha=16 for every bilevel method")
    assert _overrides("train.adapter=lora", "bilevel.adapter=full")[-1] == (
        "train.adapter=lora does not apply to BDS, which trains the full model (bilevel.adapter=full); the other "
        "bilevel methods train train's LoRA")
    assert not any("adapter" in note for note in _overrides("bilevel.adapter=full"))
