"""The held-out evaluation's stage key: generation settings only, so lm-eval settings never re-run it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from raycurate.config.schema import EvalConfig
from raycurate.errors import UserError
from raycurate.rundir import RunDir
from raycurate.stages.data_stages import corpus_stage
from raycurate.stages.model_stages import heldout_eval_config, question_file


def test_lm_eval_settings_do_not_change_the_key_and_generation_settings_do():
    base = heldout_eval_config(EvalConfig(), 384)
    lm_eval_only = EvalConfig(lm_eval_limit=5, lm_eval_tasks=["x"], lm_eval_num_fewshot=3, lm_eval_domain="code")
    assert heldout_eval_config(lm_eval_only, 384) == base
    assert set(base["eval"]) == {"max_new_tokens", "batch_size", "samples", "temperature", "seed", "pool"}
    for change in ({"max_new_tokens": 9}, {"samples": 1}, {"temperature": 0.5}, {"seed": 1}):
        assert heldout_eval_config(dataclasses.replace(EvalConfig(), **change), 384) != base, change
    assert heldout_eval_config(EvalConfig(), 256) != base


def test_the_validation_split_changes_the_key_and_the_default_split_leaves_old_keys_alone():
    base = heldout_eval_config(EvalConfig(), 384)
    assert "split" not in base["eval"]  # runs from before eval.split keep their stage hashes
    validation = heldout_eval_config(EvalConfig(split="validation"), 384)
    assert validation["eval"]["split"] == "validation" and validation != base


def test_question_file_reads_the_split_and_says_how_to_get_validation_questions(tmp_path):
    run = RunDir(tmp_path / "plain")
    corpus_stage(run, rows=20, seed=0, corrupt_fraction=0.3, heldout_rows=5)
    assert question_file(run, "corpus", "heldout").name == "heldout.jsonl"
    with pytest.raises(UserError, match="data.validation_questions"):
        question_file(run, "corpus", "validation")
    plain_hash = run.stage_record("corpus")["config_hash"]

    run = RunDir(tmp_path / "with_validation")
    record = corpus_stage(run, rows=20, seed=0, corrupt_fraction=0.3, heldout_rows=5, validation_questions=7)
    assert record["config_hash"] != plain_hash
    rows = [json.loads(line) for line in question_file(run, "corpus", "validation").read_text().splitlines()]
    heldout = [json.loads(line) for line in question_file(run, "corpus", "heldout").read_text().splitlines()]
    assert len(rows) == 7 and not {r["prompt"] for r in rows} & {r["prompt"] for r in heldout}
