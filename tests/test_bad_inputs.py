"""Bad inputs a new user gives, through the real CLI entry point (issue 14).

Every case runs ``main([...])`` in-process from a fresh working folder and asserts:

* the exit code: 2 for an error, 0 for input that is accepted with rejected rows;
* an error is exactly one line ``raycurate: ...`` on stderr naming the file / key (``says``), no traceback;
* row accounting is exact: ``input == accepted + rejected`` with the expected numbers, one ``rejected.jsonl`` line
  per rejected row, the expected reasons, and every file of a folder / glob that was not read listed with a reason;
* nothing is written outside the run directory, and a case that fails validation writes nothing at all and never
  starts Ray (the point is to fail early).

``FIGURES`` at the bottom counts the table for the issue's closing note.
"""

from __future__ import annotations

import bz2
import dataclasses
import gzip
import json
import lzma
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable

import pytest

from raycurate.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
OUT = "runs/r"  # every case's run directory, relative to its working folder


def _row(i: int, **extra) -> dict:
    return {"id": f"r{i}", "prompt": f"What is {i} + {i}?", "response": f"{i} + {i} = {2 * i}. #### {2 * i}", **extra}


def _lines(rows: list) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


GOOD = _lines([_row(1), _row(2)])


def _files(**files: bytes | str | None) -> Callable[[Path], None]:
    """Writer of input files under ``in/`` (a ``None`` value makes a folder)."""

    def write(folder: Path) -> None:
        for name, data in files.items():
            path = folder / name.replace("__", "/")
            path.parent.mkdir(parents=True, exist_ok=True)
            if data is None:
                path.mkdir(exist_ok=True)
            else:
                path.write_bytes(data.encode() if isinstance(data, str) else data)

    return write


def _special(fifo: str | None = None, zero: str | None = None, good: str | None = None) -> Callable[[Path], None]:
    """Writer of a FIFO and / or a symlink to /dev/zero (plus an optional good file) under ``in/``."""

    def write(folder: Path) -> None:
        for name in (fifo, zero, good):
            if name:
                (folder / name).parent.mkdir(parents=True, exist_ok=True)
        if fifo:
            os.mkfifo(folder / fifo)
        if zero:
            os.symlink("/dev/zero", folder / zero)
        if good:
            (folder / good).write_bytes(GOOD)

    return write


def _parquet(rows: list[dict], truncate: int | None = None) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    data = buf.getvalue()
    return data[:truncate] if truncate else data


def _json_array_with_one_syntax_error() -> bytes:
    text = json.dumps([_row(1), _row(2), _row(3), _row(4)], indent=2)
    return text.replace('"id": "r2"', '"id": "r2" "oops"', 1).encode()


