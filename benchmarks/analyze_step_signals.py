"""Add the signals a curate recipe does not compute to one seed of a finished proving-ground run, then print its
detection table (``analyze_detection.py``): BDS sigma(omega) with the trusted upper level (``bds``), P2D's s_final
with trusted probe queries (``p2d``), IFD (``ifd``). Pool labels only: no arm is trained, no held-out question read.

The seed's run directory is the proving ground's own (``pipelines.proving_ground.seed_config``), so the data, the
dedup and the reference stages are reused by their config hashes; each step adds its own stages beside them.

Usage::

    .venv/bin/python benchmarks/analyze_step_signals.py --job jobs/real_curate_proving_ground.yaml \\
        --seed 0 --steps bds p2d ifd run.name=real_curate_t400
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from analyze_detection import print_run  # noqa: E402

from raycurate.config.loader import load_config  # noqa: E402
from raycurate.config.schema import JobConfig  # noqa: E402
from raycurate.pipelines.common import open_run, prepare_data  # noqa: E402
from raycurate.pipelines.curate import score_step  # noqa: E402
from raycurate.pipelines.proving_ground import seed_config  # noqa: E402

STEPS = ("bds", "p2d", "ifd")


def add_ifd(run, cfg: JobConfig) -> None:
    """IFD of every pool row under the base model (P2D's baseline; stage ``p2d_ifd``)."""
    import dataclasses

    from raycurate.config.curate import POOL_SPLIT
    from raycurate.pipelines.p2d import pool_stage
    from raycurate.stages.p2d import ifd_select_stage

    p2d_cfg = dataclasses.replace(cfg, p2d=dataclasses.replace(cfg.p2d, pool_split=POOL_SPLIT))  # as the p2d step
    ifd_select_stage(run, "p2d_ifd", pool_stage=pool_stage(run, p2d_cfg), base_stage="base_model",
                     ratio=cfg.p2d.data_ratio, pool_cfg=cfg.p2d_pool)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", default="jobs/real_curate_proving_ground.yaml")
    parser.add_argument("--seed", type=int, default=0, help="corpus seed")
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    parser.add_argument("overrides", nargs="*", help="key=value config overrides (the run's own, e.g. run.name)")
    args = parser.parse_args()
    cfg = seed_config(load_config(JobConfig, args.job, args.overrides), args.seed)
    run = open_run(cfg)
    prepare_data(run, cfg)
    for step in args.steps:
        started = time.perf_counter()
        if step == "ifd":
            add_ifd(run, cfg)
        else:
            _, info = score_step(run, cfg, step)
            print(f"{step}: {info}")
        print(f"{step}: {time.perf_counter() - started:.0f} s")
    print_run(run.root)


if __name__ == "__main__":
    main()
