"""Does the base model learn in context and read the prompt's facts?  (issue #12, item 1)

Loads a checkpoint directory (default: the embedded model, ``raycurate/models/embedded``), builds P2D probe prompts
from ``generate_corpus`` rows with P2D's own builder (:func:`raycurate.algorithms.icl_probe.assemble_prompt`:
BOS + instruction + blank line, demonstrations as tokenized chat rows, then the query and its teacher-forced gold
answer), and measures, per query, the mean gold-answer token loss (NLL) under

* 0 demonstrations, 5 clean demonstrations, 5 corrupted demonstrations (the same query in all three: paired);

and, per clean row with fact and distractor spans, the gold-response loss of the row alone when ``n`` of its
relevant-fact prompt tokens are knocked out vs when ``n`` of its distractor tokens are, ``n = min(|relevant|,
|distractor|)`` tokens drawn uniformly (seeded) from each side.  Knock-out = the response and every later token
cannot attend to those key positions (``--knockout mask``, default) or the tokens are replaced by a space token
(``--knockout replace``).

Figures (paired bootstrap 95% CIs over queries / rows, ``--bootstrap`` resamples):

* ``icl_gain = 1 - mean loss(5 clean) / mean loss(0)``;
* ``corrupted_demo_penalty = mean(loss(5 corrupted) - loss(5 clean))``;
* ``relevant_over_distractor_knockout = mean increase(relevant) / mean increase(distractor)``;
* ``context``: the pre-training block length the checkpoint reached (from ``recipe.json`` or
  ``pretrain_metadata.json``).

Usage: ``python benchmarks/bench_embedded_model.py [MODEL_DIR] [--queries 240] [--seed 7] [--json out.json]``.
The last printed line is ``icl_gain=<x> corrupted_demo_penalty=<y> relevant_over_distractor_knockout=<z>
context=<n>``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from raycurate.algorithms.icl_probe import answer_token_logprobs, assemble_prompt
from raycurate.config.p2d import P2DConfig
from raycurate.data.corpus import generate_corpus
from raycurate.data.tokenize import tokenize_batch
from raycurate.models.loading import load_model, load_tokenizer

EMBEDDED_DIR = Path(__file__).resolve().parent.parent / "raycurate" / "models" / "embedded"


def split_row(row: dict, bos: list[int]) -> tuple[list[int], list[int]]:
    """(prompt part, response part) of a token row without its BOS, as P2D's probe splits it."""
    ids, p = list(row["input_ids"]), int(row["prompt_len"])
    start = len(bos) if bos and ids[:1] == bos else 0
    return ids[start:p], ids[p:]


def answer_loss(model, ids: list[int], span: tuple[int, int], attention_mask: torch.Tensor | None = None) -> float:
    """Mean NLL of the tokens at ``span`` of ``ids`` (teacher forced)."""
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
        logits = model(input_ids=input_ids, **kwargs).logits[0]
    return float(-answer_token_logprobs(logits, input_ids[0], span).mean())


def query_losses(model, instruction: list[int], demos: list[list[int]], query: tuple[list[int], list[int]]) -> float:
    """Gold-answer loss of one query after ``demos`` (none: instruction + query + answer)."""
    q, a = query
    if demos:
        assembled = assemble_prompt(instruction, demos, [q], [a])
        return answer_loss(model, assembled["input_ids"], assembled["answer_spans"][0])
    ids = instruction + q + a
    return answer_loss(model, ids, (len(instruction) + len(q), len(ids)))


def knockout_mask(n: int, knocked: list[int]) -> torch.Tensor:
    """(1, 1, n, n) additive mask: causal, and no position attends to a knocked-out key except itself."""
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    allowed[:, knocked] = False
    allowed[knocked, knocked] = True
    mask = torch.zeros(n, n)
    mask[~allowed] = torch.finfo(torch.float32).min
    return mask[None, None]


def span_tokens(row: dict, spans: list[list[int]]) -> list[int]:
    """Prompt token positions whose character offsets start inside one of ``spans``."""
    offsets = row["prompt_offsets"]
    positions = []
    for t in range(int(row["prompt_len"])):
        start = offsets[2 * t]
        if start >= 0 and any(a <= start < b for a, b in spans):
            positions.append(t)
    return positions


