"""The proving ground: a pipeline (``proving_ground.pipeline``, default the whole demo) on several corpus seeds,
every comparison pooled over them.

:func:`run_proving_ground` runs each seed as an ordinary resumable run in ``<runs_dir>/<name>/seed-<seed>/``
(``seed-<seed>-train-<t>/`` for each of ``proving_ground.train_seeds``), sharing the base model's cache;
:func:`summarize_seeds` writes ``proving_ground.json`` and ``report.html``: per comparison each seed's paired
difference and the difference pooled over seeds (and, with 3+ runs, a t-interval over runs), for the primary
metric and, under ``by_metric``, for greedy and sampled exact match.  The HTML is
:mod:`raycurate.report.proving_ground`; why seeds, pooling and replicates: docs/design.md, "The proving ground".
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from raycurate.config.schema import JobConfig

log = logging.getLogger("raycurate")


def run_label(cfg: JobConfig, seed: int, train_seed: int) -> int | str:
    """A run's key in the summary and its folder suffix: the corpus seed (``2``) at ``train.seed``, else
    ``"2-train-1"``."""
    return seed if train_seed == cfg.train.seed else f"{seed}-train-{train_seed}"


def runs_of(cfg: JobConfig) -> list[tuple[int, int]]:
    """(corpus seed, train seed) of every run: ``proving_ground.seeds`` x ``proving_ground.train_seeds`` (or
    ``train.seed`` alone)."""
    return [(seed, t) for seed in cfg.proving_ground.seeds for t in cfg.proving_ground.train_seeds or [cfg.train.seed]]


def seed_config(cfg: JobConfig, seed: int, train_seed: int | None = None) -> JobConfig:
    """The ``proving_ground.pipeline`` job of one corpus seed (and training seed, default ``train.seed``), in
    ``<runs_dir>/<name>/seed-<run_label>``."""
    train_seed = cfg.train.seed if train_seed is None else train_seed
    runs_dir = f"{str(cfg.run.runs_dir).rstrip('/')}/{cfg.run.name}"
    return dataclasses.replace(
        cfg, pipeline=cfg.proving_ground.pipeline,
        run=dataclasses.replace(cfg.run, runs_dir=runs_dir, name=f"seed-{run_label(cfg, seed, train_seed)}"),
        data=dataclasses.replace(cfg.data, corpus_seed=seed), train=dataclasses.replace(cfg.train, seed=train_seed))


def _comparisons(scores: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Name -> (treatment, control) of every paired comparison the scores allow."""
    from raycurate.pipelines.curate import COMPOSITION_MODEL
    from raycurate.report.curation import METHODS, TOKEN_BASELINES

    pairs = {"oracle: clean vs mixed": ("clean", "mixed")}
    pairs.update({f"{model} vs base": (model, "base") for model in scores if model != "base"})
    for spec in METHODS:
        pairs[f"{spec.model} vs mixed"] = (spec.model, "mixed")
        if spec.baseline and spec.model != COMPOSITION_MODEL:  # the composition's arms are named below
            pairs[f"{spec.model} vs {spec.baseline}"] = (spec.model, spec.baseline)
    pairs.update({f"bridge vs {name}": ("bridge", name) for name in TOKEN_BASELINES})  # same token budgets
    for model in scores:  # pipeline curate: the composition minus each arm at the matched token budget
        if model.startswith(f"{COMPOSITION_MODEL}_"):
            arm = model.removeprefix(f"{COMPOSITION_MODEL}_")
            pairs[f"composition vs {arm} (matched tokens)"] = (COMPOSITION_MODEL, model)
    pairs["BDS alone vs random rows (matched tokens)"] = (f"{COMPOSITION_MODEL}_bds", f"{COMPOSITION_MODEL}_random")
    return {name: pair for name, pair in pairs.items() if pair[0] in scores and pair[1] in scores}


def summarize_seeds(per_seed: dict[int | str, tuple[str, dict[str, Any]]]) -> dict:
    """Pool paired comparisons over runs (corpus seeds, and training seeds where the job repeats them).

    Args:
        per_seed: run label (:func:`run_label`) -> (metric label, {model: (Q,) per-question scores}).

    Returns:
        ``metric``, ``seeds`` (the run labels, in run order) and ``comparisons``: name -> ``per_seed`` (label ->
        estimate dict), ``pooled`` (stratified paired bootstrap over the runs that have both models, questions
        resampled within each run), ``over_runs`` (t-interval of the per-run differences, >= 3 runs, else null)
        and ``seeds_excluding_zero``.
    """
    import numpy as np

    from raycurate.algorithms.stats import paired_bootstrap_ci, stratified_paired_bootstrap_ci, t_interval_over_runs

    names: dict[str, tuple[str, str]] = {}
    for _, scores in per_seed.values():
        names.update(_comparisons(scores))
    comparisons = {}
    for name, (a, b) in names.items():
        runs = [s for s, (_, scores) in per_seed.items() if a in scores and b in scores]
        pairs = [(per_seed[s][1][a], per_seed[s][1][b]) for s in runs]
        estimates = {s: paired_bootstrap_ci(*pair) for s, pair in zip(runs, pairs)}
        over_runs = t_interval_over_runs(np.array([np.mean(x) - np.mean(y) for x, y in pairs]))
        comparisons[name] = {"per_seed": {str(s): e.as_dict() for s, e in estimates.items()},
                             "pooled": stratified_paired_bootstrap_ci(pairs).as_dict(),
                             "over_runs": over_runs.as_dict() if over_runs else None,
                             "seeds_excluding_zero": sum(e.excludes_zero() for e in estimates.values())}
    metric = next(iter(per_seed.values()))[0] if per_seed else ""
    return {"metric": metric, "seeds": list(per_seed), "comparisons": comparisons}


