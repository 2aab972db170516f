"""Time BRIDGE token utilities (one forward-mode JVP) against a plain forward and the per-token backward loop.

Setup: the tiny-llama preset (4 layers, hidden 128, GQA 4/2 heads) with a 2,048-token vocabulary, one right-padded
batch of ``--batch`` examples, each a ``--prompt``-token prompt side followed by exactly 128 supervised response
tokens (EOS included); the direction is the real BRIDGE one on the final 4 layers (= all layers of the tiny model,
the worst case for the JVP): validation gradient of a second batch plus an anchor from a seeded perturbation,
lam = 0.2.  Timings are the minimum over ``--repeats`` interleaved runs (the machine is shared).  Denormal floats
are flushed to zero for every timed computation (``torch.set_flush_denormal``, the recommended CPU setting for
scoring actors; ``--keep-denormals`` turns it off): without it the attention and log-softmax of the forward-mode
pass hit slow denormal arithmetic on CPU.  The utilities run the hand-written layer rules
(:mod:`raycurate.algorithms.bridge.dual_layers`); an informational row times the same utilities through torch's generic
forward-mode AD (``hand_written=False``), and others with gradients restricted to the last 1 and 2 layers.
``--layers N`` (default 16) adds the paper's shape, L = ``--last-layers`` (4) scoring layers of a deeper model:
the same tiny-llama geometry with N layers (seeded init), timed forward vs utilities on
the same batch, interleaved with the rest (Llama-3.2-3B is L = 4 of 28).  ``--deep-geometry smollm2-135m``
gives the deeper model SmolLM2-135M's shape instead (30 layers, hidden 576, 9 query / 3 KV heads of 64, MLP 1,536,
49,152-token tied vocabulary; random weights), and ``--deep-dtype bfloat16`` runs it in bf16 (the dtype a bf16
checkpoint scores in); that row also prints the utilities' supervised tokens per second per thread.  Usage::

    python benchmarks/bench_token_utility.py [--batch 2] [--prompt 64] [--repeats 9] [--threads 2] [--layers 16]
    python benchmarks/bench_token_utility.py --layers 30 --deep-geometry smollm2-135m [--deep-dtype bfloat16]

The line before the last reports the knock-out prompt proxy (``bridge.prompt_proxy=knockout_grad``, one
double-backward pass over per-token key scales, all prompt tokens at once) relative to the routing proxy (one
eager attention layer + routing weights): ``knockout_over_routing=median[min,max]`` of the per-run ratios.  The
last line is ``utility_over_forward=... utility_over_forward_l4_of_16=... backward_over_utility=...
max_abs_err=...``: utility time / plain forward time on the 4-layer model with L = 4 (target <= 3.0), the same
ratio with L = 4 of the ``--layers``-layer model (the key names the actual L and N; target <= 1.6),
per-token-backward reference time / utility time (target >= 100, 4-layer model), and the largest absolute
difference between the JVP utilities and the reference.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

RESPONSE_TOKENS = 128
VOCAB = 2048


def make_batch(n: int, prompt: int, vocab: int, pad_id: int, seed: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: prompts of ``prompt - k`` tokens (k = 0..n-1, so rows differ) + 128 response tokens."""
    gen = torch.Generator().manual_seed(seed)
    width = prompt + RESPONSE_TOKENS
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width), dtype=torch.long)
    for b in range(n):
        p_len = prompt - b % 8
        length = p_len + RESPONSE_TOKENS
        input_ids[b, :length] = torch.randint(7, vocab, (length,), generator=gen)
        attention_mask[b, :length] = 1
        loss_mask[b, p_len:length] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def build(seed: int):
    from raycurate.data.corpus import generate_corpus
    from raycurate.models.tiny import build_tiny_model
    from raycurate.models.tokenizer import train_tokenizer

    rows = generate_corpus(400, seed=seed)
    tokenizer = train_tokenizer([r["prompt"] + "\n" + r["response"] for r in rows], vocab_size=VOCAB)
    return tokenizer, build_tiny_model("tiny-llama", tokenizer, seed)


SMOLLM2_135M_SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
                      "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True,
                      "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5}


