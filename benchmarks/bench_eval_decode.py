"""Held-out decoding with finished rows pruned from the batch vs decoding every row to its batch's longest.

Greedy: :func:`raycurate.models.generation.generate_greedy` (the sampling loop at temperature 0, finished rows
dropped) against :func:`raycurate.models.generation.generate_greedy_hf` (Hugging Face ``generate``, what evaluation
ran before). Sampled: :func:`raycurate.models.sampling.sample_responses` with and without ``prune_finished`` (the
same random draws, so the same tokens up to floating-point differences between batch shapes). Both as
:func:`raycurate.stages.model_stages.evaluate_rows` calls them (prompts rendered with the run's system prompt,
``eval.batch_size`` prompts per batch, ``eval.samples`` samples, ``eval.max_new_tokens``), on a checkpoint of a
finished run, in one process with ``--threads`` torch threads; each arm timed once after a warm-up batch.

The questions default to the run's trusted rows (clean rows of the corpus generator that no arm trained on), so no
held-out question is read. Prints the share of identical greedy answers (token for token, and final answers), of
identical samples, and the time ratios reference / pruned::

    .venv/bin/python benchmarks/bench_eval_decode.py runs/real_curate_t400/seed-2 --model train_curate
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def load_prompts(run: Path, questions: Path, limit: int, tokenizer, max_length: int, system_prompt: str) -> tuple:
    from raycurate.data.tokenize import tokenize_record

    rows = [json.loads(line) for line in questions.read_text().splitlines() if line.strip()][:limit]
    tokens = [tokenize_record(tokenizer, row, max_length, system_prompt=system_prompt) for row in rows]
    return rows, [t["input_ids"][: t["prompt_len"]] for t in tokens]


def timed(fn):
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a finished run's seed directory (its config.yaml is read)")
    parser.add_argument("--model", default="train_curate", help="the training stage whose model is evaluated")
    parser.add_argument("--questions", type=Path, help="jsonl of questions (default: the run's corpus/trusted.jsonl)")
    parser.add_argument("--limit", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from raycurate.config.loader import load_config
    from raycurate.config.schema import JobConfig
    from raycurate.data.answers import answers_match, extract_final_answer
    from raycurate.models.generation import generate_greedy, generate_greedy_hf
    from raycurate.models.loading import load_tokenizer
    from raycurate.models.precision import load_eval_model
    from raycurate.models.sampling import derive_seed, sample_responses
    from raycurate.stages.model_stages import stop_token_ids

    torch.set_num_threads(args.threads)
    cfg = load_config(JobConfig, str(args.run / "config.yaml"), [])
    model_dir = args.run / args.model / "model"
    tokenizer = load_tokenizer(str(model_dir))
    model = load_eval_model(str(model_dir), cfg.eval.dtype)
    rows, prompts = load_prompts(args.run, args.questions or args.run / "corpus" / "trusted.jsonl", args.limit,
                                 tokenizer, cfg.data.max_length, cfg.tokenize.system_prompt)
    common = {"max_new_tokens": cfg.eval.max_new_tokens, "pad_id": tokenizer.pad_token_id,
              "eos_ids": stop_token_ids(tokenizer), "batch_size": cfg.eval.batch_size}
    generate_greedy(model, prompts[:4], **common)  # warm-up
    reference, hf_s = timed(lambda: generate_greedy_hf(model, prompts, **common))
    pruned, pruned_s = timed(lambda: generate_greedy(model, prompts, **common))
    same_tokens = sum(a == b for a, b in zip(reference, pruned)) / len(prompts)
    answers = [(extract_final_answer(tokenizer.decode(a, skip_special_tokens=True)),
                extract_final_answer(tokenizer.decode(b, skip_special_tokens=True))) for a, b in zip(reference, pruned)]
    same_answers = sum(a == b for a, b in answers) / len(prompts)
    right = [sum(answers_match(x, row["label"]["answer"]) for x in pair) for pair, row in zip(answers, rows)]
    print(f"greedy: {len(prompts)} prompts, HF generate {hf_s:.1f} s, pruned loop {pruned_s:.1f} s, "
          f"ratio {hf_s / pruned_s:.2f}; identical tokens {same_tokens:.3f}, identical final answers "
          f"{same_answers:.3f}; exact match {sum(r >= 1 for r in right)}")

    def sampled(prune: bool):
        gens = [torch.Generator().manual_seed(derive_seed("heldout-sample", cfg.eval.seed, r["id"])) for r in rows]
        return sample_responses(model, prompts, n=cfg.eval.samples, temperature=cfg.eval.temperature,
                                generator=gens, prune_finished=prune, **common)

    full, full_s = timed(lambda: sampled(False))
    cut, cut_s = timed(lambda: sampled(True))
    pairs = [(a.response_ids, b.response_ids) for ga, gb in zip(full, cut) for a, b in zip(ga, gb)]
    same = sum(a == b for a, b in pairs) / len(pairs)
    mean_len = sum(len(a) for a, _ in pairs) / len(pairs)
    print(f"sampled: {len(pairs)} samples (mean {mean_len:.1f} tokens), unpruned {full_s:.1f} s, pruned {cut_s:.1f} s, "
          f"ratio {full_s / cut_s:.2f}; identical samples {same:.3f}")
    print(f"greedy_ratio={hf_s / pruned_s:.2f} sampled_ratio={full_s / cut_s:.2f} "
          f"greedy_identical={same_tokens:.3f} sampled_identical={same:.3f}")


if __name__ == "__main__":
    main()
