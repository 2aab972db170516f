"""One-device GPU benchmark of raycurate's torch-only hot paths; no Ray, DeepSpeed or vLLM (issue #15).

Runs on a bare CUDA machine that has only torch, transformers, peft, pyarrow and safetensors; every model is built
from a config with seeded random init (no download, no network).  Four parts, each guarded (an exception is recorded
as the part's ``error`` string and the next part runs) and each with a time budget (its repeat loop stops once the
budget is spent, after at least one timed run):

1. ``token_utility``: BRIDGE JVP token utilities (:func:`raycurate.algorithms.bridge.token_utility.token_utilities`)
   on a Llama-3.2-3B-shaped model in bf16 (hidden 3072, 28 layers, 24/8 heads, intermediate 8192, vocab 128256) with
   L = 4 of 28 scoring layers and a random unit direction of the scoring parameters' shapes, against a plain
   no-grad forward of the same right-padded batch (mirrors ``benchmarks/bench_token_utility.py``).
2. ``head_scoring``: P2D exact-W1 head scoring (:func:`raycurate.algorithms.p2d.head_scoring.score_heads`) at the
   Llama-2-7B attention shape (hidden 4096, 32 layers, 32 heads, 32 KV heads, head_dim 128: 1,024 heads of
   3 * 128 * 4096 weights).  No model is built: per layer, seeded random base q/k/v weights and a proxy = base +
   noise are generated on the device (not timed), then vector assembly + scoring are timed
   (mirrors ``benchmarks/bench_head_scoring.py``).
3. ``bds_step``: one exact BDS step against one plain LoRA SFT step (peft LoRA r 16 on q/k/v/o of the 3B-shaped
   model, AdamW, 2 accumulation micro-steps of half the rows each; mirrors ``benchmarks/bench_bds_step.py`` without
   the DDP/DeepSpeed engine).  BDS exact = the penalty-weighted loss backward + optimizer step + a no-grad forward
   of the candidate rows at theta^{k+1} + the omega update (:func:`raycurate.algorithms.bilevel.update_omega`,
   ``sparse_sgd``, the ``bilevel.omega_optimizer`` default).
4. ``generation``: the HF generation path (:func:`raycurate.models.sampling.sample_responses`, exactly as the HF
   generation actor calls it: per-prompt CPU generators, temperature 0.8) on the 3B-shaped model in bf16.

Timings synchronise the device (``torch.cuda.synchronize``), follow one warm-up run and report the median of the
timed runs.  The result is written after every part to ``<out>/gpu_bench.json`` (so a kill keeps the finished
parts); the last printed line is a one-line summary.  ``--smoke`` runs all four parts on tiny shapes (hidden 64,
4 layers) on the CPU in float32 in well under a minute (the CPU test).  Usage::

    python benchmarks/gpu_bench.py --out OUT [--smoke] [--device cuda] [--part-budget 100]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Shapes:
    """Sizes of one benchmark run.

    Attributes:
        hidden, layers, heads, kv_heads, intermediate, vocab: Geometry of the Llama-style model (parts 1, 3, 4).
        last_layers: Scoring layers L of the token utilities.
        batch, prompt, response: Token-utility batch: ``batch`` rows of ``prompt`` + ``response`` tokens.
        w1_hidden, w1_layers, w1_heads, w1_kv_heads: Attention geometry of the head-scoring part.
        bds_rows, bds_length: Rows per BDS / LoRA step (half validation, half candidates) and tokens per row.
        gen_prompts, gen_samples, gen_prompt_len, gen_new_tokens: Generation: prompts, responses per prompt (G),
            prompt length, new-token budget.
        repeats: Timed runs per measurement (at most; the part budget may stop earlier).
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    last_layers: int
    batch: int
    prompt: int
    response: int
    w1_hidden: int
    w1_layers: int
    w1_heads: int
    w1_kv_heads: int
    bds_rows: int
    bds_length: int
    gen_prompts: int
    gen_samples: int
    gen_prompt_len: int
    gen_new_tokens: int
    repeats: int


FULL = Shapes(hidden=3072, layers=28, heads=24, kv_heads=8, intermediate=8192, vocab=128256, last_layers=4,
              batch=8, prompt=256, response=256, w1_hidden=4096, w1_layers=32, w1_heads=32, w1_kv_heads=32,
              bds_rows=8, bds_length=512, gen_prompts=16, gen_samples=2, gen_prompt_len=128, gen_new_tokens=128,
              repeats=5)
