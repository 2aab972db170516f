"""``raycurate tune SWEEP.yaml``: Ray Tune over any job config key, trials sharing one cached run directory.

Outputs under ``<runs_dir>/<sweep name>/tune/``: ``results.csv`` and ``results.parquet`` (one row per trial:
parameters, metric, last rung, status), ``best.yaml`` (the job with the best trial's parameters, ready for
``raycurate run``) and the ``tune`` section of the run manifest, which the HTML report plots (metric vs parameter).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable

from raycurate import storage
from raycurate.config.job import build_job_config
from raycurate.config.loader import dump_yaml
from raycurate.config.schema import JobConfig
from raycurate.config.sweep import SweepConfig, job_path, yaml_value
from raycurate.rundir import RunDir, atomic_write_text

log = logging.getLogger("raycurate")

OBJECTIVE = "objective"


def manifest_value(manifest: dict, path: str) -> float | None:
    """The number at a dotted path of the manifest (None when absent)."""
    node: Any = manifest
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def trial_overrides(sweep: SweepConfig, params: dict, rung: int | None, runs_dir: str) -> list[str]:
    """Overrides of one trial at one rung: base overrides, the trial's parameters, the shared run directory."""
    overrides = [*sweep.overrides, *(f"{k}={yaml_value(v)}" for k, v in sorted(params.items()))]
    if rung is not None:
        overrides.append(f"train.max_steps={rung * sweep.scheduler.rung_steps}")
    return [*overrides, f"run.runs_dir={runs_dir}", f"run.name={sweep.name}", "run.progress=false"]


def job_config(job: Path, overrides: list[str]) -> JobConfig:
    """The typed job config of ``job`` with ``overrides`` (the CLI's and the API's route)."""
    return build_job_config(job, overrides=overrides)


def make_trial(sweep: SweepConfig, job: Path, runs_dir: str) -> Callable[[dict], None]:
    """The Tune function trainable: runs the pipeline once per rung and reports the manifest metric."""

    def trial(params: dict) -> None:
        from raycurate.stages.tune_runner import report, run_job_process

        rungs = range(1, sweep.scheduler.rungs + 1) if sweep.scheduler.type == "asha" else [None]
        for rung in rungs:
            overrides = trial_overrides(sweep, params, rung, runs_dir)
            job_config(job, overrides)  # fail in the trial with a config error, not in the child process
            run_job_process(str(job), overrides)
            manifest = json.loads((Path(runs_dir) / sweep.name / "manifest.json").read_text())
            value = manifest_value(manifest, sweep.metric)
            if value is None:
                raise ValueError(f"metric {sweep.metric!r} is not in the run manifest; pick a dotted path that "
                                 f"exists, e.g. results.heldout.<method>.gold_loss")
            report({OBJECTIVE: value, "rung": rung or 1})

    return trial


def run_sweep(sweep: SweepConfig, sweep_file: Path | None = None) -> dict:
    """Run a sweep; returns the ``tune`` section written to the shared run's manifest."""
    from raycurate.stages.runtime import init_ray
    from raycurate.stages.tune_runner import asha_scheduler, run_tuner

    job = job_path(sweep, sweep_file).resolve()
    base = job_config(job, list(sweep.overrides))
    if storage.is_uri(base.run.runs_dir):
        where = storage.redact(base.run.runs_dir)
        raise storage.StorageError(f"raycurate tune needs a local run.runs_dir, not {where!r} (trials share the run "
                                   f"directory's stage cache on disk); use a path on storage every node mounts")
    runs_dir = str(Path(base.run.runs_dir).resolve())
    run = RunDir(Path(runs_dir) / sweep.name)
    init_ray(address=base.ray.address, num_cpus=base.ray.num_cpus, temp_dir=base.ray.temp_dir,
             object_store_memory=base.ray.object_store_memory)
    scheduler = None
    if sweep.scheduler.type == "asha":
        scheduler = asha_scheduler(sweep.scheduler.rungs, sweep.scheduler.grace_period,
                                   sweep.scheduler.reduction_factor)
    rows = run_tuner(make_trial(sweep, job, runs_dir), sweep.params, metric=OBJECTIVE, mode=sweep.mode,
                     search=sweep.search, num_samples=sweep.num_samples, seed=sweep.seed, scheduler=scheduler,
                     storage_dir=str(run.root / "_scratch" / "tune"), name=sweep.name, trial_cpus=sweep.trial_cpus)
    return write_results(run, sweep, job, rows)


def best_trial(rows: list[dict], mode: str) -> dict | None:
    """The finished trial with the best metric (ties: the earliest trial)."""
    done = [r for r in rows if r["status"] == "done" and r["metric"] is not None]
    if not done:
        return None
    sign = 1.0 if mode == "min" else -1.0
    return min(done, key=lambda r: (sign * r["metric"], r["trial"]))


def write_results(run: RunDir, sweep: SweepConfig, job: Path, rows: list[dict]) -> dict:
    """results.csv / results.parquet, best.yaml and the manifest's ``tune`` section."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    out = run.root / "tune"
    out.mkdir(parents=True, exist_ok=True)
    columns = sorted({k for r in rows for k in r}, key=lambda k: (not k.startswith("trial"), k))
    table = pa.table({c: [_cell(r.get(c)) for r in rows] for c in columns})
    pq.write_table(table, out / "results.parquet")
    pacsv.write_csv(table, out / "results.csv")
    best = best_trial(rows, sweep.mode)
    section = {"name": sweep.name, "job": str(job), "run_dir": str(run.root), "metric": sweep.metric,
               "mode": sweep.mode, "search": sweep.search, "scheduler": sweep.scheduler.type, "trials": len(rows),
               "finished": sum(r["status"] == "done" for r in rows), "results": "tune/results.csv",
               "params": sorted(sweep.params), "rows": rows, "best": best}
    if best is not None:
        params = {k.removeprefix("param."): v for k, v in best.items() if k.startswith("param.")}
        overrides = [*sweep.overrides, *(f"{k}={yaml_value(v)}" for k, v in sorted(params.items()))]
        best_cfg = job_config(job, overrides)
        header = (f"# Best trial of sweep '{sweep.name}' ({sweep.metric} = {best['metric']:.6g}, "
                  f"mode {sweep.mode}).\n"
                  f"# Job {job} with {overrides}.\n")
        atomic_write_text(out / "best.yaml", header + dump_yaml(best_cfg))
        section["best_config"] = "tune/best.yaml"
    run.update_manifest(tune=section)
    from raycurate.report.html import write_run_report

    write_run_report(run.root)
    log.info("sweep %s: %d trials, best %s", sweep.name, len(rows), best)
    return section


def _cell(value: Any) -> Any:
    return value if value is None or isinstance(value, (int, float, str, bool)) else str(value)