def existing_manifest(run_dir: Path) -> dict:
    """The manifest of a seed's finished run (``proving_ground.pool_only``), or a UserError naming the folder."""
    from raycurate.errors import UserError
    from raycurate.rundir import parse_manifest

    path = run_dir / "manifest.json"
    if not path.is_file():
        raise UserError(f"proving_ground.pool_only: {path} does not exist; run that seed first (drop pool_only) "
                        "or leave it out of proving_ground.seeds")
    return parse_manifest(path.read_text(), str(path))


def run_proving_ground(cfg: JobConfig, run_pipeline: Callable[[JobConfig], dict]) -> dict:
    """Run ``proving_ground.pipeline`` for every seed of ``proving_ground.seeds`` and write the pooled summary
    (every evaluated model's per-question scores feed the comparisons); returns it.

    Args:
        cfg: The proving-ground job.
        run_pipeline: Runs one seed's job and returns its manifest: :func:`raycurate.pipelines.run_pipeline`, passed
            in by the registry (which imports this module, so this module does not import it back).
    """
    from raycurate.pipelines.common import check_split_sizes
    from raycurate.storage import is_uri

    if is_uri(cfg.run.runs_dir):
        raise ValueError("pipeline proving_ground writes its summary locally; give run.runs_dir a local folder")
    pool_only = cfg.proving_ground.pool_only
    if not pool_only:
        check_split_sizes(cfg)  # every seed's splits, before the first seed starts Ray
    finished = []
    for seed, train_seed in runs_of(cfg):
        child = seed_config(cfg, seed, train_seed)
        run_dir = Path(child.run.runs_dir) / child.run.name
        log.info("proving ground: corpus seed %d, train seed %d, pipeline %s -> %s%s", seed, train_seed,
                 child.pipeline, run_dir, " (pooled as it is)" if pool_only else "")
        manifest = existing_manifest(run_dir) if pool_only else run_pipeline(child)
        finished.append((run_label(cfg, seed, train_seed), run_dir, manifest))
    summary = pool_runs(finished, cfg.proving_ground.pipeline)
    write_summary(Path(cfg.run.runs_dir) / cfg.run.name, summary)
    return summary


def pool_runs(runs: list[tuple[int | str, Path, dict]], pipeline: str) -> dict:
    """The pooled summary of finished runs: every evaluated model's per-question scores feed the comparisons.

    Args:
        runs: (run label, run folder, manifest) of each run, in run order.
        pipeline: The pipeline the runs ran (recorded in the summary).

    Returns:
        :func:`summarize_seeds` of the primary metric, plus ``pipeline``, ``by_metric`` (greedy and sampled exact
        match), and where the runs composed a pool, ``composition_budgets`` and ``separation`` per run.
    """
    from raycurate.report.curation import aligned_scores, evaluated_models, scores_by_metric

    per_seed: dict[int | str, tuple[str, dict[str, Any]]] = {}
    by_metric: dict[str, dict[int | str, tuple[str, dict[str, Any]]]] = {}
    budgets: dict[str, dict] = {}
    separation: dict[str, dict] = {}
    for label, run_dir, manifest in runs:
        loaded = aligned_scores(run_dir, manifest, evaluated_models(manifest))
        if loaded is not None:
            per_seed[label] = (loaded[1], loaded[2])
        for key, pair in scores_by_metric(run_dir, manifest, evaluated_models(manifest)).items():
            by_metric.setdefault(key, {})[label] = pair
        composition = (manifest.get("results") or {}).get("composition")
        if composition:  # what each arm trained on, so the pooled table can be read against the budgets
            budgets[str(label)] = {"budget_tokens": composition["budget_tokens"],
                                  "arms": {arm: {k: a.get(k) for k in ("rows", "response_tokens", "clean_share")}
                                           for arm, a in composition["arms"].items()}}
            if composition.get("separation"):  # the recipe's ranking, clean rows vs each corruption kind
                separation[str(label)] = composition["separation"]
    summary = summarize_seeds(per_seed)
    summary["pipeline"] = pipeline
    summary["by_metric"] = {key: summarize_seeds(seeds) for key, seeds in by_metric.items()}
    if budgets:
        summary["composition_budgets"] = budgets
    if separation:
        summary["separation"] = separation
    return summary


def write_summary(root: Path, summary: dict) -> Path:
    """Write ``proving_ground.json`` and ``report.html`` under ``root`` (atomically); returns the report's path."""
    from raycurate.report.proving_ground import render_proving_ground
    from raycurate.rundir import atomic_write_text

    atomic_write_text(root / "proving_ground.json", json.dumps(summary, indent=2))
    atomic_write_text(root / "report.html", render_proving_ground(summary))
    log.info("proving ground summary: %s", root / "report.html")
    return root / "report.html"
