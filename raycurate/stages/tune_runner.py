"""Ray Tune mechanics for ``raycurate tune``: search space, scheduler, the Tuner, and the trial results.

The trial body is injected by the caller (:mod:`raycurate.pipelines.sweep`), so this module never imports a
pipeline.  :func:`search_space` and :func:`asha_scheduler` build the Tune objects, :func:`run_tuner` runs the trials
one at a time in one shared run directory, :func:`run_job_process` starts a trial's pipeline as a child driver
process (so its stages reserve their own resources), and :func:`report` sends one ASHA rung's result.  Why a
function trainable, sequential trials and rungs that extend training: docs/tune_eval.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


def search_space(params: dict[str, dict]) -> dict[str, Any]:
    """Tune's ``param_space`` for ``{key: {grid|choice|uniform|loguniform|randint: values}}``."""
    from ray import tune

    builders: dict[str, Callable[[list], Any]] = {
        "grid": tune.grid_search,
        "choice": tune.choice,
        "uniform": lambda v: tune.uniform(*v),
        "loguniform": lambda v: tune.loguniform(*v),
        "randint": lambda v: tune.randint(v[0], v[1] + 1),  # inclusive upper bound, as written in the sweep
    }
    return {key: builders[kind](values) for key, spec in params.items() for kind, values in spec.items()}


def asha_scheduler(rungs: int, grace_period: int, reduction_factor: float) -> Any:
    """ASHA over rungs (``rung`` is the time attribute)."""
    from ray.tune.schedulers import ASHAScheduler

    return ASHAScheduler(time_attr="rung", max_t=rungs, grace_period=grace_period,
                         reduction_factor=reduction_factor)


def run_tuner(trial: Callable[[dict], None], params: dict[str, dict], *, metric: str, mode: str, search: str,
              num_samples: int, seed: int, scheduler: Any, storage_dir: str, name: str,
              trial_cpus: float) -> list[dict]:
    """Run the sweep and return one row per trial (parameters, last reported metrics, status).

    Args:
        trial: ``trial(params)``; calls :func:`report` once per rung.
        params: The sweep's parameter specs.
        metric: Name of the reported metric to optimise.
        mode: "min" or "max".
        search: "grid" or "random".
        num_samples: Trials of a random search, repeats of a grid.
        seed: Seed of the random search.
        scheduler: An ASHA scheduler or None.
        storage_dir: Where Tune keeps trial state.
        name: Tune experiment name.
        trial_cpus: CPU reservation of each trial process.
    """
    from ray import tune
    from ray.tune.search import BasicVariantGenerator

    tuner = tune.Tuner(
        tune.with_resources(trial, {"cpu": trial_cpus}),
        param_space=search_space(params),
        tune_config=tune.TuneConfig(
            metric=metric, mode=mode, num_samples=num_samples, scheduler=scheduler, max_concurrent_trials=1,
            search_alg=BasicVariantGenerator(random_state=seed) if search == "random" else None,
        ),
        run_config=tune.RunConfig(name=name, storage_path=storage_dir, verbose=1),
    )
    grid = tuner.fit()
    rows = []
    for index, result in enumerate(grid):
        metrics = dict(result.metrics or {})
        value = metrics.get(metric)
        rows.append({
            "trial": index,
            "trial_id": metrics.get("trial_id", ""),
            **{f"param.{k}": v for k, v in (result.config or {}).items()},
            "metric": value if value is None or math.isfinite(value) else None,
            "rung": metrics.get("rung"),
            "status": "error" if result.error else ("done" if value is not None else "no result"),
            "error": str(result.error) if result.error else "",
        })
    return rows


def run_job_process(job: str, overrides: list[str]) -> None:
    """Run ``raycurate run JOB overrides`` as a child driver process attached to this Ray cluster.

    A Tune trial's tasks and actors are captured by the trial's placement group (here a 0.01-CPU bundle), so a
    pipeline run in-process could not schedule its Ray Data pools; a separate driver process is not captured and
    reserves its stages' resources from the cluster like any job.
    """
    import subprocess
    import sys

    import ray

    address = ray.get_runtime_context().gcs_address
    cmd = [sys.executable, "-m", "raycurate.cli.main", "run", job, *overrides, f"ray.address={address}"]
    done = subprocess.run(cmd, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"trial job failed with exit code {done.returncode}: {' '.join(cmd)}")


def report(metrics: dict) -> None:
    """Report a trial's metrics for this rung."""
    from ray import tune

    tune.report(metrics)
