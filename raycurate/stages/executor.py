"""The one executor of "a model over rows": every map of the stages goes through :func:`map_model_over_rows`.

A map is a UDF (a callable class built once per worker, ``udf(**udf_kwargs)(pyarrow.Table) -> pyarrow.Table``),
:class:`PoolResources` (workers, CPUs and GPUs each, rows per batch) and ``warm`` (reuse worker processes).  The
input's kind picks the back-end: a ``ray.data.Dataset`` (parquet read lazily) streams through a Ray Data actor
pool; :class:`ShardedInput` (a parquet path and a shard folder) is mapped in resumable shards by an actor pool
(:mod:`raycurate.stages.sharded`); ``list[dict]`` (small, in memory: held-out questions) goes to Ray tasks, the
one back-end whose workers can be warm, and comes back as the UDF's tables in input order.  Why each back-end:
``docs/design.md``, "One executor for maps".
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

from raycurate.config.pool import ActorPoolConfig
from raycurate.rundir import RunDir
from raycurate.stages.base import StageOutput, run_stage, scratch_dir
from raycurate.stages.runtime import actor_cpus, cluster_cpus, cluster_gpus
from raycurate.stages.sharded import (
    SHARDS_DIR,
    Shard,
    ShardFailed,
    ShardWorker,
    list_input_files,
    plan_key,
    plan_shards,
    prepare_shards_dir,
    udf_name,
    verify_coverage,
)

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger("raycurate")

_IN_FLIGHT_PER_ACTOR = 2  # one running, one queued: a shard actor never waits for the driver


# ----------------------------------------------------------------------------------------------------------
# The spec
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PoolResources:
    """Resolved resources of one map: workers (actors or tasks), CPUs and GPUs each, rows per UDF call."""

    num_actors: int
    num_cpus: float
    num_gpus: float
    batch_size: int


@dataclasses.dataclass(frozen=True)
class ShardedInput:
    """A parquet input mapped in resumable shards (the format and resume rules: :mod:`raycurate.stages.sharded`).

    Args:
        path: Parquet file or folder of parquet files (read in file-name order).
        out_dir: Output folder; parts and markers go to ``<out_dir>/shards/``.  Keep it between runs to resume.
        shard_rows: Input rows per shard (the unit of resume).
        in_process: Map the shards one after another in the driver (one UDF instance, no actors, Ray not needed;
            same plan, markers, parts and resume): for cheap CPU UDFs on inputs small enough that starting worker
            processes costs more than the map.
        max_restarts: Restarts of a crashed actor.
        max_task_retries: Retries of a shard task (after a crash or a UDF exception).
    """

    path: str | os.PathLike
    out_dir: str | os.PathLike
    shard_rows: int
    in_process: bool = False
    max_restarts: int = 3
    max_task_retries: int = 3


def resolve_pool(cfg: ActorPoolConfig, total_cpus: float | None = None,
                 total_gpus: float | None = None) -> PoolResources:
    """Turn a pool config into concrete per-actor resources for the current cluster.

    Args:
        cfg: Pool config.
        total_cpus: Cluster CPUs (read from Ray when None).
        total_gpus: Cluster GPUs (read from Ray when None).
    """
    total_cpus = cluster_cpus() if total_cpus is None else total_cpus
    total_gpus = cluster_gpus() if total_gpus is None else total_gpus
    num_gpus = cfg.gpus_per_actor if cfg.gpus_per_actor is not None else (1.0 if total_gpus >= 1 else 0.0)
    num_actors = cfg.num_actors
    if num_gpus > 0 and total_gpus > 0:
        num_actors = min(num_actors, max(1, int(total_gpus // num_gpus)))
    return PoolResources(
        num_actors=num_actors,
        num_cpus=actor_cpus(cfg.cpus_per_actor, num_actors, total_cpus),
        num_gpus=num_gpus,
        batch_size=cfg.batch_size,
    )


# ----------------------------------------------------------------------------------------------------------
# The entry point
# ----------------------------------------------------------------------------------------------------------


@overload
def map_model_over_rows(source: list[dict], udf: Callable, udf_kwargs: dict, resources: PoolResources | None, *,
                        warm: bool = ..., progress: bool = ..., batch_format: str = ...) -> pa.Table: ...


@overload
def map_model_over_rows(source: ShardedInput, udf: Callable, udf_kwargs: dict, resources: PoolResources | None, *,
                        warm: bool = ..., progress: bool = ..., batch_format: str = ...) -> dict: ...


@overload
def map_model_over_rows(source: Any, udf: Callable, udf_kwargs: dict, resources: PoolResources | None, *,
                        warm: bool = ..., progress: bool = ..., batch_format: str = ...) -> Any: ...


def map_model_over_rows(source: Any, udf: Callable, udf_kwargs: dict, resources: PoolResources | None, *,
                        warm: bool = False, progress: bool = True, batch_format: str = "pyarrow") -> Any:
    """Map ``udf`` over the rows of ``source`` on the back-end its kind names (module docstring).

    Args:
        source: A ``ray.data.Dataset``: returns the mapped (lazy) ``Dataset``, in input order where the caller
            set ``preserve_order``.  A :class:`ShardedInput`: writes ``<out_dir>/shards`` and returns the map's
            metrics (``{shards, shards_skipped, shards_computed, rows, rows_computed, seconds, rows_per_s, plan,
            shards_dir}``).  A ``list[dict]``: returns the UDF's output tables concatenated in input order, with
            the UDF's Arrow types (an empty table for no rows).
        udf: Callable class ``udf(**udf_kwargs)(batch: pyarrow.Table) -> pyarrow.Table``, importable (or pickled
            by value) on the workers; on a ``Dataset`` with ``resources=None`` a plain function
            ``udf(batch, **udf_kwargs)``, which Ray Data runs on tasks with its own batch size.
        udf_kwargs: Constructor arguments (JSON-able for a :class:`ShardedInput`: they enter its plan key).
        resources: Workers, CPUs and GPUs each, and rows per UDF call (:func:`resolve_pool`).
        warm: Let the workers run in, and leave behind, reusable processes (imports and Python paid once per run):
            only for ``list[dict]`` inputs; the other back-ends start their actors for one map.
        progress: Progress bar over shards or batches (a ``Dataset`` follows :func:`configure_data_context`).
        batch_format: The batch type a ``Dataset``'s UDF sees.

    Raises:
        ValueError: ``warm`` asked of an actor-pool back-end, or no ``resources`` where they are needed.
        TypeError: ``source`` is none of the kinds above.
    """
    if isinstance(source, (ShardedInput, list)):
        if warm and isinstance(source, ShardedInput):
            raise ValueError("warm=True needs in-memory rows (the task back-end): sharded maps start their actors "
                             "for one map")
        if resources is None:
            raise ValueError(f"mapping {type(source).__name__} input needs resources (resolve_pool)")
        if isinstance(source, ShardedInput):
            return _map_shards(source, udf, udf_kwargs, resources, progress=progress)
        return _map_on_tasks(source, udf, udf_kwargs, resources, progress=progress, warm=warm)
    import ray.data

    if not isinstance(source, ray.data.Dataset):
        raise TypeError(f"map_model_over_rows maps a ray.data.Dataset, a ShardedInput or a list of row dicts, "
                        f"not {type(source).__name__}")
    if warm:
        raise ValueError("warm=True needs in-memory rows (the task back-end): a Ray Data pool lives for one map")
    return _map_on_ray_data(source, udf, udf_kwargs, resources, batch_format=batch_format)


# ----------------------------------------------------------------------------------------------------------
# Ray Data back-end (streamed parquet inputs)
# ----------------------------------------------------------------------------------------------------------


def configure_data_context(*, progress: bool) -> Any:
    """Driver-side Ray Data settings of a run: progress bars follow ``run.progress`` (Ray Data's own default is on,
    which floods the logs of non-interactive jobs and Tune trials).  Returns the current ``DataContext``."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = bool(progress)
    return ctx


