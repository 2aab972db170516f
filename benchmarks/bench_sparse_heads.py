"""Step time and optimizer-state bytes of sparse head adaptation (head-delta adapter) vs full FT and LoRA.

Setup: a randomly initialised Llama built from config (8 layers, hidden 512, 8 query heads / 4 KV heads, head_dim
64, MLP 1376, vocabulary 4096: ~27M parameters), float32 on CPU, one seeded batch of ``--batch`` x ``--seq`` tokens,
AdamW (lr 1e-4).  Arms:

* ``full``: every parameter trains (the reference);
* ``head_delta``: 10% of the 64 heads (ceil(6.4) = 7, seeded random choice) through
  :func:`raycurate.models.head_adapter.attach_head_delta` (q rows + KV-group k/v rows; ``--train-o`` adds o columns);
* ``lora``: PEFT LoRA r = 128 (alpha 256) on q_proj, k_proj, v_proj, as the P2D paper's baseline;
* ``masked`` (info): the same heads trained as full q/k/v matrices with masked gradients -- the implementation SPEC §5
  rules out as the only one, because its optimizer state covers whole matrices.

Optimizer bytes are the AdamW state tensors after the first step (exp_avg + exp_avg_sq).  Step time (forward,
backward, optimizer step) is the minimum over ``--repeats`` interleaved steps per arm (the machine is shared).
Usage::

    python benchmarks/bench_sparse_heads.py [--ratio 0.1] [--batch 4] [--seq 128] [--repeats 8] [--threads 2]

The last line is ``optimizer_bytes_over_full=... optimizer_bytes_over_lora=... step_time_over_full=...
step_time_over_lora=...`` (target: optimizer_bytes_over_full <= 0.15).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from raycurate.models.head_adapter import attach_head_delta, trainable_parameter_count
from raycurate.models.heads import head_param_slices

VOCAB = 4096


def build_model(seed: int) -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1376,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def random_heads(config, ratio: float, seed: int) -> list[tuple[int, int]]:
    n_heads = config.num_hidden_layers * config.num_attention_heads
    chosen = np.random.default_rng(seed).choice(n_heads, size=math.ceil(ratio * n_heads - 1e-9), replace=False)
    return sorted((int(flat) // config.num_attention_heads, int(flat) % config.num_attention_heads) for flat in chosen)


def setup_full(model, heads, args) -> list[torch.nn.Parameter]:
    return list(model.parameters())


def setup_head_delta(model, heads, args) -> list[torch.nn.Parameter]:
    return attach_head_delta(model, heads, train_o=args.train_o)


def setup_lora(model, heads, args) -> list[torch.nn.Parameter]:
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(
        model, LoraConfig(r=128, lora_alpha=256, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj"])
    )
    args.models["lora"] = peft_model
    return [p for p in peft_model.parameters() if p.requires_grad]


def setup_masked(model, heads, args) -> list[torch.nn.Parameter]:
    """Whole q/k/v matrices of the selected layers train; a gradient hook zeroes every row outside the heads."""
    named = dict(model.named_parameters())
    for p in model.parameters():
        p.requires_grad_(False)
    masks: dict[str, torch.Tensor] = {}
    for layer, head in heads:
        for name, dim, index in head_param_slices(model.config, layer, head, include_o=args.train_o).values():
            mask = masks.setdefault(name, torch.zeros_like(named[name], dtype=torch.bool))
            if dim == 0:
                mask[index] = True
            else:
                mask[:, index] = True
    for name, mask in masks.items():
        named[name].requires_grad_(True)
        named[name].register_hook(lambda grad, mask=mask: grad * mask)
    return [named[name] for name in masks]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim() > 0)


def make_step(model, optimizer, input_ids) -> Callable[[], None]:
    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratio", type=float, default=0.1)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--train-o", action="store_true", help="also train the heads' o_proj columns")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.models = {}

    input_ids = torch.randint(3, VOCAB, (args.batch, args.seq), generator=torch.Generator().manual_seed(args.seed))
    setups = {"full": setup_full, "head_delta": setup_head_delta, "lora": setup_lora, "masked": setup_masked}
    heads = random_heads(build_model(args.seed).config, args.ratio, args.seed)
    steps, optimizer_bytes, trainable = {}, {}, {}
    for arm, setup in setups.items():
        model = build_model(args.seed)
        params = setup(model, heads, args)
        model = args.models.get(arm, model).train()
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        steps[arm] = make_step(model, optimizer, input_ids)
        steps[arm]()  # warm-up step: allocates the optimizer state
        optimizer_bytes[arm] = state_bytes(optimizer)
        trainable[arm] = trainable_parameter_count(model)
    best = {arm: float("inf") for arm in steps}
    for _ in range(args.repeats):  # interleaved, so load spikes hit all arms alike
        for arm, step in steps.items():
            start = time.perf_counter()
            step()
            best[arm] = min(best[arm], time.perf_counter() - start)

    print(
        f"Llama 8 layers, hidden 512, 8 q / 4 kv heads; {len(heads)} of 64 heads ({args.ratio:.0%}), "
        f"train_o={args.train_o}; batch {args.batch} x {args.seq}; {torch.get_num_threads()} threads"
    )
    print(f"{'arm':<12}{'trainable':>12}{'optimizer MB':>14}{'/ full':>9}{'step s':>10}{'/ full':>9}")
    for arm in steps:
        print(
            f"{arm:<12}{trainable[arm]:>12,}{optimizer_bytes[arm] / 2**20:>14.2f}"
            f"{optimizer_bytes[arm] / optimizer_bytes['full']:>9.3f}{best[arm]:>10.4f}{best[arm] / best['full']:>9.3f}"
        )
    print(
        f"optimizer_bytes_over_full={optimizer_bytes['head_delta'] / optimizer_bytes['full']:.4f} "
        f"optimizer_bytes_over_lora={optimizer_bytes['head_delta'] / optimizer_bytes['lora']:.4f} "
        f"step_time_over_full={best['head_delta'] / best['full']:.3f} "
        f"step_time_over_lora={best['head_delta'] / best['lora']:.3f}"
    )


if __name__ == "__main__":
    main()