def knockout_increases(model, tokenizer, row: dict, rng: np.random.Generator, how: str) -> tuple[float, float] | None:
    """(loss increase with relevant tokens knocked out, with as many distractor tokens knocked out) for one row."""
    label = row["label"]
    relevant = span_tokens(row, label.get("relevant_spans") or [])
    distractor = span_tokens(row, label.get("distractor_spans") or [])
    n = min(len(relevant), len(distractor))
    if n == 0:
        return None
    ids, p = list(row["input_ids"]), int(row["prompt_len"])
    span = (p, len(ids))
    base = answer_loss(model, ids, span)
    out = []
    filler = tokenizer.encode(" ", add_special_tokens=False)[0]
    for side in (relevant, distractor):
        knocked = sorted(rng.choice(side, size=n, replace=False).tolist())
        if how == "mask":
            out.append(answer_loss(model, ids, span, knockout_mask(len(ids), knocked)) - base)
        else:
            replaced = [filler if i in set(knocked) else t for i, t in enumerate(ids)]
            out.append(answer_loss(model, replaced, span) - base)
    return out[0], out[1]


def bootstrap(stat, arrays: list[np.ndarray], n_boot: int, seed: int) -> tuple[float, float, float]:
    """(point, low, high): ``stat(*arrays)`` and its paired percentile bootstrap 95% CI."""
    rng = np.random.default_rng(seed)
    n = len(arrays[0])
    point = float(stat(*arrays))
    draws = [float(stat(*(a[idx] for a in arrays))) for idx in (rng.integers(0, n, n) for _ in range(n_boot))]
    low, high = np.percentile(draws, [2.5, 97.5])
    return point, float(low), float(high)


def context_length(model_dir: str, model) -> int:
    """The pre-training block length the checkpoint reached (recipe.json / pretrain_metadata.json), else 0."""
    recipe = os.path.join(model_dir, "recipe.json")
    if os.path.isfile(recipe):
        return int(json.loads(Path(recipe).read_text())["context"])
    meta = os.path.join(model_dir, "pretrain_metadata.json")
    if os.path.isfile(meta):
        return int(json.loads(Path(meta).read_text())["settings"]["max_len"])
    return 0


