"""How the trusted set's size changes what the reference step sees: AUROC per corruption kind and rows kept per kind.

For each ``data.trusted_rows`` size, runs the curate recipe of a job (default ``jobs/real_curate_proving_ground.yaml``)
up to its composed training table on one corpus seed, in ``runs/trusted_size/seed-S-trusted-N`` (resumable): the
data, dedup, the reference fine-tuned on the fit share of the trusted rows, the pool scored, the calibrated rule.
No arm is trained and no held-out question is read; labels come from the corpus generator.

Usage::

    .venv/bin/python benchmarks/analyze_trusted_size.py [key=value ...] --seed 1 --sizes 200 400 800
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import Counter

from raycurate.config.loader import load_config
from raycurate.config.schema import JobConfig
from raycurate.pipelines.common import open_run, prepare_data
from raycurate.pipelines.curate import compose_pool
from raycurate.stages.rows import corruption_kinds


def size_config(cfg: JobConfig, seed: int, size: int, label: str = "") -> JobConfig:
    """``cfg`` on corpus seed ``seed`` with ``size`` trusted rows, in its own run directory (``label`` appended)."""
    name = f"seed-{seed}-trusted-{size}{label}"
    return dataclasses.replace(
        cfg, run=dataclasses.replace(cfg.run, runs_dir="runs/trusted_size", name=name),
        data=dataclasses.replace(cfg.data, corpus_seed=seed, trusted_rows=size))


def measure(cfg: JobConfig) -> dict:
    """The composed pool of ``cfg``: AUROC of the recipe's ranking per kind, and pool / kept rows per kind."""
    run = open_run(cfg)
    prepare_data(run, cfg)
    composition = compose_pool(run, cfg)
    kinds = corruption_kinds(run, "curate_pool_rows")
    pool = Counter(kinds.get(i, "none") for i in composition.pool)
    kept = Counter(kinds.get(i, "none") for i in composition.kept)
    return {"pool": pool, "kept": kept, "auroc": composition.separation.get("auroc"),
            "auroc_by_kind": composition.separation.get("auroc_by_kind", {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", default="jobs/real_curate_proving_ground.yaml")
    parser.add_argument("--seed", type=int, default=1, help="corpus seed")
    parser.add_argument("--sizes", type=int, nargs="+", default=[200, 400, 800], help="data.trusted_rows values")
    parser.add_argument("--label", default="", help="suffix of the run directories (e.g. -epochs6 with overrides)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()
    base = load_config(JobConfig, args.job, args.overrides)
    for size in args.sizes:
        found = measure(size_config(base, args.seed, size, args.label))
        by_kind = {k: round(v["auroc"], 3) for k, v in sorted(found["auroc_by_kind"].items())}
        kept = {k: f"{found['kept'].get(k, 0)}/{n}" for k, n in sorted(found["pool"].items())}
        clean_share = found["kept"].get("none", 0) / max(1, sum(found["kept"].values()))
        print(f"seed {args.seed} trusted {size}{args.label}: AUROC {found['auroc']:.3f} {by_kind}")
        print(f"  kept {sum(found['kept'].values())} rows, clean share {clean_share:.3f}, per kind {kept}")


if __name__ == "__main__":
    main()
