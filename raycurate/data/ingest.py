"""Streaming ingest: read -> validate -> split -> parquet shards + ``rejected.jsonl``.

:func:`ingest` reads every input (:mod:`raycurate.data.readers`), checks each record
(:mod:`raycurate.data.validate`), assigns its split and writes ``accepted-NNNNN.parquet`` shards and one
``{source, line, reason, field, detail, raw}`` object per rejected row, each file under a temporary name renamed
when complete; :class:`IngestResult` holds the counts, paths and ``json_columns`` (pass-through fields stored
JSON-encoded because their values share no one type).  Memory: one shard plus the set of seen ids.  The contract
(columns, reasons, splits): docs/data.md.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from raycurate.data.readers import InputFile, RawRow, iter_input, plan_inputs, raw_text
from raycurate.data.schema import (
    DOMAINS,
    EMPTY_FILE,
    RESERVED_COLUMNS,
    DataValidationError,
    Exclusions,
    rejected_row,
)
from raycurate.data.splits import SplitAssigner, check_ratios, without_split
from raycurate.data.validate import check_record
from raycurate.errors import InputError

log = logging.getLogger("raycurate")

ACCEPTED_PATTERN = "accepted-{index:05d}.parquet"
REJECTED_NAME = "rejected.jsonl"
_PROGRESS_EVERY = 1000
_TEXT_COLUMNS = ("id", "prompt", "response", "domain")


@dataclass
class IngestResult:
    """Row accounting and outputs of one ingest; ``rows["input"] == rows["accepted"] + rows["rejected"]``.

    Attributes:
        rows: ``{"input", "accepted", "rejected"}`` counts (blank jsonl lines are not input rows).
        rejected_by_reason: Reason code -> count.
        accepted_by_split: Split name -> count.
        accepted_by_domain: Domain -> count (``"none"`` for rows without a domain).
        files: ``{"path", "rows", "warning"}`` per input in read order.
        unread_files: ``{"path", "reason"}`` per file under an input folder / glob that was not read.
        accepted_files: Accepted parquet shards, in order.
        rejected_file: Path of ``rejected.jsonl``.
        json_columns: Pass-through fields stored JSON-encoded because their values have no common type.
        seconds: Wall time of the ingest.
    """

    rows: dict[str, int]
    rejected_by_reason: dict[str, int]
    accepted_by_split: dict[str, int]
    accepted_by_domain: dict[str, int]
    files: list[dict[str, Any]]
    accepted_files: list[str]
    rejected_file: str
    json_columns: list[str] = field(default_factory=list)
    unread_files: list[dict[str, str]] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict (for the run manifest)."""
        return asdict(self)


def _core_types() -> dict[str, Any]:
    import pyarrow as pa

    return {
        "id": pa.string(),
        "prompt": pa.string(),
        "response": pa.string(),
        "domain": pa.string(),
        "split": pa.string(),
        "source": pa.string(),
        "line": pa.int64(),
    }


def _json_encode(value: Any) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False, default=str)


def _parquet_writable(tp: Any) -> bool:
    """Whether parquet can store arrow type ``tp``: not a struct without fields (from ``{}``), at any depth."""
    import pyarrow as pa

    if pa.types.is_struct(tp):
        return tp.num_fields > 0 and all(_parquet_writable(tp.field(i).type) for i in range(tp.num_fields))
    if pa.types.is_list(tp) or pa.types.is_large_list(tp) or pa.types.is_fixed_size_list(tp):
        return _parquet_writable(tp.value_type)
    return True