def progress_bars_enabled() -> bool:
    """Whether the run shows driver-side progress bars (``run.progress``, set by :func:`configure_data_context`)."""
    import ray.data

    return bool(ray.data.DataContext.get_current().enable_progress_bars)


def dataset_from_rows(rows: list[dict], rows_per_block: int | None = None) -> Any:
    """A ``ray.data.Dataset`` of in-memory rows in blocks of about ``rows_per_block`` rows (None: Ray's default).

    ``ray.data.from_items`` defaults to ~200 blocks, one read task each: for the few hundred rows of a held-out
    eval or a probe plan that scheduling alone took ~11 s of a 29 s eval stage on 2 cores (17.5 s with batch-sized
    blocks; ``benchmarks/RESULTS.md``, 2026-12-04).
    """
    import ray.data

    if rows_per_block is None:
        return ray.data.from_items(rows)
    return ray.data.from_items(rows, override_num_blocks=max(1, -(-len(rows) // max(1, rows_per_block))))


def _map_on_ray_data(ds: Any, udf: Callable, udf_kwargs: dict, pool: PoolResources | None, *,
                     batch_format: str) -> Any:
    """``ds.map_batches``: a fixed-size actor pool of the class ``udf``, or Ray Data tasks of a function when
    ``pool`` is None."""
    import ray.data

    if pool is None:
        return ds.map_batches(udf, fn_kwargs=udf_kwargs, batch_format=batch_format)
    name = getattr(udf, "__name__", type(udf).__name__)
    log.info("%s: %d actors x (%.2f CPU, %.2f GPU), batch %d", name, pool.num_actors, pool.num_cpus,
             pool.num_gpus, pool.batch_size)
    # A small parquet file is read as ONE block, and a block goes to one actor: re-block to batch-sized blocks
    # (streaming, order kept) so every actor of the pool gets work.
    ds = ds.repartition(target_num_rows_per_block=pool.batch_size)
    return ds.map_batches(
        udf,
        fn_constructor_kwargs=udf_kwargs,
        batch_size=pool.batch_size,
        batch_format=batch_format,
        compute=ray.data.ActorPoolStrategy(size=pool.num_actors),
        num_cpus=pool.num_cpus,
        num_gpus=pool.num_gpus,
    )


# ----------------------------------------------------------------------------------------------------------
# Task back-end (small in-memory inputs; warm or cold workers)
# ----------------------------------------------------------------------------------------------------------


def row_groups(rows: list[dict], group_rows: int) -> list[list[dict]]:
    """``rows`` cut into consecutive groups of ``group_rows`` (the last may be shorter)."""
    if group_rows < 1:
        raise ValueError(f"group_rows must be >= 1, got {group_rows}")
    return [rows[i:i + group_rows] for i in range(0, len(rows), group_rows)]


def _map_groups(udf: Callable, udf_kwargs: dict, groups: list[list[dict]]) -> Iterator[pa.Table]:
    """Task body: build ``udf`` once, then yield its output table for each group in order."""
    import pyarrow as pa

    fn = udf(**udf_kwargs)
    for group in groups:
        yield fn(pa.Table.from_pylist(group))


def concat_in_order(tables: list[pa.Table]) -> pa.Table:
    """One table of ``tables`` in order; empty for none.  Column types are unified across batches (pyarrow's
    permissive promotion: an all-null batch column takes the others' type, and numeric types widen)."""
    import pyarrow as pa

    return pa.concat_tables(tables, promote_options="permissive") if tables else pa.table({})


def _map_on_tasks(rows: list[dict], udf: Callable, udf_kwargs: dict, pool: PoolResources, *, progress: bool,
                  warm: bool) -> pa.Table:
    """``udf`` over ``rows`` in groups of ``pool.batch_size`` on ``pool.num_actors`` concurrent Ray tasks; the
    output tables concatenated in input order.

    Group ``g`` goes to task ``g % tasks``; each task builds ``udf(**udf_kwargs)`` once (one model load) and streams
    back one table per group, so the UDF sees the batches of a Ray Data ``map_batches`` with
    ``batch_size=pool.batch_size`` over the rows in order.  Ray retries a task whose worker dies.  Cold
    (``max_calls=1``): each task's process exits after it, so no model-sized heap passes to whatever task Ray
    schedules there next (a reused process once carried a real-model training's 6.8 GB into the next one); warm:
    the process, with its imports, serves the next task (4.3 s of imports for two tasks in a fresh Ray, 0.02 s
    after), for small models whose evaluation is mostly imports.
    """
    import ray
    from tqdm import tqdm

    groups = row_groups(rows, pool.batch_size)
    tasks = min(pool.num_actors, len(groups))
    name = getattr(udf, "__name__", type(udf).__name__)
    log.info("%s: %d tasks x (%.2f CPU, %.2f GPU), %d groups of <= %d rows", name, tasks, pool.num_cpus,
             pool.num_gpus, len(groups), pool.batch_size)
    remote = ray.remote(max_calls=0 if warm else 1)(_map_groups).options(
        num_cpus=pool.num_cpus, num_gpus=pool.num_gpus, num_returns="streaming")
    streams = [remote.remote(udf, udf_kwargs, groups[k::tasks]) for k in range(tasks)]
    tables: list = [None] * len(groups)
    with tqdm(total=len(groups), desc=f"{name} groups", unit="group", disable=not progress) as bar:
        for k, stream in enumerate(streams):
            for j, ref in enumerate(stream):
                tables[k + j * tasks] = ray.get(ref)  # task k's j-th group is group k + j * tasks
                bar.update(1)
    return concat_in_order(tables)


# ----------------------------------------------------------------------------------------------------------
# Shard back-end (resumable maps over parquet inputs)
# ----------------------------------------------------------------------------------------------------------


def _map_shards(spec: ShardedInput, udf: Any, udf_kwargs: dict, pool: PoolResources, *,
                progress: bool) -> dict:
    """Map ``udf`` over ``spec.path`` shard by shard on an actor pool (or in the driver), skipping finished shards.

    ``pool.batch_size`` rows per UDF call inside a shard.  Ray must already be initialised
    (:func:`raycurate.stages.runtime.init_ray`) unless ``spec.in_process``.

    Raises:
        ShardFailed: A shard failed after all retries (finished shards stay; re-run to resume).
        ShardCoverageError: The parts do not account for every input row exactly once.
    """
    import ray
    from tqdm import tqdm

    if pool.num_actors < 1 and not spec.in_process:
        raise ValueError(f"num_actors must be >= 1, got {pool.num_actors}")
    if not spec.in_process and not ray.is_initialized():
        raise RuntimeError("a sharded map needs a running Ray: call raycurate.stages.runtime.init_ray() first")
    started = time.perf_counter()
    files = list_input_files(spec.path)
    total_rows = sum(f.rows for f in files)
    shards = plan_shards(total_rows, spec.shard_rows)
    key = plan_key(files, spec.shard_rows, udf, udf_kwargs)
    shards_dir = Path(spec.out_dir) / SHARDS_DIR
    done = prepare_shards_dir(shards_dir, shards, key)
    todo = collections.deque(s for s in shards if s.index not in done)
    name = getattr(udf, "__name__", type(udf).__name__)
    log.info("sharded map %s: %d rows, %d shards (%d done, %d to compute), %s", name, total_rows, len(shards),
             len(done), len(todo), "in process" if spec.in_process else
             f"{pool.num_actors} actors x ({pool.num_cpus:.2f} CPU, {pool.num_gpus:.2f} GPU)")
    worker_args = (udf, udf_kwargs, files, str(shards_dir), key, pool.batch_size)
    bar = tqdm(total=len(shards), initial=len(done), desc=f"{name} shards", unit="shard", disable=not progress)
    actors: list = []
    try:
        if spec.in_process:
            worker = ShardWorker(*worker_args) if todo else None
            while worker is not None and todo:
                worker.process(todo.popleft())
                bar.update(1)
        else:
            actor_cls = ray.remote(num_cpus=pool.num_cpus, num_gpus=pool.num_gpus, max_restarts=spec.max_restarts,
                                   max_task_retries=spec.max_task_retries)(ShardWorker)
            actors = [actor_cls.remote(*worker_args) for _ in range(min(pool.num_actors, max(len(todo), 1)))] \
                if todo else []
            _keep_actors_busy(actors, todo, bar)
    finally:
        bar.close()
        for actor in actors:
            ray.kill(actor)
    verify_coverage(shards_dir, shards, total_rows)
    seconds = time.perf_counter() - started
    rows_computed = total_rows - sum(s.rows for s in shards if s.index in done)
    return {"shards": len(shards), "shards_skipped": len(done), "shards_computed": len(shards) - len(done),
            "rows": total_rows, "rows_computed": rows_computed, "seconds": round(seconds, 3),
            "rows_per_s": round(rows_computed / seconds, 1) if seconds > 0 else 0.0, "plan": key,
            "shards_dir": str(shards_dir)}


def _keep_actors_busy(actors: list, todo: collections.deque, bar: Any) -> None:
    """Keep every actor busy with up to ``_IN_FLIGHT_PER_ACTOR`` shards until ``todo`` is empty; the driver
    receives only the small marker dicts, so its memory does not grow with the input."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    in_flight: dict[Any, tuple[Shard, Any]] = {}

    def submit(actor: Any) -> None:
        shard = todo.popleft()
        in_flight[actor.process.options(retry_exceptions=True).remote(shard)] = (shard, actor)

    for _ in range(_IN_FLIGHT_PER_ACTOR):
        for actor in actors:
            if todo:
                submit(actor)
    while in_flight:
        ready, _ = ray.wait(list(in_flight), num_returns=1)
        shard, actor = in_flight.pop(ready[0])
        try:
            ray.get(ready[0])
        except (RayActorError, RayTaskError) as exc:
            raise ShardFailed(f"shard {shard.name} (input rows [{shard.start}, {shard.stop})) failed after all "
                              "retries; finished shards are kept, so fix the cause and re-run to resume. "
                              f"Cause: {exc}") from exc
        bar.update(1)
        if todo:
            submit(actor)


def sharded_stage(
    run: RunDir,
    stage: str,
    input_path: str | os.PathLike,
    udf_cls: type,
    ctor_kwargs: dict,
    resources: Any,
    *,
    shard_rows: int,
    config: Any,
    upstream: list[str],
    force: bool = False,
    progress: bool = True,
) -> dict:
    """A sharded map (:func:`map_model_over_rows` of a :class:`ShardedInput`) as a resumable
    run stage; outputs ``<stage>/shards`` (parts + markers).

    Shards are computed in ``_scratch/<stage>/shards`` (which survives a killed job) and moved into the stage
    folder once all are done, so a re-run after a kill recomputes only the unfinished shards.

    Args:
        run: The run directory.
        stage: Stage name.
        input_path: Parquet file or folder (usually an upstream stage's output).
        udf_cls: Callable class, one output row per input row, in order.
        ctor_kwargs: Its constructor arguments (JSON-able).
        resources: The map's :class:`PoolResources`.
        shard_rows: Input rows per shard (the unit of resume).
        config: Everything that changes the result besides the UDF and input (hashed by ``run_stage``).
        upstream: Stages whose outputs are read.
        force: Re-run even when current (finished shards in scratch are still reused when the plan matches).
        progress: Progress bar over shards.

    Returns:
        The stage's manifest record.
    """
    scratch = scratch_dir(run, stage)

    def body(out: Path) -> StageOutput:
        metrics = map_model_over_rows(ShardedInput(input_path, scratch, shard_rows), udf_cls, ctor_kwargs, resources,
                                      progress=progress)
        os.replace(scratch / SHARDS_DIR, out / SHARDS_DIR)
        metrics["shards_dir"] = SHARDS_DIR
        return StageOutput(outputs={"shards": SHARDS_DIR}, metrics=metrics)

    record = run_stage(run, stage, body, config={"udf": udf_name(udf_cls),
                                                 "ctor_kwargs": ctor_kwargs, "config": config,
                                                 "shard_rows": shard_rows},
                       upstream=upstream, force=force)
    shutil.rmtree(scratch, ignore_errors=True)
    return record
