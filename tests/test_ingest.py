"""Readers, validation, rejected rows, strict mode and sharded output of ``raycurate.data.ingest``."""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import pytest

from raycurate.data.ingest import ingest
from raycurate.data.readers import iter_raw_rows, resolve_inputs
from raycurate.data.schema import DataValidationError
from raycurate.data.validate import content_id, validate_record

RATIOS = {"train": 0.5, "validation": 0.5}


def _write_jsonl(path, lines: list) -> str:
    """Write rows (dicts are JSON-encoded, bytes written as-is, str encoded UTF-8), one per line."""
    with open(path, "wb") as fh:
        for line in lines:
            if isinstance(line, dict):
                line = json.dumps(line)
            fh.write((line.encode("utf-8") if isinstance(line, str) else line) + b"\n")
    return str(path)


def _ingest(paths, out_dir, **kwargs):
    kwargs.setdefault("strict", False)
    kwargs.setdefault("split_seed", 0)
    kwargs.setdefault("split_ratios", RATIOS)
    kwargs.setdefault("progress", False)
    return ingest(paths if isinstance(paths, list) else [paths], str(out_dir), **kwargs)


def _accepted(result) -> list[dict]:
    import pyarrow.parquet as pq

    return [row for path in result.accepted_files for row in pq.read_table(path).to_pylist()]


