"""P2D head stability: overlap of the selected heads H_T across proxies trained on different seeded samples.

The P2D paper reports ~91% overlap of the top heads across proxy runs.  This script reuses a finished run
directory's ``base_model`` and ``tokenize`` stages (e.g. the demo's), trains one proxy per seed on its own seeded
``proxy_examples`` sample (stages ``p2d_proxy_rows_s<seed>``, ``p2d_proxy_s<seed>``, ``p2d_heads_s<seed>``, cached
like every stage; seed ``p2d.seed`` reads a finished P2D run's ``p2d_heads``, ``--p2d-run`` or ``--run-dir``) and
reports the pairwise overlap |A & B| / |A| of the selected heads and the Spearman correlation of the full score
maps.  Usage::

    python benchmarks/bench_p2d_heads.py --run-dir runs/demo [key=value overrides of the demo job] [--seeds 0 1 2]
    python benchmarks/bench_p2d_heads.py --job jobs/real_proving_ground.yaml \
        --run-dir runs/real_proving_ground/seed-0 train.threads_per_worker=1 --seeds 0 1 2   # SmolLM2-135M (#25)

(overrides before ``--seeds``, which takes every number after it).

``--job`` (default the demo job) must be the job that made ``--run-dir``: the proxies train with its ``train`` and
``p2d`` settings on its ``tokenize`` rows.

Last line: ``head_overlap_mean=... head_overlap_min=... score_spearman_mean=... heads=... selected=...``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--job", type=Path, default=None, help="job YAML that made --run-dir (default: the demo job)")
    parser.add_argument("--p2d-run", type=Path, default=None,
                        help="a P2D run of the same job and corpus whose p2d_heads stands for seed p2d.seed "
                             "(default: --run-dir itself)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    import numpy as np
    import torch
    from scipy.stats import spearmanr

    from raycurate.algorithms.p2d.head_scoring import head_overlap
    from raycurate.cli.main import _load_job, demo_job_path
    from raycurate.rundir import RunDir
    from raycurate.stages.base import output_path
    from raycurate.stages.rows import token_ids
    from raycurate.stages.runtime import init_ray

    cfg = _load_job(args.job or demo_job_path(), args.overrides)
    run = RunDir(Path(args.run_dir))
    p2d_run = RunDir(args.p2d_run) if args.p2d_run else run
    init_ray()
    pool = token_ids(run, "tokenize")
    masks, scores = {}, {}
    for seed in args.seeds:
        p2d = dataclasses.replace(cfg.p2d, seed=seed)
        if reuses_pipeline_heads(p2d_run, cfg.p2d, seed):
            heads_file = output_path(p2d_run, "p2d_heads", "heads")
            print(f"seed {seed}: {p2d_run.root}'s own p2d_heads (its proxy is this seed's)")
        else:
            train_seed_proxy(run, cfg, p2d, pool, seed)
            heads_file = output_path(run, f"p2d_heads_s{seed}", "heads")
        data = json.loads(heads_file.read_text())
        shape = (data["n_layers"], data["n_heads"])
        masks[seed] = torch.tensor([h["selected"] for h in data["heads"]]).reshape(shape)
        scores[seed] = np.array([h["score"] for h in data["heads"]])
        print(f"seed {seed}: selected heads {[(h['layer'], h['head']) for h in data['heads'] if h['selected']]}")
    overlaps, rhos = [], []
    for a, b in itertools.combinations(args.seeds, 2):
        overlaps.append(head_overlap(masks[a], masks[b]))
        rhos.append(float(spearmanr(scores[a], scores[b]).statistic))
        print(f"seeds {a},{b}: overlap {overlaps[-1]:.3f}, score Spearman {rhos[-1]:.3f}")
    print(f"head_overlap_mean={np.mean(overlaps):.3f} head_overlap_min={np.min(overlaps):.3f} "
          f"score_spearman_mean={np.mean(rhos):.3f} heads={masks[args.seeds[0]].numel()} "
          f"selected={int(masks[args.seeds[0]].sum())}")


def reuses_pipeline_heads(run, p2d_cfg, seed: int) -> bool:
    """Whether the run's own ``p2d_heads`` (a P2D pipeline's, proxy on ``tokenize``'s seeded sample) is this seed's
    result, so its proxy (~16 CPU-min on SmolLM2-135M) is not trained twice."""
    record = run.stage_record("p2d_heads")
    return (seed == p2d_cfg.seed and p2d_cfg.pool_split is None and p2d_cfg.task_model is None
            and bool(record) and record.get("status") == "done")


def train_seed_proxy(run, cfg, p2d, pool: list[str], seed: int) -> None:
    """Stages ``p2d_proxy_rows_s<seed>``, ``p2d_proxy_s<seed>`` and ``p2d_heads_s<seed>``: the proxy recipe on the
    seed's own sample of ``pool``."""
    from raycurate.config.train import full_batch_train_config
    from raycurate.stages.model_stages import train_stage
    from raycurate.stages.p2d import heads_stage
    from raycurate.stages.rows import ids_subset_stage, seeded_sample

    ids = seeded_sample(pool, min(p2d.proxy_examples, len(pool)), seed)
    ids_subset_stage(run, f"p2d_proxy_rows_s{seed}", tokens_stage="tokenize", ids=ids,
                     description=f"proxy sample, seed {seed}")
    proxy_cfg = full_batch_train_config(cfg.train, len(ids), p2d.proxy_steps, p2d.proxy_lr)
    train_stage(run, f"p2d_proxy_s{seed}", tokens_stage=f"p2d_proxy_rows_s{seed}", init_stage="base_model",
                train_cfg=proxy_cfg)
    heads_stage(run, f"p2d_heads_s{seed}", base_stage="base_model", proxy_stage=f"p2d_proxy_s{seed}",
                task_model=None, p2d_cfg=p2d)


if __name__ == "__main__":
    main()
