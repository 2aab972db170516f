"""Warm shard workers: actors that keep their process, imports and last model between sharded maps.

:func:`raycurate.stages.sharded.sharded_map` normally starts a pool of actors for one map and kills it at the end,
so every map pays Python, torch and transformers imports plus one model load per actor (~2-4 s per actor on a
2-core machine), and that start-up does not shrink with more actors: at 1,200 rows the 2-actor scaling of BRIDGE
scoring stayed at 1.47-1.56.  A :class:`WarmPool` holds its actors until it is closed; each actor keeps the last
UDF it built (its model) and builds a new one only when a map asks for a different UDF or different constructor
arguments (the checkpoint path among them), so consecutive maps over the same model never reload it, and maps over
another model pay the load but not the imports.

The pool's actors hold their CPU / GPU reservations for as long as it is open, so a stage that needs those
resources (a training, a Ray Data pool) cannot start inside it: open a pool around a run of maps and close it
before anything else runs (``with WarmPool(...) as pool: ...``), or call :meth:`WarmPool.release` to drop the
models while keeping the processes.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
from typing import Any

from raycurate.stages.sharded import map_shard, udf_name

log = logging.getLogger("raycurate")


def udf_identity(udf_cls: type, ctor_kwargs: dict) -> str:
    """What makes two UDF instances interchangeable: the class and its constructor arguments."""
    return json.dumps({"udf": udf_name(udf_cls), "ctor_kwargs": ctor_kwargs}, sort_keys=True, default=str)


class WarmShardWorker:
    """Actor body: maps shards of whichever UDF a map names, keeping the last UDF it built."""

    def __init__(self) -> None:
        self.udf: Any = None
        self.identity: str | None = None
        self.builds = 0

    def udf_for(self, udf_cls: type, ctor_kwargs: dict) -> Any:
        """The cached UDF when ``(udf_cls, ctor_kwargs)`` match it; else the old one is dropped and a new one built."""
        identity = udf_identity(udf_cls, ctor_kwargs)
        if identity != self.identity:
            self.release()
            self.udf = udf_cls(**ctor_kwargs)
            self.identity = identity
            self.builds += 1
        return self.udf

    def process(self, udf_cls: type, ctor_kwargs: dict, files: list, shards_dir: str, key: str,
                batch_rows: int | None, shard: Any) -> dict:
        """Map one shard with the (cached) UDF and write it; returns its marker."""
        return map_shard(self.udf_for(udf_cls, ctor_kwargs), files, shards_dir, key, batch_rows, shard)

    def release(self) -> None:
        """Drop the cached UDF (and its model); the process, and what it imported, stay."""
        self.udf, self.identity = None, None
        gc.collect()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def stats(self) -> dict:
        """``{pid, builds, holding}``: the process, how many UDFs it has built, whether it holds one now."""
        return {"pid": os.getpid(), "builds": self.builds, "holding": self.identity is not None}


class WarmPool:
    """A fixed set of :class:`WarmShardWorker` actors for :func:`~raycurate.stages.sharded.sharded_map` (``pool=``).

    Args:
        num_actors: Actors in the pool.
        num_cpus_per_actor: CPUs each actor reserves while the pool is open.
        num_gpus_per_actor: GPUs each actor reserves while the pool is open.
        max_restarts: Restarts of a crashed actor (it comes back empty and rebuilds its UDF on the next shard).
        max_task_retries: Retries of a shard after a crash or a UDF exception.
    """

    def __init__(self, num_actors: int, num_cpus_per_actor: float, num_gpus_per_actor: float = 0, *,
                 max_restarts: int = 3, max_task_retries: int = 3) -> None:
        import ray

        if num_actors < 1:
            raise ValueError(f"a warm pool needs at least one actor, got num_actors={num_actors}")
        if not ray.is_initialized():
            raise RuntimeError("WarmPool needs a running Ray: call raycurate.stages.runtime.init_ray() first")
        actor_cls = ray.remote(num_cpus=num_cpus_per_actor, num_gpus=num_gpus_per_actor, max_restarts=max_restarts,
                               max_task_retries=max_task_retries)(WarmShardWorker)
        self.actors: list[Any] = [actor_cls.remote() for _ in range(num_actors)]
        log.info("warm pool: %d actors x (%.2f CPU, %.2f GPU)", num_actors, num_cpus_per_actor, num_gpus_per_actor)

    def stats(self) -> list[dict]:
        """Each actor's :meth:`WarmShardWorker.stats`."""
        import ray

        return ray.get([actor.stats.remote() for actor in self.actors])

    def release(self) -> None:
        """Drop every actor's cached model; the actors (and their reservations) stay."""
        import ray

        ray.get([actor.release.remote() for actor in self.actors])

    def close(self) -> None:
        """Kill the actors, freeing their processes and reservations."""
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []

    def __enter__(self) -> WarmPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
