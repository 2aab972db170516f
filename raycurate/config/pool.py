"""The actor-pool section shared by every Ray Data stage's config.

It is a plain dataclass, kept in the config layer so config sections can embed it without importing stages;
:func:`raycurate.stages.executor.resolve_pool` turns it into concrete per-actor resources.
"""

from __future__ import annotations

import dataclasses

from raycurate.config.base import option


@dataclasses.dataclass
class ActorPoolConfig:
    """How a Ray Data actor-pool stage is sized."""

    num_actors: int = option(2, "Actors in the pool (one model copy each).", ge=1)
    cpus_per_actor: float | None = option(
        None, "CPUs per actor; null sizes it from the cluster so read/write tasks always keep a CPU (no deadlock).",
        gt=0
    )
    gpus_per_actor: float | None = option(
        None, "GPUs per actor; null means 1 when the cluster has GPUs, else 0 (CPU actors).", ge=0
    )
    batch_size: int = option(64, "Rows per batch handed to an actor.", ge=1)
    shard_rows: int = option(1024, "Rows per resumable shard (stages on raycurate.stages.sharded: a killed job "
                             "recomputes only unfinished shards).", ge=1)
