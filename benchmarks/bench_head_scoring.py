"""Time P2D head scoring (exact W1, tau = 0.1) over every head of a 7B-shaped model, streamed layer by layer.

Setup: the attention geometry of Qwen2.5-7B (28 layers, hidden 3584, 28 query heads, 4 KV heads, head_dim 128:
784 heads, each a vector of 3 * 128 * 3584 = 1,376,256 weights).  No model is built: per layer, seeded random base
q/k/v weights (std 0.02) and a proxy = base + small Gaussian noise are generated, then turned into (H, D) head
vectors (:func:`raycurate.models.heads.layer_head_vectors`) and scored
(:func:`raycurate.algorithms.p2d.head_scoring.score_heads`); only one layer is in memory at a time.  "seconds" is the
vector assembly + scoring time summed over layers (the weight generation stands in for reading a checkpoint and is
reported separately).  The reference is a per-head Python loop -- slice each head's rows by hand, softmax, then
``scipy.stats.wasserstein_distance`` on the index support -- on the first ``--reference-layers`` layers; the ratio is
its per-layer time over the vectorised per-layer time, and ``max_abs_err`` compares the two scores.  Usage::

    python benchmarks/bench_head_scoring.py [--layers 28] [--reference-layers 1] [--threads 2]

The last line is ``seconds=... heads=784 reference_over_fast=... max_abs_err=... peak_rss_gb=...``.
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np
import torch
from transformers import Qwen2Config

from raycurate.algorithms.p2d.head_scoring import score_heads
from raycurate.models.heads import layer_head_vectors, param_name


def qwen7b_config(n_layers: int) -> Qwen2Config:
    return Qwen2Config(
        hidden_size=3584,
        num_hidden_layers=n_layers,
        num_attention_heads=28,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=8,
        vocab_size=8,
    )


def layer_weights(config, layer: int, seed: int, noise: float) -> tuple[dict, dict]:
    """Seeded base and proxy q/k/v weights of one layer, keyed by HF parameter name."""
    gen = torch.Generator().manual_seed(seed * 1000 + layer)
    dim, hidden = config.head_dim, config.hidden_size
    shapes = {
        "q_proj": (config.num_attention_heads * dim, hidden),
        "k_proj": (config.num_key_value_heads * dim, hidden),
        "v_proj": (config.num_key_value_heads * dim, hidden),
    }
    base, proxy = {}, {}
    for projection, shape in shapes.items():
        name = param_name(layer, projection)
        base[name] = 0.02 * torch.randn(shape, generator=gen)
        proxy[name] = base[name] + noise * torch.randn(shape, generator=gen)
    return base, proxy


def fast_scores(config, layer: int, base: dict, proxy: dict, tau: float) -> torch.Tensor:
    return score_heads(layer_head_vectors(base, config, layer), layer_head_vectors(proxy, config, layer), tau=tau)


def reference_scores(config, layer: int, base: dict, proxy: dict, tau: float) -> torch.Tensor:
    """Per-head loop: hand-indexed slices, float64 softmax, scipy W1 on the index support."""
    from scipy.stats import wasserstein_distance

    dim = config.head_dim
    group_size = config.num_attention_heads // config.num_key_value_heads
    scores = []
    for head in range(config.num_attention_heads):
        group = head // group_size
        distributions = []
        for state in (base, proxy):
            parts = [state[param_name(layer, "q_proj")][head * dim : (head + 1) * dim]]
            parts += [state[param_name(layer, p)][group * dim : (group + 1) * dim] for p in ("k_proj", "v_proj")]
            vec = torch.cat([part.flatten() for part in parts]).double()
            distributions.append(torch.softmax(vec / tau, dim=0).numpy())
        support = np.linspace(0.0, 1.0, distributions[0].size)
        scores.append(wasserstein_distance(support, support, distributions[0], distributions[1]))
    return torch.tensor(scores, dtype=torch.float64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--reference-layers", type=int, default=1)
    parser.add_argument("--noise", type=float, default=1e-3, help="std of the proxy - base weight change")
    parser.add_argument("--tau", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = qwen7b_config(args.layers)
    n_heads = config.num_attention_heads * args.layers
    vector_len = 3 * config.head_dim * config.hidden_size

    print(
        f"Qwen2.5-7B attention shape: {args.layers} layers x {config.num_attention_heads} heads "
        f"({config.num_key_value_heads} KV heads), head vector length {vector_len:,}, tau {args.tau}, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'layer':>6}{'generate s':>12}{'score s':>12}{'reference s':>14}{'max score':>14}")
    total, generation, fast_times, reference_times, errors = 0.0, 0.0, [], [], []
    for layer in range(args.layers):
        start = time.perf_counter()
        base, proxy = layer_weights(config, layer, args.seed, args.noise)
        generated = time.perf_counter() - start
        generation += generated
        start = time.perf_counter()
        scores = fast_scores(config, layer, base, proxy, args.tau)
        elapsed = time.perf_counter() - start
        total += elapsed
        fast_times.append(elapsed)
        reference_cell = ""
        if layer < args.reference_layers:
            start = time.perf_counter()
            reference = reference_scores(config, layer, base, proxy, args.tau)
            reference_times.append(time.perf_counter() - start)
            errors.append(float((reference - scores).abs().max()))
            reference_cell = f"{reference_times[-1]:.3f}"
        print(f"{layer:>6}{generated:>12.3f}{elapsed:>12.3f}{reference_cell:>14}{float(scores.max()):>14.3e}")
        del base, proxy
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    ratio = (
        (np.mean(reference_times) / np.mean(fast_times[: len(reference_times)])) if reference_times else float("nan")
    )
    print(
        f"scored {n_heads} heads in {total:.2f} s ({total / args.layers:.3f} s/layer); weight generation "
        f"{generation:.2f} s; per-head loop + scipy reference {ratio:.1f}x slower per layer; peak RSS {peak_gb:.2f} GB"
    )
    max_err = max(errors) if errors else float("nan")
    print(
        f"seconds={total:.3f} heads={n_heads} reference_over_fast={ratio:.2f} max_abs_err={max_err:.3e} "
        f"peak_rss_gb={peak_gb:.2f}"
    )


if __name__ == "__main__":
    main()
