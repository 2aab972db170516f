"""Toy replay: BRIDGE's direction, scores and selection with another theta_bar, on a finished BRIDGE run's data.

BRIDGE's token utility is the alignment of a token's loss gradient at theta_bar (the warmup SFT: 7 steps on 56
pool rows here) with the trusted set's.  Is it blind to a swapped number because theta_bar has not learnt the task?
This replays ``bridge_direction``, ``bridge_score`` and ``bridge_select`` with theta_bar = another stage's model
(default ``curate_reference``: a LoRA fine-tuned on 300 of the trusted rows, which has) in a hard-linked copy of the
run (``<run>-<stage>``), then prints ``analyze_detection.py``'s tables.  Pool labels only: no arm is trained.

Usage::

    .venv/bin/python benchmarks/analyze_bridge_warmup.py runs/real_bridge_t400/seed-0 \\
        --job jobs/real_proving_ground.yaml data.trusted_rows=400
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from analyze_detection import print_run  # noqa: E402

from raycurate.config.loader import load_config  # noqa: E402
from raycurate.config.schema import JobConfig  # noqa: E402
from raycurate.pipelines.common import open_run, prepare_data  # noqa: E402
from raycurate.rundir import LOCK  # noqa: E402
from raycurate.stages.bridge import direction_stage, score_stage, select_stage  # noqa: E402
from raycurate.stages.data_stages import TRUSTED_TOKENS  # noqa: E402


def linked_copy(source: Path, target: Path) -> None:
    """``target`` as hard links to ``source``'s files (stages replace their folders whole, so the source's files
    are never written through the links), with a real copy of the manifest, which is rewritten in place, and
    without the source's lock file (a shared inode would share its flock)."""
    if target.exists():
        return
    subprocess.run(["cp", "-al", str(source), str(target)], check=True)
    (target / "manifest.json").unlink()
    shutil.copy2(source / "manifest.json", target / "manifest.json")
    (target / LOCK).unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a finished BRIDGE run (runs/<name>/seed-<seed>)")
    parser.add_argument("--job", default="jobs/real_proving_ground.yaml", help="the job the run ran")
    parser.add_argument("--theta-bar", default="curate_reference", help="the stage whose model is theta_bar")
    parser.add_argument("overrides", nargs="*", help="the run's own key=value overrides")
    args = parser.parse_args()
    target = args.run.with_name(f"{args.run.name}-{args.theta_bar}")
    linked_copy(args.run, target)
    cfg = load_config(JobConfig, args.job, [*args.overrides, f"run.runs_dir={target.parent}", f"run.name={target.name}",
                                             "run.progress=false"])
    run = open_run(cfg)
    prepare_data(run, cfg)
    direction = direction_stage(run, warmup_stage=args.theta_bar, base_stage="base_model",
                                validation_stage=TRUSTED_TOKENS, bridge_cfg=cfg.bridge)
    print({k: v for k, v in direction["metrics"].items() if k.endswith("norm")})
    score_stage(run, tokens_stage="bridge_selection_rows", warmup_stage=args.theta_bar,
                direction_stage_name="bridge_direction", bridge_cfg=cfg.bridge, pool_cfg=cfg.bridge_pool,
                progress=False)
    select_stage(run, score_stage_name="bridge_score", bridge_cfg=cfg.bridge, pool_cfg=cfg.bridge_pool,
                 progress=False)
    print_run(target)


if __name__ == "__main__":
    main()