class _ShardWriter:
    """Buffers accepted rows and writes parquet shards under temporary names; :meth:`finalize` publishes them."""

    def __init__(self, out_dir: str, shard_rows: int) -> None:
        if shard_rows < 1:
            raise ValueError(f"shard_rows must be >= 1, got {shard_rows}")
        self.out_dir = out_dir
        self.shard_rows = shard_rows
        self.buffer: list[dict[str, Any]] = []
        self.temp_paths: list[str] = []
        self.shard_json: list[set[str]] = []  # per shard: columns JSON-encoded in it
        self.json_columns: list[str] = []  # order of first need
        self._core = _core_types()

    def add(self, row: dict[str, Any]) -> None:
        self.buffer.append(row)
        if len(self.buffer) >= self.shard_rows:
            self._flush()

    def _column(self, name: str, values: list[Any], encoded: set[str]) -> Any:
        import pyarrow as pa

        if name in self._core:
            return pa.array(values, type=self._core[name])
        if name not in self.json_columns:
            try:
                array = pa.array(values)
                if _parquet_writable(array.type):
                    return array
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError):
                pass
            self.json_columns.append(name)
        encoded.add(name)
        return pa.array([_json_encode(v) for v in values], type=pa.string())

    def _write(self, table: Any, index: int) -> str:
        import pyarrow.parquet as pq

        path = os.path.join(self.out_dir, f".{ACCEPTED_PATTERN.format(index=index)}.tmp-{os.getpid()}")
        pq.write_table(table, path)
        return path

    def _flush(self) -> None:
        import pyarrow as pa

        names = list(self._core)
        seen = set(names)
        for row in self.buffer:
            for key in row:
                if key not in seen:
                    seen.add(key)
                    names.append(key)
        encoded: set[str] = set()
        arrays = [self._column(n, [row.get(n) for row in self.buffer], encoded) for n in names]
        table = pa.Table.from_arrays(arrays, names=names)
        self.temp_paths.append(self._write(table, len(self.temp_paths)))
        self.shard_json.append(encoded)
        self.buffer = []

    def _unified_schema(self) -> Any:
        """One schema for all shards; fields with no common type are added to ``json_columns``."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        schemas = [pq.read_schema(p) for p in self.temp_paths]
        by_name: dict[str, list[Any]] = {}
        for schema in schemas:
            for f in schema:
                by_name.setdefault(f.name, []).append(f)
        for name, fields in by_name.items():
            if name in self.json_columns or name in self._core:
                continue
            try:
                pa.unify_schemas([pa.schema([f]) for f in fields], promote_options="permissive")
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                self.json_columns.append(name)
        fixed = []
        for schema in schemas:
            fields = [pa.field(f.name, pa.string()) if f.name in self.json_columns else f for f in schema]
            fixed.append(pa.schema(fields))
        return pa.unify_schemas(fixed, promote_options="permissive")

    def _conform(self, path: str, encoded: set[str], schema: Any) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        columns = []
        for f in schema:
            if f.name not in table.column_names:
                columns.append(pa.nulls(table.num_rows, f.type))
                continue
            column = table.column(f.name)
            if f.name in self.json_columns and f.name not in encoded:
                column = pa.array([_json_encode(v) for v in column.to_pylist()], type=pa.string())
            columns.append(column.cast(f.type))
        pq.write_table(pa.Table.from_arrays(columns, schema=schema), path)

    def finalize(self) -> list[str]:
        """Flush, make every shard share one schema, and rename shards to their final names."""
        import pyarrow.parquet as pq

        if self.buffer or not self.temp_paths:
            self._flush()
        schema = self._unified_schema()
        for path, encoded in zip(self.temp_paths, self.shard_json):
            if not pq.read_schema(path).equals(schema) or set(self.json_columns) - encoded:
                self._conform(path, encoded, schema)
        finals = [os.path.join(self.out_dir, ACCEPTED_PATTERN.format(index=i)) for i in range(len(self.temp_paths))]
        for temp, final in zip(self.temp_paths, finals):
            os.replace(temp, final)
        self.temp_paths = []
        _remove_stale_shards(self.out_dir, keep=len(finals))
        return finals

    def abort(self) -> None:
        for path in self.temp_paths:
            if os.path.exists(path):
                os.remove(path)
        self.temp_paths = []


def _remove_stale_shards(out_dir: str, keep: int) -> None:
    """Delete ``accepted-*.parquet`` left by an earlier, larger ingest into the same folder."""
    for name in os.listdir(out_dir):
        if name.startswith("accepted-") and name.endswith(".parquet"):
            try:
                index = int(name[len("accepted-") : -len(".parquet")])
            except ValueError:
                continue
            if index >= keep:
                os.remove(os.path.join(out_dir, name))


def _with_provenance(record: dict[str, Any], split: str, source: str, line: int) -> dict[str, Any]:
    row = {k: record[k] for k in _TEXT_COLUMNS}
    row.update(split=split, source=source, line=line)
    for key, value in record.items():
        if key not in _TEXT_COLUMNS:
            row[f"input_{key}" if key in RESERVED_COLUMNS else key] = value
    return row


@dataclass
class _Counts:
    input: int = 0
    accepted: int = 0
    rejected_by_reason: Counter = field(default_factory=Counter)
    by_split: Counter = field(default_factory=Counter)
    by_domain: Counter = field(default_factory=Counter)


_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def _one_json_line(entry: dict[str, Any]) -> str:
    """``entry`` as JSON on one physical line for every reader: the Unicode line breaks JSON leaves raw inside
    strings (U+2028, U+2029, U+0085, which ``str.splitlines`` splits on) are escaped too."""
    return json.dumps(entry, ensure_ascii=False).translate(_LINE_BREAKS)


class _Ingest:
    """State of one ingest run: counters, writers and the seen-id set."""

    def __init__(self, out_dir: str, strict: bool, known_domains: tuple[str, ...] | list[str], shard_rows: int,
                 exclude: list[Exclusions] | None = None) -> None:
        self.strict = strict
        self.exclude = list(exclude or [])
        self.known_domains = known_domains
        self.seen_ids: set[str] = set()
        self.counts = _Counts()
        self.writer = _ShardWriter(out_dir, shard_rows)
        self.rejected_path = os.path.join(out_dir, REJECTED_NAME)
        self.rejected_temp = os.path.join(out_dir, f".{REJECTED_NAME}.tmp-{os.getpid()}")
        # backslashreplace: a rejected row's raw text may hold a lone surrogate (the reason it was rejected)
        self.rejected_fh = open(self.rejected_temp, "w", encoding="utf-8", errors="backslashreplace")

    def reject(self, raw: RawRow, reason: str, field_name: str | None, detail: str) -> None:
        if self.strict:
            raise DataValidationError(raw.source, raw.line, field_name, reason, detail)
        self.counts.rejected_by_reason[reason] += 1
        entry = rejected_row(raw.source, raw.line, reason, field_name, detail, raw_text(raw))
        self.rejected_fh.write(_one_json_line(entry) + "\n")

    def process(self, raw: RawRow, split_of: Any) -> None:
        self.counts.input += 1
        if raw.error is not None:
            self.reject(raw, *raw.error)
            return
        assert raw.record is not None, "a row without a parse error has a record"
        verdict = check_record(raw.record, seen_ids=self.seen_ids, known_domains=self.known_domains)
        if verdict.record is None:
            assert verdict.reason is not None, "a rejected record has a reason"
            self.reject(raw, verdict.reason, verdict.field, verdict.detail)
            return
        record = verdict.record
        for exclusions in self.exclude:
            overlap = exclusions.match(record)
            if overlap is not None:
                self.reject(raw, exclusions.reason, *overlap)
                return
        split = split_of(record["id"])
        self.writer.add(_with_provenance(record, split, raw.source, raw.line))
        self.counts.accepted += 1
        self.counts.by_split[split] += 1
        self.counts.by_domain[record["domain"] or "none"] += 1

    def finish(self) -> tuple[list[str], str]:
        self.rejected_fh.close()
        accepted = self.writer.finalize()
        os.replace(self.rejected_temp, self.rejected_path)
        return accepted, self.rejected_path

    def abort(self) -> None:
        self.rejected_fh.close()
        if os.path.exists(self.rejected_temp):
            os.remove(self.rejected_temp)
        self.writer.abort()


def _empty_file_check(inp: InputFile, rows: int, strict: bool) -> str | None:
    if rows:
        return None
    if strict:
        raise DataValidationError(inp.source, 0, None, EMPTY_FILE, "file has no rows")
    return "empty file: no rows"


def ingest(
    paths: str | list[str],
    out_dir: str,
    *,
    strict: bool,
    split_seed: int,
    split_ratios: dict[str, float],
    known_domains: tuple[str, ...] | list[str] = DOMAINS,
    shard_rows: int = 50_000,
    progress: bool = True,
    validation_paths: str | list[str] | None = None,
    validation_split: str = "validation",
    exclude: list[Exclusions] | None = None,
) -> IngestResult:
    """Validate and split a corpus into parquet shards, accounting for every input row.

    Args:
        paths: Input files / folders / globs / HF dataset folders (see :func:`~raycurate.data.readers.resolve_inputs`).
        out_dir: Output folder (created); earlier ``accepted-*.parquet`` there are replaced.
        strict: Raise :class:`DataValidationError` (file, line, field) on the first bad row or empty file instead
            of rejecting it.
        split_seed: Seed of the deterministic split assignment.
        split_ratios: Split name -> fraction (sums to 1), e.g. warmup 0.05 / validation 0.05 / selection 0.90.
        known_domains: Allowed ``domain`` values.
        shard_rows: Accepted rows per parquet shard.
        progress: Show a tqdm progress bar.
        validation_paths: Optional separate validation inputs.  They are read first, all their rows get split
            ``validation_split``, and the main inputs are split with ``split_ratios`` minus that split
            (rescaled).  Reading them first makes a training row that duplicates a validation row the rejected one.
        validation_split: Split name given to ``validation_paths`` rows.
        exclude: Sets a row must not overlap (same prompt or id): an overlapping row is rejected with the set's
            reason (e.g. a pool row equal to a trusted row, ``overlaps_trusted``).

    Returns:
        :class:`IngestResult`.

    Raises:
        InputError (a ValueError; :class:`~raycurate.data.readers.InputNotFound` is also a FileNotFoundError):
            missing or unreadable inputs (before any row is read), or every input empty.
        ValueError: Bad split ratios or shard size.
        DataValidationError: In strict mode, the first bad row or empty file.
    """
    from tqdm import tqdm

    start = time.perf_counter()
    check_ratios(split_ratios)
    plan: list[tuple[InputFile, str | None]] = []
    unread: list[dict[str, str]] = []
    if validation_paths:
        found = plan_inputs(validation_paths)
        plan += [(inp, validation_split) for inp in found.inputs]
        unread += found.unread
        split_ratios = without_split(split_ratios, validation_split)
    found = plan_inputs(paths)
    plan += [(inp, None) for inp in found.inputs]
    unread += found.unread
    for item in unread:
        log.warning("not read: %s (%s)", item["path"], item["reason"])
    assigner = SplitAssigner(split_seed, split_ratios)
    os.makedirs(out_dir, exist_ok=True)

    run = _Ingest(out_dir, strict, known_domains, shard_rows, exclude)
    files: list[dict[str, Any]] = []
    bar = tqdm(desc="ingest", unit="rows", disable=not progress, mininterval=0.5)
    try:
        for inp, fixed_split in plan:
            split_of = assigner if fixed_split is None else (lambda _id, s=fixed_split: s)
            rows = 0
            for raw in iter_input(inp):
                run.process(raw, split_of)
                rows += 1
                if rows % _PROGRESS_EVERY == 0:
                    bar.update(_PROGRESS_EVERY)
            bar.update(rows % _PROGRESS_EVERY)
            files.append({"path": inp.source, "rows": rows, "warning": _empty_file_check(inp, rows, strict)})
        if run.counts.input == 0:
            names = ", ".join(f["path"] for f in files)
            raise InputError(f"all inputs are empty (no rows in {names}); check the input paths")
        accepted_files, rejected_file = run.finish()
    except BaseException:
        run.abort()
        raise
    finally:
        bar.close()

    counts = run.counts
    rejected = sum(counts.rejected_by_reason.values())
    return IngestResult(
        rows={"input": counts.input, "accepted": counts.accepted, "rejected": rejected},
        rejected_by_reason=dict(sorted(counts.rejected_by_reason.items())),
        accepted_by_split=dict(sorted(counts.by_split.items())),
        accepted_by_domain=dict(sorted(counts.by_domain.items())),
        files=files,
        accepted_files=accepted_files,
        rejected_file=rejected_file,
        json_columns=list(run.writer.json_columns),
        unread_files=unread,
        seconds=round(time.perf_counter() - start, 3),
    )
