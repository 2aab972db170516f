"""Streaming readers for the corpus formats: JSON lines, parquet and HF ``save_to_disk`` folders.

Decisions:

* Format comes from the path: ``.jsonl`` / ``.ndjson`` / ``.json`` are JSON lines (a ``.json`` file whose first
  non-blank byte is ``[`` is read as one JSON array, loaded whole, elements numbered from 1); ``.parquet`` is
  parquet; a folder with ``dataset_info.json`` / ``state.json`` (a ``Dataset``) or ``dataset_dict.json`` (a
  ``DatasetDict``, splits read in name order) is an HF dataset.  Any other folder is expanded to the supported
  files under it (recursively, sorted); a path with ``*``/``?``/``[`` is a glob (sorted).  So the row order is
  deterministic for a given set of files.
* JSON lines are read as bytes and decoded per line, so one bad line is one rejected row: invalid UTF-8 ->
  ``non_utf8``, invalid JSON -> ``malformed_json``, a JSON value that is not an object -> ``wrong_type``.
  Blank (whitespace-only) lines are skipped and not counted as input rows; ``line`` is always the physical
  1-based line number in the file, so error messages point at the right line.  A UTF-8 BOM is ignored.
* Parquet and HF rows are numbered from 1 in file order (``line`` = row number).
* Parquet footers and HF datasets are opened by :func:`resolve_inputs` before any row is read, so a corrupt or
  missing file fails the run up front instead of halfway.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Any, Iterator

from raycurate.data.schema import MALFORMED_JSON, NON_UTF8, WRONG_TYPE

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet",)
HF_MARKERS = ("dataset_info.json", "state.json")
HF_DICT_MARKER = "dataset_dict.json"
SUPPORTED = "JSON lines (.jsonl/.ndjson/.json), parquet (.parquet), HF save_to_disk folders, folders and globs of those"
_BATCH_ROWS = 4096


@dataclass(frozen=True)
class InputFile:
    """One readable input: a file, or one split of an HF dataset folder.

    Attributes:
        path: File or folder path as given (after glob/folder expansion).
        format: ``"jsonl"``, ``"parquet"`` or ``"hf"``.
        subset: Split name inside an HF ``DatasetDict`` folder, else ``None``.
    """

    path: str
    format: str
    subset: str | None = None

    @property
    def source(self) -> str:
        """Name used in provenance columns and error messages (``path`` or ``path[split]``)."""
        return self.path if self.subset is None else f"{self.path}[{self.subset}]"


@dataclass(slots=True)
class RawRow:
    """One input row before validation.

    Attributes:
        source: Input name (:attr:`InputFile.source`).
        line: 1-based line (jsonl) or row number (parquet / HF).
        record: The parsed object, or ``None`` when the row could not be parsed.
        error: ``(reason, field, detail)`` when the row could not be parsed, else ``None``.
        raw: Original line text for JSON lines; ``""`` for columnar formats (see :func:`raw_text`).
    """

    source: str
    line: int
    record: dict[str, Any] | None
    error: tuple[str, str | None, str] | None
    raw: str = ""


def raw_text(row: RawRow) -> str:
    """The row as text for ``rejected.jsonl``: the original line, or the record JSON-encoded."""
    if row.raw or row.record is None:
        return row.raw
    return json.dumps(row.record, ensure_ascii=False, default=str)


def _is_glob(path: str) -> bool:
    return any(ch in path for ch in "*?[")


def _is_hf_folder(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, name)) for name in (*HF_MARKERS, HF_DICT_MARKER))


def _file_format(path: str) -> str:
    lower = path.lower()
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if lower.endswith(PARQUET_SUFFIXES):
        return "parquet"
    raise ValueError(f"{path}: unsupported input format; supported: {SUPPORTED}")


def _expand_folder(path: str) -> list[str]:
    found = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found.extend(
            os.path.join(root, f)
            for f in files
            if not f.startswith(".") and f.lower().endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES)
        )
    if not found:
        raise FileNotFoundError(f"{path}: folder has no input files; expected {SUPPORTED}")
    return sorted(found)


def _hf_inputs(path: str) -> list[InputFile]:
    import datasets

    try:
        loaded = datasets.load_from_disk(path)
    except Exception as exc:  # noqa: BLE001 - datasets raises many types; re-raise one clear error
        fix = "save it with Dataset.save_to_disk"
        raise ValueError(f"{path}: could not open HF dataset folder ({exc}); {fix}") from exc
    if isinstance(loaded, datasets.DatasetDict):
        return [InputFile(path, "hf", name) for name in sorted(loaded)]
    return [InputFile(path, "hf")]


def _check_parquet(path: str) -> None:
    import pyarrow.parquet as pq

    try:
        pq.ParquetFile(path).close()
    except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid/OSError; re-raise one clear error
        fix = "re-export it or remove it from the inputs"
        raise ValueError(f"{path}: not a readable parquet file ({exc}); {fix}") from exc


def resolve_inputs(paths: str | list[str]) -> list[InputFile]:
    """Expand paths, folders and globs into readable inputs, opening columnar files to fail early.

    Args:
        paths: One path or a list of paths, folders, HF dataset folders or glob patterns.

    Returns:
        Inputs in a deterministic order: the given order, with each folder/glob expanded sorted.

    Raises:
        FileNotFoundError: A path does not exist, a glob matches nothing, or a folder holds no input files.
        ValueError: Unsupported format or an unreadable parquet / HF dataset.
    """
    if isinstance(paths, str):
        paths = [paths]
    if not paths:
        raise ValueError("no input paths given; pass at least one jsonl/parquet file, folder or HF dataset folder")
    inputs: list[InputFile] = []
    for path in paths:
        if _is_glob(path) and not os.path.exists(path):
            matches = sorted(glob.glob(path, recursive=True))
            if not matches:
                raise FileNotFoundError(f"{path}: glob matched no files; expected {SUPPORTED}")
            inputs.extend(resolve_inputs(matches))
        elif os.path.isdir(path):
            if _is_hf_folder(path):
                inputs.extend(_hf_inputs(path))
            else:
                inputs.extend(resolve_inputs(_expand_folder(path)))
        elif os.path.isfile(path):
            fmt = _file_format(path)
            if fmt == "parquet":
                _check_parquet(path)
            inputs.append(InputFile(path, fmt))
        else:
            raise FileNotFoundError(f"{path}: no such file or folder; expected {SUPPORTED}")
    return inputs


def _parse_json_line(source: str, line: int, text: str) -> RawRow:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        detail = f"invalid JSON: {exc.msg} at column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else str(exc)
        return RawRow(source, line, None, (MALFORMED_JSON, None, detail), text)
    if not isinstance(value, dict):
        detail = f"expected a JSON object, got {type(value).__name__}"
        return RawRow(source, line, None, (WRONG_TYPE, None, detail), text)
    return RawRow(source, line, value, None, text)


def _first_byte(path: str) -> bytes:
    with open(path, "rb") as fh:
        head = fh.read(4096).lstrip(b"\xef\xbb\xbf").lstrip()
    return head[:1]


def _iter_json_array(inp: InputFile) -> Iterator[RawRow]:
    try:
        with open(inp.path, encoding="utf-8-sig") as fh:
            values = json.load(fh)
    except UnicodeDecodeError as exc:
        yield RawRow(inp.source, 1, None, (NON_UTF8, None, f"file is not valid UTF-8 ({exc.reason})"), "")
        return
    except json.JSONDecodeError as exc:
        detail = f"invalid JSON array: {exc.msg} at line {exc.lineno} column {exc.colno}"
        yield RawRow(inp.source, exc.lineno, None, (MALFORMED_JSON, None, detail), "")
        return
    for index, value in enumerate(values, start=1):
        if isinstance(value, dict):
            yield RawRow(inp.source, index, value, None)
        else:
            detail = f"expected a JSON object, got {type(value).__name__}"
            yield RawRow(inp.source, index, None, (WRONG_TYPE, None, detail), json.dumps(value, default=str))


def _iter_jsonl(inp: InputFile) -> Iterator[RawRow]:
    if inp.path.lower().endswith(".json") and _first_byte(inp.path) == b"[":
        yield from _iter_json_array(inp)
        return
    with open(inp.path, "rb") as fh:
        for line_no, data in enumerate(fh, start=1):
            if line_no == 1:
                data = data.removeprefix(b"\xef\xbb\xbf")
            if not data.strip():
                continue
            try:
                text = data.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as exc:
                raw = data.decode("utf-8", errors="replace").rstrip("\r\n")
                detail = f"invalid UTF-8 byte at offset {exc.start}"
                yield RawRow(inp.source, line_no, None, (NON_UTF8, None, detail), raw)
                continue
            yield _parse_json_line(inp.source, line_no, text)


def _iter_parquet(inp: InputFile) -> Iterator[RawRow]:
    import pyarrow.parquet as pq

    line = 0
    with pq.ParquetFile(inp.path) as pf:
        for batch in pf.iter_batches(batch_size=_BATCH_ROWS):
            for record in batch.to_pylist():
                line += 1
                yield RawRow(inp.source, line, record, None)


def _iter_hf(inp: InputFile) -> Iterator[RawRow]:
    import datasets

    loaded = datasets.load_from_disk(inp.path)
    dataset = loaded[inp.subset] if inp.subset is not None else loaded
    line = 0
    for table in dataset.with_format("arrow").iter(batch_size=_BATCH_ROWS):
        for record in table.to_pylist():
            line += 1
            yield RawRow(inp.source, line, record, None)


_READERS = {"jsonl": _iter_jsonl, "parquet": _iter_parquet, "hf": _iter_hf}


def iter_input(inp: InputFile) -> Iterator[RawRow]:
    """Stream the rows of one resolved input (bounded memory except for ``.json`` arrays)."""
    return _READERS[inp.format](inp)


def iter_raw_rows(path: str | list[str]) -> Iterator[RawRow]:
    """Stream every row of one or more paths (files, folders, globs, HF folders) in deterministic order.

    Args:
        path: What :func:`resolve_inputs` accepts.

    Yields:
        :class:`RawRow` per non-blank line / row; parse failures carry ``error`` instead of ``record``.
    """
    for inp in resolve_inputs(path):
        yield from iter_input(inp)
