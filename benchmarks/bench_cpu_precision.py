"""bf16 vs fp32 and 1 vs 2 torch threads on CPU, on a real model's geometry: forward, LoRA step, BRIDGE utilities.

Issue #25: does bf16 pay on this CPU, does it change BRIDGE's selections, and which thread count should a worker
use.  Every arm runs in this process on the same inputs, interleaved over ``--repeats`` rounds, and the figure is
the minimum per arm (the machine may be shared: ``uptime`` is printed first and last, so the load is on record).

Arms:

* ``forward``: a no-grad forward of a (``--batch``, ``--tokens``) batch; fp32 weights, fp32 weights under
  ``torch.autocast(cpu, bf16)`` (what ``train.bf16: true`` does with ``train.engine: ddp``), bf16 weights (what
  ``model.dtype: auto`` gives on the bf16 smollm2-135m folder).
* ``lora_step``: forward + backward of the same batch with LoRA r=16 on every linear layer (the real proving
  ground's training), same three precisions.
* ``utilities``: BRIDGE token utilities (one forward-mode JVP along the validation direction of the last
  ``--last-layers`` layers) on ``--rows`` corpus rows, fp32 vs bf16 weights: time, Spearman of the utilities and
  the agreement of the top-``--rho`` response masks (share of the same positions selected).

Each of ``forward`` and ``lora_step`` is timed at 1 and 2 threads; the precision ratios use 1 thread (on shared
cores 2 threads collapse and would swamp them), the utility arms 2.  Usage::

    python benchmarks/bench_cpu_precision.py --model smollm2-135m [--batch 8] [--tokens 96] [--repeats 3]

The last line: ``fwd_bf16_over_fp32=... step_autocast_over_fp32=... step_bf16_over_fp32=... fwd_2t_over_1t=...
step_2t_over_1t=... utility_bf16_over_fp32=... utility_spearman=... mask_agreement=...`` (time ratios: < 1 is
faster; thread ratios are 2-thread time / 1-thread time, 0.5 = perfect scaling).
"""

from __future__ import annotations

import argparse
import subprocess
import time
from contextlib import nullcontext

import numpy as np
import torch

from raycurate.algorithms.bridge.selection import top_b

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PRECISIONS = ("fp32", "autocast", "bf16")


def load(model_name: str, precision: str, lora: bool) -> torch.nn.Module:
    """The model in fp32 (``fp32`` / ``autocast``) or bf16 weights, optionally with a LoRA r=16 adapter."""
    from raycurate.models.loading import load_model

    model = load_model(model_name, dtype="bfloat16" if precision == "bf16" else "float32")
    if lora:
        from raycurate.models.adapters import apply_adapter

        model = apply_adapter(model, {"kind": "lora", "r": 16, "alpha": 16, "targets": LORA_TARGETS})
        model.train()
    return model


