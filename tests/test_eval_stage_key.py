"""The held-out evaluation's stage key: generation settings only, so lm-eval settings never re-run it."""

from __future__ import annotations

import dataclasses

from raycurate.config.schema import EvalConfig
from raycurate.stages.model_stages import heldout_eval_config


def test_lm_eval_settings_do_not_change_the_key_and_generation_settings_do():
    base = heldout_eval_config(EvalConfig(), 384)
    lm_eval_only = EvalConfig(lm_eval_limit=5, lm_eval_tasks=["x"], lm_eval_num_fewshot=3, lm_eval_domain="code")
    assert heldout_eval_config(lm_eval_only, 384) == base
    assert set(base["eval"]) == {"max_new_tokens", "batch_size", "samples", "temperature", "seed", "pool"}
    for change in ({"max_new_tokens": 9}, {"samples": 1}, {"temperature": 0.5}, {"seed": 1}):
        assert heldout_eval_config(dataclasses.replace(EvalConfig(), **change), 384) != base, change
    assert heldout_eval_config(EvalConfig(), 256) != base
