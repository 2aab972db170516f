"""Sweep files for ``raycurate tune`` (``tune/*.yaml``); :func:`load_sweep` checks every ``params`` key against the job
and refuses held-out metrics (docs/tune_eval.md)::

    name: bridge_budgets
    job: jobs/bridge_demo.yaml            # relative to the sweep file's folder's parent, or absolute
    overrides: [data.corpus_rows=600, data.validation_questions=200, eval.split=validation]
    metric: results.validation.bridge.gold_loss
    mode: min
    params: {bridge.rho_p: {grid: [0.5, 0.75]}}   # search: grid (default); random also samples {uniform: [a, b]}
    scheduler: {type: asha, rungs: 3, rung_steps: 20, reduction_factor: 2}
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from raycurate.config.base import option
from raycurate.config.loader import ConfigError, apply_overrides, from_dict, read_yaml

DISTRIBUTIONS = ("grid", "choice", "uniform", "loguniform", "randint")


@dataclasses.dataclass
class SchedulerConfig:
    """Early stopping: none, or ASHA over rungs of extra training steps of the final models."""

    type: str = option("none", "Trial scheduler.", choices=("none", "asha"))
    rungs: int = option(3, "ASHA: evaluations per trial; rung k trains k * rung_steps optimizer steps.", ge=1)
    rung_steps: int = option(20, "ASHA: optimizer steps of the final training per rung (train.max_steps).", ge=1)
    grace_period: int = option(1, "ASHA: rungs every trial gets before it can be stopped.", ge=1)
    reduction_factor: float = option(2.0, "ASHA: keep 1/reduction_factor of the trials at each rung.", gt=1)


@dataclasses.dataclass
class SweepConfig:
    """A Ray Tune sweep over a pipeline's config keys."""

    name: str = option("sweep", "Sweep name; trials share the run directory <runs_dir>/<name>.")
    job: str = option("", "Job YAML the trials start from.")
    overrides: list[str] = option([], "key=value overrides applied to the job before the trial parameters.")
    metric: str = option("results.validation.bridge.gold_loss", "Dotted path of the metric in the run manifest "
                         "(never results.heldout: sweeps choose on the validation questions).")
    mode: str = option("min", "Minimise or maximise the metric.", choices=("min", "max"))
    search: str = option("grid", "Grid search over the grid values, or random sampling.", choices=("grid", "random"))
    num_samples: int = option(1, "Random search: trials; grid search: repeats of the whole grid.", ge=1)
    seed: int = option(0, "Seed of the random search.")
    params: dict[str, dict] = option(
        {}, "Config key -> {grid|choice: [...]} or {uniform|loguniform|randint: [lo, hi]}.")
    scheduler: SchedulerConfig = option(SchedulerConfig(), "Early stopping.")
    trial_cpus: float = option(0.01, "CPU reservation of each trial's driver process (its stages reserve their own).",
                               ge=0)


def load_sweep(path: str | Path, overrides: list[str] | None = None) -> SweepConfig:
    """Read and validate a sweep file; every parameter key is checked against the job's config schema."""
    path = Path(path)
    data = apply_overrides(read_yaml(path), list(overrides or []))
    sweep = from_dict(SweepConfig, data, source=str(path))
    problems = sweep_problems(sweep, path)
    if problems:
        raise ConfigError(str(path), problems)
    return sweep


def job_path(sweep: SweepConfig, sweep_file: Path | None = None) -> Path:
    """The job file of a sweep: absolute, relative to the working directory, or to the repository root."""
    job = Path(sweep.job)
    if job.is_absolute() or job.exists() or sweep_file is None:
        return job
    return sweep_file.resolve().parent.parent / job


def sweep_problems(sweep: SweepConfig, sweep_file: Path | None = None) -> list[str]:
    """Everything wrong with a sweep, as messages that say what to change."""
    from raycurate.config.job import build_job_config

    problems = []
    job = job_path(sweep, sweep_file)
    if not sweep.job or not job.exists():
        return [f"job {sweep.job!r} does not exist; point 'job' at a jobs/*.yaml file"]
    if not sweep.params:
        problems.append("params is empty; add at least one config key to vary")
    for key, spec in sweep.params.items():
        if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in DISTRIBUTIONS:
            problems.append(f"params.{key} must be one of {{{'|'.join(DISTRIBUTIONS)}: ...}}, got {spec!r}")
            continue
        kind, values = next(iter(spec.items()))
        if not isinstance(values, list) or not values:
            problems.append(f"params.{key}.{kind} needs a non-empty list")
            continue
        if kind in ("uniform", "loguniform", "randint") and len(values) != 2:
            problems.append(f"params.{key}.{kind} needs [low, high]")
            continue
        if kind not in ("grid", "choice") and sweep.search == "grid":
            problems.append(f"params.{key} uses {kind}, which needs search: random (grid search enumerates lists)")
        try:
            build_job_config(job, overrides=[*sweep.overrides, f"{key}={yaml_value(values[0])}"],
                             source=f"{job} + params.{key}")
        except ConfigError as err:
            problems.append(f"params.{key}: {err}")
    problems += reported_metric_problems(sweep.metric)
    if sweep.scheduler.type == "asha" and sweep.scheduler.rungs < 2:
        problems.append("scheduler.rungs must be >= 2 for ASHA to stop anything")
    return problems


#: Manifest sections that hold what a run reports; a sweep that chose settings on them would report a tuned number.
REPORTED_RESULTS = ("results.heldout", "results.curation", "results.lm_eval")


def reported_metric_problems(metric: str) -> list[str]:
    """A problem when ``metric`` reads the held-out results that runs report (settings are chosen on validation)."""
    if ".".join(metric.split(".")[:2]) not in REPORTED_RESULTS:
        return []
    return [f"metric {metric!r} reads held-out results, which are what the run reports; choose settings on the "
            "validation questions instead: add data.validation_questions=200 and eval.split=validation to overrides "
            "and use results.validation.<model>.<metric>"]


def yaml_value(value: Any) -> str:
    import yaml

    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