def _rejected(result) -> list[dict]:
    with open(result.rejected_file, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def _good(i: int, **extra) -> dict:
    return {"id": f"r{i}", "prompt": f"prompt {i}", "response": f"response {i}", **extra}


BAD_ROWS = [
    # (line content, reason, field)
    (b'{"id": "x1", "prompt": "p", "response": ', "malformed_json", None),
    ({"id": "x2", "response": "r"}, "missing_field", "prompt"),
    ({"id": "x3", "prompt": "", "response": "r"}, "empty_field", "prompt"),
    ({"id": "x4", "prompt": "p", "response": " \n\t"}, "empty_field", "response"),
    ({"id": "x5", "prompt": 42, "response": "r"}, "wrong_type", "prompt"),
    ({"id": ["x6"], "prompt": "p", "response": "r"}, "wrong_type", "id"),
    (b'["not", "an", "object"]', "wrong_type", None),
    (b'{"id": "x8", "prompt": "caf\xe9", "response": "r"}', "non_utf8", None),
    ({"id": "r0", "prompt": "again", "response": "again"}, "duplicate_id", "id"),
    ({"id": "x10", "prompt": "p", "response": "r", "domain": "poetry"}, "unknown_domain", "domain"),
]


@pytest.mark.parametrize("line, reason, field", BAD_ROWS, ids=[r for _, r, _ in BAD_ROWS])
def test_each_bad_row_kind_is_rejected_with_reason_and_counted(tmp_path, line, reason, field):
    path = _write_jsonl(tmp_path / "in.jsonl", [_good(0), line, _good(2)])
    result = _ingest(path, tmp_path / "out")
    assert result.rows == {"input": 3, "accepted": 2, "rejected": 1}
    assert result.rejected_by_reason == {reason: 1}
    (rej,) = _rejected(result)
    assert (rej["source"], rej["line"], rej["reason"], rej["field"]) == (path, 2, reason, field)
    assert rej["detail"]
    assert [r["id"] for r in _accepted(result)] == ["r0", "r2"]


@pytest.mark.parametrize("line, reason, field", BAD_ROWS, ids=[r for _, r, _ in BAD_ROWS])
def test_strict_mode_names_file_line_and_field(tmp_path, line, reason, field):
    path = _write_jsonl(tmp_path / "in.jsonl", [_good(0), line, _good(2)])
    out = tmp_path / "out"
    with pytest.raises(DataValidationError) as info:
        _ingest(path, out, strict=True)
    err = info.value
    assert (err.file, err.line, err.field, err.reason) == (path, 2, field, reason)
    assert str(err).startswith(f"{path}:2: ")
    if field:
        assert f"field '{field}'" in str(err)
    assert "without strict mode" in str(err)
    assert os.listdir(out) == []  # nothing published, temp files removed


def test_mixed_file_accounting_and_blank_lines(tmp_path):
    lines = [_good(0), b"", b"   ", _good(1)] + [line for line, _, _ in BAD_ROWS] + [_good(2, domain="Math")]
    path = _write_jsonl(tmp_path / "in.jsonl", lines)
    result = _ingest(path, tmp_path / "out")
    # Blank lines are not input rows, but line numbers stay physical.
    assert result.rows == {"input": 13, "accepted": 3, "rejected": 10}
    assert result.rows["input"] == result.rows["accepted"] + result.rows["rejected"]
    assert sum(result.accepted_by_split.values()) == 3
    assert result.accepted_by_domain == {"math": 1, "none": 2}
    assert [r["line"] for r in _rejected(result)] == list(range(5, 15))
    assert [r["line"] for r in _accepted(result)] == [1, 4, 15]
    assert result.files == [{"path": path, "rows": 13, "warning": None}]


def test_accepted_rows_carry_split_and_provenance(tmp_path):
    path = _write_jsonl(tmp_path / "in.jsonl", [_good(i, domain="code") for i in range(20)])
    result = _ingest(path, tmp_path / "out", split_seed=3)
    rows = _accepted(result)
    from raycurate.data.splits import assign_split

    for row in rows:
        assert row["split"] == assign_split(row["id"], 3, RATIOS)
        assert row["source"] == path
        assert row["domain"] == "code"
    assert result.accepted_by_split == dict(sorted(Counter(r["split"] for r in rows).items()))
    assert sum(result.accepted_by_split.values()) == 20


def test_missing_id_gets_stable_content_hash_and_exact_duplicates_are_rejected(tmp_path):
    row = {"prompt": "p", "response": "r"}
    path = _write_jsonl(tmp_path / "in.jsonl", [row, row, {"id": 7, "prompt": "p", "response": "r"}])
    result = _ingest(path, tmp_path / "out")
    ids = [r["id"] for r in _accepted(result)]
    assert ids == [content_id("p", "r"), "7"]
    assert content_id("p", "r") == content_id("p", "r") != content_id("p", "r ")
    assert result.rejected_by_reason == {"duplicate_id": 1}


def test_first_accepted_occurrence_of_an_id_wins():
    seen: set[str] = set()
    assert validate_record({"id": "a", "prompt": "", "response": "r"}, seen_ids=seen)[1] == "empty_field"
    clean, reason, _ = validate_record({"id": "a", "prompt": "p", "response": "r"}, seen_ids=seen)
    assert clean["id"] == "a" and reason is None
    assert validate_record({"id": "a", "prompt": "p", "response": "r"}, seen_ids=seen) == (None, "duplicate_id", "id")


def test_messages_supply_prompt_and_response():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "5"},
    ]
    clean, reason, _ = validate_record({"id": "m", "messages": messages}, seen_ids=set())
    assert reason is None
    assert (clean["prompt"], clean["response"]) == ("Be brief.\n\n2+3?", "5")
    assert clean["messages"] == messages
    no_answer = {"id": "n", "messages": messages[:2]}
    assert validate_record(no_answer, seen_ids=set()) == (None, "missing_field", "prompt")
    bad_turn = {"id": "b", "messages": [{"role": "user", "content": None}]}
    assert validate_record(bad_turn, seen_ids=set()) == (None, "wrong_type", "messages")


def test_reserved_input_columns_are_kept_under_input_prefix(tmp_path):
    path = _write_jsonl(tmp_path / "in.jsonl", [_good(0, split="train", source="gsm8k")])
    (row,) = _accepted(_ingest(path, tmp_path / "out"))
    assert row["input_split"] == "train" and row["input_source"] == "gsm8k"
    assert row["source"] == path and row["split"] in RATIOS


