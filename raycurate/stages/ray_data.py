"""The Ray Data stage template: a callable UDF class run by an actor pool.

A stage is (UDF class, constructor kwargs, pool spec).  Heavy state (model, tokenizer) is built once per actor
in ``__init__``; the row logic lives in plain functions the UDF calls, so it is testable without Ray.  Resource
arithmetic (actors, CPUs/GPUs per actor, batch size) lives here only.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from raycurate.config.pool import ActorPoolConfig
from raycurate.stages.runtime import actor_cpus, cluster_cpus, cluster_gpus

log = logging.getLogger("raycurate")


@dataclasses.dataclass(frozen=True)
class PoolResources:
    """Resolved resources of one actor pool."""

    num_actors: int
    num_cpus: float
    num_gpus: float
    batch_size: int


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


def dataset_from_rows(rows: list[dict], rows_per_block: int) -> Any:
    """A ``ray.data.Dataset`` of in-memory rows in blocks of about ``rows_per_block`` rows.

    ``ray.data.from_items`` defaults to ~200 blocks, one read task each: for the few hundred rows of a held-out
    eval or a probe plan that scheduling alone took ~11 s of a 29 s eval stage on 2 cores (17.5 s with batch-sized
    blocks; ``benchmarks/RESULTS.md``, 2026-12-04).
    """
    import ray.data

    return ray.data.from_items(rows, override_num_blocks=max(1, -(-len(rows) // max(1, rows_per_block))))


def map_with_actor_pool(ds: Any, udf: type, ctor_kwargs: dict, pool: PoolResources, **map_kwargs: Any) -> Any:
    """``ds.map_batches`` with a fixed-size actor pool of ``udf`` (pyarrow batches in and out).

    Args:
        ds: A ``ray.data.Dataset``.
        udf: Callable class ``udf(**ctor_kwargs)(batch: pyarrow.Table) -> pyarrow.Table``.
        ctor_kwargs: Constructor arguments (built once per actor).
        pool: Resolved resources.
        **map_kwargs: Extra ``map_batches`` arguments (e.g. ``max_restarts`` via ray_remote_args).
    """
    import ray.data

    log.info(
        "%s: %d actors x (%.2f CPU, %.2f GPU), batch %d", udf.__name__, pool.num_actors, pool.num_cpus,
        pool.num_gpus, pool.batch_size,
    )
    # A small parquet file is read as ONE block, and a block goes to one actor: re-block to batch-sized blocks
    # (streaming, order kept) so every actor of the pool gets work.
    ds = ds.repartition(target_num_rows_per_block=pool.batch_size)
    return ds.map_batches(
        udf,
        fn_constructor_kwargs=ctor_kwargs,
        batch_size=pool.batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=pool.num_actors),
        num_cpus=pool.num_cpus,
        num_gpus=pool.num_gpus,
        **map_kwargs,
    )