def induction_check(model, tokenizer, n_episodes: int = 60, seed: int = 12345) -> tuple[float, float]:
    """Mean response loss in word-mapping episodes: (key seen earlier in the episode, key first seen).

    A model with induction heads copies the value of a repeated key, so the first number is far below the second.
    """
    import random

    from raycurate.data.pretrain_texts import ASSISTANT, END, EOS, USER, mapping_episode

    rng = random.Random(seed)
    seen_losses, new_losses = [], []
    for _ in range(n_episodes):
        ids = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        spans, seen, keys = [], [], set()
        for prompt, response in mapping_episode(rng, 10):
            ids += tokenizer.encode(f"{USER}{prompt}{END}{ASSISTANT}", add_special_tokens=False)
            start = len(ids)
            ids += tokenizer.encode(response, add_special_tokens=False)
            spans.append((start, len(ids)))
            key = response.split(" -> ")[0]
            seen.append(key in keys)
            keys.add(key)
            ids += tokenizer.encode(f"{END}{EOS}", add_special_tokens=False)
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits[0]
        for span, was_seen in zip(spans, seen):
            loss = float(-answer_token_logprobs(logits, input_ids[0], span).mean())
            (seen_losses if was_seen else new_losses).append(loss)
    return float(np.mean(seen_losses)), float(np.mean(new_losses))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", nargs="?", default=str(EMBEDDED_DIR))
    parser.add_argument("--queries", type=int, default=240, help="queries per condition (>= 200 for the claim)")
    parser.add_argument("--knockout-rows", type=int, default=240)
    parser.add_argument("--corpus-rows", type=int, default=3000)
    parser.add_argument("--corpus-seed", type=int, default=7)
    parser.add_argument("--corrupt-fraction", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0, help="seed of the demo/query draws and knock-out tokens")
    parser.add_argument("--demos", type=int, default=5)
    parser.add_argument("--knockout", choices=("mask", "replace"), default="mask")
    parser.add_argument("--bootstrap", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)

    tokenizer = load_tokenizer(args.model_dir)
    model = load_model(args.model_dir, dtype="float32", attn_implementation="sdpa").eval()
    rows, _ = tokenize_batch(tokenizer, generate_corpus(args.corpus_rows, args.corpus_seed, args.corrupt_fraction),
                             max_length=4096)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    instruction = bos + tokenizer.encode(P2DConfig().instruction + "\n\n", add_special_tokens=False)
    clean = [r for r in rows if r["label"]["clean"]]
    corrupted = [r for r in rows if not r["label"]["clean"]]
    rng = np.random.default_rng(args.seed)

    losses = {"zero": [], "clean": [], "corrupted": []}
    query_order = rng.permutation(len(clean))[: args.queries]
    for qi in query_order.tolist():
        query = split_row(clean[qi], bos)
        others = [i for i in rng.choice(len(clean), size=args.demos + 1, replace=False).tolist() if i != qi]
        clean_demos = [sum(split_row(clean[i], bos), []) for i in others[: args.demos]]
        bad_demos = [sum(split_row(corrupted[i], bos), [])
                     for i in rng.choice(len(corrupted), size=args.demos, replace=False).tolist()]
        losses["zero"].append(query_losses(model, instruction, [], query))
        losses["clean"].append(query_losses(model, instruction, clean_demos, query))
        losses["corrupted"].append(query_losses(model, instruction, bad_demos, query))
    zero, with_clean, with_bad = (np.array(losses[k]) for k in ("zero", "clean", "corrupted"))

    knock = [knockout_increases(model, tokenizer, r, rng, args.knockout)
             for r in clean if r["label"].get("distractor_spans")][: args.knockout_rows]
    knock = np.array([k for k in knock if k is not None])

    gain = bootstrap(lambda z, c: 1 - c.mean() / z.mean(), [zero, with_clean], args.bootstrap, args.seed)
    penalty = bootstrap(lambda c, b: (b - c).mean(), [with_clean, with_bad], args.bootstrap, args.seed)
    ratio = bootstrap(lambda r, d: r.mean() / d.mean(), [knock[:, 0], knock[:, 1]], args.bootstrap, args.seed)
    # the ratio is ill-conditioned when the distractor increase is ~0 (or < 0): report both increases and their gap
    relevant_up = bootstrap(lambda r: r.mean(), [knock[:, 0]], args.bootstrap, args.seed)
    distractor_up = bootstrap(lambda d: d.mean(), [knock[:, 1]], args.bootstrap, args.seed)
    gap = bootstrap(lambda r, d: (r - d).mean(), [knock[:, 0], knock[:, 1]], args.bootstrap, args.seed)
    result = {
        "model_dir": args.model_dir, "queries": len(zero), "knockout_rows": len(knock), "knockout": args.knockout,
        "corpus_seed": args.corpus_seed, "corrupt_fraction": args.corrupt_fraction, "seed": args.seed,
        "loss_zero_demos": float(zero.mean()), "loss_clean_demos": float(with_clean.mean()),
        "loss_corrupted_demos": float(with_bad.mean()),
        "icl_gain": gain, "corrupted_demo_penalty": penalty, "relevant_over_distractor_knockout": ratio,
        "knockout_increase_relevant": float(knock[:, 0].mean()),
        "knockout_increase_distractor": float(knock[:, 1].mean()),
        "knockout_increase_relevant_ci": relevant_up, "knockout_increase_distractor_ci": distractor_up,
        "knockout_relevant_minus_distractor": gap,
        "context": context_length(args.model_dir, model),
    }
    for key in ("icl_gain", "corrupted_demo_penalty", "relevant_over_distractor_knockout",
                "knockout_increase_relevant_ci", "knockout_increase_distractor_ci",
                "knockout_relevant_minus_distractor"):
        point, low, high = result[key]
        print(f"{key}: {point:.4f}  95% CI [{low:.4f}, {high:.4f}]")
    print(f"mean answer loss: 0 demos {zero.mean():.4f}, 5 clean {with_clean.mean():.4f}, 5 corrupted "
          f"{with_bad.mean():.4f} ({len(zero)} queries); knock-out increase relevant "
          f"{result['knockout_increase_relevant']:.4f} vs distractor {result['knockout_increase_distractor']:.4f} "
          f"({len(knock)} rows, {args.knockout})")
    result["induction_seen_key_loss"], result["induction_new_key_loss"] = induction_check(model, tokenizer)
    print(f"induction check (word-mapping episodes): response loss {result['induction_seen_key_loss']:.4f} when the "
          f"key appeared earlier vs {result['induction_new_key_loss']:.4f} when new")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    sys.stdout.flush()
    print(f"icl_gain={gain[0]:.4f} corrupted_demo_penalty={penalty[0]:.4f} "
          f"relevant_over_distractor_knockout={ratio[0]:.4f} context={result['context']}")
    return result


if __name__ == "__main__":
    main()