SMOKE = Shapes(hidden=64, layers=4, heads=4, kv_heads=2, intermediate=128, vocab=512, last_layers=2,
               batch=2, prompt=16, response=16, w1_hidden=64, w1_layers=4, w1_heads=4, w1_kv_heads=2,
               bds_rows=4, bds_length=32, gen_prompts=4, gen_samples=2, gen_prompt_len=8, gen_new_tokens=8,
               repeats=2)
FIRST_TOKEN = 7  # random token ids start here (keeps clear of pad/BOS/EOS = 0/1/2)
PAD, BOS, EOS = 0, 1, 2


# ------------------------------------------------------------------------------------------------- helpers


def sync(device: torch.device) -> None:
    """Wait for the device's queued kernels (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_median(fn: Callable[[], Any], device: torch.device, repeats: int, deadline: float) -> dict[str, Any]:
    """One warm-up run, then up to ``repeats`` timed runs (stopping at ``deadline`` after the first).

    Args:
        fn: The computation.
        device: Synchronised around each run.
        repeats: Most timed runs.
        deadline: ``time.perf_counter()`` value after which no further run starts.

    Returns:
        ``{"median_s", "min_s", "runs"}``.
    """
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
        if time.perf_counter() >= deadline:
            break
    return {"median_s": statistics.median(times), "min_s": min(times), "runs": len(times)}


def llama_model(shapes: Shapes, device: torch.device, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """A randomly initialised Llama-style causal LM built from a config directly on ``device`` (eval mode)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=shapes.hidden, num_hidden_layers=shapes.layers, num_attention_heads=shapes.heads,
        num_key_value_heads=shapes.kv_heads, intermediate_size=shapes.intermediate, vocab_size=shapes.vocab,
        max_position_embeddings=4096, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with device:
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    model.config.use_cache = False
    return model.eval()


def right_padded(rows: int, prompt: int, response: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: row ``b`` has a ``prompt - b % 8``-token prompt side, then ``response`` supervised tokens."""
    gen = torch.Generator().manual_seed(seed)
    width = prompt + response
    input_ids = torch.full((rows, width), PAD, dtype=torch.long)
    attention_mask = torch.zeros((rows, width), dtype=torch.long)
    loss_mask = torch.zeros((rows, width), dtype=torch.long)
    for b in range(rows):
        p_len = max(1, prompt - b % 8)
        length = p_len + response
        input_ids[b, :length] = torch.randint(FIRST_TOKEN, vocab, (length,), generator=gen)
        attention_mask[b, :length] = 1
        loss_mask[b, p_len:length] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of ``batch`` moved to ``device``."""
    return {key: value.to(device) for key, value in batch.items()}


class ModelCache:
    """Builds the Llama-shaped model once and shares it between the parts that only read it."""

    def __init__(self, shapes: Shapes, device: torch.device, dtype: torch.dtype, seed: int) -> None:
        self.shapes, self.device, self.dtype, self.seed = shapes, device, dtype, seed
        self._model: torch.nn.Module | None = None
        self.build_s: float | None = None

    def get(self) -> torch.nn.Module:
        """The shared eval-mode model (built on first use)."""
        if self._model is None:
            start = time.perf_counter()
            self._model = llama_model(self.shapes, self.device, self.dtype, self.seed)
            sync(self.device)
            self.build_s = time.perf_counter() - start
        return self._model

    def take(self) -> torch.nn.Module:
        """The model, handed over for modification (e.g. a LoRA wrap); later ``get`` calls build a fresh one."""
        model, self._model = self.get(), None
        return model


# --------------------------------------------------------------------------------------------------- parts


def part_token_utility(shapes: Shapes, models: ModelCache, deadline: float) -> dict[str, Any]:
    """JVP token utilities vs a plain forward (L = ``last_layers`` of ``layers`` scoring layers)."""
    from raycurate.algorithms.bridge import token_utility as tu

    device = models.device
    model = models.get()
    batch = to_device(right_padded(shapes.batch, shapes.prompt, shapes.response, shapes.vocab, 1), device)
    params = tu.scoring_parameters(model, last_layers=shapes.last_layers)
    gen = torch.Generator(device=device).manual_seed(2)
    g_random = {name: torch.randn(p.shape, generator=gen, device=device) for name, p in params.items()}
    direction = tu.scoring_direction(g_random, None, lam=0.0)  # unit direction; its values do not change the cost
    inputs = (batch["input_ids"], batch["attention_mask"], batch["loss_mask"])

    def forward() -> None:
        with torch.no_grad():
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)

    def utility() -> None:
        tu.token_utilities(model, *inputs, direction)

    half = (deadline - time.perf_counter()) / 2
    t_forward = timed_median(forward, device, shapes.repeats, time.perf_counter() + half)
    t_utility = timed_median(utility, device, shapes.repeats, deadline)
    utilities = tu.token_utilities(model, *inputs, direction)
    supervised = int(((batch["loss_mask"] != 0) & (batch["attention_mask"] != 0))[:, 1:].sum())  # scored tokens
    tokens = int(batch["attention_mask"].sum())
    return {
        "shape": f"{shapes.layers} layers, hidden {shapes.hidden}, L={shapes.last_layers}",
        "batch": shapes.batch, "seq_len": shapes.prompt + shapes.response,
        "tokens": tokens, "supervised_tokens": supervised, "scoring_params": sum(p.numel() for p in params.values()),
        "forward_s": t_forward["median_s"], "utility_s": t_utility["median_s"],
        "utility_over_forward": t_utility["median_s"] / t_forward["median_s"],
        "utility_tokens_per_s": tokens / t_utility["median_s"],
        "utility_supervised_tokens_per_s": supervised / t_utility["median_s"],
        "forward_tokens_per_s": tokens / t_forward["median_s"],
        "utilities_finite": bool(torch.isfinite(utilities).all()),
        "runs": {"forward": t_forward["runs"], "utility": t_utility["runs"]},
    }


