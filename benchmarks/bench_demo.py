"""Time `raycurate demo` phases: first use (tiny-model pre-training included) and with the model cache.

Also measures ingest throughput on a larger generated corpus.  Usage::

    python benchmarks/bench_demo.py [--out /tmp/raycurate-bench] [--ingest-rows 100000]

The last line is ``key=value`` pairs: ``demo_seconds`` (first use), ``demo_cached_seconds``, per-stage seconds of
the first run, ``ingest_rows_per_s`` and the held-out accuracies.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path


def run_demo(out: Path, cache: Path, overrides: list[str]) -> tuple[float, dict]:
    from raycurate.cli.main import _load_job, demo_job_path
    from raycurate.pipelines import run_pipeline

    cfg = _load_job(demo_job_path(), [f"run.runs_dir={out.parent}", f"run.name={out.name}",
                                      f"model.cache_dir={cache}", *overrides])
    start = time.perf_counter()
    manifest = run_pipeline(cfg)
    return time.perf_counter() - start, manifest


def ingest_throughput(rows: int, workdir: Path) -> float:
    from raycurate.data.corpus import generate_corpus, write_jsonl
    from raycurate.data.ingest import ingest

    path = workdir / "ingest_corpus.jsonl"
    write_jsonl(generate_corpus(rows, seed=1), path)
    start = time.perf_counter()
    result = ingest([str(path)], str(workdir / "ingest_out"), strict=False, split_seed=0,
                    split_ratios={"warmup": 0.05, "validation": 0.05, "selection": 0.9}, progress=False)
    seconds = time.perf_counter() - start
    assert result.rows["input"] == rows
    return rows / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None, help="work folder (default: a fresh temp folder)")
    parser.add_argument("--ingest-rows", type=int, default=100_000)
    parser.add_argument("overrides", nargs="*", help="demo config overrides")
    args = parser.parse_args()
    work = Path(args.out or tempfile.mkdtemp(prefix="raycurate-bench-"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cache = work / "cache"
    first_s, manifest = run_demo(work / "first", cache, args.overrides)
    cached_s, _ = run_demo(work / "cached", cache, args.overrides)
    rows_per_s = ingest_throughput(args.ingest_rows, work)
    stages = {name: rec.get("seconds", 0.0) for name, rec in manifest["stages"].items()}
    results = manifest.get("results", {}).get("heldout", {})
    print("stage seconds (first run): " + ", ".join(f"{k} {v:.1f}" for k, v in stages.items()))
    pairs = {
        "demo_seconds": f"{first_s:.1f}",
        "demo_cached_seconds": f"{cached_s:.1f}",
        "ingest_rows_per_s": f"{rows_per_s:.0f}",
        **{f"{k}_seconds": f"{v:.1f}" for k, v in stages.items()},
        **{f"exact_match_{k}": f"{v['exact_match']:.3f}" for k, v in results.items()},
        **{f"gold_loss_{k}": f"{v['gold_loss']:.3f}" for k, v in results.items()},
    }
    print(" ".join(f"{k}={v}" for k, v in pairs.items()))


if __name__ == "__main__":
    main()
