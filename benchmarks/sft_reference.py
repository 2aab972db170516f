"""An independent LoRA SFT + greedy evaluation, to check the engine's numbers on a real model.

It shares no code with raycurate's tokenizer, trainer or evaluator (only the bootstrap CI): it renders rows with
the tokenizer's own chat template, trains PEFT LoRA with a plain PyTorch loop (AdamW, linear warmup then cosine,
loss on response tokens only), generates greedily with ``model.generate`` and reads the answer after ``####`` with
its own regex. Point it at a finished run directory and it compares its held-out exact match with the engine's
predictions on the same questions (paired bootstrap CI of the difference).

Example:
    python benchmarks/sft_reference.py --run runs/real_proving_ground/seed-0 --arm mixed --questions 300

Last line: ``reference_exact_match=… engine_exact_match=… diff=… [lo, hi] train_loss=…``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import time
from pathlib import Path

import numpy as np
import torch

ANSWER = re.compile(r"####\s*(-?[\d,]+(?:\.\d+)?)")


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSON-lines file, skipping lines that do not parse (the corpus has deliberate bad lines)."""
    rows = []
    for raw in path.read_bytes().splitlines():
        try:
            row = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(row, dict) and isinstance(row.get("prompt"), str) and isinstance(row.get("response"), str):
            rows.append(row)
    return rows


def messages(system: str, prompt: str, response: str | None = None) -> list[dict]:
    """Chat messages of one row."""
    turns = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
    return turns + ([{"role": "assistant", "content": response}] if response is not None else [])


def encode_row(tok, system: str, row: dict, max_length: int) -> tuple[list[int], list[int]] | None:
    """Token ids and labels (-100 on the prompt) of one training row; None when it is too long."""
    prompt_ids = tok.apply_chat_template(messages(system, row["prompt"]), add_generation_prompt=True, tokenize=True)
    full_ids = tok.apply_chat_template(messages(system, row["prompt"], row["response"]), tokenize=True)
    prompt_ids, full_ids = list(_ids(prompt_ids)), list(_ids(full_ids))
    if full_ids[: len(prompt_ids)] != prompt_ids or len(full_ids) > max_length:
        return None
    return full_ids, [-100] * len(prompt_ids) + full_ids[len(prompt_ids):]


def _ids(encoded) -> list[int]:
    """``apply_chat_template(tokenize=True)`` returns ids, or a BatchEncoding holding them (transformers 5)."""
    return encoded["input_ids"] if hasattr(encoded, "keys") else encoded


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warmup to 1, then cosine to 0."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def train(model, batches: list[list[tuple[list[int], list[int]]]], lr: float, warmup_ratio: float,
          pad_id: int, loss_kind: str = "token") -> float:
    """Plain AdamW loop over ``batches``; returns the mean loss of the last 10 steps.

    ``loss_kind``: ``token`` averages over every supervised token of the batch; ``example`` averages each
    example's tokens first, then the examples."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = int(round(warmup_ratio * len(batches)))
    losses = []
    model.train()
    start = time.time()
    for step, batch in enumerate(batches):
        for group in opt.param_groups:
            group["lr"] = lr * lr_factor(step, warmup, len(batches))
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([i + [pad_id] * (width - len(i)) for i, _ in batch])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
        mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in batch])
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        per_token = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:],
                                                      ignore_index=-100, reduction="none")  # (B, T-1)
        supervised = (labels[:, 1:] != -100).float()
        if loss_kind == "token":
            loss = per_token.sum() / supervised.sum()
        else:
            loss = ((per_token * supervised).sum(1) / supervised.sum(1).clamp(min=1)).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step % 10 == 0:
            print(f"step {step}/{len(batches)} loss {np.mean(losses[-10:]):.4f} ({time.time() - start:.0f} s)",
                  flush=True)
    return float(np.mean(losses[-10:]))


@torch.no_grad()
def greedy_answers(model, tok, system: str, questions: list[dict], max_new_tokens: int, batch: int) -> list[str]:
    """Greedy generations for ``questions`` (left-padded batches)."""
    model.eval()
    tok.padding_side = "left"
    out = []
    for i in range(0, len(questions), batch):
        texts = [tok.apply_chat_template(messages(system, q["prompt"]), add_generation_prompt=True, tokenize=False)
                 for q in questions[i:i + batch]]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
        out += tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        print(f"generated {len(out)}/{len(questions)}", flush=True)
    return out


def final_answer(text: str) -> str | None:
    """The number after the first ``####`` (commas removed), or None."""
    match = ANSWER.search(text)
    return match.group(1).replace(",", "") if match else None