def part_head_scoring(shapes: Shapes, device: torch.device, deadline: float, seed: int = 0) -> dict[str, Any]:
    """Exact-W1 scores of every head of a 7B-shaped attention stack, one layer at a time."""
    from transformers import LlamaConfig

    from raycurate.algorithms.p2d.head_scoring import score_heads
    from raycurate.models.heads import layer_head_vectors, param_name

    config = LlamaConfig(hidden_size=shapes.w1_hidden, num_hidden_layers=shapes.w1_layers,
                         num_attention_heads=shapes.w1_heads, num_key_value_heads=shapes.w1_kv_heads,
                         intermediate_size=8, vocab_size=8)
    dim = config.hidden_size // config.num_attention_heads
    shape = {"q_proj": (config.num_attention_heads * dim, config.hidden_size),
             "k_proj": (config.num_key_value_heads * dim, config.hidden_size),
             "v_proj": (config.num_key_value_heads * dim, config.hidden_size)}

    def weights(layer: int) -> tuple[dict, dict]:
        gen = torch.Generator(device=device).manual_seed(seed * 1000 + layer)
        base, proxy = {}, {}
        for projection, size in shape.items():
            name = param_name(layer, projection)
            base[name] = 0.02 * torch.randn(size, generator=gen, device=device)
            proxy[name] = base[name] + 1e-3 * torch.randn(size, generator=gen, device=device)
        return base, proxy

    def score(layer: int, base: dict, proxy: dict) -> torch.Tensor:
        return score_heads(layer_head_vectors(base, config, layer), layer_head_vectors(proxy, config, layer), tau=0.1)

    base, proxy = weights(0)
    score(0, base, proxy)  # warm-up (kernel load), not timed
    sync(device)
    seconds, layers_done, scores = 0.0, 0, []
    for layer in range(config.num_hidden_layers):
        base, proxy = weights(layer)
        sync(device)
        start = time.perf_counter()
        scores.append(score(layer, base, proxy))
        sync(device)
        seconds += time.perf_counter() - start
        layers_done += 1
        if time.perf_counter() >= deadline:
            break
    heads = layers_done * config.num_attention_heads
    stacked = torch.stack(scores)
    return {
        "shape": f"attention of hidden {config.hidden_size}, {config.num_attention_heads} heads "
                 f"({config.num_key_value_heads} KV), head_dim {dim}; q/k/v weights only, no model built",
        "layers_scored": layers_done, "layers_total": config.num_hidden_layers, "heads": heads,
        "head_vector_len": 3 * dim * config.hidden_size, "seconds": seconds, "heads_per_s": heads / seconds,
        "seconds_all_layers_est": seconds * config.num_hidden_layers / layers_done,
        "scores_finite": bool(torch.isfinite(stacked).all()), "max_score": float(stacked.max()),
    }


