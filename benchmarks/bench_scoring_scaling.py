"""BRIDGE scoring stage throughput with 1 and 2 actors (same rows, same model).

Usage::

    python benchmarks/bench_scoring_scaling.py [--rows 400] [--shard-rows 128]

Builds the tiny model (briefly pre-trained, cached in a temp folder), tokenizes embedded-corpus rows, draws a seeded
scoring direction on the last 4 layers, then runs the real actor UDF (`BridgeScoreUDF`: JVP utilities, one
attention layer; since issue #15 the selection runs in its own CPU stage, so rows before that date include the
alternating selection and closure) with pools of 1 and 2 actors, one torch thread each, through the stage's own
path, the executor's sharded map (``map_model_over_rows`` of a ``ShardedInput``; rows before 2026-12-04 went
through a Ray Data ``map_batches`` with the driver iterating rows).  The pool starts for the map and is killed after
(actor start-up, imports and model loads are in the time), as in the stage.  Last line: ``scaling_2_over_1=…``
(rows/s with 2 actors over rows/s with 1).  The ``warm`` arm (a ``WarmPool`` kept across maps, #29 in
``benchmarks/RESULTS.md``) went with ``WarmPool`` when every map moved to one executor (no pipeline opened one).
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


def run_pool(actors: int, model_dir: str, tokens: str, direction: str, shard_rows: int) -> tuple[float, int]:
    """The ``bridge_score`` stage's path: a sharded map of ``BridgeScoreUDF`` over ``actors`` actors, one torch
    thread each, into a fresh scratch folder (nothing resumed), actor start-up included."""
    from raycurate.algorithms.bridge.rows import SelectionSettings
    from raycurate.config.pool import ActorPoolConfig
    from raycurate.stages.bridge import BridgeScoreUDF
    from raycurate.stages.executor import ShardedInput, map_model_over_rows, resolve_pool

    pool = resolve_pool(ActorPoolConfig(num_actors=actors, batch_size=16))
    scratch = tempfile.mkdtemp(prefix=f"raycurate-scaling-{actors}-")
    start = time.perf_counter()
    metrics = map_model_over_rows(ShardedInput(tokens, scratch, shard_rows), BridgeScoreUDF, {
        "model_dir": model_dir, "direction_path": direction, "routing_layer": None, "settings": SelectionSettings(),
        "micro_batch": 8, "threads": 1}, pool, progress=False)
    return time.perf_counter() - start, metrics["rows_computed"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--shard-rows", type=int, default=128,
                        help="rows per shard: enough shards that both actors stay busy to the end")
    args = parser.parse_args()
    from raycurate.stages.runtime import init_ray

    init_ray(num_cpus=2)
    work = Path(tempfile.mkdtemp(prefix="raycurate-scaling-"))
    model_dir, tokens, direction = prepare(work, args.rows)
    run_pool(1, model_dir, tokens, direction, args.shard_rows)  # warm-up: worker start, imports, denormal flush
    results: dict[int, float] = {}
    for actors in (1, 2):
        seconds, n = run_pool(actors, model_dir, tokens, direction, args.shard_rows)
        results[actors] = n / seconds
        print(f"cold, {actors} actor(s): {n} rows in {seconds:.1f} s = {n / seconds:.1f} rows/s")
    one, two = results[1], results[2]
    print(f"rows_per_s_1={one:.1f} rows_per_s_2={two:.1f} scaling_2_over_1={two / one:.2f}")


if __name__ == "__main__":
    main()
