"""BRIDGE scoring stage throughput with 1 and 2 actors (same rows, same model).

Usage::

    python benchmarks/bench_scoring_scaling.py [--rows 400] [--shard-rows 128]

Builds the tiny model (briefly pre-trained, cached in a temp folder), tokenizes embedded-corpus rows, draws a seeded
scoring direction on the last 4 layers, then runs the real actor UDF (`BridgeScoreUDF`: JVP utilities, one
attention layer; since issue #15 the selection runs in its own CPU stage, so rows before that date include the
alternating selection and closure) with pools of 1 and 2 actors, one torch thread each, through the stage's own
path, ``raycurate.stages.sharded.sharded_map`` (rows before 2026-12-04 went through a Ray Data ``map_batches``
with the driver iterating rows; the stage has used ``sharded_map`` since the scoring split).  Two arms: ``cold``
starts the pool for the map and kills it after (the stage today: actor start-up, imports and model loads are in
the time), ``warm`` maps on a :class:`raycurate.stages.warm_pool.WarmPool` whose actors already ran a map with the
same UDF and model (one shard), as a pool kept across maps would.  Last line: ``scaling_2_over_1=…`` (cold: rows/s
with 2 actors over rows/s with 1) and ``warm_scaling_2_over_1=…``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def prepare(work: Path, rows: int) -> tuple[str, str, str]:
    import pyarrow.parquet as pq
    import torch
    from safetensors.torch import save_file

    from raycurate.algorithms.bridge.token_utility import scoring_parameters
    from raycurate.data.corpus import generate_corpus, generate_pretraining_texts
    from raycurate.data.tokenize import token_table, tokenize_batch
    from raycurate.models.loading import load_model, load_tokenizer
    from raycurate.models.pretrain import ensure_base_model

    model_dir = ensure_base_model("tiny-llama", str(work / "cache"), lambda: generate_pretraining_texts(1000, 0),
                                  steps=30, seed=0, data_key="bench-scaling", progress=False)
    tokenizer = load_tokenizer(model_dir)
    records = [dict(r, source="bench", line=i + 1) for i, r in enumerate(generate_corpus(rows, seed=7))]
    token_rows, _ = tokenize_batch(tokenizer, records, 384)
    tokens_dir = work / "tokens"
    tokens_dir.mkdir()
    table = token_table(token_rows)
    for i in range(8):  # 8 files so the read side parallelises like a real table
        pq.write_table(table.slice(i * len(token_rows) // 8, len(token_rows) // 8 + 1), tokens_dir / f"{i}.parquet")
    model = load_model(model_dir)
    gen = torch.Generator().manual_seed(0)
    direction = {k: torch.randn(v.shape, generator=gen) * 1e-2 for k, v in scoring_parameters(model, 4).items()}
    save_file(direction, str(work / "direction.safetensors"))
    return model_dir, str(tokens_dir), str(work / "direction.safetensors")


def run_pool(actors: int, model_dir: str, tokens: str, direction: str, shard_rows: int,
             warm: object = None) -> tuple[float, int]:
    """The ``bridge_score`` stage's path: :func:`sharded_map` of ``BridgeScoreUDF`` over ``actors`` actors, one torch
    thread each, into a fresh scratch folder (nothing resumed); actor start-up included unless ``warm`` (a
    ``WarmPool``) maps it."""
    from raycurate.algorithms.bridge.rows import SelectionSettings
    from raycurate.config.pool import ActorPoolConfig
    from raycurate.stages.bridge import BridgeScoreUDF
    from raycurate.stages.ray_data import resolve_pool
    from raycurate.stages.sharded import sharded_map

    pool = resolve_pool(ActorPoolConfig(num_actors=actors, batch_size=16))
    scratch = tempfile.mkdtemp(prefix=f"raycurate-scaling-{actors}-")
    start = time.perf_counter()
    metrics = sharded_map(tokens, scratch, BridgeScoreUDF, {
        "model_dir": model_dir, "direction_path": direction, "routing_layer": None, "settings": SelectionSettings(),
        "micro_batch": 8, "threads": 1}, shard_rows=shard_rows, num_actors=pool.num_actors,
        num_cpus_per_actor=pool.num_cpus, batch_rows=pool.batch_size, progress=False, pool=warm)
    return time.perf_counter() - start, metrics["rows_computed"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--shard-rows", type=int, default=128,
                        help="rows per shard: enough shards that both actors stay busy to the end")
    parser.add_argument("--arms", default="cold,warm", help="comma-separated: cold, warm")
    args = parser.parse_args()
    from raycurate.stages.runtime import init_ray
    from raycurate.stages.warm_pool import WarmPool

    init_ray(num_cpus=2)
    work = Path(tempfile.mkdtemp(prefix="raycurate-scaling-"))
    model_dir, tokens, direction = prepare(work, args.rows)
    run_pool(1, model_dir, tokens, direction, args.shard_rows)  # warm-up: worker start, imports, denormal flush
    arms = args.arms.split(",")
    results: dict[tuple[str, int], float] = {}
    for actors in (1, 2):
        if "cold" in arms:
            seconds, n = run_pool(actors, model_dir, tokens, direction, args.shard_rows)
            results["cold", actors] = n / seconds
            print(f"cold, {actors} actor(s): {n} rows in {seconds:.1f} s = {n / seconds:.1f} rows/s")
        if "warm" in arms:
            with WarmPool(actors, 1.0) as pool:
                run_pool(actors, model_dir, first_shard(work, tokens, actors), direction, args.shard_rows, pool)
                seconds, n = run_pool(actors, model_dir, tokens, direction, args.shard_rows, pool)
            results["warm", actors] = n / seconds
            print(f"warm, {actors} actor(s): {n} rows in {seconds:.1f} s = {n / seconds:.1f} rows/s")
    line = []
    for arm in ("cold", "warm"):
        if (arm, 1) in results:
            prefix = "" if arm == "cold" else "warm_"
            one, two = results[arm, 1], results[arm, 2]
            line.append(f"{prefix}rows_per_s_1={one:.1f} {prefix}rows_per_s_2={two:.1f} "
                        f"{prefix}scaling_2_over_1={two / one:.2f}")
    print(" ".join(line))


def first_shard(work: Path, tokens: str, actors: int) -> str:
    """A small input (the first token file, repeated once per actor) that warms every actor of a pool."""
    import shutil

    folder = work / f"warmup-{actors}"
    folder.mkdir(exist_ok=True)
    first = sorted(Path(tokens).glob("*.parquet"))[0]
    for i in range(actors):
        shutil.copy(first, folder / f"{i}.parquet")
    return str(folder)


if __name__ == "__main__":
    main()
