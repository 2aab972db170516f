"""What BDS's learned weights separate, per corruption kind, and what its kept rows hold (issue #25).

For each run directory of ``pipeline: curate`` with the step ``bds`` (one per corpus seed)::

    python benchmarks/analyze_bds_selection.py runs/real_curate_proving_ground/seed-0 [more runs]

prints the AUROC of sigma(omega) (clean vs corrupted, and clean vs each ``label.corruption`` kind), the AUROC of
minus each row's latest loss (the loss-based score BDS can at best reproduce), and per kind the share of the pool's
rows that the BDS arm (``curate_rows``) and the random-rows arm (``curate_random_rows``) train on.  The last line
has the means over the runs: ``auroc=... auroc_neg_loss=... kept_clean_share_bds=... kept_clean_share_random=...``.
Reads only; writes nothing.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path


def kind_of(label: dict) -> str:
    """The row's corruption kind, ``none`` for a clean row."""
    return label.get("corruption") or ("none" if label.get("clean") else "unknown")


def arm_ids(run, stage: str) -> set[str]:
    """Ids of the rows a subset stage kept (absent stage: empty)."""
    from raycurate.stages.base import output_path
    from raycurate.stages.bridge import read_token_rows

    if run.stage_record(stage) is None:
        return set()
    return {r["id"] for r in read_token_rows(output_path(run, stage, "tokens"), ["id"])}


def analyze(path: Path) -> dict:
    """AUROCs and kept shares per kind of one run (see the module docstring)."""
    from raycurate.rundir import RunDir
    from raycurate.stages.base import output_path
    from raycurate.stages.bilevel import label_columns, weight_analysis
    from raycurate.stages.bridge import read_token_rows

    run = RunDir(str(path))
    analysis = weight_analysis(run, "curate_bds", "bilevel_candidate_rows")
    rows = read_token_rows(output_path(run, "curate_pool_rows", "tokens"), label_columns(run, "curate_pool_rows"))
    kinds = {r["id"]: kind_of(r.get("label") or {}) for r in rows}
    pool = Counter(kinds.values())
    arms = {"bds": arm_ids(run, "curate_rows"), "random": arm_ids(run, "curate_random_rows")}
    kept = {arm: Counter(kinds[i] for i in ids) for arm, ids in arms.items()}
    return {"auroc": analysis.get("auroc"), "auroc_neg_loss": analysis.get("auroc_neg_loss"),
            "by_kind": {k: v.get("auroc") for k, v in analysis.get("auroc_by_kind", {}).items()},
            "pool": dict(pool), "kept": {arm: dict(c) for arm, c in kept.items()},
            "clean_share": {arm: kept[arm]["none"] / max(1, len(ids)) for arm, ids in arms.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", type=Path, nargs="+")
    args = parser.parse_args(argv)
    results = []
    for path in args.runs:
        result = analyze(path)
        results.append(result)
        print(f"{path}: AUROC {result['auroc']:.3f}, loss-based ceiling {result['auroc_neg_loss']:.3f}")
        print(f"  {'kind':<24} {'pool':>5} {'AUROC':>6} {'kept by BDS':>12} {'kept by random':>15}")
        for kind in sorted(result["pool"]):
            n = result["pool"][kind]
            auc = result["by_kind"].get(kind)
            shares = [result["kept"][arm].get(kind, 0) / n for arm in ("bds", "random")]
            print(f"  {kind:<24} {n:>5} {'' if auc is None else f'{auc:.3f}':>6} {shares[0]:>12.2f} {shares[1]:>15.2f}")
    mean = lambda key, arm=None: sum(  # noqa: E731 - one-line mean over runs
        (r[key][arm] if arm else r[key]) for r in results) / len(results)
    print(f"auroc={mean('auroc'):.3f} auroc_neg_loss={mean('auroc_neg_loss'):.3f} "
          f"kept_clean_share_bds={mean('clean_share', 'bds'):.3f} "
          f"kept_clean_share_random={mean('clean_share', 'random'):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