def training_rows(run: Path, arm: str) -> list[dict]:
    """The corpus rows an arm trains on: all parsable rows (mixed) or those labelled clean (clean)."""
    rows = read_jsonl(run / "corpus" / "corpus.jsonl")
    seen, unique = set(), []
    for row in rows:
        if row.get("id") in seen or row.get("domain") not in {"math", "code", "instruction"}:
            continue
        seen.add(row.get("id"))
        unique.append(row)
    if arm == "clean":
        unique = [r for r in unique if (r.get("label") or {}).get("clean")]
    return unique


def train_lora(args: argparse.Namespace, model_dir: str, batches: list, pad_id: int):
    """PEFT LoRA on the frozen base (``args.dtype``), adapter in fp32; returns (model, last-10-step loss)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                                             target_modules=targets))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    train_loss = train(model, batches, args.lr, 0.05, pad_id, args.loss)

    return model, train_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a finished demo/proving-ground seed directory")
    parser.add_argument("--arm", choices=["mixed", "clean"], default="mixed")
    parser.add_argument("--questions", type=int, default=300)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--lora-alpha", type=float, default=16.0)
    parser.add_argument("--system", default="You are a helpful assistant.")
    parser.add_argument("--max-length", type=int, default=384)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="frozen base dtype")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--loss", choices=["token", "example"], default="token",
                        help="token: mean over the batch's supervised tokens; example: per-example mean, then mean")
    parser.add_argument("--eval-model", type=Path, default=None,
                        help="skip training: evaluate this HF model folder (e.g. the engine's train_mixed/model)")
    parser.add_argument("--eval-adapter", type=Path, default=None,
                        help="skip training: evaluate the base (fp32) with this PEFT adapter folder, unmerged")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model_dir = json.loads((args.run / "base_model" / "base_model.json").read_text())["model_dir"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = training_rows(args.run, args.arm)
    encoded = [e for e in (encode_row(tok, args.system, r, args.max_length) for r in rows) if e is not None]
    questions = read_jsonl(args.run / "corpus" / "heldout.jsonl")[: args.questions]
    print(f"reference SFT: {len(encoded)} rows ({args.arm}), {args.epochs} epoch(s), batch {args.batch}, "
          f"lr {args.lr}, LoRA r={args.lora_r} alpha={args.lora_alpha}, base {args.dtype}; "
          f"then greedy on {len(questions)} held-out questions", flush=True)

    rng = random.Random(args.seed)
    batches = []
    for _ in range(args.epochs):
        order = list(range(len(encoded)))
        rng.shuffle(order)
        batches += [[encoded[j] for j in order[i:i + args.batch]] for i in range(0, len(order), args.batch)]
    if args.eval_model is not None:
        model = AutoModelForCausalLM.from_pretrained(args.eval_model, dtype=torch.float32)
        train_loss = float("nan")
    elif args.eval_adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                          str(args.eval_adapter))
        train_loss = float("nan")
    else:
        model, train_loss = train_lora(args, model_dir, batches, tok.pad_token_id or 0)
    generations = greedy_answers(model, tok, args.system, questions, 64, 16)
    ours = np.array([float(final_answer(g) == q["label"]["answer"]) for g, q in zip(generations, questions)])
    engine_file = args.run / f"eval_{args.arm}" / "predictions.parquet"
    line = f"reference_exact_match={ours.mean():.3f} train_loss={train_loss:.4f} questions={len(questions)}"
    if engine_file.exists():
        import pyarrow.parquet as pq

        engine = {r["id"]: float(r["correct"]) for r in pq.read_table(engine_file).to_pylist()}
        theirs = np.array([engine[q["id"]] for q in questions])
        from raycurate.algorithms.stats import paired_bootstrap_ci

        diff = paired_bootstrap_ci(ours, theirs)
        line += (f" engine_exact_match={theirs.mean():.3f} diff={diff.value:+.3f} "
                 f"[{diff.low:+.3f}, {diff.high:+.3f}]")
    print(line)


if __name__ == "__main__":
    main()