def test_rejected_raw_is_truncated(tmp_path):
    path = _write_jsonl(tmp_path / "in.jsonl", ['{"id": "long", "prompt": "' + "x" * 5000])
    (rej,) = _rejected(_ingest([path, _write_jsonl(tmp_path / "ok.jsonl", [_good(1)])], tmp_path / "out"))
    assert rej["reason"] == "malformed_json"
    assert rej["raw"].startswith('{"id": "long"') and len(rej["raw"]) < 2100


def test_empty_file_warns_and_all_empty_fails(tmp_path):
    empty = _write_jsonl(tmp_path / "empty.jsonl", [])
    blank = _write_jsonl(tmp_path / "blank.jsonl", [b"", b"  "])
    good = _write_jsonl(tmp_path / "good.jsonl", [_good(0)])
    result = _ingest([empty, good], tmp_path / "out")
    assert result.rows == {"input": 1, "accepted": 1, "rejected": 0}
    assert result.files[0] == {"path": empty, "rows": 0, "warning": "empty file: no rows"}
    with pytest.raises(ValueError, match="all inputs are empty"):
        _ingest([empty, blank], tmp_path / "out2")
    with pytest.raises(DataValidationError, match="empty.jsonl: file has no rows") as info:
        _ingest([good, empty], tmp_path / "out3", strict=True)
    assert info.value.reason == "empty_file"


def test_missing_paths_fail_fast_with_clear_errors(tmp_path):
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match="nope.jsonl: no such file"):
        _ingest(str(tmp_path / "nope.jsonl"), tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="glob matched no files"):
        _ingest(str(tmp_path / "*.parquet"), tmp_path / "out")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(FileNotFoundError, match="folder has no input files"):
        _ingest(str(tmp_path / "emptydir"), tmp_path / "out")
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"unsupported format \(\.csv\); supported: JSON lines"):
        _ingest(str(tmp_path / "data.csv"), tmp_path / "out")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="not a readable parquet file"):
        _ingest(str(tmp_path / "broken.parquet"), tmp_path / "out")
    assert time.perf_counter() - start < 2.0
    assert not (tmp_path / "out").exists()  # failed before creating outputs


