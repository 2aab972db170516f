"""Bilevel stage helpers: direct-mixing weights, method names, masked questions of the generation hook."""

from __future__ import annotations

import numpy as np
import pytest

from raycurate.config.bilevel import BilevelConfig
from raycurate.config.train import TrainConfig
from raycurate.pipelines.bilevel import check_methods
from raycurate.stages.bilevel import PoolGenerationHook, bds_settings, mixing_weights


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


def test_bds_settings_split_the_effective_batch():
    settings = bds_settings(BilevelConfig(), TrainConfig(effective_batch_size=32), online=False)
    assert (settings.val_batch, settings.cand_batch, settings.generation_every) == (16, 16, None)
    online = bds_settings(BilevelConfig(val_batch=8, generation_every=7), TrainConfig(effective_batch_size=32), True)
    assert (online.val_batch, online.cand_batch, online.generation_every) == (8, 24, 7)


def _hook(mask: str) -> PoolGenerationHook:
    return PoolGenerationHook("c", "m", None, "/tmp", ratio=0.2, mask=mask, samples=1, temperature=0.8,
                              max_new_tokens=8, seed=3)


def test_generation_hook_masks_fixed_or_bottom_sigma():
    omega = np.array([0.5, -2.0, 0.1, 3.0, -1.0, 0.0, 1.0, 2.0, -0.5, 0.2])
    assert sorted(_hook("dynamic").masked(omega).tolist()) == [1, 4]  # the two lowest weights
    fixed = _hook("fixed").masked(omega)
    assert len(fixed) == 2 and fixed.tolist() == _hook("fixed").masked(-omega).tolist()  # independent of omega
