"""Streaming readers for the corpus formats: JSON lines (plain or compressed), parquet and HF ``save_to_disk`` folders.

:func:`plan_inputs` expands paths, folders and globs (sorted, so row order is deterministic) and lists every file
not read with its reason; :func:`resolve_inputs` opens parquet footers and HF datasets before any row is read, so a
corrupt input fails up front; :func:`file_format` picks the reader from the path; :func:`iter_raw_rows` yields
:class:`RawRow` objects, one per line, array element or parquet/HF row, a bad line becoming one rejected row
(``non_utf8``, ``malformed_json``, ``wrong_type``, ``unreadable_file``).  Formats, encodings, line numbers and
rejections: docs/data.md, "Input" and "Rejections".
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

from raycurate.data.schema import MALFORMED_JSON, NON_UTF8, UNREADABLE_FILE, WRONG_TYPE
from raycurate.errors import InputError

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
COMPRESSION_SUFFIXES = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd"}
PARQUET_SUFFIXES = (".parquet",)
HF_MARKERS = ("dataset_info.json", "state.json")
HF_DICT_MARKER = "dataset_dict.json"
SUPPORTED = ("JSON lines (.jsonl/.ndjson/.json, also .gz/.bz2/.xz/.zst compressed), parquet (.parquet), "
             "HF save_to_disk folders, folders and globs of those")
_BATCH_ROWS = 4096
_CHUNK_BYTES = 1 << 20
_WHOLE_JSON_LIMIT = 256 << 20  # a .json object file larger than this is read as JSON lines


class InputNotFound(InputError, FileNotFoundError):
    """An input path, glob or folder that yields no file to read."""


@dataclass
class InputPlan:
    """What :func:`plan_inputs` found: the inputs to read, and every file under a folder / glob it will not read.

    Attributes:
        inputs: Readable inputs in read order.
        unread: ``{"path", "reason"}`` per skipped file or folder, in discovery order.
    """

    inputs: list[InputFile] = field(default_factory=list)
    unread: list[dict[str, str]] = field(default_factory=list)


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
    compression: str | None = None

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


def _split_compression(path: str) -> tuple[str, str | None]:
    lower = path.lower()
    for suffix, codec in COMPRESSION_SUFFIXES.items():
        if lower.endswith(suffix):
            return lower[: -len(suffix)], codec
    return lower, None


def file_format(path: str) -> tuple[str, str | None] | None:
    """``(format, compression)`` of a file path, or ``None`` when the suffix is not a supported one."""
    base, codec = _split_compression(path)
    if base.endswith(JSONL_SUFFIXES):
        return "jsonl", codec
    if base.endswith(PARQUET_SUFFIXES) and codec is None:
        return "parquet", None
    return None


NOT_REGULAR = "not a regular file (a FIFO, device or socket), not read"


def _unsupported_reason(path: str, listed: bool = False) -> str:
    name = os.path.basename(path)
    suffix = "".join(re.findall(r"\.[^.]+", name)[-2:]) or "no suffix"
    return f"unsupported format ({suffix})" + ("" if listed else f"; supported: {SUPPORTED}")


def _expand_folder(path: str, plan: InputPlan) -> list[str]:
    """Supported files under ``path`` (sorted); every other file / skipped folder is added to ``plan.unread``."""
    found = []
    for root, dirs, files in os.walk(path):
        kept = []
        for d in sorted(dirs):
            full = os.path.join(root, d)
            if d.startswith("."):
                plan.unread.append({"path": full, "reason": "hidden folder (name starts with '.'), not searched"})
            elif os.path.islink(full):
                plan.unread.append({"path": full, "reason": "symlinked folder, not followed (pass it directly)"})
            else:
                kept.append(d)
        dirs[:] = kept
        for f in sorted(files):
            full = os.path.join(root, f)
            if f.startswith("."):
                plan.unread.append({"path": full, "reason": "hidden file (name starts with '.')"})
            elif not os.path.exists(full):
                plan.unread.append({"path": full, "reason": "broken or looping symlink"})
            elif not os.path.isfile(full):  # never opened: reading a FIFO blocks, a device never ends
                plan.unread.append({"path": full, "reason": NOT_REGULAR})
            elif file_format(full) is None:
                plan.unread.append({"path": full, "reason": _unsupported_reason(full, listed=True)})
            else:
                found.append(full)
    return sorted(found)


def _hf_inputs(path: str) -> list[InputFile]:
    import datasets

    try:
        loaded = datasets.load_from_disk(path)
    except Exception as exc:  # noqa: BLE001 - datasets raises many types; re-raise one clear error
        fix = "save it with Dataset.save_to_disk"
        raise InputError(f"{path}: could not open HF dataset folder ({_one_line(exc)}); {fix}") from None
    if isinstance(loaded, datasets.DatasetDict):
        return [InputFile(path, "hf", name) for name in sorted(loaded)]
    return [InputFile(path, "hf")]


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def _check_parquet(path: str) -> None:
    import pyarrow.parquet as pq

    try:
        pq.ParquetFile(path).close()
    except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid/OSError; re-raise one clear error
        fix = "re-export it or remove it from the inputs"
        raise InputError(f"{path}: not a readable parquet file ({_one_line(exc)}); {fix}") from None


def _check_readable(path: str) -> None:
    try:
        with open(path, "rb") as fh:
            fh.read(1)
    except OSError as exc:
        raise InputError(f"{path}: cannot be read ({exc.strerror or exc}); check its permissions") from None


def _add_file(path: str, plan: InputPlan, *, given: bool) -> None:
    fmt = file_format(path)
    if fmt is None:
        if given:
            raise InputError(f"{path}: {_unsupported_reason(path)}; convert it to JSON lines or parquet")
        plan.unread.append({"path": path, "reason": _unsupported_reason(path, listed=True)})
        return
    _check_readable(path)
    if fmt[0] == "parquet":
        _check_parquet(path)
    plan.inputs.append(InputFile(path, fmt[0], compression=fmt[1]))


def _add_path(path: str, plan: InputPlan, *, given: bool) -> None:
    if not isinstance(path, str) or not path.strip():
        raise InputError(f"input path {path!r} is empty; pass a jsonl/parquet file, folder, glob or HF dataset folder")
    if _is_glob(path) and not os.path.exists(path):
        matches = sorted(glob.glob(path, recursive=True))
        if not matches:
            raise InputNotFound(f"{path}: glob matched no files; expected {SUPPORTED}")
        before = len(plan.inputs)
        for match in matches:
            _add_path(match, plan, given=False)
        if len(plan.inputs) == before:
            reasons = "; ".join(f"{u['path']}: {u['reason']}" for u in plan.unread[-3:])
            raise InputNotFound(f"{path}: glob matched {len(matches)} path(s) but no readable input ({reasons})")
    elif os.path.isdir(path):
        if _is_hf_folder(path):
            plan.inputs.extend(_hf_inputs(path))
            return
        before = len(plan.unread)
        files = _expand_folder(path, plan)
        if not files:
            skipped = plan.unread[before:]
            listed = "; ".join(f"{os.path.relpath(u['path'], path)}: {u['reason']}" for u in skipped[:3])
            more = f" (+{len(skipped) - 3} more)" if len(skipped) > 3 else ""
            found = f"; found only {len(skipped)} unreadable: {listed}{more}" if skipped else ""
            raise InputNotFound(f"{path}: folder has no input files{found}; expected {SUPPORTED}")
        for f in files:
            _add_file(f, plan, given=False)
    elif os.path.isfile(path):
        _add_file(path, plan, given=given)
    elif os.path.exists(path):
        if not given:
            plan.unread.append({"path": path, "reason": NOT_REGULAR})
            return
        raise InputError(f"{path}: {NOT_REGULAR}; pass a jsonl/parquet file or folder")
    elif os.path.islink(path):
        raise InputNotFound(f"{path}: broken or looping symlink; point it at a jsonl/parquet file or folder")
    else:
        raise InputNotFound(f"{path}: no such file or folder; expected {SUPPORTED}")


def plan_inputs(paths: str | list[str]) -> InputPlan:
    """Expand paths, folders and globs into readable inputs, opening columnar files to fail early.

    Args:
        paths: One path or a list of paths, folders, HF dataset folders or glob patterns.

    Returns:
        :class:`InputPlan`: the inputs in a deterministic order (the given order, each folder / glob expanded
        sorted) and every file under a folder / glob that will not be read, with the reason.

    Raises:
        InputNotFound: A path does not exist, a glob matches nothing readable, or a folder holds no input files.
        InputError: A file given directly has an unsupported format or is an unreadable parquet / HF dataset.
    """
    if isinstance(paths, str):
        paths = [paths]
    if not paths:
        raise InputError("no input paths given; pass at least one jsonl/parquet file, folder or HF dataset folder")
    plan = InputPlan()
    for path in paths:
        _add_path(os.fspath(path) if isinstance(path, os.PathLike) else path, plan, given=True)
    return plan


_BLANK_PROBE_BYTES = 1 << 16
_BOMS = (b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")


def _is_blank_file(inp: InputFile) -> bool:
    """Whether an uncompressed JSON / JSON-lines file holds nothing but whitespace (small files only)."""
    if inp.format != "jsonl" or inp.compression is not None:
        return False
    try:
        if os.path.getsize(inp.path) > _BLANK_PROBE_BYTES:
            return False
        with open(inp.path, "rb") as fh:
            data = fh.read(_BLANK_PROBE_BYTES)
    except OSError:
        return False
    for bom in _BOMS:
        data = data.removeprefix(bom)
    return not data.strip(b" \t\r\n\x00")


def require_rows(plan: InputPlan, key: str = "") -> None:
    """Refuse a plan whose every input is an empty (or whitespace-only) file, before anything is written.

    Args:
        key: The config key the inputs came from, named in the error (e.g. ``data.trusted_input``).

    Raises:
        InputError: Naming the empty files (the same words as ingest's own check on compressed inputs).
    """
    if plan.inputs and all(_is_blank_file(inp) for inp in plan.inputs):
        names = ", ".join(inp.source for inp in plan.inputs[:5])
        raise InputError(f"{key + ': ' if key else ''}all inputs are empty (no rows in {names}); check the input "
                         "paths")


def resolve_inputs(paths: str | list[str]) -> list[InputFile]:
    """The readable inputs of :func:`plan_inputs` (files it skips under folders / globs are not returned)."""
    return plan_inputs(paths).inputs


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


def _open_binary(inp: InputFile) -> Any:
    """A binary file object over the decompressed bytes of ``inp``."""
    if inp.compression == "gzip":
        import gzip

        return gzip.open(inp.path, "rb")
    if inp.compression == "bz2":
        import bz2

        return bz2.open(inp.path, "rb")
    if inp.compression == "xz":
        import lzma

        return lzma.open(inp.path, "rb")
    if inp.compression == "zstd":
        import pyarrow as pa

        return pa.input_stream(inp.path, compression="zstd")
    return open(inp.path, "rb")


def _iter_byte_lines(fh: Any) -> Iterator[bytes]:
    """Lines (with their ``\\n``) of a binary stream that may only support ``read(n)``."""
    rest = b""
    read = getattr(fh, "read1", fh.read)  # read1: what is decodable now, so a truncated stream keeps its prefix
    while True:
        chunk = read(_CHUNK_BYTES)
        if not chunk:
            break
        parts = (rest + chunk).split(b"\n")
        rest = parts.pop()
        for part in parts:
            yield part + b"\n"
    if rest:
        yield rest


def _sniff(inp: InputFile) -> bytes:
    """The first decompressed bytes (empty when even they cannot be read: the line reader reports that)."""
    try:
        with _open_binary(inp) as fh:
            return fh.read(4096)
    except (OSError, EOFError, ValueError):
        return b""


_UTF32_BOMS = {b"\xff\xfe\x00\x00": "utf-32-le", b"\x00\x00\xfe\xff": "utf-32-be"}
_UTF16_BOMS = {b"\xff\xfe": "utf-16-le", b"\xfe\xff": "utf-16-be"}


def wide_encoding(head: bytes) -> tuple[str, int] | None:
    """``(encoding, BOM length)`` for UTF-16 / UTF-32 text (by BOM, or by NUL bytes for BOM-less UTF-16)."""
    for bom, enc in _UTF32_BOMS.items():
        if head.startswith(bom):
            return enc, 4
    for bom, enc in _UTF16_BOMS.items():
        if head.startswith(bom):
            return enc, 2
    sample = head[:512]
    if len(sample) >= 8 and sample.count(0) * 3 >= len(sample):
        even_nul = sample[0::2].count(0)
        odd_nul = sample[1::2].count(0)
        if odd_nul > 3 * even_nul:
            return "utf-16-le", 0
        if even_nul > 3 * odd_nul:
            return "utf-16-be", 0
    return None


def _first_byte(head: bytes) -> bytes:
    return head.lstrip(b"\xef\xbb\xbf").lstrip()[:1]


def _next_element(text: str, pos: int, column: int | None) -> int | None:
    """Start of the next array element after a parse failure at ``pos`` (``,`` then ``{``), or None.

    With a multi-line array only a ``{`` in the same column as the first element counts, so a nested object
    inside the broken element is not mistaken for the next element.
    """
    for match in re.finditer(r",\s*\{", text[pos:]):
        start = pos + match.end() - 1
        if column is None or start - (text.rfind("\n", 0, start) + 1) == column:
            return start
    return None


def _iter_json_array(inp: InputFile, text: str) -> Iterator[RawRow]:
    """Elements of a JSON array text; a syntax error costs only the broken stretch (one ``malformed_json`` row)."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    index = 0
    column: int | None = None
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        index += 1
        if column is None and "\n" in text[:pos]:
            column = pos - (text.rfind("\n", 0, pos) + 1)
        try:
            value, end = decoder.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError) as exc:
            line = text.count("\n", 0, pos) + 1
            where = f"element {index} (line {line})"
            detail = f"invalid JSON array {where}: {getattr(exc, 'msg', exc)}"
            resume = _next_element(text, pos, column)
            raw = text[pos:resume] if resume is not None else text[pos:].rstrip().removesuffix("]")
            yield RawRow(inp.source, index, None, (MALFORMED_JSON, None, detail), raw.strip().rstrip(","))
            if resume is None:
                break
            pos = resume
            continue
        pos = end
        if isinstance(value, dict):
            yield RawRow(inp.source, index, value, None)
        else:
            detail = f"expected a JSON object, got {type(value).__name__}"
            yield RawRow(inp.source, index, None, (WRONG_TYPE, None, detail), json.dumps(value, default=str))


def _read_text(inp: InputFile, encoding: str) -> str:
    with _open_binary(inp) as fh:
        return fh.read().decode(encoding)


def _whole_json(inp: InputFile, head: bytes) -> Iterator[RawRow] | None:
    """Rows of a ``.json`` file that is one array or one object, or None when it should be read as JSON lines."""
    base, _ = _split_compression(inp.path)
    first = _first_byte(head)
    if not base.endswith(".json") or first not in (b"[", b"{"):
        return None
    if first == b"{" and os.path.getsize(inp.path) > _WHOLE_JSON_LIMIT:
        return None
    try:
        text = _read_text(inp, "utf-8-sig")
    except UnicodeDecodeError as exc:
        return iter([RawRow(inp.source, 1, None, (NON_UTF8, None, f"file is not valid UTF-8 ({exc.reason})"), "")])
    if first == b"[":
        return _iter_json_array(inp, text)
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None  # not one object: JSON lines
    return iter([RawRow(inp.source, 1, value, None)])


def _iter_wide(inp: InputFile, encoding: str, bom: int) -> Iterator[RawRow]:
    """JSON lines in UTF-16 / UTF-32: decoded whole, then numbered by physical line."""
    with _open_binary(inp) as fh:
        data = fh.read()[bom:]
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as exc:
        detail = f"file looks like {encoding.upper()} but does not decode ({exc.reason} at byte {exc.start})"
        yield RawRow(inp.source, 1, None, (NON_UTF8, None, f"{detail}; re-save it as UTF-8"), "")
        return
    for line_no, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            yield _parse_json_line(inp.source, line_no, line.rstrip("\r"))


def _iter_jsonl(inp: InputFile) -> Iterator[RawRow]:
    head = _sniff(inp)
    wide = wide_encoding(head)
    if wide is not None:
        yield from _iter_wide(inp, *wide)
        return
    whole = _whole_json(inp, head)
    if whole is not None:
        yield from whole
        return
    line_no = 0
    try:
        with _open_binary(inp) as fh:
            for data in _iter_byte_lines(fh):
                line_no += 1
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
    except (OSError, EOFError, ValueError) as exc:  # truncated / corrupt compressed stream
        detail = (f"file could not be read past line {line_no} ({_one_line(exc)}); the rest of the file is lost: "
                  "re-create or re-download it")
        yield RawRow(inp.source, line_no + 1, None, (UNREADABLE_FILE, None, detail), "")


def _iter_parquet(inp: InputFile) -> Iterator[RawRow]:
    import pyarrow.parquet as pq

    line = 0
    with pq.ParquetFile(inp.path) as pf:
        total = pf.metadata.num_rows
        try:
            for batch in pf.iter_batches(batch_size=_BATCH_ROWS):
                for record in batch.to_pylist():
                    line += 1
                    yield RawRow(inp.source, line, record, None)
        except (OSError, ValueError) as exc:  # ArrowInvalid / ArrowIOError: a corrupt page
            detail = f"parquet data could not be read after row {line} ({_one_line(exc)}); re-export the file"
            for lost in range(line + 1, max(total, line + 1) + 1):
                yield RawRow(inp.source, lost, None, (UNREADABLE_FILE, None, detail), "")


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
