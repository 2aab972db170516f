"""In-memory data in and out of a run directory, for the Python API (:mod:`raycurate.api`).

* :func:`write_source` turns rows held in memory (a list of dicts, a ``pyarrow.Table``, a pandas DataFrame, a
  Hugging Face ``datasets.Dataset`` or a ``ray.data.Dataset``) into files the ingest stage reads, in a
  content-addressed folder, so the same rows give the same path and a re-run skips ingest.
* :func:`read_dataset` opens a stage's parquet output as a ``ray.data.Dataset``.
* :func:`heldout_stage` and :func:`external_model_stage` record a held-out set and a model folder as stages, so
  :func:`raycurate.stages.model_stages.evaluate_stage` can read them like the pipelines' ``corpus`` and
  ``train_*`` stages.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from raycurate.errors import InputError
from raycurate.rundir import RunDir
from raycurate.stages.base import StageOutput, run_stage

SOURCE_PREFIX = "source-"


def is_ray_dataset(obj: Any) -> bool:
    """Whether ``obj`` is a ``ray.data.Dataset`` (without importing Ray when the caller never did)."""
    if "ray.data" not in sys.modules:
        return False
    import ray.data

    return isinstance(obj, ray.data.Dataset)


def _is_hf_dataset(obj: Any) -> bool:
    return type(obj).__module__.startswith("datasets.") and hasattr(obj, "to_parquet")


def _is_pandas(obj: Any) -> bool:
    # pandas 3 reports DataFrame.__module__ as "pandas", pandas 2 as "pandas.core.frame"
    return type(obj).__module__.split(".")[0] == "pandas" and hasattr(obj, "to_parquet")


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return value.tolist()
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError("bytes are not text; decode them first (value.decode('utf-8')) or drop the field")
    raise TypeError(f"a {type(value).__name__} value cannot be stored; give str, numbers, bools, None, lists or dicts")


def _jsonl_line(row: dict, index: int) -> bytes:
    """One row as a UTF-8 JSON line.  Text that UTF-8 cannot hold (a lone surrogate) is written as a JSON escape,
    so ingest rejects that row with a reason (``non_utf8``) instead of the whole write failing.

    Raises:
        InputError: A value is not JSON data (bytes, a set, an object), naming the row.
    """
    try:
        text = json.dumps(row, default=_json_default, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise InputError(f"row {index} of the rows given: {exc}") from None
    try:
        return text.encode("utf-8") + b"\n"
    except UnicodeEncodeError:
        return json.dumps(row, default=_json_default, ensure_ascii=True).encode("ascii") + b"\n"


def in_memory_kind(source: Any) -> str | None:
    """``rows`` / ``arrow`` / ``pandas`` / ``hf`` / ``ray`` for data held in memory, None for anything else."""
    import pyarrow as pa

    if is_ray_dataset(source):
        return "ray"
    if isinstance(source, pa.Table):
        return "arrow"
    if _is_pandas(source):
        return "pandas"
    if _is_hf_dataset(source):
        return "hf"
    if isinstance(source, (list, tuple)) and source and all(isinstance(r, dict) for r in source):
        return "rows"
    return None


def _write(source: Any, kind: str, folder: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind == "rows":
        with open(folder / "rows.jsonl", "wb") as fh:
            for index, row in enumerate(source):
                fh.write(_jsonl_line(row, index))
    elif kind == "arrow":
        pq.write_table(source, folder / "rows.parquet")
    elif kind == "pandas":
        pq.write_table(pa.Table.from_pandas(source, preserve_index=False), folder / "rows.parquet")
    elif kind == "hf":
        source.to_parquet(str(folder / "rows.parquet"))
    elif kind == "ray":
        source.write_parquet(str(folder))
    else:  # pragma: no cover - callers check in_memory_kind first
        raise ValueError(kind)


def _folder_digest(folder: Path) -> str:
    """Hash of the files' contents, independent of their names (Ray names the files it writes at random)."""
    digests = sorted(hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir() if p.is_file())
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()[:16]


def check_source(source: Any) -> str:
    """The :func:`in_memory_kind` of ``source``, after checking that it holds rows (before anything is written).

    Raises:
        InputError: ``source`` is not in-memory rows of a supported kind, or is empty.
    """
    kind = in_memory_kind(source)
    if kind is None:
        what = f"an empty {type(source).__name__}" if isinstance(source, (list, tuple)) and not source \
            else type(source).__name__
        raise InputError(f"cannot read {what} as rows; pass path(s), a non-empty list of dicts, a "
                         "pyarrow.Table, a pandas DataFrame, a datasets.Dataset or a ray.data.Dataset")
    if kind in ("arrow", "pandas", "hf") and len(source) == 0:
        raise InputError(f"the {type(source).__name__} given holds no rows; pass at least one row")
    return kind