def build_deep(tokenizer, layers: int, seed: int, geometry: str = "tiny-llama", dtype: torch.dtype = torch.float32):
    """A ``layers``-layer Llama with tiny-llama's geometry or SmolLM2-135M's (seeded init, eval mode)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from raycurate.models.tiny import tiny_config

    if geometry == "smollm2-135m":
        config = LlamaConfig(num_hidden_layers=layers, pad_token_id=tokenizer.pad_token_id, **SMOLLM2_135M_SHAPE)
    else:
        config = tiny_config("tiny-llama", tokenizer)
        config.num_hidden_layers = layers
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return model.to(dtype).eval()


def direction_for(model, val_batch: dict[str, torch.Tensor], seed: int, last_layers: int = 4) -> dict:
    from raycurate.algorithms.bridge import token_utility as tu

    params = tu.scoring_parameters(model, last_layers=last_layers)
    g_target = tu.validation_gradient(model, [val_batch], params)
    gen = torch.Generator().manual_seed(seed)
    theta_old = {name: p.detach() - 1e-3 * torch.randn(p.shape, generator=gen) for name, p in params.items()}
    return tu.scoring_direction(g_target, tu.anchor_direction(params, theta_old), lam=0.2)


def best_of(fn, repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    from raycurate.algorithms.bridge import token_utility as tu

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=64, help="prompt-side tokens of the longest example")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--keep-denormals", action="store_true", help="do not flush denormals to zero")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=16, help="layers of the deeper model (0: skip it)")
    parser.add_argument("--last-layers", type=int, default=4, help="scoring layers L on the deeper model")
    parser.add_argument("--deep-geometry", choices=("tiny-llama", "smollm2-135m"), default="tiny-llama",
                        help="shape of the deeper model")
    parser.add_argument("--deep-dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    if args.layers and not 1 <= args.last_layers <= args.layers:
        parser.error(f"--last-layers must be in [1, --layers={args.layers}]")
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(not args.keep_denormals)

    tokenizer, model = build(args.seed)
    batch = make_batch(args.batch, args.prompt, len(tokenizer), tokenizer.pad_token_id, args.seed + 1)
    val_batch = make_batch(args.batch, args.prompt, len(tokenizer), tokenizer.pad_token_id, args.seed + 2)
    direction = direction_for(model, val_batch, args.seed)
    shallow = {layers: direction_for(model, val_batch, args.seed, layers) for layers in (1, 2)}
    inputs = (batch["input_ids"], batch["attention_mask"], batch["loss_mask"])

    def forward() -> None:
        with torch.no_grad():
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)

    def utility() -> torch.Tensor:
        return tu.token_utilities(model, *inputs, direction)

    prompt_lens = batch["attention_mask"].sum(dim=1) - RESPONSE_TOKENS  # (B,)
    prompt_mask = torch.arange(batch["input_ids"].shape[1])[None, :] < prompt_lens[:, None]
    prompt_mask[:, 0] = False  # BOS-like first token is fixed

    def routing() -> None:  # the paper's prompt proxy input: attention of ONE layer, then routing weights
        from raycurate.algorithms.bridge.routing import (
            attention_for_layer,
            default_routing_layer,
            routing_weights_batch,
        )

        attn = attention_for_layer(model, batch["input_ids"], batch["attention_mask"], default_routing_layer(model))
        routing_weights_batch(attn, prompt_lens, batch["attention_mask"])

    def knockout() -> None:  # bridge.prompt_proxy=knockout_grad: one double-backward pass over the key scales
        tu.knockout_prompt_scores(model, batch["input_ids"], batch["attention_mask"], prompt_mask,
                                  batch["loss_mask"].float(), direction)

    timed = {"forward": forward, "utility": utility, "routing": routing, "knockout": knockout,
             "generic": lambda: tu.token_utilities(model, *inputs, direction, hand_written=False)}
    timed.update({f"L{layers}": (lambda d=d: tu.token_utilities(model, *inputs, d)) for layers, d in shallow.items()})
    if args.layers:
        deep = build_deep(tokenizer, args.layers, args.seed, args.deep_geometry, getattr(torch, args.deep_dtype))
        deep_direction = direction_for(deep, val_batch, args.seed, args.last_layers)

        def deep_forward() -> None:
            with torch.no_grad():
                deep(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)

        timed["deep_forward"] = deep_forward
        timed["deep_utility"] = lambda: tu.token_utilities(deep, *inputs, deep_direction)
        timed["deep_generic"] = lambda: tu.token_utilities(deep, *inputs, deep_direction, hand_written=False)
    best = {name: float("inf") for name in timed}
    ratios = []  # knockout / routing, one per interleaved run
    for _ in range(args.repeats):  # interleaved, so load spikes hit all alike
        run = {}
        for name, fn in timed.items():
            run[name] = best_of(fn, 1)
            best[name] = min(best[name], run[name])
        ratios.append(run["knockout"] / run["routing"])
    t_forward, t_utility = best["forward"], best["utility"]
    start = time.perf_counter()
    reference = tu.reference_token_utilities(model, *inputs, direction)
    t_reference = time.perf_counter() - start
    fast = utility()
    n_tokens = int(batch["loss_mask"].sum())
    max_abs_err = float((fast - reference).abs().max())
    scale = float(reference.abs().max())

    print(f"tiny-llama, batch {args.batch} x {batch['input_ids'].shape[1]} tokens, {n_tokens} supervised tokens, "
          f"L=4 layers, {torch.get_num_threads()} threads, flush denormals {not args.keep_denormals}")
    print(f"{'computation':<34}{'seconds':>12}{'ratio':>12}")
    print(f"{'plain forward (sdpa)':<34}{t_forward:>12.4f}{1.0:>12.2f}")
    print(f"{'JVP utilities, L=4 (all tokens)':<34}{t_utility:>12.4f}{t_utility / t_forward:>12.2f}")
    print(f"{'  (info) same, generic forward AD':<34}{best['generic']:>12.4f}{best['generic'] / t_forward:>12.2f}")
    for layers in shallow:
        label = f"  (info) JVP utilities, L={layers}"
        print(f"{label:<34}{best[f'L{layers}']:>12.4f}{best[f'L{layers}'] / t_forward:>12.2f}")
    print(f"{'per-token backward reference':<34}{t_reference:>12.4f}{t_reference / t_forward:>12.2f}")
    print(f"{'routing proxy (1 eager layer)':<34}{best['routing']:>12.4f}{best['routing'] / t_forward:>12.2f}")
    print(f"{'knock-out proxy (double backward)':<34}{best['knockout']:>12.4f}{best['knockout'] / t_forward:>12.2f}")
    ratio_median, ratio_lo, ratio_hi = float(np.median(ratios)), min(ratios), max(ratios)
    scoring = t_utility + best["routing"]  # what bridge_select computes per micro-batch before the selection
    q1, q3 = np.percentile(ratios, [25, 75])
    print(f"knock-out / routing per interleaved run: median {ratio_median:.2f}, IQR [{q1:.2f}, {q3:.2f}], range "
          f"[{ratio_lo:.2f}, {ratio_hi:.2f}] over {len(ratios)} runs; best-of ratio "
          f"{best['knockout'] / best['routing']:.2f}; "
          f"scoring (utility + routing) grows by x{(scoring + best['knockout']) / scoring:.2f}")
    print(f"max |a_jvp - a_ref| = {max_abs_err:.3e} (max |a_ref| = {scale:.3e}, relative {max_abs_err / scale:.1e})")
    deep_key = ""
    if args.layers:
        deep_ratio = best["deep_utility"] / best["deep_forward"]
        per_thread = n_tokens / best["deep_utility"] / torch.get_num_threads()
        print(f"{args.layers}-layer {args.deep_geometry} geometry ({args.deep_dtype}): forward "
              f"{best['deep_forward']:.4f} s, JVP utilities L={args.last_layers} {best['deep_utility']:.4f} s, "
              f"ratio {deep_ratio:.2f}, {per_thread:.0f} supervised tokens/s per thread; generic forward AD "
              f"{best['deep_generic']:.4f} s, ratio {best['deep_generic'] / best['deep_forward']:.2f}")
        deep_key = f"utility_over_forward_l{args.last_layers}_of_{args.layers}={deep_ratio:.3f} "
    print(f"knockout_over_routing={ratio_median:.2f}[{ratio_lo:.2f},{ratio_hi:.2f}]")
    print(f"utility_over_forward={t_utility / t_forward:.3f} {deep_key}backward_over_utility="
          f"{t_reference / t_utility:.1f} max_abs_err={max_abs_err:.3e}")


if __name__ == "__main__":
    main()
