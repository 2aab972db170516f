"""Held-out A - B differences of two eval stages over run directories (one per corpus seed), pooled (issue #26).

Per run directory and pooled over them (questions resampled within each seed,
``stats.stratified_paired_bootstrap_ci``), for sampled and greedy exact match::

    python benchmarks/compare_bridge_arms.py --runs runs/s0 runs/s1 runs/s2 --a eval_bridge --b eval_random

With three or more run directories it also prints the t-interval over the runs' differences: list replicate runs
(``train.seed`` 0 and 1 of each corpus seed) to include the training's randomness, which the question bootstrap
does not see.

``--a`` / ``--b`` may name ``RUN_SUFFIX:stage`` to compare stages of two sibling run directories (e.g. the same seed
run with another ``bridge.budget``): ``--a _corpus:eval_bridge`` reads ``<run>_corpus/eval_bridge``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def per_question(run: Path, spec: str, metric: str) -> np.ndarray:
    """(N,) per-question scores of an eval stage, sorted by question id."""
    import pyarrow.parquet as pq

    suffix, _, stage = spec.rpartition(":")
    path = Path(str(run) + suffix) / stage / "predictions.parquet"
    table = pq.read_table(path).sort_by("id")
    column = "sampled_accuracy" if metric == "sampled" else "correct"
    return np.asarray(table[column].to_pylist(), dtype=np.float64)


def main(argv: list[str] | None = None) -> int:
    from raycurate.algorithms.stats import paired_bootstrap_ci, stratified_paired_bootstrap_ci

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=Path, nargs="+", required=True)
    parser.add_argument("--a", required=True)
    parser.add_argument("--b", required=True)
    args = parser.parse_args(argv)
    for metric in ("sampled", "greedy"):
        pairs = []
        cells = []
        for run in args.runs:
            a, b = per_question(run, args.a, metric), per_question(run, args.b, metric)
            pairs.append((a, b))
            e = paired_bootstrap_ci(a, b)
            cells.append(f"{run.name}: {a.mean():.3f} vs {b.mean():.3f}, {e.value:+.3f} [{e.low:+.3f}, {e.high:+.3f}]")
        pooled = stratified_paired_bootstrap_ci(pairs)
        print(f"{metric} EM, {args.a} - {args.b}: " + "; ".join(cells)
              + f"; pooled {pooled.value:+.3f} [{pooled.low:+.3f}, {pooled.high:+.3f}]" + over_runs(pairs))
    return 0


def over_runs(pairs: list[tuple[np.ndarray, np.ndarray]]) -> str:
    """``"; over N runs +m [t-interval]"``: the 95% t-interval of the per-run differences (>= 3 runs), which with
    replicate runs in ``--runs`` (a corpus seed trained with another ``train.seed``) includes training noise."""
    from raycurate.algorithms.stats import t_interval_over_runs

    e = t_interval_over_runs(np.array([a.mean() - b.mean() for a, b in pairs]))
    return "" if e is None else f"; over {e.n} runs {e.value:+.3f} [{e.low:+.3f}, {e.high:+.3f}]"


if __name__ == "__main__":
    sys.exit(main())
