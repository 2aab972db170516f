"""Does a model learn in context and read the prompt's facts?  (issue #12, item 1; any model since issue #25)

Loads a model (``--model``: ``embedded``, the default, ``smollm2-135m`` or a checkpoint folder), builds P2D probe
prompts from ``generate_corpus`` rows exactly as P2D's probe does (:func:`raycurate.stages.p2d.probe_prompt`: the
instruction segment of :func:`raycurate.data.chat_layout.instruction_ids` -- BOS + instruction + blank line for the
embedded tokenizer, a system turn for ChatML --, demonstrations as tokenized chat rows joined by the template's row
separator, then the query and its teacher-forced gold answer), and measures, per query, the mean gold-answer token
loss (NLL) under

* 0 demonstrations, 5 clean demonstrations, 5 corrupted demonstrations (the same query in all three: paired);

and, per clean row with fact and distractor spans, the gold-response loss of the row alone when ``n`` of its
relevant-fact prompt tokens are knocked out vs when ``n`` of its distractor tokens are, ``n = min(|relevant|,
|distractor|)`` tokens drawn uniformly (seeded) from each side.  Knock-out = the response and every later token
cannot attend to those key positions (``--knockout mask``, default) or the tokens are replaced by a space token
(``--knockout replace``).  Only the first ``--knockout-rows`` clean rows with distractor spans are computed.

Figures (paired bootstrap 95% CIs over queries / rows, ``--bootstrap`` resamples):

* ``icl_gain = 1 - mean loss(5 clean) / mean loss(0)``;
* ``corrupted_demo_penalty = mean(loss(5 corrupted) - loss(5 clean))``;
* ``relevant_over_distractor_knockout = mean increase(relevant) / mean increase(distractor)``;
* ``context``: the pre-training block length the checkpoint reached (from ``recipe.json`` or
  ``pretrain_metadata.json``; 0 when neither exists).

On the embedded model the prompts, and so the figures, are those of ``bench_embedded_model.py``, its name before
issue #25.  Progress lines (queries, knock-out rows) are printed, flushed, as the work goes.

Usage: ``python benchmarks/bench_model_icl.py [--model embedded|smollm2-135m|DIR] [--queries 240]
[--knockout-rows 240] [--system-prompt default|none|TEXT] [--seed 0] [--json out.json]``.  The last printed line
is ``icl_gain=<x> corrupted_demo_penalty=<y> relevant_over_distractor_knockout=<z> context=<n>``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from raycurate.algorithms.p2d.icl_probe import answer_token_logprobs
from raycurate.config.p2d import P2DConfig
from raycurate.data.chat_layout import ChatLayout, chat_layout, instruction_ids, split_row
from raycurate.data.corpus import generate_corpus
from raycurate.data.tokenize import tokenize_batch
from raycurate.models.loading import load_model, load_tokenizer, resolve_model_path
from raycurate.stages.p2d import probe_prompt


def progress(what: str, done: int, total: int, start: float, every: int) -> None:
    """Print ``what done/total (elapsed s)`` every ``every`` items and at the last one (flushed)."""
    if every > 0 and (done % every == 0 or done == total):
        print(f"{what} {done}/{total} ({time.perf_counter() - start:.0f} s)", flush=True)


def model_dir(name: str) -> str:
    """``--model`` -> a checkpoint folder: ``embedded``, a name :mod:`raycurate.models.loading` resolves, or a
    folder; exits with a message naming what to do when there is no such folder."""
    path = resolve_model_path(name)
    if not os.path.isdir(path):
        raise SystemExit(f"--model {name}: no checkpoint folder {path!r}; fetch and convert the model first "
                         "(README: the real model) or pass a local checkpoint folder")
    return path


def answer_loss(model, ids: list[int], span: tuple[int, int], attention_mask: torch.Tensor | None = None) -> float:
    """Mean NLL of the tokens at ``span`` of ``ids`` (teacher forced)."""
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
        logits = model(input_ids=input_ids, **kwargs).logits[0]
    return float(-answer_token_logprobs(logits, input_ids[0], span).mean())


def query_losses(model, layout: ChatLayout, instruction: list[int], demos: list[dict], query: dict) -> float:
    """Gold-answer loss of one query row after the ``demos`` rows (none: instruction + query + answer)."""
    if demos:
        assembled, _ = probe_prompt(layout, instruction, demos, [query])
        return answer_loss(model, assembled["input_ids"], assembled["answer_spans"][0])
    q, a = split_row(query, layout)
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


def induction_check(model, tokenizer, system_prompt: str = "default", n_episodes: int = 60,
                    seed: int = 12345) -> tuple[float, float]:
    """Mean response loss in word-mapping episodes: (key seen earlier in the episode, key first seen).

    An episode is 10 (question, answer) chat rows joined like a probe prompt (sequence lead once, rows as
    tokenized, the template's row separator between them); the loss is over each answer's text tokens.  A model with
    induction heads copies the value of a repeated key, so the first number is far below the second.
    """
    import random

    from raycurate.data.pretrain_texts import mapping_episode

    rng = random.Random(seed)
    layout = chat_layout(tokenizer)
    seen_losses, new_losses = [], []
    for _ in range(n_episodes):
        pairs = mapping_episode(rng, 10)
        rows, _ = tokenize_batch(tokenizer, [{"id": str(i), "prompt": p, "response": r}
                                             for i, (p, r) in enumerate(pairs)], max_length=4096,
                                 system_prompt=system_prompt)
        ids = list(layout.lead)
        spans, seen, keys = [], [], set()
        for row, (_, response) in zip(rows, pairs):
            prompt_part, response_part = split_row(row, layout)
            ids += prompt_part
            start = len(ids)
            spans.append((start, start + len(tokenizer.encode(response, add_special_tokens=False))))
            ids += response_part + layout.separator
            key = response.split(" -> ")[0]
            seen.append(key in keys)
            keys.add(key)
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits[0]
        for span, was_seen in zip(spans, seen):
            loss = float(-answer_token_logprobs(logits, input_ids[0], span).mean())
            (seen_losses if was_seen else new_losses).append(loss)
    return float(np.mean(seen_losses)), float(np.mean(new_losses))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded",
                        help="'embedded' (the committed base model), 'smollm2-135m' (once fetched) or a checkpoint "
                             "folder")
    parser.add_argument("--queries", type=int, default=240, help="queries per condition (>= 200 for the claim)")
    parser.add_argument("--knockout-rows", type=int, default=240,
                        help="clean rows with distractor spans to knock out (only these are computed)")
    parser.add_argument("--system-prompt", default="default",
                        help="tokenize.system_prompt of the rows: default (the template's), none, or the text")
    parser.add_argument("--progress-every", type=int, default=10, help="a progress line every N items (0: none)")
    parser.add_argument("--induction-episodes", type=int, default=60,
                        help="word-mapping episodes of the induction check (10 chat rows each; 0: skip it)")
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

    path = model_dir(args.model)
    tokenizer = load_tokenizer(path)
    model = load_model(path, dtype="float32", attn_implementation="sdpa").eval()
    rows, _ = tokenize_batch(tokenizer, generate_corpus(args.corpus_rows, args.corpus_seed, args.corrupt_fraction),
                             max_length=4096, system_prompt=args.system_prompt)
    layout = chat_layout(tokenizer)
    instruction = instruction_ids(tokenizer, layout, P2DConfig().instruction)
    clean = [r for r in rows if r["label"]["clean"]]
    corrupted = [r for r in rows if not r["label"]["clean"]]
    rng = np.random.default_rng(args.seed)
    print(f"{path}: {len(rows)} corpus rows, BOS kind {layout.kind}, {args.queries} queries x 3 prompts, "
          f"{args.knockout_rows} knock-out rows", flush=True)

    losses = {"zero": [], "clean": [], "corrupted": []}
    query_order = rng.permutation(len(clean))[: args.queries]
    start = time.perf_counter()
    for done, qi in enumerate(query_order.tolist(), 1):
        others = [i for i in rng.choice(len(clean), size=args.demos + 1, replace=False).tolist() if i != qi]
        clean_demos = [clean[i] for i in others[: args.demos]]
        bad_demos = [corrupted[i] for i in rng.choice(len(corrupted), size=args.demos, replace=False).tolist()]
        losses["zero"].append(query_losses(model, layout, instruction, [], clean[qi]))
        losses["clean"].append(query_losses(model, layout, instruction, clean_demos, clean[qi]))
        losses["corrupted"].append(query_losses(model, layout, instruction, bad_demos, clean[qi]))
        progress("queries", done, len(query_order), start, args.progress_every)
    zero, with_clean, with_bad = (np.array(losses[k]) for k in ("zero", "clean", "corrupted"))

    # only the rows that are reported: the first --knockout-rows clean rows with distractor spans
    eligible = [r for r in clean if r["label"].get("distractor_spans")][: args.knockout_rows]
    knock, start = [], time.perf_counter()
    for done, row in enumerate(eligible, 1):
        knock.append(knockout_increases(model, tokenizer, row, rng, args.knockout))
        progress("knock-out rows", done, len(eligible), start, args.progress_every)
    knock = np.array([k for k in knock if k is not None])

    gain = bootstrap(lambda z, c: 1 - c.mean() / z.mean(), [zero, with_clean], args.bootstrap, args.seed)
    penalty = bootstrap(lambda c, b: (b - c).mean(), [with_clean, with_bad], args.bootstrap, args.seed)
    ratio = bootstrap(lambda r, d: r.mean() / d.mean(), [knock[:, 0], knock[:, 1]], args.bootstrap, args.seed)
    # the ratio is ill-conditioned when the distractor increase is ~0 (or < 0): report both increases and their gap
    relevant_up = bootstrap(lambda r: r.mean(), [knock[:, 0]], args.bootstrap, args.seed)
    distractor_up = bootstrap(lambda d: d.mean(), [knock[:, 1]], args.bootstrap, args.seed)
    gap = bootstrap(lambda r, d: (r - d).mean(), [knock[:, 0], knock[:, 1]], args.bootstrap, args.seed)
    result = {
        "model": args.model, "model_dir": path, "system_prompt": args.system_prompt,
        "queries": len(zero), "knockout_rows": len(knock), "knockout": args.knockout,
        "corpus_seed": args.corpus_seed, "corrupt_fraction": args.corrupt_fraction, "seed": args.seed,
        "loss_zero_demos": float(zero.mean()), "loss_clean_demos": float(with_clean.mean()),
        "loss_corrupted_demos": float(with_bad.mean()),
        "icl_gain": gain, "corrupted_demo_penalty": penalty, "relevant_over_distractor_knockout": ratio,
        "knockout_increase_relevant": float(knock[:, 0].mean()),
        "knockout_increase_distractor": float(knock[:, 1].mean()),
        "knockout_increase_relevant_ci": relevant_up, "knockout_increase_distractor_ci": distractor_up,
        "knockout_relevant_minus_distractor": gap,
        "context": context_length(path, model),
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
    if args.induction_episodes > 0:
        result["induction_seen_key_loss"], result["induction_new_key_loss"] = induction_check(
            model, tokenizer, args.system_prompt, n_episodes=args.induction_episodes)
        print(f"induction check ({args.induction_episodes} word-mapping episodes): response loss "
              f"{result['induction_seen_key_loss']:.4f} when the key appeared earlier vs "
              f"{result['induction_new_key_loss']:.4f} when new")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    sys.stdout.flush()
    print(f"icl_gain={gain[0]:.4f} corrupted_demo_penalty={penalty[0]:.4f} "
          f"relevant_over_distractor_knockout={ratio[0]:.4f} context={result['context']}")
    return result


if __name__ == "__main__":
    main()