def test_folders_and_globs_read_in_sorted_order(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    _write_jsonl(folder / "b.jsonl", [_good(2)])
    _write_jsonl(folder / "a.jsonl", [_good(1)])
    _write_jsonl(folder / "sub" / "c.jsonl", [_good(3)])
    (folder / "notes.txt").write_text("ignored")
    ids = [row.record["id"] for row in iter_raw_rows(str(folder))]
    assert ids == ["r1", "r2", "r3"]
    assert [row.record["id"] for row in iter_raw_rows(str(folder / "*.jsonl"))] == ["r1", "r2"]


def test_json_array_file_is_read_as_rows(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([_good(0), 5, _good(1)]))
    rows = list(iter_raw_rows(str(path)))
    assert [(r.line, r.error[0] if r.error else None) for r in rows] == [(1, None), (2, "wrong_type"), (3, None)]


def test_parquet_round_trip_keeps_nested_pass_through(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_good(i, domain="math", label={"corrupt": i % 2 == 1, "kind": "wrong_step"}) for i in range(5)]
    rows[3]["prompt"] = "   "
    src = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    result = _ingest(str(src), tmp_path / "out", shard_rows=2)
    assert result.rows == {"input": 5, "accepted": 4, "rejected": 1}
    assert [r["line"] for r in _rejected(result)] == [4]
    assert json.loads(_rejected(result)[0]["raw"])["id"] == "r3"
    assert len(result.accepted_files) == 2  # 4 rows / 2 per shard
    out = _accepted(result)
    assert [r["id"] for r in out] == ["r0", "r1", "r2", "r4"]
    assert out[1]["label"] == {"corrupt": True, "kind": "wrong_step"}
    assert pa.types.is_struct(pq.read_schema(result.accepted_files[0]).field("label").type)
    assert result.json_columns == []


def test_hf_save_to_disk_round_trip(tmp_path):
    import datasets

    rows = [_good(i) for i in range(4)] + [{"id": "e", "prompt": "p", "response": ""}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    result = _ingest(str(tmp_path / "hf"), tmp_path / "out")
    assert result.rows == {"input": 5, "accepted": 4, "rejected": 1}
    assert [r["id"] for r in _accepted(result)] == ["r0", "r1", "r2", "r3"]
    assert _rejected(result)[0]["line"] == 5

    splits = {"train": datasets.Dataset.from_list(rows[:2]), "test": datasets.Dataset.from_list(rows[2:4])}
    dd = datasets.DatasetDict(splits)
    dd.save_to_disk(str(tmp_path / "hfdict"))
    assert [i.source for i in resolve_inputs(str(tmp_path / "hfdict"))] == [
        f"{tmp_path / 'hfdict'}[test]",
        f"{tmp_path / 'hfdict'}[train]",
    ]
    assert _ingest(str(tmp_path / "hfdict"), tmp_path / "out2").rows["accepted"] == 4


def test_inconsistent_pass_through_is_json_encoded_in_every_shard(tmp_path):
    rows = [_good(0, label="plain"), _good(1, label="text"), _good(2, label={"kind": "obj"}), _good(3, meta=[1, 2])]
    path = _write_jsonl(tmp_path / "in.jsonl", rows)
    result = _ingest(path, tmp_path / "out", shard_rows=2)
    assert result.json_columns == ["label"]
    out = _accepted(result)
    assert [json.loads(r["label"]) if r["label"] else None for r in out] == ["plain", "text", {"kind": "obj"}, None]
    assert [r["meta"] for r in out] == [None, None, None, [1, 2]]


def test_rerun_replaces_outputs_and_removes_stale_shards(tmp_path):
    path = _write_jsonl(tmp_path / "in.jsonl", [_good(i) for i in range(5)])
    first = _ingest(path, tmp_path / "out", shard_rows=1)
    assert len(first.accepted_files) == 5
    second = _ingest(path, tmp_path / "out", shard_rows=10)
    assert sorted(os.listdir(tmp_path / "out")) == ["accepted-00000.parquet", "rejected.jsonl"]
    assert len(_accepted(second)) == 5


def test_separate_validation_file(tmp_path):
    val = _write_jsonl(tmp_path / "val.jsonl", [_good(0), _good(1)])
    main = _write_jsonl(tmp_path / "train.jsonl", [_good(1)] + [_good(i) for i in range(2, 40)])
    ratios = {"warmup": 0.1, "validation": 0.1, "selection": 0.8}
    result = _ingest(main, tmp_path / "out", validation_paths=val, split_ratios=ratios)
    out = _accepted(result)
    assert [r["id"] for r in out if r["split"] == "validation"] == ["r0", "r1"]
    assert result.rejected_by_reason == {"duplicate_id": 1}  # r1 in the training file
    assert {r["split"] for r in out if r["source"] == main} <= {"warmup", "selection"}
    assert result.rows == {"input": 41, "accepted": 40, "rejected": 1}


def test_ingest_throughput_small_rows(tmp_path):
    n = 20_000
    path = tmp_path / "big.jsonl"
    with open(path, "w") as fh:
        for i in range(n):
            row = {"id": f"r{i}", "prompt": f"What is {i} + 1?", "response": f"{i + 1}", "domain": "math"}
            fh.write(json.dumps(row) + "\n")
    start = time.perf_counter()
    result = _ingest(str(path), tmp_path / "out", shard_rows=10_000)
    rate = n / (time.perf_counter() - start)
    assert result.rows["accepted"] == n
    # Target is >= 20k rows/s on one free core; the bound here leaves room for a loaded CI machine.
    assert rate > 5_000, f"{rate:.0f} rows/s"