def _truncated_gz() -> bytes:
    rows = [_row(i) for i in range(3000)]
    data = gzip.compress(_lines(rows))
    return data[: len(data) // 2]


@dataclasses.dataclass(frozen=True)
class Case:
    """One bad input.

    Attributes:
        id: Test id.
        argv: Command line (``{in}`` is the input folder).
        files: Writes the input files.
        code: Expected exit code.
        says: Substrings of the one ``raycurate:`` line (errors).
        rows: Expected ``{input, accepted, rejected}`` (exit code 0, or an error after ingest wrote its outputs).
        reasons: Expected ``rejected_by_reason``.
        unread: Names expected in ``unread_files`` (files under a folder / glob that were not read).
        early: The error comes before anything is written (validation); False when ingest already ran.
        kind: How the issue counts it: "error" (clear error), "rejected" (rows rejected with a reason),
            "handled" (read correctly).
    """

    id: str
    argv: tuple[str, ...]
    files: Callable[[Path], None] = _files()
    code: int = 2
    says: tuple[str, ...] = ()
    rows: tuple[int, int, int] | None = None
    reasons: dict | None = None
    unread: tuple[str, ...] = ()
    early: bool = True
    kind: str = "error"


def ingest(*inputs: str, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    args: list[str] = ["ingest"]
    for name in inputs:
        args += ["--input", name]
    return (*args, "--out", OUT, *extra)


CASES = [
    # --- silent losses in the issue: now read, or accounted for ----------------------------------------------
    Case("folder_with_jsonl_and_gz", ingest("{in}"),
         _files(**{"a.jsonl": GOOD, "b.jsonl.gz": gzip.compress(_lines([_row(3)]))}),
         code=0, rows=(3, 3, 0), kind="handled"),
    Case("glob_matching_gz", ingest("{in}/*.jsonl*"),
         _files(**{"a.jsonl": GOOD, "b.jsonl.gz": gzip.compress(_lines([_row(3)]))}),
         code=0, rows=(3, 3, 0), kind="handled"),
    Case("gz_given_directly", ingest("{in}/b.json.gz"), _files(**{"b.json.gz": gzip.compress(GOOD)}),
         code=0, rows=(2, 2, 0), kind="handled"),
    Case("bz2_xz_compressed", ingest("{in}/a.jsonl.bz2", "{in}/b.ndjson.xz"),
         _files(**{"a.jsonl.bz2": bz2.compress(_lines([_row(1)])), "b.ndjson.xz": lzma.compress(_lines([_row(2)]))}),
         code=0, rows=(2, 2, 0), kind="handled"),
    Case("truncated_gz_keeps_prefix_and_rejects_rest", ingest("{in}/big.jsonl.gz"),
         _files(**{"big.jsonl.gz": _truncated_gz()}), code=0, reasons={"unreadable_file": 1}, kind="rejected"),
    Case("json_array_with_one_syntax_error", ingest("{in}/rows.json"),
         _files(**{"rows.json": _json_array_with_one_syntax_error()}),
         code=0, rows=(4, 3, 1), reasons={"malformed_json": 1}, kind="rejected"),
    Case("utf16_with_bom", ingest("{in}/u.jsonl"), _files(**{"u.jsonl": GOOD.decode().encode("utf-16")}),
         code=0, rows=(2, 2, 0), kind="handled"),
    Case("utf16le_without_bom_crlf", ingest("{in}/u.jsonl"),
         _files(**{"u.jsonl": GOOD.decode().replace("\n", "\r\n").encode("utf-16-le")}),
         code=0, rows=(2, 2, 0), kind="handled"),
    Case("folder_lists_unread_files", ingest("{in}"),
         _files(**{"a.jsonl": GOOD, "notes.txt": "hello", "data.csv": "a,b\n1,2\n", ".hidden.jsonl": GOOD}),
         code=0, rows=(2, 2, 0), unread=("notes.txt", "data.csv", ".hidden.jsonl"), kind="handled"),
    # --- tracebacks in the issue: now one-line errors ---------------------------------------------------------
    Case("empty_jsonl", ingest("{in}/empty.jsonl"), _files(**{"empty.jsonl": b""}),
         says=("empty.jsonl", "all inputs are empty")),
    Case("blank_lines_only", ingest("{in}/blank.jsonl"), _files(**{"blank.jsonl": b"\n  \n\r\n"}),
         says=("blank.jsonl", "empty")),
    Case("empty_train_data", ("train", "--data", "{in}/e.jsonl", "--out", OUT),
         _files(**{"e.jsonl": b"\xef\xbb\xbf\n"}), says=("e.jsonl", "all inputs are empty")),
    Case("garbage_bin", ingest("{in}/x.bin"), _files(**{"x.bin": os.urandom(256)}),
         says=("x.bin", "unsupported format (.bin)", "convert it")),
    Case("truncated_parquet", ingest("{in}/t.parquet"), _files(**{"t.parquet": _parquet([_row(1)], truncate=60)}),
         says=("t.parquet", "not a readable parquet file", "re-export")),
    Case("junk_parquet", ingest("{in}/j.parquet"), _files(**{"j.parquet": b"PAR1" + os.urandom(64)}),
         says=("j.parquet", "not a readable parquet file")),
    Case("strict_bad_row", ingest("{in}/a.jsonl", extra=("--strict",)),
         _files(**{"a.jsonl": _lines([_row(1), {"id": "x", "prompt": "p"}])}),
         says=("a.jsonl:2", "response", "strict"), early=False),
    Case("split_ratios_sum_1_1", ingest("{in}/a.jsonl", extra=("data.split_ratios={a: 0.6, b: 0.5}",)),
         _files(**{"a.jsonl": GOOD}), says=("data.split_ratios", "sum to 1", "command line")),
    Case("split_ratio_negative", ingest("{in}/a.jsonl", extra=("data.split_ratios={a: 1.5, b: -0.5}",)),
         _files(**{"a.jsonl": GOOD}), says=("data.split_ratios", ">= 0")),
    Case("shard_rows_zero", ingest("{in}/a.jsonl", extra=("data.shard_rows=0",)), _files(**{"a.jsonl": GOOD}),
         says=("data.shard_rows", ">= 1", "from the command line")),
    Case("out_is_a_file", ("ingest", "--input", "{in}/a.jsonl", "--out", "{in}/a.jsonl"),
         _files(**{"a.jsonl": GOOD}), says=("is a file", "--out")),
    Case("out_not_creatable", ("ingest", "--input", "{in}/a.jsonl", "--out", "/proc/1/no/run"),
         _files(**{"a.jsonl": GOOD}), says=("cannot create run directory", "writable")),
    Case("every_row_rejected", ingest("{in}/bad.jsonl"),
         _files(**{"bad.jsonl": _lines([b"{not json", {"prompt": "p"}, {"prompt": "", "response": "r"}])}),
         says=("accepted 0 of 3 rows of ", "bad.jsonl (rejected by reason", "rejected.jsonl"), rows=(3, 0, 3),
         reasons={"malformed_json": 1, "missing_field": 1, "empty_field": 1}, early=False),
    Case("model_folder_not_a_model", ("train", "--data", "{in}/a.jsonl", "--model", "{in}/notamodel", "--out", OUT),
         _files(**{"a.jsonl": GOOD, "notamodel__README.md": "hi"}),
         says=("model.name_or_path", "notamodel", "config.json", "tokenizer")),
    Case("model_preset_typo", ("train", "--data", "{in}/a.jsonl", "--model", "tiny-lama", "--out", OUT),
         _files(**{"a.jsonl": GOOD}), says=("model.name_or_path='tiny-lama'", "tiny preset")),
    # --- config validated when loaded --------------------------------------------------------------------------
    Case("train_lr_negative", ("train", "--data", "{in}/a.jsonl", "--out", OUT, "train.lr=-1"),
         _files(**{"a.jsonl": GOOD}), says=("train.lr", "must be > 0", "from the command line")),
    Case("bridge_baselines_unknown", ("run", "{in}/job.yaml", "bridge.baselines=[foo]"),
         _files(**{"job.yaml": "pipeline: bridge\n"}), says=("bridge.baselines", "'foo'", "rho1")),
    Case("demo_methods_unknown", ("demo", "--out", OUT, "demo.methods=[xyz]"),
         says=("demo.methods", "'xyz'", "bilevel")),
    Case("warmup_split_smaller_than_a_batch", ("run", str(ROOT / "jobs/curate_proving_ground.yaml"), "pipeline=curate",
                                               "data.corpus_rows=400", "data.heldout_rows=40", "curate.compare=false",
                                               "eval.samples=0", "eval.lm_eval_tasks=[]", f"run.runs_dir={OUT}"),
         says=("warmup split", "of 400 rows", "fewer than one batch", "train.effective_batch_size=32")),
    Case("proving_ground_seeds_empty", ("run", str(ROOT / "jobs/curate_proving_ground.yaml"),
                                        "pipeline=proving_ground", "proving_ground.seeds=[]"),
         says=("proving_ground.seeds: empty",)),
    Case("proving_ground_seeds_repeated", ("run", str(ROOT / "jobs/curate_proving_ground.yaml"),
                                           "proving_ground.seeds=[1, 2, 1]"),
         says=("proving_ground.seeds: 1 listed more than once",)),
    Case("demo_methods_empty", ("demo", "--out", OUT, "demo.methods=[]"), says=("demo.methods: empty", "[base]")),
    Case("demo_methods_repeated", ("demo", "--out", OUT, "demo.methods=[sft, bridge, sft]"),
         says=("demo.methods: 'sft' listed more than once",)),
    Case("split_ratios_unknown_names", ("demo", "--out", OUT, "data.split_ratios={a: 1}"),
         says=("data.split_ratios", "warmup")),
    Case("key_typo_did_you_mean", ("demo", "--out", OUT, "train.lrr=1e-4"),
         says=("train.lrr", "did you mean train.lr?", "from the command line")),
    Case("bad_key_in_file", ("run", "{in}/job.yaml"), _files(**{"job.yaml": "pipeline: sft\ndata:\n  strickt: true\n"}),
         says=("data.strickt", "did you mean data.strict?", "job.yaml]")),
    Case("batch_not_a_multiple", ("run", "{in}/job.yaml", "train.effective_batch_size=10"),
         _files(**{"job.yaml": "pipeline: sft\n"}), says=("train.effective_batch_size", "multiple")),
    Case("unknown_pipeline", ("run", "{in}/job.yaml"), _files(**{"job.yaml": "pipeline: brige\n"}),
         says=("pipeline", "'brige'", "did you mean 'bridge'")),
    Case("yaml_is_a_list", ("run", "{in}/job.yaml"), _files(**{"job.yaml": "- pipeline: sft\n"}),
         says=("job.yaml", "mapping", "list")),
    Case("yaml_syntax_error", ("run", "{in}/job.yaml"), _files(**{"job.yaml": "pipeline: [sft\n"}),
         says=("job.yaml", "not valid YAML")),
    Case("yaml_impossible_date", ("run", "{in}/job.yaml"), _files(**{"job.yaml": "pipeline: sft\nx: 0000-00-00\n"}),
         says=("job.yaml", "not valid YAML", "year 0")),  # found by tests/test_fuzz_inputs.py
    Case("override_impossible_date", ("demo", "--out", OUT, "run.name=2024-02-30"),
         says=("run.name", "not valid YAML", "quote it")),
    Case("override_without_equals", ("run", "{in}/job.yaml", "trainlr"), _files(**{"job.yaml": "pipeline: sft\n"}),
         says=("'trainlr'", "key=value")),
    Case("override_value_not_yaml", ("demo", "--out", OUT, "bridge.baselines=[random"),
         says=("bridge.baselines", "not valid YAML")),
    Case("job_file_missing", ("run", "{in}/nope.yaml"), says=("nope.yaml", "does not exist")),
    Case("override_before_job", ("run", "train.lr=1"), says=("looks like an override", "job file")),
    Case("max_length_tiny", ("demo", "--out", OUT, "data.max_length=2"), says=("data.max_length", ">= 8")),
    Case("ratio_nan", ingest("{in}/a.jsonl", extra=("data.split_ratios={a: .nan}",)), _files(**{"a.jsonl": GOOD}),
         says=("data.split_ratios", "finite")),
    Case("run_data_input_missing", ("run", "{in}/job.yaml"),
         _files(**{"job.yaml": "pipeline: sft\ndata:\n  input: nowhere/x.jsonl\n"}),
         says=("nowhere/x.jsonl", "no such file")),
    Case("out_is_dot", ("ingest", "--input", "{in}/a.jsonl", "--out", "."), _files(**{"a.jsonl": GOOD}),
         says=("run name", "--out")),
    # --- more a new user hits --------------------------------------------------------------------------------
    Case("folder_without_readable_files", ingest("{in}/d"), _files(**{"d__a.csv": "a\n", "d__b.txt": "x"}),
         says=("folder has no input files", "a.csv", "unsupported format (.csv)")),
    Case("empty_folder", ingest("{in}/d"), _files(d=None), says=("folder has no input files",)),
    Case("csv_given_directly", ingest("{in}/a.csv"), _files(**{"a.csv": "prompt,response\np,r\n"}),
         says=("a.csv", "unsupported format (.csv)")),
    Case("glob_matching_nothing", ingest("{in}/*.jsonl"), says=("glob matched no files",)),
    Case("glob_matching_only_unsupported", ingest("{in}/*"), _files(**{"a.csv": "x"}),
         says=("no readable input", "a.csv")),
    Case("missing_file", ingest("{in}/nope.jsonl"), says=("nope.jsonl", "no such file")),
    Case("jsonl_with_utf8_bom_and_crlf", ingest("{in}/b.jsonl"),
         _files(**{"b.jsonl": b"\xef\xbb\xbf" + GOOD.replace(b"\n", b"\r\n")}), code=0, rows=(2, 2, 0),
         kind="handled"),
    Case("prompt_is_a_list_ids_are_ints", ingest("{in}/a.jsonl"),
         _files(**{"a.jsonl": _lines([{"id": 1, "prompt": ["a", "b"], "response": "r"},
                                      {"id": 2, "prompt": "p", "response": "r"}])}),
         code=0, rows=(2, 1, 1), reasons={"wrong_type": 1}, kind="rejected"),
    Case("line_is_a_list_or_number", ingest("{in}/a.jsonl"), _files(**{"a.jsonl": _lines([[1, 2], b"7", _row(1)])}),
         code=0, rows=(3, 1, 2), reasons={"wrong_type": 2}, kind="rejected"),
    Case("invalid_utf8_line", ingest("{in}/a.jsonl"), _files(**{"a.jsonl": _lines([b'{"prompt": "\xff"}', _row(1)])}),
         code=0, rows=(2, 1, 1), reasons={"non_utf8": 1}, kind="rejected"),
    Case("parquet_prompt_int64_every_row_rejected", ingest("{in}/n.parquet"),
         _files(**{"n.parquet": _parquet([{"prompt": 1, "response": "r"}, {"prompt": 2, "response": "s"}])}),
         says=("accepted 0 of 2 rows of ", "n.parquet", "wrong_type: 2"), rows=(2, 0, 2),
         reasons={"wrong_type": 2}, early=False),
    Case("fifo_in_input_folder", ingest("{in}/d"), _special(fifo="d/p.jsonl", good="d/a.jsonl"),
         code=0, rows=(2, 2, 0), unread=("p.jsonl",), kind="handled"),
    Case("fifo_given_directly", ingest("{in}/p.jsonl"), _special(fifo="p.jsonl"),
         says=("p.jsonl: not a regular file",)),
    Case("fifo_matched_by_glob", ingest("{in}/*.jsonl"), _special(fifo="p.jsonl", good="a.jsonl"),
         code=0, rows=(2, 2, 0), unread=("p.jsonl",), kind="handled"),
    Case("symlink_to_dev_zero", ingest("{in}/z.jsonl"), _special(zero="z.jsonl"),
         says=("z.jsonl: not a regular file",)),
    Case("symlink_to_dev_zero_in_folder", ingest("{in}/d"), _special(zero="d/z.jsonl", good="d/a.jsonl"),
         code=0, rows=(2, 2, 0), unread=("z.jsonl",), kind="handled"),
    Case("empty_object_in_a_passthrough_field", ingest("{in}/a.jsonl"),  # found by tests/test_fuzz_inputs.py
         _files(**{"a.jsonl": _lines([_row(1, extra={}), _row(2, extra={"a": {}}, more=[{}])])}),
         code=0, rows=(2, 2, 0), kind="handled"),
    Case("lone_surrogate_escape_in_jsonl", ingest("{in}/a.jsonl"),
         _files(**{"a.jsonl": _lines([b'{"prompt": "a \\udcff", "response": "r"}', _row(1),
                                      b'{"prompt": "p", "response": "r", "meta": {"\\ud800": 1}}'])}),
         code=0, rows=(3, 1, 2), reasons={"non_utf8": 2}, kind="rejected"),
    Case("inspect_truncated_manifest", ("inspect", "{in}"), _files(**{"manifest.json": '{"run": "r", "sta'}),
         says=("manifest.json is not valid JSON", "truncated")),
    Case("report_truncated_manifest", ("report", "{in}"), _files(**{"manifest.json": '{"run": "r", "sta'}),
         says=("manifest.json is not valid JSON", "truncated")),
    Case("inspect_manifest_is_a_list", ("inspect", "{in}"), _files(**{"manifest.json": "[]"}),
         says=("manifest.json is a JSON list, not an object",)),
    Case("inspect_manifest_stages_is_a_list", ("inspect", "{in}"), _files(**{"manifest.json": '{"stages": []}'}),
         says=("'stages' as a list",)),
    Case("inspect_not_a_run", ("inspect", "{in}"), says=("inspect:", "no manifest.json")),
    Case("duplicate_ids_and_unknown_domain", ingest("{in}/a.jsonl"),
         _files(**{"a.jsonl": _lines([_row(1), _row(1), _row(2, domain="poetry")])}),
         code=0, rows=(3, 1, 2), reasons={"duplicate_id": 1, "unknown_domain": 1}, kind="rejected"),
    Case("messages_wrong_shape", ingest("{in}/a.jsonl"),
         _files(**{"a.jsonl": _lines([{"messages": "hi"}, {"messages": [{"role": "user", "content": "q"}]},
                                      {"messages": [{"role": "user", "content": "q"},
                                                    {"role": "assistant", "content": "a"}]}])}),
         code=0, rows=(3, 1, 2), reasons={"wrong_type": 1, "missing_field": 1}, kind="rejected"),
    Case("pretty_printed_json_object", ingest("{in}/one.json"), _files(**{"one.json": json.dumps(_row(1), indent=2)}),
         code=0, rows=(1, 1, 0), kind="handled"),
    Case("parquet_with_wrong_column_types", ingest("{in}/a.parquet"),
         _files(**{"a.parquet": _parquet([{"prompt": "p", "response": "r"}, {"prompt": "q", "response": None}])}),
         code=0, rows=(2, 1, 1), reasons={"missing_field": 1}, kind="rejected"),
    Case("ingest_override_with_prefix", ingest("{in}/a.jsonl", extra=("data.split_seed=3",)),
         _files(**{"a.jsonl": GOOD}), code=0, rows=(2, 2, 0), kind="handled"),
    Case("report_of_a_non_run", ("report", "{in}"), says=("report", "no manifest.json")),
    Case("eval_of_a_non_run", ("eval", "{in}", "--model-stage", "train"), says=("eval", "no manifest.json")),
]


def _tree(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


def _expand(argv: tuple[str, ...], inputs: Path) -> list[str]:
    return [a.replace("{in}", str(inputs)) for a in argv]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_through_the_cli(case: Case, tmp_path, monkeypatch, capsys):
    if case.id == "symlink_loop":
        pytest.skip("covered by test_symlink_loop")
    monkeypatch.chdir(tmp_path)
    inputs = tmp_path / "in"
    inputs.mkdir()
    case.files(inputs)
    before = _tree(tmp_path)
    ray_was_up = "ray" in sys.modules and sys.modules["ray"].is_initialized()  # another test's session instance

    code = main(_expand(case.argv, inputs))

    out, err = capsys.readouterr()
    assert "Traceback" not in err + out
    messages = [line for line in err.splitlines() if line.startswith("raycurate:")]
    assert code == case.code, err
    if case.code == 2:
        assert len(messages) == 1, err
        for text in case.says:
            assert text in messages[0], messages[0]
    else:
        assert messages == []
    run_dir = tmp_path / OUT
    written = _tree(tmp_path) - before
    assert all(p == tmp_path / "runs" or p.is_relative_to(run_dir) for p in written), sorted(written)
    if case.code == 2 and case.early:
        assert written == set(), f"validation failure wrote {sorted(written)}"
    if "ray" in sys.modules and not ray_was_up:
        import ray

        assert not ray.is_initialized(), "a bad input started Ray"
    if case.rows is not None or case.reasons is not None or case.unread:
        _check_accounting(case, run_dir)


def _check_accounting(case: Case, run_dir: Path) -> None:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    rows = manifest["rows"]
    assert rows["input"] == rows["accepted"] + rows["rejected"]
    if case.rows is not None:
        assert (rows["input"], rows["accepted"], rows["rejected"]) == case.rows
    rejected = [json.loads(line) for line in (run_dir / "ingest" / "rejected.jsonl").read_text().splitlines()]
    assert len(rejected) == rows["rejected"]
    assert all(r["reason"] and r["detail"] and r["source"] for r in rejected)
    if case.reasons is not None:
        assert rows["rejected_by_reason"] == case.reasons
    metrics = manifest["stages"]["ingest"]["metrics"]
    assert sum(f["rows"] for f in metrics["files"]) == rows["input"]
    unread = {Path(u["path"]).name: u["reason"] for u in rows.get("unread_files", [])}
    assert set(unread) == set(case.unread)
    for path in [*metrics["accepted_files"], metrics["rejected_file"]]:  # final paths, not the temp folder
        assert (run_dir / path).is_file(), path


def test_truncated_gz_accounts_for_every_row_it_could_read(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "big.jsonl.gz").write_bytes(_truncated_gz())
    assert main(["ingest", "--input", "big.jsonl.gz", "--out", OUT]) == 0
    rows = json.loads((tmp_path / OUT / "manifest.json").read_text())["rows"]
    assert rows["accepted"] > 1000 and rows["rejected"] == 1  # the readable prefix is kept, the rest is one row
    (last,) = [json.loads(x) for x in (tmp_path / OUT / "ingest/rejected.jsonl").read_text().splitlines()]
    assert last["line"] == rows["accepted"] + 1 and "re-create" in last["detail"]


def test_json_array_recovery_keeps_the_valid_elements_in_order(tmp_path, monkeypatch):
    from raycurate.data.readers import iter_raw_rows

    (tmp_path / "rows.json").write_bytes(_json_array_with_one_syntax_error())
    rows = list(iter_raw_rows(str(tmp_path / "rows.json")))
    assert [(r.line, r.record["id"] if r.record else r.error[0]) for r in rows] == [
        (1, "r1"), (2, "malformed_json"), (3, "r3"), (4, "r4")]
    assert '"r2" "oops"' in rows[1].raw


def test_symlink_loop(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    os.symlink("loop_b", tmp_path / "loop_a")
    os.symlink("loop_a", tmp_path / "loop_b")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_bytes(GOOD)
    os.symlink("../loop_a", tmp_path / "d" / "loop.jsonl")
    assert main(["ingest", "--input", "loop_a", "--out", OUT]) == 2
    assert "loop_a: broken or looping symlink" in capsys.readouterr().err
    assert main(["ingest", "--input", "d", "--out", OUT]) == 0  # inside a folder: listed as not read
    unread = json.loads((tmp_path / OUT / "manifest.json").read_text())["rows"]["unread_files"]
    assert unread == [{"path": "d/loop.jsonl", "reason": "broken or looping symlink"}]


# ------------------------------------------------------------------------------------------------------------
# The run directory: one writer, stale temp folders, tampered manifests, credentials
# ------------------------------------------------------------------------------------------------------------


def test_second_writer_is_refused_naming_pid_and_host(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.jsonl").write_bytes(GOOD)
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from raycurate.rundir import open_run_dir
            open_run_dir({str(tmp_path / 'runs')!r}, 'r')
            print('locked', flush=True)
            sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(["ingest", "--input", "a.jsonl", "--out", OUT]) == 2
        (message,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("raycurate:")]
        assert f"is in use by pid {holder.pid} on host" in message and "run.name / --out" in message
        assert not (tmp_path / OUT / "ingest").exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert main(["ingest", "--input", "a.jsonl", "--out", OUT]) == 0  # the lock died with its holder


def test_stale_temp_folders_are_removed_and_manifest_paths_are_final(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.jsonl").write_bytes(GOOD)
    run_dir = tmp_path / OUT
    stale = [run_dir / ".ingest.abc123.tmp", run_dir / ".train.x9.tmp", run_dir / ".manifest.json.q1.tmp"]
    stale[0].mkdir(parents=True)
    (stale[0] / "accepted").mkdir()
    stale[1].mkdir()
    stale[2].write_text("{")
    assert main(["ingest", "--input", "a.jsonl", "--out", OUT]) == 0
    assert not any(p.exists() for p in stale)
    metrics = json.loads((run_dir / "manifest.json").read_text())["stages"]["ingest"]["metrics"]
    assert metrics["accepted_files"] == ["ingest/accepted/accepted-00000.parquet"]
    assert metrics["rejected_file"] == "ingest/rejected.jsonl"


def test_tampered_remote_manifest_cannot_reach_outside_the_mirror(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    victim = tmp_path / "victim_dir"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    remote = tmp_path / "remote" / "r"
    remote.mkdir(parents=True)
    escape = os.path.relpath(victim, tmp_path / ".cache/raycurate/run-mirrors/x/r")
    (remote / "manifest.json").write_text(json.dumps(
        {"run": "r", "rows": {}, "stages": {escape: {"status": "done", "outputs": {}}}}))
    code = main(["report", f"file://{remote}"])
    (message,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("raycurate:")]
    assert code == 2 and "is not allowed" in message and "check where it came from" in message
    assert (victim / "precious.txt").read_text() == "keep me"


@pytest.mark.parametrize("name", ["_scratch", "_anything", ".lock", "manifest.json", "config.yaml"])
def test_remote_manifest_cannot_name_internal_folders(name, tmp_path):
    """A bucket writer lists ``_scratch`` (or another internal name) as a finished stage: nothing is downloaded,
    the local training checkpoints (loaded with pickle by DeepSpeed on resume) stay as they were."""
    from raycurate.rundir import RunDirError, open_run_dir

    remote = tmp_path / "remote" / "r"
    remote.mkdir(parents=True)
    if name != "manifest.json":
        (remote / name / "train").mkdir(parents=True)
        (remote / name / "train" / "mp_rank_00_model_states.pt").write_bytes(b"evil pickle")
    (remote / "manifest.json").write_text(json.dumps(
        {"run": "r", "rows": {}, "stages": {name: {"status": "done", "outputs": {}}}}))
    mirror = tmp_path / "mirror"
    scratch = mirror / "r" / "_scratch" / "train"
    scratch.mkdir(parents=True)
    (scratch / "mp_rank_00_model_states.pt").write_bytes(b"own checkpoint")
    with pytest.raises(RunDirError, match="is not allowed.*internal name"):
        open_run_dir(f"file://{tmp_path / 'remote'}", "r", local_dir=mirror)
    assert (scratch / "mp_rank_00_model_states.pt").read_bytes() == b"own checkpoint"
    assert [p.name for p in scratch.iterdir()] == ["mp_rank_00_model_states.pt"]
    if name not in ("manifest.json", "_scratch"):
        assert not (mirror / "r" / name / "train").exists()


def test_real_stage_names_are_still_allowed(tmp_path):
    from raycurate.rundir import RunDir, check_stage_name

    for name in ["ingest", "train_bds", "eval_base.v2", "0-stage"]:
        assert check_stage_name(name) == name
    assert RunDir(tmp_path / "run").stage_dir("train_bds") == (tmp_path / "run" / "train_bds").resolve()


@pytest.mark.parametrize("text", ["[]", '{"stages": []}', '{"rows": [], "stages": {}}', '{"run": "r", "st'])
def test_ingest_into_a_run_with_a_broken_manifest_is_a_clear_error(text, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.jsonl").write_bytes(GOOD)
    (tmp_path / OUT).mkdir(parents=True)
    (tmp_path / OUT / "manifest.json").write_text(text)
    assert main(["ingest", "--input", "a.jsonl", "--out", OUT]) == 2
    err = capsys.readouterr().err
    (message,) = [x for x in err.splitlines() if x.startswith("raycurate:")]
    assert "manifest.json" in message and "start a new run directory" in message and "Traceback" not in err


def test_a_second_thread_is_refused_like_a_second_process(tmp_path):
    import threading

    from raycurate.rundir import RunDirError, acquire_lock, release_lock, release_locks

    root = tmp_path.resolve()
    acquire_lock(root)
    acquire_lock(root)  # re-entrant in the holding thread
    seen: list[BaseException | None] = []

    def other() -> None:
        try:
            acquire_lock(root)
            seen.append(None)
        except RunDirError as exc:
            seen.append(exc)

    try:
        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
        assert isinstance(seen[0], RunDirError) and "in use by another thread of this process" in str(seen[0])
    finally:
        release_lock(root)
    worker = threading.Thread(target=other)
    worker.start()
    worker.join()
    assert seen[1] is None  # free again once the holder released it
    release_locks()


def test_output_paths_in_a_manifest_must_stay_under_the_run(tmp_path):
    from raycurate.rundir import RunDir, RunDirError
    from raycurate.stages.base import output_path

    run = RunDir(tmp_path / "run")
    record = {"status": "done", "outputs": {"model": "../../etc"}}
    with pytest.raises(RunDirError, match="outside the run directory"):
        output_path(run, record, "model")
    with pytest.raises(RunDirError, match="not allowed"):
        run.stage_dir("../x")


def test_report_and_eval_accept_storage_uris(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.jsonl").write_bytes(GOOD)
    uri = f"file://{tmp_path / 'remote'}/r"
    assert main(["ingest", "--input", "a.jsonl", "--out", uri]) == 0
    capsys.readouterr()
    assert main(["report", uri]) == 0
    assert capsys.readouterr().out.strip() == f"{uri}/report.html"
    assert (tmp_path / "remote" / "r" / "report.html").is_file()
    assert main(["eval", uri, "--model-stage", "train"]) == 2  # reaches the run: a clear error, not "no manifest"
    assert "is not a finished model stage" in capsys.readouterr().err


def test_credentials_in_a_uri_are_never_shown_or_saved(tmp_path, monkeypatch, capsys):
    from raycurate import storage

    uri = "s3://AKIAEXAMPLE:SuperSecretValue@bucket/runs/x?endpoint_override=10.0.0.1:9000&scheme=http"
    assert storage.redact(uri) == "s3://bucket/runs/x"
    assert "SuperSecretValue" not in storage.scrub(f"could not open {uri}: key SuperSecretValue", uri)
    assert storage.strip_userinfo(uri) == "s3://bucket/runs/x?endpoint_override=10.0.0.1:9000&scheme=http"
    monkeypatch.chdir(tmp_path)
    code = main(["inspect", "s3://AKIAEXAMPLE:SuperSecretValue@b/r?endpoint_override=nohost.invalid:1"])
    out, err = capsys.readouterr()
    assert code == 2 and "SuperSecretValue" not in out + err and "AKIAEXAMPLE" not in out + err


def test_saved_config_redacts_the_runs_dir():
    from raycurate.config.schema import JobConfig
    from raycurate.pipelines.common import saved_config

    cfg = JobConfig()
    cfg.run.runs_dir = "s3://KEY:SECRET@bucket/runs?endpoint_override=h:1"
    assert saved_config(cfg).run.runs_dir == "s3://bucket/runs"
    assert cfg.run.runs_dir.startswith("s3://KEY:SECRET@")  # the live config keeps what pyarrow needs


# ------------------------------------------------------------------------------------------------------------
# The Python API's row inputs (no Ray: the conversion and the ingest stage's reader / validator)
# ------------------------------------------------------------------------------------------------------------


def _ingest_folder(folder: str, out: Path) -> dict:
    from raycurate.data.ingest import ingest as ingest_rows

    result = ingest_rows(folder, str(out), strict=False, split_seed=0, split_ratios={"train": 1.0}, progress=False)
    return {**result.rows, "reasons": result.rejected_by_reason}


def test_api_rows_with_a_lone_surrogate_reject_that_row(tmp_path):
    from raycurate.stages.tables import write_source

    folder = write_source([{"prompt": "\udcff", "response": "r"}, {"prompt": "p", "response": "r"}], tmp_path / "in")
    assert _ingest_folder(folder, tmp_path / "out") == {"input": 2, "accepted": 1, "rejected": 1,
                                                         "reasons": {"non_utf8": 1}}


@pytest.mark.parametrize("value", [b"\xff", bytearray(b"x"), {1, 2}, object()])
def test_api_rows_with_bytes_or_objects_are_a_clear_error_naming_the_row(value, tmp_path):
    from raycurate.errors import InputError
    from raycurate.stages.tables import write_source

    rows = [{"prompt": "p", "response": "r"}, {"prompt": value, "response": "r"}]
    with pytest.raises(InputError, match="row 1 of the rows given: "):
        write_source(rows, tmp_path / "in")


def test_api_bytes_value_fails_before_ray_and_names_the_row(tmp_path, monkeypatch):
    import raycurate
    import raycurate.stages.runtime
    from raycurate.errors import InputError

    def no_ray(*args, **kwargs):  # "before Ray" even when another test of this process left Ray running
        raise AssertionError("the call started Ray before refusing the row")

    monkeypatch.setattr(raycurate.stages.runtime, "init_ray", no_ray)
    with pytest.raises(InputError, match="row 0 of the rows given: bytes are not text"):
        raycurate.ingest([{"prompt": b"\xff", "response": "r"}], workdir=tmp_path / "w")


def test_api_accepts_a_pandas_dataframe(tmp_path):
    pd = pytest.importorskip("pandas")
    from raycurate.stages.tables import in_memory_kind, write_source

    frame = pd.DataFrame([_row(1), _row(2), {"prompt": "q", "response": None}])
    assert in_memory_kind(frame) == "pandas"
    folder = write_source(frame, tmp_path / "in")
    assert _ingest_folder(folder, tmp_path / "out") == {"input": 3, "accepted": 2, "rejected": 1,
                                                         "reasons": {"missing_field": 1}}


@pytest.mark.parametrize("source", [[], ()], ids=["empty_list", "empty_tuple"])
def test_api_empty_rows_create_no_workspace(source, tmp_path):
    import raycurate
    from raycurate.errors import InputError

    with pytest.raises(InputError, match="cannot read an empty"):
        raycurate.ingest(source, workdir=tmp_path / "w")
    assert not (tmp_path / "w").exists()


def test_api_empty_table_creates_no_workspace(tmp_path):
    import pyarrow as pa

    import raycurate
    from raycurate.errors import InputError

    with pytest.raises(InputError, match="holds no rows"):
        raycurate.ingest(pa.table({"prompt": pa.array([], pa.string())}), workdir=tmp_path / "w")
    assert not (tmp_path / "w").exists()


def test_api_holds_the_workspace_lock_from_writing_inputs_until_the_call_ends(tmp_path):
    import contextlib
    import threading

    from raycurate.api import _source_inputs, _with_workdir, job_config
    from raycurate.rundir import RunDirError, acquire_lock, release_lock

    cfg = _with_workdir(job_config("ingest", "sft"), str(tmp_path / "w"))
    errors: list[BaseException] = []

    def other() -> None:
        try:
            acquire_lock((tmp_path / "w").resolve())
            release_lock((tmp_path / "w").resolve())
        except RunDirError as exc:
            errors.append(exc)

    with contextlib.ExitStack() as stack:
        (folder,) = _source_inputs([_row(1)], cfg, stack)
        assert Path(folder).is_dir()
        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
        assert len(errors) == 1 and "in use" in str(errors[0])
    worker = threading.Thread(target=other)
    worker.start()
    worker.join()
    assert len(errors) == 1  # released when the call's stack closes


def test_api_temporary_workspace_is_removed_with_its_last_result():
    import gc
    import pickle

    from raycurate.api import Result, _TempWorkspace

    workspace = _TempWorkspace()
    path = Path(workspace.path)
    first = Result(workdir=str(path), stage="s", output="o", metrics={}, config=None, _workspace=workspace)
    second = Result(workdir=str(path), stage="t", output="o", metrics={}, config=None, _workspace=workspace)
    assert pickle.loads(pickle.dumps(first))._workspace == str(path)  # a copy does not own the folder
    del workspace, first
    gc.collect()
    assert path.is_dir()
    del second
    gc.collect()
    assert not path.exists()


def test_api_keyword_types_are_checked_before_anything_runs(tmp_path):
    import raycurate
    from raycurate.config.loader import ConfigError

    with pytest.raises(ConfigError,
                       match=r"raycurate\.bds_weights\(\) has 1 problem: online must be a bool, got str 'yes'"):
        raycurate.bds_weights([_row(1)], online="yes", workdir=tmp_path / "w")
    with pytest.raises(ConfigError, match=r"raycurate\.train\(\) has 1 problem: name must be a str"):
        raycurate.train([_row(1)], name=3, workdir=tmp_path / "w")
    assert not (tmp_path / "w").exists()


# ------------------------------------------------------------------------------------------------------------
# A few cases as a real process: the message is the only thing on stderr, no traceback
# ------------------------------------------------------------------------------------------------------------

PROCESS_CASES = [
    (("run", "{in}/job.yaml", "train.lrr=1"), "did you mean train.lr?"),
    (("ingest", "--input", "{in}/nope.jsonl", "--out", OUT), "nope.jsonl: no such file"),
    (("ingest", "--input", "{in}/x.bin", "--out", OUT), "unsupported format (.bin)"),
    (("train", "--data", "{in}/job.yaml", "--out", OUT), "unsupported format (.yaml)"),
]


@pytest.mark.parametrize("argv,says", PROCESS_CASES, ids=["config_typo", "missing_input", "garbage", "yaml_as_data"])
def test_bad_input_in_a_real_process(argv, says, tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "job.yaml").write_text("pipeline: sft\n")
    (tmp_path / "in" / "x.bin").write_bytes(os.urandom(64))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "raycurate.cli.main", *_expand(argv, tmp_path / "in")],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("raycurate: ") and says in done.stderr
    assert done.stdout == "" and not (tmp_path / "runs").exists()


# Cases of issue 27 tested outside the table: test function -> (kind, number of inputs it tries).
ROUND_2 = {
    "test_remote_manifest_cannot_name_internal_folders": ("error", 5),
    "test_ingest_into_a_run_with_a_broken_manifest_is_a_clear_error": ("error", 4),
    "test_a_second_thread_is_refused_like_a_second_process": ("error", 1),
    "test_api_rows_with_a_lone_surrogate_reject_that_row": ("rejected", 1),
    "test_api_rows_with_bytes_or_objects_are_a_clear_error_naming_the_row": ("error", 4),
    "test_api_bytes_value_fails_before_ray_and_names_the_row": ("error", 1),
    "test_api_accepts_a_pandas_dataframe": ("handled", 1),
    "test_api_empty_rows_create_no_workspace": ("error", 2),
    "test_api_empty_table_creates_no_workspace": ("error", 1),
    "test_api_holds_the_workspace_lock_from_writing_inputs_until_the_call_ends": ("handled", 1),
    "test_api_temporary_workspace_is_removed_with_its_last_result": ("handled", 1),
    "test_api_keyword_types_are_checked_before_anything_runs": ("error", 2),
}


def _round_2(kind: str) -> int:
    return sum(n for k, n in ROUND_2.values() if k == kind)


FIGURES = {
    # table + symlink loop + lock/stale/tamper/credentials + real processes + issue 27's cases outside the table
    "tried": len(CASES) + 1 + 4 + len(PROCESS_CASES) + sum(n for _, n in ROUND_2.values()),
    "clear_errors": sum(c.kind == "error" for c in CASES) + _round_2("error"),
    "rejected_with_reason": sum(c.kind == "rejected" for c in CASES) + _round_2("rejected"),
    "handled": sum(c.kind == "handled" for c in CASES) + _round_2("handled"),
    # Every case asserts that no traceback is printed and that input == accepted + rejected (with the expected
    # numbers), so the suite passing means none of either:
    "tracebacks": 0,
    "silent_losses": 0,
}


def test_figures_for_the_issue_note():
    """The table's own counts (printed with -s), so the closing note quotes numbers the suite checks."""
    print(FIGURES)
    assert all(callable(globals().get(name)) for name in ROUND_2), "ROUND_2 names a test that does not exist"
    assert FIGURES["clear_errors"] + FIGURES["rejected_with_reason"] + FIGURES["handled"] == \
        len(CASES) + sum(n for _, n in ROUND_2.values())


@pytest.mark.slow
@pytest.mark.ray
def test_train_on_all_rejected_rows_says_zero_accepted_before_any_model_work(tmp_path, monkeypatch, capsys):
    """`train` where every row is rejected: ingest (which now runs before base_model) stops the run with the counts
    and the path of rejected.jsonl, instead of a missing-folder traceback in tokenize."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.jsonl").write_bytes(_lines([b"{oops", {"prompt": "p"}]))
    code = main(["train", "--data", "bad.jsonl", "--out", OUT, "ray.num_cpus=2", "run.progress=false"])
    err = capsys.readouterr().err
    (message,) = [x for x in err.splitlines() if x.startswith("raycurate:")]
    assert code == 2 and "ingest accepted 0 of 2 rows" in message and "rejected.jsonl" in message
    stages = json.loads((tmp_path / OUT / "manifest.json").read_text())["stages"]
    assert "base_model" not in stages and "tokenize" not in stages
