"""Near-duplicate rules on a finished curate run: which rows each rule flags, and the recipe's AUROC with it.

Reads a run of ``jobs/real_curate_proving_ground.yaml`` (stages ``curate_pool_rows``, ``tokenize_trusted``,
``curate_reference_scores`` / ``curate_reference_calibration``) and, for each dedup rule (pair measure, threshold,
keep rule), prints the share of the pool's ``near_duplicate`` rows and of its clean rows it flags, the other kinds it
flags, and the AUROC per corruption kind of the recipe's ranking (flagged rows last, the rest by the reference's
calibrated badness over ``max`` and ``excess_max``). No training; labels from the corpus generator.

Usage::

    .venv/bin/python benchmarks/analyze_dedup.py runs/real_curate_proving_ground/seed-0 [more run dirs]
"""

from __future__ import annotations

import sys
from collections import Counter

import numpy as np

from raycurate.algorithms.dedup import cluster_duplicates, duplicate_pairs, minhash_signatures, word_shingles
from raycurate.algorithms.ranking import label_separation
from raycurate.algorithms.reference_signals import badness
from raycurate.rundir import RunDir
from raycurate.stages.base import output_path
from raycurate.stages.bridge import read_token_rows
from raycurate.stages.reference import read_signal

SIGNALS = ("max", "excess_max")
RULES = [("jaccard", 0.9, "first"), ("jaccard", 0.9, "shortest"), ("containment", 0.9, "shortest"),
         ("example", 1.0, "first"), ("example", 1.0, "shortest"), ("example", 0.95, "shortest"),
         ("example", 0.9, "shortest")]


def rule_pairs(rows: list[dict], measure: str, threshold: float) -> list[tuple[int, int, float]]:
    """Duplicate pairs of ``rows`` under one rule (128 permutations, 32 bands, as the curate pipeline)."""
    texts = [f"{r['prompt']}\n{r['response']}" for r in rows]
    if measure == "example":
        signatures = minhash_signatures([r["response"] for r in rows], 128, 0)
        return duplicate_pairs(signatures, [word_shingles(r["prompt"]) for r in rows], threshold, 32, measure,
                               [word_shingles(r["response"]) for r in rows])
    return duplicate_pairs(minhash_signatures(texts, 128, 0), [word_shingles(t) for t in texts], threshold, 32,
                           measure)


def analyze(run_dir: str) -> None:
    run = RunDir(run_dir)
    pool = sorted(read_token_rows(output_path(run, "curate_pool_rows", "tokens"), ["id", "prompt", "response",
                                                                                   "label"]), key=lambda r: r["id"])
    trusted = sorted(read_token_rows(output_path(run, "tokenize_trusted", "tokens"), ["id", "prompt", "response"]),
                     key=lambda r: r["id"])
    rows = trusted + pool
    kinds = np.array([(r["label"] or {}).get("corruption", "none") for r in pool])
    clean, near = kinds == "none", kinds == "near_duplicate"
    values = {n: read_signal(run, "curate_reference_scores", n) for n in SIGNALS}
    calibration = {n: np.array(list(read_signal(run, "curate_reference_calibration", n).values())) for n in SIGNALS}
    bad = badness({n: np.array([v[r["id"]] for r in pool]) for n, v in values.items()}, calibration)

    def by_kind(score: np.ndarray) -> str:
        found = label_separation(score, clean, kinds, 0)
        return f"AUROC {found['auroc']:.3f} " + " ".join(
            f"{k}={v['auroc']:.2f}" for k, v in sorted(found["auroc_by_kind"].items()))

    print(f"{run_dir}: {len(pool)} pool rows, {int(near.sum())} near-duplicates, {len(trusted)} trusted rows")
    print(f"  reference alone: {by_kind(-bad)}")
    lengths = [len(r["prompt"]) + len(r["response"]) for r in rows]
    for measure, threshold, keep in RULES:
        source, _ = cluster_duplicates(rule_pairs(rows, measure, threshold), lengths, keep=keep,
                                       protected=len(trusted))
        flagged = source[len(trusted):] >= 0
        others = Counter(kinds[flagged & ~near & ~clean].tolist())
        print(f"  {measure:11s} {threshold:.2f} {keep:8s} near-duplicates flagged {flagged[near].mean():.2f}, clean "
              f"{flagged[clean].mean():.3f}, others {dict(others)}; with the reference: "
              f"{by_kind(np.where(flagged, -2.0, -bad))}")


if __name__ == "__main__":
    for path in sys.argv[1:] or ["runs/real_curate_proving_ground/seed-0"]:
        analyze(path)
