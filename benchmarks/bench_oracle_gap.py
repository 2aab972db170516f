"""The proving ground's oracle gap without Ray: SFT on all rows vs on the clean rows, held-out exact match.

An in-process re-implementation of what the demo's ``train_mixed`` / ``train_clean`` / ``eval_*`` stages do
(same corpus, tokenization, AdamW with warm-up + cosine, clipping 1.0, no weight decay, one epoch at batch 32, the
same greedy and sampled answers), so the gap can be measured on any corpus seed and corruption fraction in a few
minutes and checked against the pipeline.  Per variant it prints greedy and sampled exact match and a breakdown of
the sampled answers (right, no ``####`` answer, a wrong number that appears in the prompt, another wrong number);
then the paired bootstrap 95% CI of clean minus mixed.  Usage::

    OMP_NUM_THREADS=1 python benchmarks/bench_oracle_gap.py [--seed 0] [--frac 0.3] [--heldout 500] [--lr 2e-3]

The last line is ``oracle_gap_sampled=<x> low=<l> high=<h> oracle_gap_greedy=<g> questions=<n>``.
"""

from __future__ import annotations

import argparse
import collections
import math
import re

import numpy as np
import torch

from raycurate.algorithms.losses import example_losses, pad_rows
from raycurate.algorithms.stats import paired_bootstrap_ci
from raycurate.data.answers import answers_match, extract_final_answer
from raycurate.data.corpus import generate_corpus, generate_heldout
from raycurate.data.tokenize import is_rejection, tokenize_record
from raycurate.models.generation import generate_greedy
from raycurate.models.loading import load_model, load_tokenizer
from raycurate.models.optim import cosine_with_warmup
from raycurate.models.sampling import derive_seed, sample_responses
from raycurate.stages.model_stages import stop_token_ids

MAX_LENGTH = 384


def fine_tune(model_dir: str, tokenizer, rows: list[dict], *, lr: float, batch: int, epochs: float, seed: int):
    """Full fine-tuning on the response tokens; returns (model, optimizer steps)."""
    model = load_model(model_dir)
    model.train()
    data = [t for t in (tokenize_record(tokenizer, r, MAX_LENGTH) for r in rows) if not is_rejection(t)]
    generator = torch.Generator().manual_seed(seed)
    steps = max(1, math.ceil(len(data) * epochs / batch))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    order: list[int] = []
    for step in range(steps):
        while len(order) < batch:
            order += torch.randperm(len(data), generator=generator).tolist()
        index, order = order[:batch], order[batch:]
        tensors = pad_rows([data[i] for i in index], tokenizer.pad_token_id)
        for group in optimizer.param_groups:
            group["lr"] = lr * cosine_with_warmup(step, max(1, steps // 20), steps, floor=0.1)
        logits = model(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"]).logits
        loss = example_losses(logits, tensors["input_ids"], tensors["loss_mask"]).mean()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return model.eval(), steps


def answer_kind(text: str, row: dict) -> str:
    predicted = extract_final_answer(text)
    if predicted is None:
        return "no_answer"
    if answers_match(predicted, row["label"]["answer"]):
        return "right"
    return "wrong_number_from_prompt" if predicted in set(re.findall(r"\d+", row["prompt"])) else "wrong_other"


def evaluate(model, tokenizer, heldout: list[dict], samples: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """(greedy 0/1 per question, sampled accuracy per question, breakdown of the sampled answers)."""
    prompts = [(t := tokenize_record(tokenizer, r, MAX_LENGTH))["input_ids"][: t["prompt_len"]] for r in heldout]
    stops = stop_token_ids(tokenizer)
    with torch.no_grad():
        greedy_ids = generate_greedy(model, prompts, max_new_tokens=64, pad_id=tokenizer.pad_token_id, eos_ids=stops,
                                     batch_size=50)
        generators = [torch.Generator().manual_seed(derive_seed("heldout-sample", 0, r["id"])) for r in heldout]
        drawn = sample_responses(model, prompts, n=samples, temperature=1.0, max_new_tokens=64, eos_ids=stops,
                                 pad_id=tokenizer.pad_token_id, generator=generators, batch_size=50)
    greedy = np.array([answer_kind(tokenizer.decode(g, skip_special_tokens=True), r) == "right"
                       for g, r in zip(greedy_ids, heldout)], dtype=float)
    kinds = [[answer_kind(tokenizer.decode(s.response_ids, skip_special_tokens=True), r) for s in row_samples]
             for row_samples, r in zip(drawn, heldout)]
    sampled = np.array([sum(k == "right" for k in row) / samples for row in kinds])
    counts = collections.Counter(k for row in kinds for k in row)
    total = sum(counts.values())
    return greedy, sampled, {k: round(v / total, 3) for k, v in sorted(counts.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded", help="base model: 'embedded' or a checkpoint folder")
    parser.add_argument("--seed", type=int, default=0, help="corpus seed")
    parser.add_argument("--frac", type=float, default=0.3, help="corrupt fraction")
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--heldout", type=int, default=500)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(args.model)
    rows = generate_corpus(args.rows, args.seed, args.frac)
    heldout = generate_heldout(args.heldout, args.seed)
    scores = {}
    for variant, train_rows in (("mixed", rows), ("clean", [r for r in rows if r["label"]["clean"]])):
        model, steps = fine_tune(args.model, tokenizer, train_rows, lr=args.lr, batch=args.batch, epochs=args.epochs,
                                 seed=0)
        greedy, sampled, breakdown = evaluate(model, tokenizer, heldout, args.samples)
        scores[variant] = (greedy, sampled)
        print(f"{variant}: {len(train_rows)} rows, {steps} steps, greedy {greedy.mean():.3f}, sampled "
              f"{sampled.mean():.3f}; sampled answers {breakdown}", flush=True)
    gap = paired_bootstrap_ci(scores["clean"][1], scores["mixed"][1])
    greedy_gap = paired_bootstrap_ci(scores["clean"][0], scores["mixed"][0])
    print(f"greedy gap {greedy_gap.value:+.3f} [{greedy_gap.low:+.3f}, {greedy_gap.high:+.3f}]")
    print(f"oracle_gap_sampled={gap.value:.4f} low={gap.low:.4f} high={gap.high:.4f} "
          f"oracle_gap_greedy={greedy_gap.value:.4f} questions={len(heldout)}")


if __name__ == "__main__":
    main()
