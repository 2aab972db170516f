"""A LoRA training step on length-sorted groups of a micro-batch vs the whole right-padded micro-batch.

Issue #39: the real proving ground's SFT micro-batch of 8 rows is ~43% padding.  This times forward + backward of
the job's LoRA set-up (SmolLM2-135M, frozen base in ``--dtype``, fp32 LoRA r=16 on the job's targets,
token-normalised loss) on ``--batches`` seeded micro-batches of a run's real token table, one forward per batch
(:func:`~raycurate.algorithms.losses.model_token_losses`) against ``--groups`` forwards
(:func:`~raycurate.algorithms.losses.grouped_model_token_losses`), interleaved in this process; and checks that the
loss and the adapter gradients agree.  Usage::

    python benchmarks/bench_length_groups.py --tokens runs/<run>/seed-2/tokenize/tokens [--groups 2] [--threads 1]

The last line: ``grouped_over_padded=<time ratio, < 1 is faster> padded_tokens=<share> grouped_tokens=<share>
max_loss_rel_diff=... max_grad_rel_diff=...``.
"""

from __future__ import annotations

import argparse
import subprocess
import time

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", required=True, help="a tokenize stage's token table (parquet folder)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="the frozen base's dtype (float32: the equality check without bf16 rounding)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())

    from raycurate.algorithms.losses import grouped_model_token_losses, length_groups
    from raycurate.config.train import TrainConfig
    from raycurate.models.adapters import apply_adapter
    from raycurate.models.loading import load_model
    from raycurate.training.batches import collate, load_token_table, token_sft_loss

    cfg = TrainConfig(adapter="lora", lora_r=16, lora_alpha=16)
    model = apply_adapter(load_model(args.model, dtype=args.dtype), cfg.adapter_spec())
    model.train()
    table = load_token_table(args.tokens)
    rng = np.random.default_rng(0)
    batches = [collate(table, rng.choice(len(table), args.batch, replace=False)) for _ in range(args.batches)]
    trainable = [p for p in model.parameters() if p.requires_grad]

    def step(batch: dict, groups: int) -> tuple[float, float, list[torch.Tensor]]:
        started = time.perf_counter()
        per_token = grouped_model_token_losses(model, batch["input_ids"], batch["attention_mask"],
                                               batch["loss_mask"], groups)
        counted = (batch["loss_mask"][:, 1:] != 0).sum()
        loss = token_sft_loss(per_token, {**batch, "token_norm": counted.to(torch.float32)})
        grads = torch.autograd.grad(loss, trainable)
        return time.perf_counter() - started, float(loss.detach()), grads

    times = {1: [], args.groups: []}
    loss_diff = grad_diff = 0.0
    step(batches[0], 1)  # warm-up
    for batch in batches:
        (t1, l1, g1), (tg, lg, gg) = step(batch, 1), step(batch, args.groups)
        times[1].append(t1)
        times[args.groups].append(tg)
        loss_diff = max(loss_diff, abs(lg - l1) / abs(l1))
        norm = torch.sqrt(sum((a.float() ** 2).sum() for a in g1))
        grad_diff = max(grad_diff, float(torch.sqrt(sum(((a - b).float() ** 2).sum() for a, b in zip(g1, gg))) / norm))
    widths = [b["attention_mask"] for b in batches]
    real = sum(int(m.sum()) for m in widths)
    padded = sum(m.numel() for m in widths)
    grouped = sum(width * len(rows) for m in widths for rows, width in length_groups(m.sum(dim=1), args.groups))
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print(f"padded {np.sum(times[1]):.2f} s, {args.groups} groups {np.sum(times[args.groups]):.2f} s over "
          f"{args.batches} batches of {args.batch} at {args.threads} thread(s), {args.dtype} base")
    print(f"grouped_over_padded={np.sum(times[args.groups]) / np.sum(times[1]):.3f} "
          f"padded_tokens={padded / real:.3f} grouped_tokens={grouped / real:.3f} "
          f"max_loss_rel_diff={loss_diff:.2e} max_grad_rel_diff={grad_diff:.2e}")


if __name__ == "__main__":
    main()