def autocast(precision: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "autocast" else nullcontext()


def time_forward(model: torch.nn.Module, ids: torch.Tensor, precision: str) -> float:
    started = time.perf_counter()
    with torch.no_grad(), autocast(precision):
        model(input_ids=ids, use_cache=False)
    return time.perf_counter() - started


def time_step(model: torch.nn.Module, ids: torch.Tensor, precision: str) -> float:
    started = time.perf_counter()
    with autocast(precision):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def timed_arms(model_name: str, ids: torch.Tensor, repeats: int) -> dict[tuple[str, str, int], float]:
    """(kind, precision, threads) -> min seconds, interleaved over ``repeats`` rounds."""
    models = {(kind, p): load(model_name, p, kind == "lora_step") for kind in ("forward", "lora_step")
              for p in PRECISIONS}
    best: dict[tuple[str, str, int], float] = {}
    for round_ in range(repeats + 1):  # round 0 warms every arm up and is not counted
        for (kind, precision), model in models.items():
            for threads in (1, 2):
                torch.set_num_threads(threads)
                fn = time_forward if kind == "forward" else time_step
                seconds = fn(model, ids, precision)
                if round_:
                    key = (kind, precision, threads)
                    best[key] = min(best.get(key, float("inf")), seconds)
        print(f"round {round_}/{repeats} done", flush=True)
    return best


def corpus_batch(model_name: str, rows: int, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(scored batch, validation batch) of tokenized corpus rows, right-padded."""
    from raycurate.algorithms.losses import pad_rows
    from raycurate.data.corpus import generate_corpus
    from raycurate.data.tokenize import tokenize_record
    from raycurate.models.loading import load_tokenizer

    tokenizer = load_tokenizer(model_name)
    records = generate_corpus(2 * rows, seed=seed)
    token_rows = [tokenize_record(tokenizer, r, 384, system_prompt="You are a helpful assistant.") for r in records]

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return pad_rows(token_rows[:rows], pad_id), pad_rows(token_rows[rows:], pad_id)


def utilities(model_name: str, precision: str, scored: dict, validation: dict, last_layers: int,
              threads: int) -> tuple[np.ndarray, float]:
    """(B, T) utilities along the validation direction (lam = 0) and the seconds of the utility pass."""
    from raycurate.algorithms.bridge.token_utility import (
        scoring_direction,
        scoring_parameters,
        token_utilities,
        validation_gradient,
    )

    torch.set_num_threads(threads)
    model = load(model_name, precision, lora=False).eval()
    params = scoring_parameters(model, last_layers)
    direction = scoring_direction(validation_gradient(model, [validation], params), None, lam=0.0)
    direction = {k: v.to(params[k].dtype) for k, v in direction.items()}
    started = time.perf_counter()
    values = token_utilities(model, scored["input_ids"], scored["attention_mask"], scored["loss_mask"], direction)
    return values.float().numpy(), time.perf_counter() - started


def mask_agreement(a: np.ndarray, b: np.ndarray, loss_mask: np.ndarray, rho: float) -> float:
    """Share of the top-``rho`` supervised positions per row that both utility arrays select (pooled over rows)."""
    same = total = 0
    for row in range(a.shape[0]):
        positions = np.flatnonzero(loss_mask[row])
        positions = positions[positions > 0]
        k = int(round(rho * len(positions)))
        both = top_b(a[row, positions], k) & top_b(b[row, positions], k)  # BRIDGE's Top-b, ties by position
        same, total = same + int(both.sum()), total + k
    return same / max(total, 1)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=8, help="corpus rows scored by the utility arms")
    parser.add_argument("--last-layers", type=int, default=4)
    parser.add_argument("--rho", type=float, default=0.75)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("load:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)
    torch.manual_seed(args.seed)
    from transformers import AutoConfig

    from raycurate.models.loading import resolve_model_path

    vocab = AutoConfig.from_pretrained(resolve_model_path(args.model), local_files_only=True).vocab_size
    ids = torch.randint(10, vocab, (args.batch, args.tokens))
    best = timed_arms(args.model, ids, args.repeats)
    tokens = args.batch * args.tokens
    for (kind, precision, threads), seconds in sorted(best.items()):
        print(f"{kind:9s} {precision:8s} threads={threads}: {seconds:.3f} s ({tokens / seconds:.0f} tok/s)",
              flush=True)
    scored, validation = corpus_batch(args.model, args.rows, args.seed)
    print(f"utilities: {args.rows} rows, {int(scored['loss_mask'].sum())} supervised tokens", flush=True)
    u32, t32 = utilities(args.model, "fp32", scored, validation, args.last_layers, 2)
    u16, t16 = utilities(args.model, "bf16", scored, validation, args.last_layers, 2)
    supervised = (scored["loss_mask"].numpy() > 0)
    supervised[:, 0] = False
    rho_s = spearman(u32[supervised], u16[supervised])
    agree = mask_agreement(u32, u16, supervised, args.rho)
    print(f"utilities fp32 {t32:.2f} s, bf16 {t16:.2f} s", flush=True)
    print("load:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)
    ratio = {
        "fwd_bf16_over_fp32": best[("forward", "bf16", 1)] / best[("forward", "fp32", 1)],
        "step_autocast_over_fp32": best[("lora_step", "autocast", 1)] / best[("lora_step", "fp32", 1)],
        "step_bf16_over_fp32": best[("lora_step", "bf16", 1)] / best[("lora_step", "fp32", 1)],
        "fwd_2t_over_1t": best[("forward", "fp32", 2)] / best[("forward", "fp32", 1)],
        "step_2t_over_1t": best[("lora_step", "fp32", 2)] / best[("lora_step", "fp32", 1)],
        "utility_bf16_over_fp32": t16 / t32,
        "utility_spearman": rho_s,
        "mask_agreement": agree,
    }
    print(" ".join(f"{k}={v:.3f}" for k, v in ratio.items()), flush=True)


if __name__ == "__main__":
    main()
