"""Streaming at scale: a generated corpus through ingest and a sharded cheap-scoring stage, then kill-and-resume.

Usage::

    python benchmarks/bench_scale.py --rows 1000000 [--small-rows 100000] [--shard-rows 25000] [--actors 2]

For each of ``--small-rows`` and ``--rows``: a subprocess writes the embedded corpus (``generate_corpus`` in
50,000-row chunks with globally unique ids, streamed to parquet files; never the whole corpus in memory), then a
fresh *driver* process runs the real stages on it: ``ingest_stage`` (streaming validation and split into parquet
shards) and ``sharded_stage`` with a cheap scorer (distinct word-bigram share of the response, one Ray actor per
CPU, ``--shard-rows`` rows per shard), Ray started with object spilling to a local folder.  The driver reports its
peak RSS (``ru_maxrss``) and per-phase peaks sampled every 50 ms.  Then, at ``--rows``: three scoring-only runs of
the sharded map over the ingested rows, each in a fresh process: uninterrupted, killed with SIGKILL once half the
shards have markers, and the resumed re-run; their part files are compared by checksum.

Printed: per-size rows/s of ingest, scoring and both together, driver RSS, Ray start-up time.  Last line:
``rows_per_s=… rss_1m_over_100k=… resume_overhead=…``: ingest+scoring rows/s at ``--rows`` (Ray start-up
excluded), peak driver RSS at ``--rows`` over that at ``--small-rows`` (target < 1.5), and (killed run + resumed
run) / uninterrupted run in wall time (each includes its own Python and Ray start-up).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CHUNK_ROWS = 50_000


class BigramScoreUDF:
    """Cheap scorer: share of distinct word bigrams in the response (1 = no repetition) times a length factor.

    Output: ``id``, ``score`` (float32), ``words`` (int32); one row per input row, in order.
    """

    def __init__(self, full_length_words: int = 32):
        self.full_length_words = full_length_words

    def __call__(self, table):
        import pyarrow as pa

        scores, counts = [], []
        for text in table["response"].to_pylist():
            words = text.split()
            bigrams = list(zip(words, words[1:]))
            distinct = len(set(bigrams)) / len(bigrams) if bigrams else 0.0
            scores.append(distinct * min(1.0, len(words) / self.full_length_words))
            counts.append(len(words))
        return pa.table({"id": table["id"], "score": pa.array(scores, pa.float32()),
                         "words": pa.array(counts, pa.int32())})


# ----------------------------------------------------------------------------------------------------------
# Worker modes (each runs in its own process)
# ----------------------------------------------------------------------------------------------------------


def generate(rows: int, out_dir: Path, seed: int) -> dict:
    """Write ``rows`` corpus rows as ``corpus-{k:04d}.parquet`` chunks; ids are unique across chunks."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raycurate.data.corpus import generate_corpus

    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for k, offset in enumerate(range(0, rows, CHUNK_ROWS)):
        chunk = generate_corpus(min(CHUNK_ROWS, rows - offset), seed=seed * 100_000 + k)
        for row in chunk:
            row["id"] = f"c{k:04d}-{row['id']}"
            if row["label"]["source_id"]:
                row["label"]["source_id"] = f"c{k:04d}-{row['label']['source_id']}"
        pq.write_table(pa.Table.from_pylist(chunk), out_dir / f"corpus-{k:04d}.parquet")
    return {"rows": rows, "seconds": time.perf_counter() - start}


class RssSampler:
    """Peak RSS of this process per named phase, sampled every ``interval_s`` in a daemon thread."""

    def __init__(self, interval_s: float = 0.05):
        import psutil

        self.process = psutil.Process()
        self.interval_s = interval_s
        self.phase = "start"
        self.peaks: dict[str, int] = {}
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            rss = self.process.memory_info().rss
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)
            time.sleep(self.interval_s)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def start_ray(work: Path, num_cpus: int) -> float:
    """Local Ray with object spilling to ``work/spill``; returns the start-up seconds."""
    from raycurate.stages.runtime import init_ray

    (work / "spill").mkdir(parents=True, exist_ok=True)
    # Read by Ray's node start-up when ray.init gets no object_spilling_directory (init_ray passes none yet).
    os.environ["RAY_object_spilling_directory"] = str(work / "spill")
    start = time.perf_counter()
    init_ray(num_cpus=num_cpus, temp_dir=tempfile.mkdtemp(prefix="ray", dir=work))  # deleted with ``work``
    return time.perf_counter() - start