def write_source(source: Any, inputs_dir: str | Path) -> str:
    """Write in-memory rows under ``inputs_dir/source-<content hash>/`` and return that folder.

    The same rows give the same folder (its files keep their size and modification time), so the ingest stage's
    input fingerprint is unchanged and a re-run skips ingest and everything after it; other ``source-*`` folders
    (earlier inputs of the workspace) are removed.

    Args:
        source: A non-empty list of dicts (written as jsonl, so each row is validated on its own line), a
            ``pyarrow.Table``, a pandas DataFrame, a Hugging Face ``datasets.Dataset`` or a ``ray.data.Dataset``
            (written by Ray as parquet files, in parallel).
        inputs_dir: Folder of the workspace holding converted inputs.

    Raises:
        InputError: ``source`` is none of these, or holds no row.
    """
    kind = check_source(source)
    inputs_dir = Path(inputs_dir)
    inputs_dir.mkdir(parents=True, exist_ok=True)
    for stale in inputs_dir.glob(".*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=".source.", suffix=".tmp", dir=inputs_dir))
    try:
        _write(source, kind, tmp)
        files = [p for p in tmp.iterdir() if p.is_file()]
        if not files:
            raise InputError(f"the {type(source).__name__} given holds no rows")
        final = inputs_dir / f"{SOURCE_PREFIX}{_folder_digest(tmp)}"
        if not final.exists():
            os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for other in inputs_dir.glob(f"{SOURCE_PREFIX}*"):
        if other != final:
            shutil.rmtree(other, ignore_errors=True)
    return str(final)


def source_rows(source: Any) -> list[dict]:
    """All rows of a small source (a held-out set) as dicts: in-memory data, or a jsonl / parquet file path.

    Raises:
        InputError: A path that is neither jsonl nor parquet, or an unsupported object.
    """
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise InputError(f"held-out set {path} is not a file; pass a jsonl or parquet file, or the rows")
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        try:
            return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        except ValueError as exc:
            raise InputError(f"held-out set {path} is not jsonl ({exc}); pass a jsonl or parquet file") from None
    kind = in_memory_kind(source)
    if kind == "rows":
        return [dict(r) for r in source]
    if kind == "ray":
        return source.take_all()
    if kind == "arrow":
        return source.to_pylist()
    if kind in ("pandas", "hf"):
        return list(source.to_dict(orient="records")) if kind == "pandas" else source.to_list()
    raise InputError(f"cannot read {type(source).__name__} as held-out rows; pass a jsonl / parquet path, a list "
                     "of dicts, a pyarrow.Table or a ray.data.Dataset")


def read_table(path: Path) -> Any:
    """A parquet file, or a folder of parquet parts in name order, as one ``pyarrow.Table``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not path.is_dir():
        return pq.read_table(path)
    parts = [pq.read_table(p) for p in sorted(path.glob("*.parquet"))]
    return pa.concat_tables(parts, promote_options="default") if parts else pa.table({})


def read_dataset(source: Any) -> Any:
    """A stage's parquet output (a file or a folder of parts; or a ``pyarrow.Table`` already read) as a
    ``ray.data.Dataset``, in file order."""
    import pyarrow as pa
    import ray.data

    if isinstance(source, pa.Table):
        return ray.data.from_arrow(source)
    return ray.data.read_parquet(str(source))


def heldout_stage(run: RunDir, stage: str, rows: list[dict], force: bool = False) -> dict:
    """Record held-out rows (``id``, ``prompt``, ``response``, ``label.answer``) as ``<stage>/heldout.jsonl``, the
    output :func:`raycurate.stages.model_stages.evaluate_stage` reads; the stage hash covers the rows' content.

    Raises:
        InputError: No rows, or a row without ``id``, ``prompt`` or ``label.answer``.
    """
    if not rows:
        raise InputError("the held-out set holds no rows")
    for index, row in enumerate(rows):
        missing = [k for k in ("id", "prompt") if not row.get(k)]
        if not isinstance(row.get("label"), dict) or "answer" not in row["label"]:
            missing.append("label.answer")
        if missing:
            raise InputError(f"held-out row {index} (id {row.get('id')!r}) lacks {', '.join(missing)}; evaluation "
                             "needs id, prompt, response and the gold final answer in label.answer")
    text = "".join(json.dumps(r, default=_json_default, ensure_ascii=False, sort_keys=True) + "\n" for r in rows)

    def body(out: Path) -> StageOutput:
        (out / "heldout.jsonl").write_text(text, encoding="utf-8")
        return StageOutput(outputs={"heldout": "heldout.jsonl"}, metrics={"heldout_rows": len(rows)})

    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return run_stage(run, stage, body, config={"heldout_sha256": digest}, force=force)


def external_model_stage(run: RunDir, stage: str, model_dir: str | Path, force: bool = False) -> dict:
    """Record a checkpoint folder (a ``model`` symlink) as a model stage; the hash covers its path and the
    modification times of its files, so a changed checkpoint re-runs what reads it."""
    from raycurate.models.loading import check_model_source

    path = Path(model_dir).resolve()
    check_model_source(str(path), key="model_dir")

    def body(out: Path) -> StageOutput:
        os.symlink(path, out / "model", target_is_directory=True)
        return StageOutput(outputs={"model": "model"}, metrics={"model_dir": str(path)})

    files = {p.name: int(p.stat().st_mtime) for p in sorted(path.iterdir()) if p.is_file()}
    return run_stage(run, stage, body, config={"model_dir": str(path), "files": files}, force=force)
