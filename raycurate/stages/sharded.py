"""Shards of a parquet input: the plan, part and marker files and resume rules of the executor's sharded maps.

The input (a parquet file, or a folder read in file-name order) is cut into shards of ``shard_rows`` rows by global
row index; a :class:`ShardWorker` (one UDF instance) reads a shard straight from the input files and writes, each
atomically, ``<out_dir>/shards/part-00000.parquet`` (the UDF output + ``row_index``) and then its ``.done`` marker.
A re-run skips every shard whose marker is valid (same plan key: input files, ``shard_rows``, UDF and arguments).
No Ray here: :func:`raycurate.stages.executor.map_model_over_rows` schedules the shards on its actors; the format,
the failure handling and the resume rules are in ``docs/design.md``, "One executor for maps".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from raycurate.rundir import atomic_file, atomic_write_json

log = logging.getLogger("raycurate")

ROW_INDEX = "row_index"
SHARDS_DIR = "shards"


class ShardCoverageError(RuntimeError):
    """The shard outputs do not account for every input row exactly once."""


class ShardFailed(RuntimeError):
    """A shard still failed after every retry; completed shards are kept, so a re-run resumes."""


@dataclasses.dataclass(frozen=True)
class InputFile:
    """One parquet input file and its row count (from the footer, no data read)."""

    path: str
    rows: int
    size: int
    mtime_ns: int


@dataclasses.dataclass(frozen=True)
class Shard:
    """Rows ``[start, stop)`` of the input, in global row-index order."""

    index: int
    start: int
    stop: int

    @property
    def name(self) -> str:
        return f"part-{self.index:05d}"

    @property
    def rows(self) -> int:
        return self.stop - self.start


# ----------------------------------------------------------------------------------------------------------
# Planning (driver)
# ----------------------------------------------------------------------------------------------------------


def list_input_files(input_path: str | os.PathLike) -> list[InputFile]:
    """The parquet files of ``input_path`` in read order, with row counts.

    Args:
        input_path: A parquet file, or a folder whose ``*.parquet`` files (hidden ones excluded) are read in
            file-name order.

    Raises:
        FileNotFoundError: The path does not exist or the folder holds no parquet file.
    """
    import pyarrow.parquet as pq

    path = Path(input_path)
    if path.is_dir():
        paths = sorted(p for p in path.glob("*.parquet") if not p.name.startswith((".", "_")))
        if not paths:
            raise FileNotFoundError(f"no parquet files in {path}; pass a parquet file or a folder of them")
    elif path.is_file():
        paths = [path]
    else:
        raise FileNotFoundError(f"sharded map input {path} does not exist")
    files = []
    for p in paths:
        stat = p.stat()
        files.append(InputFile(str(p.resolve()), pq.ParquetFile(p).metadata.num_rows, stat.st_size, stat.st_mtime_ns))
    return files


def plan_shards(total_rows: int, shard_rows: int) -> list[Shard]:
    """Cut ``total_rows`` rows into consecutive shards of ``shard_rows`` (the last one may be shorter)."""
    if shard_rows < 1:
        raise ValueError(f"shard_rows must be >= 1, got {shard_rows}")
    return [Shard(k, start, min(start + shard_rows, total_rows))
            for k, start in enumerate(range(0, total_rows, shard_rows))]


def udf_name(udf_cls: type) -> str:
    """The UDF class's qualified name, as plan keys and stage hashes record it."""
    return f"{udf_cls.__module__}.{udf_cls.__qualname__}"


def plan_key(files: list[InputFile], shard_rows: int, udf_cls: type, ctor_kwargs: dict) -> str:
    """Hash of everything that fixes the shard outputs: input files, shard size, UDF and its arguments."""
    payload = {
        "files": [[os.path.basename(f.path), f.rows, f.size, f.mtime_ns] for f in files],
        "shard_rows": shard_rows,
        "udf": udf_name(udf_cls),
        "ctor_kwargs": ctor_kwargs,
    }
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------------------
# Shard I/O (actors and driver)
# ----------------------------------------------------------------------------------------------------------


