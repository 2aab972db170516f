"""BRIDGE prompt side on the demo model: fidelity of both prompt proxies and distractor vs relevant-fact drops.

In-process replica of the demo's BRIDGE stages (no Ray), per corpus seed: the embedded corpus (``--corpus-rows``,
30% corrupted) tokenized with the demo base model's tokenizer and hash-split like ``data.split_ratios``
(5/5/90); warmup SFT from the base model on the warmup split (1 epoch, AdamW ``--lr``, batch 32, 5% linear warmup
then cosine, the demo's ``train`` settings); direction v on the validation split (last 4 layers, lambda 0.2).
Then:

* **drops**: ``score_and_select_rows`` on ``--select-rows`` selection rows that carry relevant/distractor spans,
  at rho_p = 0.5 (rho_r 0.75, alternating T = 4), once per ``bridge.prompt_proxy``; shares of relevant-fact and
  distractor prompt tokens dropped (``prompt_relevance_drops``).  Target: distractor share >= 2x relevant share.
* **fidelity**: ``example_fidelity`` (the diagnostics stage's computation, bridge defaults rho 0.75, EOS not
  folded) on ``--fidelity-rows`` seeded selection rows: prompt-side Spearman, Top-b overlap, Jaccard and regret
  of ``attention_x_a`` (routing, the paper's) and ``knockout_grad`` vs the exact leave-one-out reference, plus
  the response side of ``attention`` (routing alone) and ``attention_x_a``; and, to split the gap, the Spearman
  of both proxies vs an exact *knock-out* reference (``s_i = 0`` in every layer, positions kept, one JVP pass
  over p masked copies) and of that knock-out vs the leave-one-out removal.  Target: Spearman >= 0.6 for the
  better proxy.  Ranking shift (Fig. 2b) with random nested and Top-b subsets.
* **oracle drops**: on ``--oracle-rows`` labelled rows, the drop shares when the prompt side (state at rho_p 0.5)
  is ranked by the exact leave-one-out reference, the exact knock-out, the knock-out derivative and routing:
  whether a faithful proxy can reach the distractor target at all.

The base model is the demo's committed embedded model (``--model embedded``, default; warmup lr 2e-3 as the
demo's ``train.lr``, scoring layers capped at its 2), the old cached tiny-llama (``--model tiny``), or any model
name :mod:`raycurate.models.loading` resolves (``smollm2-135m`` once fetched) or checkpoint folder; the rows are
rendered with ``--system-prompt`` (``tokenize.system_prompt``).  Each seed's work is sized before it starts (one
line with the row counts) and progress lines (phases, fidelity and oracle rows) are printed, flushed, as it goes.
Usage::

    python benchmarks/bench_bridge_prompt_side.py [--corpus-seeds 0 1 2] [--select-rows 150] [--fidelity-rows 20]

The last line is ``routing_spearman=... knockout_spearman=... routing_drop_ratio=... knockout_drop_ratio=...``
(means over the seeds; drop ratio = distractor share dropped / relevant share dropped).
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch


def base_model_dir(cache_dir: str) -> str:
    from raycurate.data.corpus import generate_pretraining_texts
    from raycurate.models.pretrain import ensure_base_model

    return ensure_base_model("tiny-llama", cache_dir, lambda: generate_pretraining_texts(4000, seed=0), steps=600,
                             seed=0, vocab_size=2048, chat_template=True, data_key="embedded-pretrain-v1-4000-0",
                             progress=False)


def say(text: str, start: float | None = None) -> None:
    """A progress line, flushed (with the seconds since ``start`` when given)."""
    print(text if start is None else f"{text} ({time.perf_counter() - start:.0f} s)", flush=True)


def token_splits(tokenizer, corpus_seed: int, n_rows: int, system_prompt: str = "default") -> dict[str, list[dict]]:
    from raycurate.config.data import DataConfig
    from raycurate.data.corpus import generate_corpus
    from raycurate.data.splits import assign_splits
    from raycurate.data.tokenize import tokenize_batch

    rows = generate_corpus(n_rows, seed=corpus_seed, corrupt_fraction=0.3)
    token_rows, _ = tokenize_batch(tokenizer, rows, max_length=384, system_prompt=system_prompt)
    names = assign_splits([r["id"] for r in token_rows], 0, DataConfig().split_ratios)
    out: dict[str, list[dict]] = {"warmup": [], "validation": [], "selection": []}
    for row, name in zip(token_rows, names):
        out[name].append(row)
    return out


def warmup_sft(model, rows: list[dict], pad_id: int, seed: int, lr: float = 5e-4, batch: int = 32) -> float:
    from raycurate.algorithms.losses import example_losses, pad_rows

    order = np.random.default_rng(seed).permutation(len(rows))
    steps = math.ceil(len(rows) / batch)
    warm = max(1, round(0.05 * steps))
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: (s + 1) / warm if s < warm else
                                              0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm))))
    model.train()
    loss = float("nan")
    for step in range(steps):
        b = pad_rows([rows[i] for i in order[step * batch:(step + 1) * batch]], pad_id)
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        value = example_losses(logits, b["input_ids"], b["loss_mask"]).mean()
        optim.zero_grad()
        value.backward()
        optim.step()
        sched.step()
        loss = float(value.detach())
    return loss


def direction_for(model, theta_old: dict, rows: list[dict], pad_id: int, last_layers: int = 4) -> dict:
    from raycurate.algorithms.bridge import token_utility as tu
    from raycurate.algorithms.losses import pad_rows

    params = tu.scoring_parameters(model, last_layers)
    batches = [pad_rows(rows[i:i + 16], pad_id) for i in range(0, len(rows), 16)]
    g_target = tu.validation_gradient(model, batches, params)
    return tu.scoring_direction(g_target, tu.anchor_direction(params, {k: theta_old[k] for k in params}), lam=0.2)


def drop_shares(model, direction, rows: list[dict], pad_id: int, proxy: str) -> dict:
    from raycurate.algorithms.bridge.routing import default_routing_layer
    from raycurate.algorithms.bridge.rows import SelectionSettings, prompt_relevance_drops, score_and_select_rows

    settings = SelectionSettings(rho_p=0.5, rho_r=0.75, prompt_proxy=proxy)
    results = score_and_select_rows(model, direction, default_routing_layer(model), rows, settings, pad_id=pad_id,
                                    micro_batch=8)
    sums = {"relevant_total": 0, "relevant_dropped": 0, "distractor_total": 0, "distractor_dropped": 0}
    for row, res in zip(rows, results):
        label = row["label"]
        counts = prompt_relevance_drops(res["prompt_keep"], row["prompt_offsets"], label.get("relevant_spans") or [],
                                        label.get("distractor_spans") or [])
        for key, value in counts.items():
            sums[key] += value
    relevant = sums["relevant_dropped"] / max(sums["relevant_total"], 1)
    distractor = sums["distractor_dropped"] / max(sums["distractor_total"], 1)
    return {"relevant": relevant, "distractor": distractor, "ratio": distractor / relevant if relevant else math.inf,
            **sums}


def knockout_reference(model, ids: torch.Tensor, prompt_len: int, prompt_idx: np.ndarray, weights: np.ndarray,
                       direction) -> np.ndarray:
    """Exact knock-out: sum_j w_j [a_j(s = 1) - a_j(s_i = 0)] per eligible prompt token (positions kept)."""
    from raycurate.algorithms.bridge.token_utility import token_utilities
    from raycurate.models.loading import key_log_scales

    n = ids.shape[0]
    loss_mask = torch.zeros((1, n), dtype=torch.long)
    loss_mask[0, prompt_len:] = 1
    w = torch.as_tensor(weights, dtype=torch.float32)
    full = float((token_utilities(model, ids[None], torch.ones((1, n), dtype=torch.long), loss_mask, direction)[0]
                  * w).sum())
    out = []
    for start in range(0, len(prompt_idx), 16):
        chunk = prompt_idx[start:start + 16]
        log_s = torch.zeros((len(chunk), n))
        log_s[torch.arange(len(chunk)), torch.as_tensor(chunk)] = float("-inf")
        rows = ids[None].repeat(len(chunk), 1)
        with key_log_scales(model, log_s):
            a = token_utilities(model, rows, torch.ones_like(rows), loss_mask.repeat(len(chunk), 1), direction)
        out.extend((full - (a * w[None]).sum(dim=1)).tolist())
    return np.asarray(out)


def fidelity(model, direction, rows: list[dict]) -> dict:
    from raycurate.algorithms.bridge.fidelity import (
        KNOCKOUT,
        example_fidelity,
        fidelity_table,
        mean_ranking_shift,
        ranking_shift,
    )
    from raycurate.algorithms.bridge.rows import fixed_masks
    from raycurate.algorithms.bridge.selection import eligible_positions
    from raycurate.algorithms.ranking import spearman

    examples, extra, curves, top_curves = [], [], [], []
    start = time.perf_counter()
    for index, row in enumerate(rows):
        say(f"  fidelity row {index + 1}/{len(rows)}", start)
        n, p = len(row["input_ids"]), int(row["prompt_len"])
        fixed_p, fixed_r = fixed_masks(p, n, row["prompt_offsets"], row["response_offsets"])
        prompt_idx, response_idx = eligible_positions(n, p, bool(fixed_p[0]), fixed_p, fixed_r)
        if len(prompt_idx) < 3 or len(response_idx) == 0:
            continue
        ids = torch.as_tensor(row["input_ids"])
        ex = example_fidelity(model, ids, p, prompt_idx, response_idx, direction, count_fixed_response=False)
        examples.append(ex)
        weights = np.zeros(n)
        weights[response_idx] = ex.S_r
        ko_ref = knockout_reference(model, ids, p, prompt_idx, weights, direction)
        extra.append({"routing_vs_loo": spearman(ex.reference[0], ex.proxies["attention_x_a"][0]),
                      "knockout_grad_vs_loo": spearman(ex.reference[0], ex.proxies[KNOCKOUT][0]),
                      "knockout_vs_loo": spearman(ex.reference[0], ko_ref),
                      "knockout_grad_vs_knockout": spearman(ko_ref, ex.proxies[KNOCKOUT][0]),
                      "routing_vs_knockout": spearman(ko_ref, ex.proxies["attention_x_a"][0])})
        curves.append(ranking_shift(ex.beta, ex.gamma, ex.prompt_bias, subset="random",
                                    seed=np.random.SeedSequence([0, index])))
        top_curves.append(ranking_shift(ex.beta, ex.gamma, ex.prompt_bias, subset="top"))
    table = {(r["side"], r["proxy"]): r for r in fidelity_table(examples)}
    extra_mean = {k: float(np.nanmean([e[k] for e in extra])) for k in extra[0]}
    per_example = {k: [e[k] for e in extra] for k in ("routing_vs_loo", "knockout_grad_vs_loo")}
    return {"examples": len(examples), "table": table, "extra": extra_mean, "per_example": per_example,
            "shift_random": mean_ranking_shift(curves), "shift_top": mean_ranking_shift(top_curves)}


def loss_removal_scores(model, ids: torch.Tensor, prompt_len: int, prompt_idx: np.ndarray) -> np.ndarray:
    """Rise of the summed response loss when prompt token i is physically removed (no direction involved): does
    the model read the relevant facts at all?"""
    from raycurate.algorithms.bridge.fidelity import leave_one_out_rows
    from raycurate.algorithms.losses import token_losses

    def response_loss(rows: torch.Tensor, start: int) -> torch.Tensor:
        mask = torch.zeros_like(rows)
        mask[:, start:] = 1
        with torch.no_grad():
            logits = model(input_ids=rows, attention_mask=torch.ones_like(rows)).logits
        return token_losses(logits, rows, mask).sum(dim=1)  # (k,)

    full = float(response_loss(ids[None], prompt_len)[0])
    out = [response_loss(leave_one_out_rows(ids, prompt_idx[i:i + 16]), prompt_len - 1) - full
           for i in range(0, len(prompt_idx), 16)]
    return torch.cat(out).double().numpy()


def oracle_drops(model, direction, rows: list[dict]) -> dict:
    """Drop shares at rho_p 0.5 when the prompt side is ranked by the exact leave-one-out reference, the exact
    knock-out, the knock-out derivative and routing, all conditioned on the same state (is the target reachable?)."""
    from raycurate.algorithms.bridge.fidelity import KNOCKOUT, example_fidelity
    from raycurate.algorithms.bridge.rows import fixed_masks, prompt_relevance_drops
    from raycurate.algorithms.bridge.selection import eligible_positions, top_b

    keys = ("relevant_total", "relevant_dropped", "distractor_total", "distractor_dropped")
    names = ("exact_loo", "exact_knockout", KNOCKOUT, "routing", "abs_exact_loo", "abs_knockout_grad",
             "loss_removal")
    sums = {name: dict.fromkeys(keys, 0) for name in names}
    start = time.perf_counter()
    for index, row in enumerate(rows):
        say(f"  oracle row {index + 1}/{len(rows)}", start)
        n, p = len(row["input_ids"]), int(row["prompt_len"])
        fixed_p, fixed_r = fixed_masks(p, n, row["prompt_offsets"], row["response_offsets"])
        prompt_idx, response_idx = eligible_positions(n, p, bool(fixed_p[0]), fixed_p, fixed_r)
        if len(prompt_idx) < 3 or len(response_idx) == 0:
            continue
        ids = torch.as_tensor(row["input_ids"])
        ex = example_fidelity(model, ids, p, prompt_idx, response_idx, direction, rho_p=0.5, rho_r=0.75,
                              count_fixed_response=False)
        weights = np.zeros(n)
        weights[response_idx] = ex.S_r
        scores = {"exact_loo": ex.reference[0], KNOCKOUT: ex.proxies[KNOCKOUT][0],
                  "routing": ex.proxies["attention_x_a"][0],
                  "exact_knockout": knockout_reference(model, ids, p, prompt_idx, weights, direction)}
        # magnitude only (sign ignored): does the response depend on relevant facts more than on distractors?
        scores.update({"abs_exact_loo": np.abs(ex.reference[0]), "abs_knockout_grad": np.abs(scores[KNOCKOUT]),
                       "loss_removal": loss_removal_scores(model, ids, p, prompt_idx)})
        for name, s in scores.items():
            keep = np.ones(p, dtype=np.int8)
            keep[prompt_idx] = top_b(s, ex.b_p)
            counts = prompt_relevance_drops(keep, row["prompt_offsets"], row["label"].get("relevant_spans") or [],
                                            row["label"].get("distractor_spans") or [])
            for key, value in counts.items():
                sums[name][key] += value
    out = {}
    for name, c in sums.items():
        rel = c["relevant_dropped"] / max(c["relevant_total"], 1)
        dis = c["distractor_dropped"] / max(c["distractor_total"], 1)
        out[name] = {"relevant": rel, "distractor": dis, "ratio": dis / rel if rel else math.inf}
    return out


def run_seed(corpus_seed: int, args, base_dir: str) -> dict:
    from raycurate.models.loading import load_model, load_tokenizer

    start = time.perf_counter()
    tokenizer = load_tokenizer(base_dir)
    pad_id = tokenizer.pad_token_id or 0
    splits = token_splits(tokenizer, corpus_seed, args.corpus_rows, args.system_prompt)
    order = np.random.default_rng(corpus_seed).permutation(len(splits["selection"]))
    selection = [splits["selection"][i] for i in order]
    labelled = [r for r in selection if r["label"].get("distractor_spans")][:args.select_rows]
    validation = splits["validation"][:args.validation_rows]
    fidelity_rows, oracle_rows = selection[:args.fidelity_rows], labelled[:args.oracle_rows]
    say(f"corpus seed {corpus_seed} plan: warmup SFT on {len(splits['warmup'])} rows, direction on "
        f"{len(validation)} validation rows, "
        + (f"oracle drops on {len(oracle_rows)} rows" if args.oracle_only else
           f"drops on {len(labelled)} rows x 2 proxies, fidelity on {len(fidelity_rows)} rows, oracle drops on "
           f"{len(oracle_rows)} rows"))
    model = load_model(base_dir, dtype="float32", device="cpu")
    theta_old = {k: v.detach().clone() for k, v in model.named_parameters()}
    warm_loss = warmup_sft(model, splits["warmup"], pad_id, seed=corpus_seed, lr=args.lr)
    say(f"  warmup SFT done, last loss {warm_loss:.3f}", start)
    model.eval()
    direction = direction_for(model, theta_old, validation, pad_id,
                              last_layers=min(args.last_layers, model.config.num_hidden_layers))
    say("  direction done", start)
    drops = {}
    for proxy in () if args.oracle_only else ("routing", "knockout_grad"):
        drops[proxy] = drop_shares(model, direction, labelled, pad_id, proxy)
        say(f"  drops ({proxy}) done", start)
    if args.oracle_only:
        return {"seed": corpus_seed, "oracle": oracle_drops(model, direction, oracle_rows)}
    fid = fidelity(model, direction, fidelity_rows)
    oracle = oracle_drops(model, direction, oracle_rows)
    return {"seed": corpus_seed, "warmup_rows": len(splits["warmup"]), "warmup_loss": warm_loss,
            "select_rows": len(labelled), "drops": drops, "fidelity": fid, "oracle": oracle,
            "seconds": time.perf_counter() - start}


def ci_text(values: list[float]) -> str:
    """``mean [low, high] (n)``: per-example values (NaN, a constant ranking, left out) with a bootstrap 95% CI."""
    from raycurate.algorithms.stats import bootstrap_mean_ci

    kept = np.asarray([v for v in values if np.isfinite(v)], dtype=np.float64)
    if not len(kept):
        return "n/a (0)"
    e = bootstrap_mean_ci(kept)
    return f"{e.value:.3f} [{e.low:.3f}, {e.high:.3f}] ({e.n})"


def report(result: dict) -> None:
    fid, t = result["fidelity"], result["fidelity"]["table"]
    print(f"--- corpus seed {result['seed']}: warmup {result['warmup_rows']} rows (last loss "
          f"{result['warmup_loss']:.3f}), {result['seconds']:.0f} s")
    print(f"fidelity, {fid['examples']} examples: side/proxy  Spearman  Top-b  Jaccard  regret")
    for key in [("prompt", "attention"), ("prompt", "attention_x_a"), ("prompt", "knockout_grad"),
                ("response", "attention"), ("response", "attention_x_a")]:
        r = t[key]
        print(f"  {key[0]:<9}{key[1]:<15}{r['spearman']:>8.3f}{r['top_b_overlap']:>7.3f}{r['jaccard']:>8.3f}"
              f"{r['normalized_regret']:>8.3f}")
    for key, values in fid["per_example"].items():
        print(f"  prompt Spearman {key}: {ci_text(values)} over examples")
    e = fid["extra"]
    print(f"  exact knock-out vs leave-one-out {e['knockout_vs_loo']:.3f}; vs exact knock-out: knockout_grad "
          f"{e['knockout_grad_vs_knockout']:.3f}, routing {e['routing_vs_knockout']:.3f}")
    for name in ("shift_random", "shift_top"):
        curve = fid[name]
        cells = " ".join(f"{r:g}:{s:.2f}" for r, s in zip(curve["retention"], curve["prompt_shift"]))
        print(f"  prompt ranking shift ({name[6:]}): {cells}")
    for proxy, d in result["drops"].items():
        print(f"drops at rho_p 0.5, {result['select_rows']} rows, {proxy}: distractor {d['distractor']:.3f} "
              f"({d['distractor_total']} tokens), relevant {d['relevant']:.3f} ({d['relevant_total']} tokens), "
              f"ratio {d['ratio']:.2f}")
    cells = ", ".join(f"{name} {d['distractor']:.2f}/{d['relevant']:.2f} (x{d['ratio']:.2f})"
                      for name, d in result["oracle"].items())
    print(f"same-state Top-b drops (distractor/relevant) on the first oracle rows: {cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus-seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--corpus-rows", type=int, default=3000)
    parser.add_argument("--select-rows", type=int, default=150)
    parser.add_argument("--fidelity-rows", type=int, default=20)
    parser.add_argument("--validation-rows", type=int, default=200)
    parser.add_argument("--oracle-rows", type=int, default=12, help="labelled rows ranked by the exact references")
    parser.add_argument("--oracle-only", action="store_true", help="only the same-state oracle drop shares")
    parser.add_argument("--cache-dir", default=".cache/raycurate")
    parser.add_argument("--model", default="embedded",
                        help="'embedded' (the demo's committed base model), 'tiny' (the old cached tiny-llama), a "
                             "model name raycurate resolves (smollm2-135m, once fetched) or a checkpoint folder")
    parser.add_argument("--system-prompt", default="default",
                        help="tokenize.system_prompt of the rows: default (the template's), none, or the text")
    parser.add_argument("--lr", type=float, default=2e-3, help="warmup SFT lr (the demo's train.lr)")
    parser.add_argument("--last-layers", type=int, default=4, help="scoring layers L (capped at the model's depth)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    from raycurate.models.loading import resolve_model_path

    base_dir = base_model_dir(args.cache_dir) if args.model == "tiny" else resolve_model_path(args.model)
    results = []
    for seed in args.corpus_seeds:
        results.append(run_seed(seed, args, base_dir))
        if args.oracle_only:
            print(f"seed {seed} oracle drops: {results[-1]['oracle']}")
            continue
        report(results[-1])
    if args.oracle_only:
        return

    def mean_sd(values: list[float]) -> str:
        return f"{np.mean(values):.3f}+-{np.std(values, ddof=1) if len(values) > 1 else 0.0:.3f}"

    spear = {proxy: [r["fidelity"]["table"][("prompt", proxy)]["spearman"] for r in results]
             for proxy in ("attention_x_a", "knockout_grad")}
    ratio = {proxy: [r["drops"][proxy]["ratio"] for r in results] for proxy in ("routing", "knockout_grad")}
    for key in ("routing_vs_loo", "knockout_grad_vs_loo"):
        print(f"prompt Spearman {key}, examples of all seeds: "
              + ci_text([v for r in results for v in r["fidelity"]["per_example"][key]]))
    print(f"seeds {args.corpus_seeds} (mean+-sd over seeds)")
    print(f"routing_spearman={mean_sd(spear['attention_x_a'])} knockout_spearman={mean_sd(spear['knockout_grad'])} "
          f"routing_drop_ratio={mean_sd(ratio['routing'])} knockout_drop_ratio={mean_sd(ratio['knockout_grad'])}")


if __name__ == "__main__":
    main()
