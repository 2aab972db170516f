"""Time one offline BDS step against one plain LoRA SFT step on the same rows.

Setup: the tiny-llama preset (4 layers, hidden 128, GQA 4/2 heads) with a 2,048-token vocabulary and a LoRA adapter
(r 16, alpha 16 on q/k/v/o), the DDP engine in-process (one rank, no process group), ``--batch`` rows per step
(half validation, half candidates) of ``--length`` tokens, micro-batch ``--batch / 2`` (2 accumulation micro-steps).
The plain step is ``engine.train_micro_batch`` with the SFT loss over exactly the rows the BDS step trains on; the
BDS step is :func:`raycurate.training.bds_step.bds_step` (theta step on the penalty-weighted loss, then the omega
update) in both variants: ``exact`` adds a no-grad forward of the candidate rows at theta^{k+1} (paper eq. 5b),
``detached`` reuses the theta step's candidate losses (BIPOST).  Timings are the minimum over ``--repeats``
interleaved runs (the machine is shared).  Usage::

    python benchmarks/bench_bds_step.py [--batch 8] [--length 192] [--repeats 7] [--threads 2]

The last line is ``bds_over_lora=... detached_over_lora=...``: exact-BDS step time / plain LoRA step time (target
<= 1.15) and the same for the detached variant.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

VOCAB = 2048


def token_table(rows: int, length: int, vocab: int, seed: int, prefix: str):
    """An in-memory token table of random rows: a ``length // 2`` prompt side and a supervised response side."""
    from raycurate.training.batches import TokenTable

    rng = np.random.default_rng(seed)
    tokens = rng.integers(7, vocab, size=rows * length)
    mask = np.tile(np.r_[np.zeros(length // 2), np.ones(length - length // 2)], rows).astype(np.int8)
    return TokenTable(
        ids=np.array([f"{prefix}{i:05d}" for i in range(rows)], dtype=object),
        token_values=tokens.astype(np.int64),
        mask_values=mask,
        offsets=np.arange(rows + 1, dtype=np.int64) * length,
        weights=np.ones(rows, dtype=np.float32),
    )


def build_context(args: argparse.Namespace, variant: str):
    from raycurate.config.bilevel import BilevelConfig
    from raycurate.config.train import TrainConfig
    from raycurate.data.corpus import generate_corpus
    from raycurate.models.adapters import apply_adapter
    from raycurate.models.tiny import build_tiny_model
    from raycurate.models.tokenizer import train_tokenizer
    from raycurate.training import bds_step as bs
    from raycurate.training.batches import stack_tables
    from raycurate.training.engines import build_engine

    rows = generate_corpus(200, seed=args.seed)
    tokenizer = train_tokenizer([r["prompt"] + "\n" + r["response"] for r in rows], vocab_size=VOCAB)
    model = build_tiny_model("tiny-llama", tokenizer, args.seed).train()
    model.config.use_cache = False
    model = apply_adapter(model, {"kind": "lora", "r": 16, "alpha": 16})
    half = args.batch // 2
    cfg = TrainConfig(engine="ddp", num_workers=1, micro_batch_size=half, effective_batch_size=args.batch, lr=5e-6,
                      warmup_ratio=0.0)
    settings = BilevelConfig(val_batch=half, variant=variant, seed=args.seed)
    engine = build_engine(model, cfg, run_steps=10_000, device=torch.device("cpu"), bf16=False)
    vocab = len(tokenizer)
    val = token_table(64, args.length, vocab, args.seed, "v")
    cand = token_table(256, args.length, vocab, args.seed + 1, "c")
    return bs.StepContext(engine, stack_tables(val, cand), len(val), len(cand), cfg, settings, 0, 1,
                          torch.device("cpu"), tokenizer.pad_token_id, bs.check_bds_batches(cfg, settings, 1))


def plain_step(ctx, step: int) -> None:
    """One SFT optimizer step (plain loss, unit weights) on the rows BDS step ``step`` trains on."""
    from raycurate.training.batches import collate, sft_loss
    from raycurate.training.bds_step import bds_batches, step_rows

    val, cand = step_rows(step, ctx.num_val, ctx.num_cand, *bds_batches(ctx.cfg, ctx.bds), ctx.bds.seed)
    rows, micro = np.concatenate([val, ctx.num_val + cand]), ctx.cfg.micro_batch_size
    for k in range(ctx.accum):
        batch = collate(ctx.table, rows[k * micro:(k + 1) * micro], ctx.pad_id)
        ctx.engine.train_micro_batch(batch, sft_loss, is_boundary=k == ctx.accum - 1)


def main() -> None:
    from raycurate.training import bds_step as bs
    from raycurate.training.bds_state import OmegaState

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="rows per step (half validation, half candidates)")
    parser.add_argument("--length", type=int, default=192, help="tokens per row")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)

    contexts = {variant: build_context(args, variant) for variant in ("exact", "detached")}
    omega = {variant: OmegaState.fresh(ctx.num_cand) for variant, ctx in contexts.items()}
    best = {"plain": float("inf"), "exact": float("inf"), "detached": float("inf")}
    step = 0
    for _ in range(args.repeats + 1):  # the first round warms up
        for name in best:
            ctx = contexts["exact" if name == "plain" else name]
            started = time.perf_counter()
            if name == "plain":
                plain_step(ctx, step)
            else:
                omega[name], _ = bs.bds_step(ctx, omega[name], step)
            elapsed = time.perf_counter() - started
            if step > 0:
                best[name] = min(best[name], elapsed)
        step += 1

    n_params = sum(p.numel() for p in contexts["exact"].engine.module.parameters())
    print(f"tiny-llama + LoRA r16 ({n_params / 1e6:.2f}M parameters), {args.batch} rows x {args.length} tokens per "
          f"step, micro-batch {args.batch // 2}, {torch.get_num_threads()} threads")
    print(f"{'step':<34}{'seconds':>12}{'ratio':>12}")
    for name, label in (("plain", "plain LoRA SFT"), ("exact", "BDS exact (eq. 5b)"),
                        ("detached", "BDS detached (BIPOST)")):
        print(f"{label:<34}{best[name]:>12.4f}{best[name] / best['plain']:>12.3f}")
    exact, detached = best["exact"] / best["plain"], best["detached"] / best["plain"]
    print(f"bds_over_lora={exact:.3f} detached_over_lora={detached:.3f}")


if __name__ == "__main__":
    main()
