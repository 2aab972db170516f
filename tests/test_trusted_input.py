"""The trusted set as a user file (data.trusted_input): ingested on its own, overlaps rejected with a reason, bad
files refused in one line before anything runs."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from raycurate.config.data import DataConfig
from raycurate.config.schema import JobConfig
from raycurate.data.ingest import ingest
from raycurate.data.schema import OVERLAPS_EVALUATION, OVERLAPS_TRUSTED, Exclusions
from raycurate.errors import InputError, UserError
from raycurate.rundir import RunDir

TRUSTED = [{"id": "t1", "prompt": "What is 2 + 2?", "response": "2 + 2 = 4.\n#### 4"},
           {"id": "t2", "prompt": "Name a colour.", "response": "Blue."}]
POOL = [{"id": "p1", "prompt": "what is  2 + 2?", "response": "#### 5"},  # t1's prompt, other case and spacing
        {"id": "t2", "prompt": "Name a fruit.", "response": "Apple."},  # t2's id
        {"id": "p3", "prompt": "Name a tree.", "response": "Oak."}]


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _rejected(out) -> list[dict]:
    return [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]


def test_pool_rows_repeating_a_trusted_prompt_or_id_are_rejected_with_the_reason(tmp_path):
    exclude = [Exclusions(OVERLAPS_TRUSTED, "trusted row", [(r["id"], r["prompt"]) for r in TRUSTED])]
    result = ingest([_jsonl(tmp_path / "pool.jsonl", POOL)], str(tmp_path / "out"), strict=False, split_seed=0,
                    split_ratios={"selection": 1.0}, progress=False, exclude=exclude)
    assert result.rows == {"input": 3, "accepted": 1, "rejected": 2}
    assert result.rejected_by_reason == {OVERLAPS_TRUSTED: 2}
    rejected = _rejected(tmp_path / "out")
    assert [(r["line"], r["field"]) for r in rejected] == [(1, "prompt"), (2, "id")]
    assert "trusted row 't1'" in rejected[0]["detail"]
    kept = pq.read_table(tmp_path / "out" / "accepted-00000.parquet").to_pylist()
    assert [r["id"] for r in kept] == ["p3"]


def _run_with(tmp_path, trusted_rows: list[dict] | None, questions: list[dict]):
    from raycurate.stages.data_stages import trusted_stage

    run = RunDir(tmp_path / "run")
    trusted = _jsonl(tmp_path / "trusted.jsonl", trusted_rows or [])
    heldout = _jsonl(tmp_path / "heldout.jsonl", questions)
    return run, trusted_stage(run, [trusted], DataConfig(), evaluation_files=[heldout], upstream=[],
                              progress=False)


def test_trusted_rows_equal_to_an_evaluation_question_are_rejected(tmp_path):
    run, record = _run_with(tmp_path, TRUSTED, [{"id": "h1", "prompt": "Name a colour.", "response": "Red."}])
    assert record["metrics"]["rows"] == {"input": 2, "accepted": 1, "rejected": 1}
    assert record["metrics"]["rejected_by_reason"] == {OVERLAPS_EVALUATION: 1}
    assert "evaluation question 'h1'" in _rejected(run.root / "trusted")[0]["detail"]


def test_a_trusted_file_with_no_usable_row_is_one_clear_error(tmp_path):
    with pytest.raises(InputError, match=r"data.trusted_input: none of its 1 rows is usable \(rejected: "
                                         r"overlaps_evaluation 1\)"):
        _run_with(tmp_path, TRUSTED[:1], [{"id": "h1", "prompt": "What is 2 + 2?", "response": "4"}])


@pytest.mark.parametrize("name, message", [("missing.jsonl", "data.trusted_input: .*missing.jsonl"),
                                           ("empty.jsonl", "data.trusted_input: all inputs are empty")])
def test_a_missing_or_empty_trusted_file_fails_before_anything_runs(tmp_path, name, message):
    from raycurate.pipelines.common import check_job_inputs

    pool = _jsonl(tmp_path / "pool.jsonl", POOL)
    (tmp_path / "empty.jsonl").write_text("")
    cfg = JobConfig(pipeline="sft", data=DataConfig(input=pool, trusted_input=str(tmp_path / name)))
    with pytest.raises(UserError, match=message):
        check_job_inputs(cfg)


def test_methods_without_a_paper_fallback_need_a_trusted_set():
    from raycurate.config.curate import CurateConfig

    pool = DataConfig(input="pool.jsonl")
    assert JobConfig(pipeline="curate", data=pool, curate=CurateConfig(steps=["dedup"], compare=False)
                     ).config_problems() == []
    problems = JobConfig(pipeline="curate", data=pool, curate=CurateConfig(steps=["reference", "mask"],
                                                                           compare=False)).config_problems()
    assert problems == ["data.trusted_input: the reference step and the mask step need a trusted set (their papers' "
                        "target is a small hand-checked set, never rows of the pool being curated); give a trusted "
                        "jsonl / parquet file, or data.trusted_rows > 0 on the embedded corpus"]
    assert JobConfig(pipeline="bilevel", data=DataConfig(trusted_rows=0)).config_problems()[0].startswith(
        "data.trusted_input: bilevel (BDS, BMO, LESS, DSIR) need")
    assert JobConfig(pipeline="bilevel").config_problems() == []  # the embedded corpus generates trusted rows
    assert JobConfig(pipeline="bridge", data=pool).config_problems() == []  # BRIDGE falls back as its paper
