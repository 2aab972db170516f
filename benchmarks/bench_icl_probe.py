"""ICL probing throughput (P2D): prompts/s of the probe actor's work on the tiny model, vs all-layer attention.

Setup: the tiny-llama preset (4 layers, hidden 128, GQA 4/2 heads) with a tokenizer trained on the embedded
corpus; ``--pool`` corpus rows tokenized with the chat template; the probing plan of ``--rounds`` rounds with
5 demonstrations + 3 queries per prompt (``probe_plan``); 2 selected heads in the last layer (10% of 16 heads,
rounded up).  The timed work is exactly :class:`raycurate.stages.p2d.IclProbeUDF.probe` (one forward with attention
materialised only for the layers holding selected heads, gold log-likelihood query scores) over every prompt of
the plan.  The reference is the same probe with attention materialised on *all* layers (plain eager attention),
what an implementation without the selective-attention path pays.  Usage::

    python benchmarks/bench_icl_probe.py [--pool 200] [--rounds 1] [--threads 2]

Last line: ``prompts_per_s=... all_layers_over_selected=... mean_prompt_tokens=...``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace


def build(tmp: Path, pool: int, seed: int) -> tuple[str, str, list[str]]:
    """Tiny model + tokenizer saved under ``tmp``; the pool's token rows as parquet; the pool ids."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raycurate.data.corpus import generate_corpus
    from raycurate.data.tokenize import tokenize_record
    from raycurate.models.tiny import build_tiny_model
    from raycurate.models.tokenizer import train_tokenizer

    rows = generate_corpus(pool, seed=seed)
    tokenizer = train_tokenizer([r["prompt"] + "\n" + r["response"] for r in rows], vocab_size=2048)
    model = build_tiny_model("tiny-llama", tokenizer, seed)
    model_dir = tmp / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    token_rows = [tokenize_record(tokenizer, r, 384) for r in rows]
    token_rows = [t for t in token_rows if "input_ids" in t]
    tokens_dir = tmp / "tokens"
    tokens_dir.mkdir()
    pq.write_table(pa.Table.from_pylist([{k: t[k] for k in ("id", "input_ids", "prompt_len", "response")}
                                         for t in token_rows]), tokens_dir / "part-00000.parquet")
    return str(model_dir), str(tokens_dir), sorted(t["id"] for t in token_rows)


def time_probe(udf, plan: list[dict]) -> tuple[float, int]:
    started = time.perf_counter()
    tokens = sum(udf.probe(prompt)["tokens"] for prompt in plan)
    return time.perf_counter() - started, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pool", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from raycurate.models.loading import enable_attention_outputs
    from raycurate.stages.p2d import IclProbeUDF, probe_plan

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, tokens_dir, ids = build(Path(tmp), args.pool, args.seed)
        cfg = SimpleNamespace(rounds=args.rounds, demos=5, queries=3, seed=args.seed)
        plan = probe_plan(ids, cfg)
        heads = [[3, 0], [3, 1]]
        udf = IclProbeUDF(model_dir, tokens_dir, heads, "Solve the following problems.", "loglik", 8192, 8,
                          args.threads)
        udf.probe(plan[0])  # warm-up
        selected_s, tokens = time_probe(udf, plan)
        enable_attention_outputs(udf.model, None)  # reference: eager attention on every layer
        all_s, _ = time_probe(udf, plan)
    print(f"prompts: {len(plan)}, tokens: {tokens}, selective attention {selected_s:.2f} s, all-layer attention "
          f"{all_s:.2f} s")
    print(f"prompts_per_s={len(plan) / selected_s:.2f} all_layers_over_selected={all_s / selected_s:.2f} "
          f"mean_prompt_tokens={tokens / len(plan):.0f}")


if __name__ == "__main__":
    main()
