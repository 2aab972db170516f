"""Ray start-up and resource arithmetic shared by every stage.

:func:`init_ray` starts a local Ray instance (``address=None``, passed to Ray as ``"local"``) or joins
``address``, with session files under ``temp_dir`` and Ray's default token authentication;
:func:`cluster_cpus` / :func:`cluster_gpus` read the cluster, :func:`run_as_task` runs a function as one Ray task,
and :func:`actor_cpus` sizes actors in CPU fractions that keep one whole CPU free for Ray Data's read tasks.  Why
each (a stale ``ray_current_cluster``, never disabling auth on a reachable machine, the 2-CPU deadlock):
docs/ray.md.
"""

from __future__ import annotations

import math
import os
from typing import Any


def _worker_env() -> dict[str, str]:
    env = {"TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore::DeprecationWarning"}
    for key in ("DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def init_ray(
    address: str | None = None,
    num_cpus: int | None = None,
    temp_dir: str | None = None,
    object_store_memory: int | None = None,
    spill_dir: str | None = None,
) -> Any:
    """Start (or connect to) Ray once per process.

    Args:
        address: ``None`` starts a local instance (or joins ``$RAY_ADDRESS`` when set); ``"auto"`` or
            ``"ray://host:port"`` connects to a cluster.
        num_cpus: CPUs for a local instance (default: all cores).
        temp_dir: Ray session directory for a local instance (default ``/tmp/ray``).
        object_store_memory: Object store size in bytes for a local instance.
        spill_dir: Where a local instance spills objects that do not fit in the object store (default: Ray's,
            under the session folder); on a cluster set ``RAY_object_spilling_directory`` on every node.

    Returns:
        The ``ray`` module, initialised.
    """
    import ray

    if ray.is_initialized():
        return ray
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - torch import issues must not block Ray start-up
        has_gpu = False
    if not has_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    kwargs: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": True,
        "runtime_env": {"env_vars": _worker_env()},
        "ignore_reinit_error": True,
    }
    if address is None and os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
        _warn_local_options_ignored(address, num_cpus=num_cpus, temp_dir=temp_dir,
                                    object_store_memory=object_store_memory, spill_dir=spill_dir)
    if address is None:
        kwargs["address"] = "local"
        if num_cpus is not None:
            kwargs["num_cpus"] = num_cpus
        if temp_dir is not None:
            kwargs["_temp_dir"] = os.path.abspath(temp_dir)
        if object_store_memory is not None:
            kwargs["object_store_memory"] = object_store_memory
        if spill_dir is not None:
            import json

            spilling = {"type": "filesystem", "params": {"directory_path": os.path.abspath(spill_dir)}}
            kwargs["_system_config"] = {"object_spilling_config": json.dumps(spilling)}
    else:
        kwargs["address"] = address
    ray.init(**kwargs)
    return ray


def _warn_local_options_ignored(address: str, **options: Any) -> None:
    """Say which local-instance options do not apply because ``$RAY_ADDRESS`` names a cluster to join."""
    given = sorted(name for name, value in options.items() if value is not None)
    if given:
        import logging

        logging.getLogger(__name__).warning(
            "RAY_ADDRESS=%s: joining that cluster, so %s (local-instance options) are ignored; unset RAY_ADDRESS "
            "to start a local Ray instead", address, ", ".join(given))


def cluster_cpus() -> float:
    """Total CPUs Ray reports for the cluster."""
    import ray

    return float(ray.cluster_resources().get("CPU", 1.0))


def cluster_gpus() -> float:
    """Total GPUs Ray reports for the cluster (0 on CPU-only machines)."""
    import ray

    return float(ray.cluster_resources().get("GPU", 0.0))


def run_as_task(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` as one Ray task (1 CPU, plus 1 GPU when the cluster has one) and wait for it."""
    import ray

    task = ray.remote(num_cpus=1, num_gpus=1 if cluster_gpus() >= 1 else 0)(fn)
    return ray.get(task.remote(*args, **kwargs))


RESERVE_HEADROOM = 0.05  # CPUs kept free besides the read task's whole CPU


def actor_cpus(requested: float | None, num_actors: int, total_cpus: float) -> float:
    """CPUs per actor that always leave one whole CPU for Ray Data's read/write tasks.

    Ray Data tasks ask for 1 CPU each; if an actor pool holds more than ``total - 1`` CPUs, the read task that
    feeds the pool can never be scheduled and the pipeline hangs.

    Args:
        requested: CPUs per actor from the config; ``None`` means "size it from the cluster".
        num_actors: Actors in the pool.
        total_cpus: CPUs in the cluster.

    Returns:
        ``requested`` when the pool plus one spare CPU fits, else the fraction that leaves one CPU free plus
        :data:`RESERVE_HEADROOM` for small standing reservations (e.g. a Tune trial's 0.01-CPU bundle).
    """
    spare = 1.0 + RESERVE_HEADROOM
    if requested is not None and requested * num_actors + spare <= total_cpus:
        return requested
    return max(0.01, math.floor((total_cpus - spare) / max(num_actors, 1) * 1000) / 1000)
