"""Generation throughput of the BMO actor pool against one in-process ``sample_responses`` call.

Setup: the tiny-llama preset (4 layers, hidden 128, GQA 4/2 heads) with a 2,048-token vocabulary trained on the
embedded corpus, saved as a local checkpoint; ``--questions`` prompts from the embedded corpus rendered with the chat
template, ``--samples`` responses each (G), temperature 0.8, ``--new-tokens`` new tokens at most (the untrained
model rarely samples EOS, so nearly every response runs to the budget).  Reference: one in-process
:func:`raycurate.models.sampling.sample_responses` call with ``--threads`` torch threads (default 1, what each
actor gets) and the same per-question seeds the actors derive, so both produce the same tokens (checked).  Pool:
:class:`GenerationPool` with ``--actors`` HF actors on a local Ray instance of ``--cpus`` CPUs (each actor gets
``cpus / actors`` of them, at least one thread); actor start-up is excluded (one warm-up call).  A ratio above 1 is
the parallel speed-up net of Ray's overhead.  Times are the minimum over ``--repeats`` runs.  On a shared, loaded
machine keep ``--threads 1``: multi-threaded torch then spends most of its time in OpenMP spin-waits (measured here:
2 threads 14-24 s vs 1 thread 1.1 s for the same call at load average 12 on 2 cores).  With a CUDA GPU and vllm
installed, a vLLM pool (one actor) is timed as well.  Usage::

    python benchmarks/bench_generation.py [--questions 16] [--samples 2] [--new-tokens 64] [--actors 2] [--cpus 2]

The last line is ``tokens_per_s=... ratio_pool_over_inprocess=...`` (pool tokens/s and pool / in-process tokens/s),
plus ``vllm_tokens_per_s=... vllm_over_hf=...`` when the vLLM pool ran.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time

import torch

VOCAB = 2048
STEP = 0


def build_checkpoint(path: str, seed: int, n_questions: int) -> list[list[int]]:
    """Save a tiny model + tokenizer to ``path``; return chat-rendered prompt ids (BOS + user turn + assistant tag)."""
    from raycurate.data.corpus import generate_corpus
    from raycurate.models.tiny import build_tiny_model
    from raycurate.models.tokenizer import train_tokenizer

    rows = generate_corpus(max(400, n_questions), seed=seed)
    tokenizer = train_tokenizer([r["prompt"] + "\n" + r["response"] for r in rows], vocab_size=VOCAB)
    build_tiny_model("tiny-llama", tokenizer, seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    prompts = []
    for row in rows[:n_questions]:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True)
        ids = chat["input_ids"] if hasattr(chat, "keys") else chat
        prompts.append([tokenizer.bos_token_id] + list(ids))
    return prompts


def count_tokens(rows: list[dict]) -> int:
    return sum(len(r["response_ids"]) for r in rows)


def time_pool(pool, requests, settings: dict, repeats: int) -> tuple[float, list[dict]]:
    rows = pool.generate(requests, **settings)  # warm-up: actors load the model
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        rows = pool.generate(requests, **settings)
        best = min(best, time.perf_counter() - start)
    return best, rows


def time_inprocess(model_dir: str, prompts, requests, settings: dict, seed: int, repeats: int):
    from raycurate.models.loading import load_model
    from raycurate.models.sampling import derive_seed, sample_responses
    from raycurate.stages.generation import stop_and_pad_ids

    model = load_model(model_dir, dtype="float32")
    eos_ids, pad_id = stop_and_pad_ids(model_dir, model.config)

    def run():
        generators = [torch.Generator().manual_seed(derive_seed(seed, STEP, r.question_id)) for r in requests]
        return sample_responses(model, prompts, n=settings["n"], temperature=settings["temperature"],
                                max_new_tokens=settings["max_new_tokens"], eos_ids=eos_ids, pad_id=pad_id,
                                generator=generators)

    run()  # warm-up
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> None:
    from raycurate.stages.generation import GenerationPool, GenerationRequest
    from raycurate.stages.runtime import init_ray

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--samples", type=int, default=2, help="responses per question (G)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the in-process reference")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray instance")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    settings = {"n": args.samples, "temperature": 0.8, "max_new_tokens": args.new_tokens, "step": STEP}

    with tempfile.TemporaryDirectory(prefix="bench-generation-") as model_dir:
        prompts = build_checkpoint(model_dir, args.seed, args.questions)
        requests = [GenerationRequest(f"q{k:04d}", ids) for k, ids in enumerate(prompts)]
        t_ref, reference = time_inprocess(model_dir, prompts, requests, settings, args.seed, args.repeats)
        ref_tokens = sum(len(s.response_ids) for samples in reference for s in samples)

        init_ray(num_cpus=args.cpus)
        pool = GenerationPool(model_dir, backend="hf", num_actors=args.actors, seed=args.seed)
        t_pool, rows = time_pool(pool, requests, settings, args.repeats)
        pool.shutdown()
        same = [r["response_ids"] for r in rows] == [s.response_ids for samples in reference for s in samples]

        vllm_result = None
        if torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None:
            vllm_pool = GenerationPool(model_dir, backend="vllm", num_actors=1, seed=args.seed)
            t_vllm, vllm_rows = time_pool(vllm_pool, requests, settings, args.repeats)
            vllm_pool.shutdown()
            vllm_result = count_tokens(vllm_rows) / t_vllm

    ref_tps, pool_tps = ref_tokens / t_ref, count_tokens(rows) / t_pool
    print(f"tiny-llama, {len(prompts)} questions x G={args.samples}, <= {args.new_tokens} new tokens, "
          f"temperature 0.8; in process {args.threads} thread(s), pool {args.actors} HF actors on {args.cpus} CPUs; "
          f"min of {args.repeats} runs")
    print(f"{'generator':<36}{'tokens':>8}{'seconds':>10}{'tokens/s':>12}{'ratio':>8}")
    print(f"{'in-process sample_responses':<36}{ref_tokens:>8}{t_ref:>10.3f}{ref_tps:>12.1f}{1.0:>8.2f}")
    print(f"{'GenerationPool (hf)':<36}{count_tokens(rows):>8}{t_pool:>10.3f}{pool_tps:>12.1f}"
          f"{pool_tps / ref_tps:>8.2f}")
    print(f"pool samples identical to in-process: {same}")
    last = f"tokens_per_s={pool_tps:.1f} ratio_pool_over_inprocess={pool_tps / ref_tps:.3f}"
    if vllm_result is not None:
        print(f"{'GenerationPool (vllm, 1 GPU actor)':<36}{'':>8}{'':>10}{vllm_result:>12.1f}")
        last += f" vllm_tokens_per_s={vllm_result:.1f} vllm_over_hf={vllm_result / pool_tps:.2f}"
    print(last)


if __name__ == "__main__":
    main()