def pipeline(corpus: Path, run_root: Path, work: Path, shard_rows: int, actors: int) -> dict:
    """Driver: ingest stage then sharded scoring stage in a run directory; timings and driver memory."""
    from raycurate.config.data import DataConfig
    from raycurate.rundir import RunDir
    from raycurate.stages.base import output_path
    from raycurate.stages.data_stages import ingest_stage
    from raycurate.stages.executor import PoolResources, sharded_stage

    sampler = RssSampler()
    run = RunDir(run_root)
    sampler.phase = "ingest"
    start = time.perf_counter()
    ingest = ingest_stage(run, [str(corpus)], DataConfig(), upstream=[], progress=False)
    ingest_s = time.perf_counter() - start
    sampler.phase = "ray_start"
    ray_s = start_ray(work, actors)
    sampler.phase = "score"
    start = time.perf_counter()
    whole_shards = PoolResources(num_actors=actors, num_cpus=1, num_gpus=0, batch_size=shard_rows)
    score = sharded_stage(run, "score", output_path(run, ingest, "accepted"), BigramScoreUDF, {}, whole_shards,
                          config={}, upstream=["ingest"], shard_rows=shard_rows, progress=False)
    score_s = time.perf_counter() - start
    time.sleep(0.1)
    rows = ingest["metrics"]["rows"]
    return {"input": rows["input"], "accepted": rows["accepted"], "scored": score["metrics"]["rows"],
            "ingest_s": ingest_s, "ray_start_s": ray_s, "score_s": score_s, "peak_rss": peak_rss_bytes(),
            "phase_rss": dict(sampler.peaks)}


def score(accepted: Path, out: Path, work: Path, shard_rows: int, actors: int) -> dict:
    """Scoring only (a resumable sharded map into ``out``, one UDF call per shard)."""
    from raycurate.stages.executor import PoolResources, ShardedInput, map_model_over_rows

    start_ray(work, actors)
    whole_shards = PoolResources(num_actors=actors, num_cpus=1, num_gpus=0, batch_size=shard_rows)
    return map_model_over_rows(ShardedInput(accepted, out, shard_rows), BigramScoreUDF, {}, whole_shards,
                               progress=False)


# ----------------------------------------------------------------------------------------------------------
# Orchestration (parent process)
# ----------------------------------------------------------------------------------------------------------