def part_bds_step(shapes: Shapes, models: ModelCache, deadline: float, seed: int = 0) -> dict[str, Any]:
    """One exact BDS step vs one plain LoRA SFT step on the same rows (peft LoRA r 16 on q/k/v/o)."""
    import numpy as np
    from peft import LoraConfig, get_peft_model

    from raycurate.algorithms import bilevel
    from raycurate.algorithms.losses import model_example_losses, weighted_batch_loss

    device = models.device
    model = get_peft_model(models.take(), LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0,
                                                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=5e-6)
    half = shapes.bds_rows // 2  # validation rows = candidate rows = micro-batch
    accum = 2
    n_cand = 64
    val = to_device(right_padded(half, shapes.bds_length // 2, shapes.bds_length // 2, shapes.vocab, seed + 3), device)
    cand = to_device(right_padded(half, shapes.bds_length // 2, shapes.bds_length // 2, shapes.vocab, seed + 4),
                     device)
    cand_idx = np.arange(half, dtype=np.int64)
    state = {"omega": np.zeros(n_cand), "adam": bilevel.AdamState.zeros(n_cand)}

    def losses(batch: dict[str, torch.Tensor]) -> torch.Tensor:  # logits of the supervised window, as the engines
        return model_example_losses(model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"])

    def lora_step() -> None:
        for batch in (val, cand):
            (weighted_batch_loss(losses(batch)) / accum).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def bds_step() -> None:
        gamma = bilevel.gamma_schedule(0)
        sigma = bilevel.data_weights(state["omega"])
        total = 2 * half
        weights = [torch.full((half,), total / half, device=device),
                   torch.as_tensor(gamma * sigma[cand_idx] * total / half, dtype=torch.float32, device=device)]
        kept = []
        for batch, w in zip((val, cand), weights):
            per_example = losses(batch)
            kept.append(per_example.detach())
            (weighted_batch_loss(per_example, w) / accum).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():  # eq. 5b: candidate losses at theta^{k+1}
            cand_losses = losses(cand).float().cpu().numpy()
        state["omega"], state["adam"] = bilevel.update_omega("sparse_sgd", state["omega"], cand_idx, cand_losses,
                                                             gamma, state["adam"], 100.0)

    runs = {"lora": [], "bds": []}
    lora_step()  # warm-up of both (optimizer state, kernels)
    bds_step()
    sync(device)
    for _ in range(shapes.repeats):  # interleaved, as in bench_bds_step.py
        for name, fn in (("lora", lora_step), ("bds", bds_step)):
            start = time.perf_counter()
            fn()
            sync(device)
            runs[name].append(time.perf_counter() - start)
        if time.perf_counter() >= deadline:
            break
    lora_s, bds_s = statistics.median(runs["lora"]), statistics.median(runs["bds"])
    return {
        "shape": f"{shapes.layers} layers, hidden {shapes.hidden} + LoRA r16 q/k/v/o",
        "trainable_params": sum(p.numel() for p in trainable), "rows_per_step": 2 * half,
        "micro_batch": half, "seq_len": shapes.bds_length,
        "lora_step_s": lora_s, "bds_step_s": bds_s, "bds_over_lora": bds_s / lora_s,
        "omega_finite": bool(np.isfinite(state["omega"]).all()), "runs": len(runs["bds"]),
    }


def part_generation(shapes: Shapes, models: ModelCache, deadline: float, seed: int = 0) -> dict[str, Any]:
    """HF generation path tokens/s: ``sample_responses`` as the HF generation actor calls it."""
    from raycurate.models.sampling import derive_seed, sample_responses

    device = models.device
    model = models.get()
    gen = torch.Generator().manual_seed(seed + 5)
    prompts = [[BOS] + torch.randint(FIRST_TOKEN, shapes.vocab, (shapes.gen_prompt_len - 1 - i % 4,),
                                     generator=gen).tolist() for i in range(shapes.gen_prompts)]
    counted: list[int] = []

    def run() -> None:
        generators = [torch.Generator().manual_seed(derive_seed(seed, 0, f"q{i}")) for i in range(len(prompts))]
        samples = sample_responses(model, prompts, n=shapes.gen_samples, temperature=0.8,
                                   max_new_tokens=shapes.gen_new_tokens, eos_ids=[EOS], pad_id=PAD,
                                   generator=generators, batch_size=32)
        counted.append(sum(len(s.response_ids) for group in samples for s in group))

    timing = timed_median(run, device, shapes.repeats, deadline)
    tokens = counted[-1]  # same seeds every run, so every run generates the same tokens
    return {
        "shape": f"{shapes.layers} layers, hidden {shapes.hidden}, vocab {shapes.vocab}",
        "prompts": len(prompts), "samples_per_prompt": shapes.gen_samples, "prompt_len": shapes.gen_prompt_len,
        "max_new_tokens": shapes.gen_new_tokens, "generated_tokens": tokens,
        "seconds": timing["median_s"], "tokens_per_s": tokens / timing["median_s"], "runs": timing["runs"],
    }


# ---------------------------------------------------------------------------------------------------- main


def environment(device: torch.device) -> dict[str, Any]:
    """Versions and the device name."""
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


def main(argv: list[str] | None = None) -> int:
    """Run the four parts, write ``<out>/gpu_bench.json`` after each, print the summary line.

    Returns:
        0 when every part ran without an error, else 1.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_bench_out"), help="output folder")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU in float32 (the CPU test)")
    parser.add_argument("--device", default=None, help="default: cuda when available (cpu with --smoke)")
    parser.add_argument("--part-budget", type=float, default=None,
                        help="seconds of timed repeats per part (default 100, 10 with --smoke)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shapes = SMOKE if args.smoke else FULL
    device = torch.device(args.device or ("cpu" if args.smoke or not torch.cuda.is_available() else "cuda"))
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    budget = args.part_budget if args.part_budget is not None else (10.0 if args.smoke else 100.0)
    if device.type == "cpu":
        torch.set_flush_denormal(True)
    if args.smoke:
        torch.set_num_threads(1)  # tiny shapes: extra threads only add OpenMP spin-waits on a loaded machine
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu_bench.json"

    started = time.perf_counter()
    result: dict[str, Any] = {"mode": "smoke" if args.smoke else "full", "dtype": str(dtype).removeprefix("torch."),
                              "part_budget_s": budget, "shapes": asdict(shapes), "env": environment(device)}
    models = ModelCache(shapes, device, dtype, args.seed)
    parts: list[tuple[str, Callable[[float], dict[str, Any]]]] = [
        ("token_utility", lambda d: part_token_utility(shapes, models, d)),
        ("generation", lambda d: part_generation(shapes, models, d, args.seed)),
        ("head_scoring", lambda d: part_head_scoring(shapes, device, d, args.seed)),
        ("bds_step", lambda d: part_bds_step(shapes, models, d, args.seed)),  # last: it LoRA-wraps the model
    ]
    for name, fn in parts:
        part_start = time.perf_counter()
        try:
            entry = fn(part_start + budget)
        except Exception as err:  # noqa: BLE001 - one failing part must not lose the others
            entry = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(limit=8)}
            print(f"[gpu_bench] {name} failed: {entry['error']}", file=sys.stderr, flush=True)
        entry["wall_s"] = time.perf_counter() - part_start
        if device.type == "cuda":
            entry["peak_gpu_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
            torch.cuda.reset_peak_memory_stats(device)
        result[name] = entry
        result["model_build_s"] = models.build_s
        result["wall_s"] = time.perf_counter() - started
        result["imported"] = {mod: mod in sys.modules for mod in ("ray", "deepspeed", "vllm")}
        result["ray_imported"] = result["imported"]["ray"]
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"[gpu_bench] {name}: {json.dumps({k: v for k, v in entry.items() if k != 'traceback'}, default=str)}",
              flush=True)

    errors = [name for name, _ in parts if "error" in result[name]]
    result["errors"] = errors
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")

    def field(part: str, key: str) -> str:
        value = result[part].get(key)
        return "nan" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4g}"

    print(f"gpu_bench mode={result['mode']} utility_over_forward={field('token_utility', 'utility_over_forward')} "
          f"utility_tokens_per_s={field('token_utility', 'utility_tokens_per_s')} "
          f"head_scoring_s={field('head_scoring', 'seconds')} heads_per_s={field('head_scoring', 'heads_per_s')} "
          f"bds_over_lora={field('bds_step', 'bds_over_lora')} "
          f"generation_tokens_per_s={field('generation', 'tokens_per_s')} "
          f"ray_imported={result['ray_imported']} errors={','.join(errors) or 'none'} "
          f"wall_s={result['wall_s']:.1f} json={path}", flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
