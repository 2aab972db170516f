"""Map a callable class over in-memory rows on Ray tasks (held-out evaluation), one model load per task.

Ray can hand a finished task's idle worker process to the next task, which pays the Python, torch and
transformers imports once per run (two tasks that import them and load the embedded model: 4.3 s in a fresh Ray
instance, 0.02 s after that). ``reuse_workers`` says whether to: yes for small models (the caller decides, e.g.
:func:`raycurate.models.loading.is_small_checkpoint`), where the imports are most of an evaluation; no for real
models (``max_calls=1``), whose processes exit so that no model-sized heap passes to the next task (a reused process
once carried a real-model training's 6.8 GB into the next one; imports are ~3% of a SmolLM2 evaluation).

For small in-memory inputs such as the held-out questions of an evaluation; large inputs stay on Ray Data or
:func:`raycurate.stages.sharded.sharded_map` (which stream, shard and resume).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from raycurate.stages.ray_data import PoolResources

log = logging.getLogger("raycurate")


def row_groups(rows: list[dict], group_rows: int) -> list[list[dict]]:
    """``rows`` cut into consecutive groups of ``group_rows`` (the last may be shorter)."""
    if group_rows < 1:
        raise ValueError(f"group_rows must be >= 1, got {group_rows}")
    return [rows[i:i + group_rows] for i in range(0, len(rows), group_rows)]


def _map_groups(udf: type, ctor_kwargs: dict, groups: list[list[dict]]) -> Iterator[list[dict]]:
    """Task body: build ``udf`` once, then yield its output rows for each group in order."""
    import pyarrow as pa

    fn = udf(**ctor_kwargs)
    for group in groups:
        yield fn(pa.Table.from_pylist(group)).to_pylist()


def map_rows_on_tasks(rows: list[dict], udf: type, ctor_kwargs: dict, pool: PoolResources, *,
                      progress: bool = True, reuse_workers: bool = False) -> list[dict]:
    """Apply ``udf`` to ``rows`` in groups of ``pool.batch_size`` on ``pool.num_actors`` concurrent Ray tasks.

    Group ``g`` goes to task ``g % tasks``; each task builds ``udf(**ctor_kwargs)`` once (one model load) and streams
    back one result per group.  The UDF sees the same groups as a Ray Data ``map_batches`` with
    ``batch_size=pool.batch_size`` over the rows in order.  Ray retries a task whose worker dies.

    Args:
        rows: Input rows (JSON-like dicts).
        udf: Callable class ``udf(**ctor_kwargs)(batch: pyarrow.Table) -> pyarrow.Table``; must be importable on
            the workers.
        ctor_kwargs: Constructor arguments.
        pool: Resources per task (``num_cpus``, ``num_gpus``), the number of tasks (``num_actors``) and the group
            size (``batch_size``).
        progress: Show a progress bar over groups.
        reuse_workers: Let the tasks run in (and leave behind) reusable worker processes instead of fresh ones.

    Returns:
        The output rows of every group, in the tasks' order (sort them by a key if the order matters).
    """
    import ray
    from tqdm import tqdm

    groups = row_groups(rows, pool.batch_size)
    tasks = min(pool.num_actors, len(groups))
    log.info("%s: %d tasks x (%.2f CPU, %.2f GPU), %d groups of <= %d rows", udf.__name__, tasks, pool.num_cpus,
             pool.num_gpus, len(groups), pool.batch_size)
    # max_calls=1: each task loads its model once and streams all its groups; its process then exits rather than
    # hand a model-sized heap to whatever task Ray schedules on it next (a training, another evaluation).
    remote = ray.remote(max_calls=0 if reuse_workers else 1)(_map_groups).options(
        num_cpus=pool.num_cpus, num_gpus=pool.num_gpus, num_returns="streaming")
    streams = [remote.remote(udf, ctor_kwargs, groups[k::tasks]) for k in range(tasks)]
    out: list[dict] = []
    with tqdm(total=len(groups), desc=f"{udf.__name__} groups", unit="group", disable=not progress) as bar:
        for stream in streams:
            for ref in stream:
                out.extend(ray.get(ref))
                bar.update(1)
    return out