def read_row_range(files: list[InputFile], start: int, stop: int) -> Any:
    """Rows ``[start, stop)`` of the concatenated input files as one ``pyarrow.Table``.

    Only the row groups that overlap the range are read.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    pieces = []
    file_start = 0
    for f in files:
        file_stop = file_start + f.rows
        lo, hi = max(start, file_start), min(stop, file_stop)
        if lo < hi:
            pieces.append(_read_file_range(pq.ParquetFile(f.path), lo - file_start, hi - file_start))
        file_start = file_stop
    if not pieces:
        raise ValueError(f"row range [{start}, {stop}) is outside the input ({file_start} rows)")
    return pa.concat_tables(pieces, promote_options="permissive") if len(pieces) > 1 else pieces[0]


def _read_file_range(parquet: Any, lo: int, hi: int) -> Any:
    """Rows ``[lo, hi)`` of one parquet file, reading only the overlapping row groups."""
    groups: list[int] = []
    first_row: int | None = None
    offset = 0
    for g in range(parquet.metadata.num_row_groups):
        n = parquet.metadata.row_group(g).num_rows
        if offset < hi and offset + n > lo:
            groups.append(g)
            first_row = offset if first_row is None else first_row
        offset += n
    assert first_row is not None, f"rows [{lo}, {hi}) do not overlap the file (the caller checks)"
    table = parquet.read_row_groups(groups)
    return table.slice(lo - first_row, hi - lo)


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def part_path(shards_dir: str | os.PathLike, shard: Shard) -> Path:
    return Path(shards_dir) / f"{shard.name}.parquet"


def marker_path(shards_dir: str | os.PathLike, shard: Shard) -> Path:
    return Path(shards_dir) / f"{shard.name}.done"


def part_files(shards_dir: str | os.PathLike) -> list[Path]:
    """The part files of a finished map, in row order (what a downstream stage reads)."""
    return sorted(Path(shards_dir).glob("part-*.parquet"))


def read_marker(shards_dir: str | os.PathLike, shard: Shard) -> dict | None:
    """The shard's completion marker, or None when absent or unreadable."""
    try:
        return json.loads(marker_path(shards_dir, shard).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def marker_is_valid(shards_dir: str | os.PathLike, shard: Shard, key: str) -> bool:
    """True when the shard's marker matches this plan and its part file is there with the recorded checksum."""
    marker = read_marker(shards_dir, shard)
    if marker is None or marker.get("plan") != key or marker.get("input_rows") != [shard.start, shard.stop]:
        return False
    part = part_path(shards_dir, shard)
    return part.exists() and marker.get("rows") == shard.rows and marker.get("sha256") == file_sha256(part)


def write_shard(shards_dir: str | os.PathLike, shard: Shard, table: Any, key: str, seconds: float) -> dict:
    """Write a shard's part file, then its marker, each atomically; return the marker."""
    import pyarrow.parquet as pq

    final = part_path(shards_dir, shard)
    # A retried task may race an earlier attempt of the same shard: atomic_file gives each its own temp name.
    with atomic_file(final) as tmp:
        pq.write_table(table, tmp)
    marker = {"shard": shard.index, "rows": table.num_rows, "input_rows": [shard.start, shard.stop],
              "sha256": file_sha256(final), "plan": key, "seconds": round(seconds, 3), "pid": os.getpid(),
              "finished": time.time()}
    atomic_write_json(marker_path(shards_dir, shard), marker)
    return marker


def with_row_index(table: Any, shard: Shard) -> Any:
    """Append ``row_index`` (global input row indices of the shard); check it when the UDF already kept one."""
    import numpy as np
    import pyarrow as pa

    expected = np.arange(shard.start, shard.stop, dtype=np.int64)
    if ROW_INDEX in table.column_names:
        if not np.array_equal(table[ROW_INDEX].to_numpy(), expected):
            raise ShardCoverageError(f"shard {shard.name}: the UDF output has a '{ROW_INDEX}' column that is not "
                                     f"[{shard.start}, {shard.stop}); the UDF must keep rows in input order")
        return table
    return table.append_column(ROW_INDEX, pa.array(expected, type=pa.int64()))


def apply_udf(udf: Any, table: Any, batch_rows: int | None) -> Any:
    """``udf`` over ``table`` (whole, or in ``batch_rows`` slices), checking one output row per input row."""
    import pyarrow as pa

    step = batch_rows or max(table.num_rows, 1)
    outputs = []
    for offset in range(0, table.num_rows, step):
        batch = table.slice(offset, step)
        out = udf(batch)
        if out.num_rows != batch.num_rows:
            raise ValueError(f"{type(udf).__name__} returned {out.num_rows} rows for a batch of {batch.num_rows}; "
                             "a sharded map UDF must return exactly one row per input row, in order")
        outputs.append(out)
    if not outputs:
        return udf(table)
    return pa.concat_tables(outputs) if len(outputs) > 1 else outputs[0]


class ShardWorker:
    """Actor body: builds the UDF once, then reads, maps and writes whole shards.

    Args:
        udf_cls: Callable class ``udf_cls(**ctor_kwargs)(table) -> table``.
        ctor_kwargs: Its constructor arguments.
        files: The input files (same list the driver planned with).
        shards_dir: Output folder of the part files and markers.
        key: The plan key written into every marker.
        batch_rows: Rows per UDF call (None: the whole shard in one call).
    """

    def __init__(self, udf_cls: type, ctor_kwargs: dict, files: list[InputFile], shards_dir: str, key: str,
                 batch_rows: int | None = None):
        self.udf = udf_cls(**ctor_kwargs)
        self.files = files
        self.shards_dir = shards_dir
        self.key = key
        self.batch_rows = batch_rows

    def process(self, shard: Shard) -> dict:
        """Map one shard and write it; returns the marker (a small dict: the driver never sees the rows)."""
        return map_shard(self.udf, self.files, self.shards_dir, self.key, self.batch_rows, shard)


def map_shard(udf: Any, files: list[InputFile], shards_dir: str, key: str, batch_rows: int | None,
              shard: Shard) -> dict:
    """Read ``shard``'s rows, apply ``udf``, write the part and its marker; returns the marker."""
    started = time.perf_counter()
    table = read_row_range(files, shard.start, shard.stop)
    out = with_row_index(apply_udf(udf, table, batch_rows), shard)
    return write_shard(shards_dir, shard, out, key, time.perf_counter() - started)


# ----------------------------------------------------------------------------------------------------------
# Resume bookkeeping and the final check (driver)
# ----------------------------------------------------------------------------------------------------------


def prepare_shards_dir(shards_dir: Path, shards: list[Shard], key: str) -> set[int]:
    """Create the folder, drop temp files, stale parts and invalid markers; return the indices already done."""
    shards_dir.mkdir(parents=True, exist_ok=True)
    done = set()
    for shard in shards:
        if marker_is_valid(shards_dir, shard, key):
            done.add(shard.index)
        else:
            marker_path(shards_dir, shard).unlink(missing_ok=True)
    planned = {s.name for s in shards}
    for path in shards_dir.iterdir():
        stem = path.name.split(".")[0]
        if path.name.startswith(".") or (stem.startswith("part-") and stem not in planned):
            path.unlink()
    return done


def verify_coverage(shards_dir: str | os.PathLike, shards: list[Shard], total_rows: int) -> None:
    """Check that the parts hold every input row exactly once, in order (reads only the ``row_index`` column).

    Raises:
        ShardCoverageError: A row is missing, duplicated or out of place, naming the shard.
    """
    import numpy as np
    import pyarrow.parquet as pq

    expected_start = 0
    for shard in shards:
        if shard.start != expected_start:
            raise ShardCoverageError(f"shard plan has a gap or overlap at row {expected_start} ({shard.name})")
        path = part_path(shards_dir, shard)
        if not path.exists() or read_marker(shards_dir, shard) is None:
            raise ShardCoverageError(f"{path} or its .done marker is missing; re-run to compute the shard")
        index = pq.read_table(path, columns=[ROW_INDEX])[ROW_INDEX].to_numpy()
        if not np.array_equal(index, np.arange(shard.start, shard.stop)):
            raise ShardCoverageError(f"{path} does not hold exactly input rows [{shard.start}, {shard.stop}) in "
                                     f"order ({len(index)} rows); delete it and its marker and re-run")
        expected_start = shard.stop
    if expected_start != total_rows:
        raise ShardCoverageError(f"shards cover rows [0, {expected_start}) of {total_rows}")


# ----------------------------------------------------------------------------------------------------------
# A sharded map as a run stage
# ----------------------------------------------------------------------------------------------------------
