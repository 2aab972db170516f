"""Pool finished proving-ground runs that no single job lists: e.g. corpus seeds 0-2 at training seed 0 plus seed 0
again at training seed 1 (``proving_ground.train_seeds`` crosses every seed with every training seed, and
``pool_only`` needs each of them). Reads each run's manifest and held-out predictions, runs nothing, and writes
``proving_ground.json`` and ``report.html`` to ``--out`` (the same summary ``pipeline: proving_ground`` writes).

A run folder's label is its name without ``seed-``: ``seed-2`` -> 2, ``seed-0-train-1`` -> ``"0-train-1"``.

Usage::

    .venv/bin/python benchmarks/pool_runs.py --out runs/real_curate_t400 \\
        runs/real_curate_t400/seed-{0,1,2} runs/real_curate_t400/seed-0-train-1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from raycurate.pipelines.proving_ground import existing_manifest, pool_runs, write_summary


def run_label_of(folder: Path) -> int | str:
    """``seed-2`` -> 2; ``seed-0-train-1`` -> ``"0-train-1"`` (as :func:`proving_ground.run_label` names them)."""
    label = folder.name.removeprefix("seed-")
    return int(label) if label.isdigit() else label


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="finished run folders (seed-<label>)")
    parser.add_argument("--out", type=Path, required=True, help="folder for proving_ground.json and report.html")
    parser.add_argument("--pipeline", default="curate", help="the pipeline the runs ran (recorded)")
    args = parser.parse_args()
    runs = [(run_label_of(folder), folder, existing_manifest(folder)) for folder in args.runs]
    summary = pool_runs(runs, args.pipeline)
    print(json.dumps({name: {key: c["pooled"] for key, c in block["comparisons"].items()}
                      for name, block in summary["by_metric"].items()}, indent=1)[:4000])
    print(write_summary(args.out, summary))


if __name__ == "__main__":
    main()