def run_worker(args: list[str], kill_when=None) -> tuple[dict | None, float]:
    """Run this script in ``--worker`` mode; returns (its JSON result or None if killed, wall seconds)."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--worker", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        if kill_when is not None:
            while not kill_when():
                if proc.poll() is not None:
                    tail = proc.stderr.read()[-3000:]
                    raise RuntimeError(f"worker {args[0]} finished before the kill point:\n{tail}")
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None, time.perf_counter() - start
        stdout, stderr = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"worker {args[0]} failed ({proc.returncode}):\n{stderr[-3000:]}")
        return json.loads(stdout.strip().splitlines()[-1]), time.perf_counter() - start
    finally:
        _kill_session(proc.pid)


def _kill_session(sid: int) -> None:
    """SIGKILL what is left of a worker's session (its Ray processes; Ray puts workers in their own groups)."""
    import psutil

    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.info["pid"]) == sid:
                os.kill(p.info["pid"], signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue


def mib(n: int) -> float:
    return n / 2**20


def scale_run(work: Path, rows: int, shard_rows: int, actors: int) -> dict:
    corpus = work / f"corpus-{rows}"
    gen, _ = run_worker(["generate", str(rows), str(corpus)])
    result, _ = run_worker(["pipeline", str(corpus), str(work / f"run-{rows}"), str(work), str(shard_rows),
                            str(actors)])
    result["generate_s"] = gen["seconds"]
    shutil.rmtree(corpus)
    phases = " ".join(f"{k}={mib(v):.0f}MiB" for k, v in result["phase_rss"].items())
    ingest_rate, score_rate = result["input"] / result["ingest_s"], result["scored"] / result["score_s"]
    print(f"rows={rows}: generate {rows / gen['seconds']:,.0f} rows/s; ingest {ingest_rate:,.0f} rows/s "
          f"({result['ingest_s']:.1f} s); score {score_rate:,.0f} rows/s ({result['score_s']:.1f} s, {actors} actors, "
          f"{shard_rows}-row shards); Ray start {result['ray_start_s']:.1f} s; driver peak RSS "
          f"{mib(result['peak_rss']):.0f} MiB (per phase: {phases})", flush=True)
    assert result["scored"] == result["accepted"], "every accepted row is scored exactly once"
    return result


def checksums(shards_dir: Path) -> dict[str, str]:
    return {p.stem: json.loads(p.read_text())["sha256"] for p in sorted(shards_dir.glob("*.done"))}


def resume_run(work: Path, rows: int, shard_rows: int, actors: int) -> dict:
    accepted = work / f"run-{rows}" / "ingest" / "accepted"
    common = [str(work), str(shard_rows), str(actors)]
    ref, ref_s = run_worker(["score", str(accepted), str(work / "score-ref"), *common])
    half = (ref["shards"] + 1) // 2
    out = work / "score-resumed"
    _, killed_s = run_worker(["score", str(accepted), str(out), *common],
                             kill_when=lambda: len(list((out / "shards").glob("*.done"))) >= half)
    done_at_kill = len(list((out / "shards").glob("*.done")))
    resumed, resumed_s = run_worker(["score", str(accepted), str(out), *common])
    identical = checksums(out / "shards") == checksums(work / "score-ref" / "shards")
    overhead = (killed_s + resumed_s) / ref_s
    print(f"resume at rows={rows}: uninterrupted {ref_s:.1f} s; killed after {done_at_kill}/{ref['shards']} shards "
          f"at {killed_s:.1f} s; resumed {resumed_s:.1f} s (skipped {resumed['shards_skipped']}, computed "
          f"{resumed['shards_computed']}); parts identical to the uninterrupted run: {identical}", flush=True)
    assert identical, "a resumed run must produce the uninterrupted run's output"
    return {"overhead": overhead}


def worker_main(argv: list[str]) -> None:
    mode, rest = argv[0], argv[1:]
    if mode == "generate":
        result = generate(int(rest[0]), Path(rest[1]), seed=0)
    elif mode == "pipeline":
        result = pipeline(Path(rest[0]), Path(rest[1]), Path(rest[2]), int(rest[3]), int(rest[4]))
    elif mode == "score":
        result = score(Path(rest[0]), Path(rest[1]), Path(rest[2]), int(rest[3]), int(rest[4]))
    else:
        raise SystemExit(f"unknown worker mode {mode!r}")
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--small-rows", type=int, default=None, help="reference size (default rows / 10)")
    parser.add_argument("--shard-rows", type=int, default=25_000)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--work", default=None, help="work folder (default: a temp folder, deleted at the end)")
    args = parser.parse_args()
    small = args.small_rows or max(args.rows // 10, 1)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_scale_"))
    try:
        small_result = scale_run(work, small, args.shard_rows, args.actors)
        big_result = scale_run(work, args.rows, args.shard_rows, args.actors)
        resume = resume_run(work, args.rows, args.shard_rows, args.actors)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    rows_per_s = big_result["input"] / (big_result["ingest_s"] + big_result["score_s"])
    rss_ratio = big_result["peak_rss"] / small_result["peak_rss"]
    print(f"rows_per_s={rows_per_s:.0f} rss_1m_over_100k={rss_ratio:.2f} resume_overhead={resume['overhead']:.2f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2:])
    else:
        main()
