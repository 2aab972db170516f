"""Resumable stage execution.

A stage is a function ``fn(out_dir) -> StageOutput`` that writes its files into ``out_dir``.  :func:`run_stage`
gives it a temporary folder and moves that folder into ``runs/<name>/<stage>/`` only when ``fn`` returns, so a
stage's outputs are all there or not there at all.  The stage's hash covers its own config and the hashes of the
stages it reads from, so changing one stage's config re-runs that stage and everything downstream, and nothing
else.  State that must survive a crash inside a stage (Ray Train checkpoints) lives in :func:`scratch_dir`,
outside the atomic folder.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable

from raycurate.config.loader import config_hash
from raycurate.errors import UserError
from raycurate.rundir import RunDir, atomic_dir, check_stage_name

log = logging.getLogger("raycurate")


@dataclasses.dataclass
class StageOutput:
    """What a stage produced.

    Attributes:
        outputs: output name -> path relative to the stage folder (every path must exist when the stage returns).
        metrics: small JSON-able numbers worth keeping in the manifest (counts, losses, accuracies).
    """

    outputs: dict[str, str]
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)


class StageFailed(RuntimeError):
    """A stage raised; the manifest records it as ``failed`` with the error."""


class MissingColumnsError(UserError):
    """A stage's input rows lack columns its UDF reads (instead of a bare ``KeyError`` deep inside the UDF)."""


def require_columns(stage: str, batch: Any, required: Iterable[str]) -> None:
    """Check that a UDF's input batch has every column the UDF declares it reads.

    Ray Data UDF classes declare ``REQUIRED_COLUMNS`` and call this first thing in ``__call__``.

    Args:
        stage: Name of the stage running the UDF (named in the error).
        batch: A ``pyarrow.Table`` (``column_names``) or a dict of columns.
        required: Column names the UDF reads.

    Raises:
        MissingColumnsError: Naming the stage, the missing columns, the columns present and what to do.
    """
    names = getattr(batch, "column_names", None)
    present = list(batch) if names is None else list(names)
    missing = sorted(set(required) - set(present))
    if missing:
        raise MissingColumnsError(
            f"stage '{stage}': its input rows lack the column(s) {missing} (they have {sorted(present)}); the "
            "upstream stage's output does not match what this stage reads. Re-run the upstream stages with "
            "--force (their outputs may come from an older raycurate or another pipeline), or check the input files")


def stage_hash(run: RunDir, config: Any, upstream: Iterable[str]) -> str:
    """Hash of a stage's config plus the hashes of the stages it depends on."""
    upstream_hashes = []
    for name in upstream:
        record = run.stage_record(name)
        if record is None or record.get("status") != "done":
            raise StageFailed(f"stage depends on '{name}', which has not completed in {run.root}")
        upstream_hashes.append((name, record["config_hash"]))
    return config_hash(config, upstream_hashes)


def _scratch_path(run: RunDir, stage: str) -> Path:
    return run.path_of(f"_scratch/{check_stage_name(stage)}")


def scratch_dir(run: RunDir, stage: str) -> Path:
    """A persistent per-stage folder for state that must survive a crash (e.g. training checkpoints)."""
    path = _scratch_path(run, stage)
    path.mkdir(parents=True, exist_ok=True)
    return path


def clear_scratch(run: RunDir, stage: str) -> None:
    """Delete ``_scratch/<stage>``: a forced stage recomputes instead of resuming from the checkpoints or finished
    shards an earlier execution left there (with the same config hash they would be picked up as its own)."""
    path = _scratch_path(run, stage)
    if path.exists():
        log.info("stage %-14s forced: deleting its resume state %s", stage, path)
        shutil.rmtree(path)


def run_stage(
    run: RunDir,
    stage: str,
    fn: Callable[[Path], StageOutput],
    *,
    config: Any,
    upstream: Iterable[str] = (),
    force: bool = False,
) -> dict:
    """Run ``fn`` as stage ``stage`` unless its outputs are current; return the manifest record.

    Args:
        run: The run directory.
        stage: Stage name (also its folder name).
        fn: Writes outputs into the folder it is given and describes them.
        config: Everything that changes the stage's result (config sections, plain values).
        upstream: Stages whose outputs ``fn`` reads.
        force: Re-run even when current (also when ``run.is_forced(stage)``: the job's ``run.force``), from the
            start: the stage's ``_scratch`` resume state is deleted first.

    Returns:
        The stage's manifest record: ``{status, seconds, config_hash, outputs, metrics, ...}``; ``outputs`` paths
        are relative to the run root.
    """
    upstream = list(upstream)
    digest = stage_hash(run, config, upstream)
    forced = force or run.is_forced(stage)
    if not forced and run.stage_is_current(stage, digest, upstream):
        log.info("stage %-14s skipped (outputs current, hash %s)", stage, digest)
        record = run.stage_record(stage)
        assert record is not None
        return record
    log.info("stage %-14s running", stage)
    if forced:
        clear_scratch(run, stage)
    previous = run.stage_record(stage) or {}
    executions = int(previous.get("executions", 0)) + 1  # how often this stage actually ran in this run directory
    started = time.time()
    run.record_stage(stage, {"status": "running", "config_hash": digest, "upstream": upstream, "started": started,
                             "executions": executions - 1})
    try:
        with atomic_dir(run.stage_dir(stage)) as tmp:
            result = fn(tmp)
            missing = [rel for rel in result.outputs.values() if not (tmp / rel).exists()]
            if missing:
                raise StageFailed(f"stage '{stage}' declared outputs it did not write: {missing}")
    except BaseException as exc:
        run.record_stage(
            stage,
            {
                "status": "failed",
                "config_hash": digest,
                "upstream": upstream,
                "seconds": round(time.time() - started, 3),
                "error": f"{type(exc).__name__}: {exc}",
                "executions": executions - 1,
                "traceback": traceback.format_exc(limit=8),
            },
        )
        raise
    seconds = round(time.time() - started, 3)
    record = {
        "status": "done",
        "seconds": seconds,
        "config_hash": digest,
        "upstream": upstream,
        "started": started,
        "outputs": {k: f"{stage}/{v}" for k, v in result.outputs.items()},
        "metrics": result.metrics,
        "finished": time.time(),
        "executions": executions,
    }
    run.record_stage(stage, record)
    log.info("stage %-14s done in %.1f s", stage, seconds)
    return record


def output_path(run: RunDir, record_or_stage: dict | str, name: str) -> Path:
    """Absolute path of output ``name`` of a completed stage (given its record or its name)."""
    record = run.stage_record(record_or_stage) if isinstance(record_or_stage, str) else record_or_stage
    if record is None or name not in record.get("outputs", {}):
        raise KeyError(f"no output '{name}' recorded for stage {record_or_stage!r} in {run.manifest_path}")
    return run.path_of(record["outputs"][name])  # checked: a tampered manifest cannot point outside the run
