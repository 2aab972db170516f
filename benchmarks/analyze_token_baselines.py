"""Why the loss-difference token baselines (RHO-1, Token Cleaning) starve digits and answers (issue #26).

Reads a run directory that ran the BRIDGE stages (``bridge_select``, ``bridge_warmup``, ``base_model``), recomputes
the per-token losses of the base model (theta_old) and of the reference (the warmup checkpoint, which the baselines
use) on the first ``--rows`` selection rows of ``--domain``, and prints per response token type
(:func:`analyze_bridge_selection.token_types`): mean base loss, mean reference loss, mean excess loss
``l_base - l_ref`` (RHO-1's score; Token Cleaning's too, see ``token_baselines``), the share of tokens whose excess
loss is <= 0, and the supervision rate at ``rho_r`` of the per-example Top-b (RHO-1) and of the corpus-wide Top-B
(Token Cleaning, ``token_baselines.global_response_budgets``). It also checks that no selection row id is in the
warmup split (the reference never saw the rows it scores).

Usage::

    python benchmarks/analyze_token_baselines.py runs/demo [--rows 400] [--domain math] [--rho-r 0.75]

Single-threaded; under a minute for 400 rows on the embedded model.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from analyze_bridge_selection import TYPES, fmt, print_table, read_parts, stage_dir, token_types  # noqa: E402


def stored_mask_tables(run: Path, methods: list[str]) -> None:
    """Supervised share of eligible response tokens in the stored masks of each method, by type, domain, corruption."""
    by_type: dict[str, dict[str, list[int]]] = {}
    by_group: dict[str, dict[str, list[int]]] = {}
    for method in methods:
        rows = read_parts(stage_dir(run, f"baseline_{method}_masks") / "masks")
        t_acc: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        g_acc: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for r in rows:
            p = int(r["prompt_len"])
            offsets = np.asarray(r["response_offsets"], dtype=np.int64).reshape(-1, 2)
            loss = np.asarray(r[f"{method}_loss_mask"], dtype=bool)[p:]
            types = token_types(r["response"], offsets)
            elig = [j for j, t in enumerate(types) if t != "fixed" and j < len(types) - 1]
            for j in elig:
                if r["domain"] == "math":
                    t_acc[types[j]][0] += 1
                    t_acc[types[j]][1] += int(loss[j])
            for key in (f"domain {r['domain']}", f"corruption {_label(r).get('corruption', '?')}"):
                g_acc[key][0] += len(elig)
                g_acc[key][1] += int(sum(loss[j] for j in elig))
        by_type[method], by_group[method] = t_acc, g_acc

    def share(acc: dict[str, list[int]], key: str) -> str:
        n, k = acc.get(key, [0, 0])
        return fmt(k / n) if n else "-"

    print_table(f"Stored masks: supervised share of eligible response tokens by type, math rows ({run})",
                ["type", *methods], [[t, *(share(by_type[m], t) for m in methods)] for t in TYPES if t != "fixed"
                                     and any(by_type[m].get(t) for m in methods)])
    groups = sorted({g for m in methods for g in by_group[m]})
    print_table("Stored masks: supervised share by domain and corruption kind", ["rows", *methods],
                [[g, *(share(by_group[m], g) for m in methods)] for g in groups])


def _label(row: dict) -> dict:
    """The row's ground-truth label as a dict (parquet map columns read back as a list of pairs)."""
    label = row.get("label") or {}
    return dict(label) if isinstance(label, list) else label


def train_reference(model_dir: Path, rows: list[dict], steps: int, pad_id: int, batch: int = 32,
                    lr: float = 2e-3) -> object:
    """A reference model trained here: ``steps`` AdamW steps of SFT on ``rows`` (cycled, fixed order), eval mode."""
    import torch

    from raycurate.algorithms.losses import mean_supervised_loss, model_token_losses, pad_rows
    from raycurate.models.loading import load_model

    torch.manual_seed(0)
    model = load_model(str(model_dir), dtype="float32", device="cpu").train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for step in range(steps):
        chunk = [rows[(step * batch + k) % len(rows)] for k in range(batch)]
        b = pad_rows(chunk, pad_id)
        loss = mean_supervised_loss(model_token_losses(model, b["input_ids"], b["attention_mask"], b["loss_mask"]),
                                    b["loss_mask"]).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--domain", default="math")
    parser.add_argument("--rho-r", type=float, default=0.75)
    parser.add_argument("--reference-stage", default="bridge_warmup")
    parser.add_argument("--train-reference", type=int, default=0, metavar="STEPS",
                        help="instead of the stored reference, train one here: STEPS AdamW steps (batch 32, lr 2e-3) "
                        "from the base model on the warmup split (a diagnostic of what the reference needs)")
    parser.add_argument("--clean-reference", action="store_true",
                        help="with --train-reference: train on the warmup split's uncorrupted rows only (oracle "
                        "labels; RHO-1 and Token Cleaning assume a reference trained on clean data)")
    parser.add_argument("--masks", nargs="*", default=[], metavar="METHOD",
                        help="also tabulate the masks the run's baseline_<METHOD>_masks stages wrote (all rows): "
                        "supervision per token type (math rows) and per domain and corruption kind")
    args = parser.parse_args(argv)
    if args.masks:
        stored_mask_tables(args.run_dir, args.masks)

    import torch

    torch.set_num_threads(1)
    from raycurate.algorithms.bridge import token_baselines as tb
    from raycurate.algorithms.bridge.rows import fixed_masks
    from raycurate.models.loading import load_model, load_tokenizer
    from raycurate.stages.bridge_compact import row_token_losses

    run = args.run_dir
    sel = read_parts(stage_dir(run, "bridge_select") / "selection")
    warm_ids = {r["id"] for r in read_parts(stage_dir(run, "bridge_warmup_rows") / "tokens", ["id"])} if (
        run / "bridge_warmup_rows" / "tokens").exists() else set()
    overlap = sum(r["id"] in warm_ids for r in sel)
    rows = [r for r in sel if r["domain"] == args.domain][: args.rows]
    base = load_model(str(run / "base_model" / "model"), dtype="float32", device="cpu").eval()
    pad = load_tokenizer(str(run / "base_model" / "model")).pad_token_id or 0
    if args.train_reference:
        warm = read_parts(run / "bridge_warmup_rows" / "tokens")
        if args.clean_reference:
            warm = [r for r in warm if _label(r).get("clean", False)]
        ref = train_reference(run / "base_model" / "model", warm, args.train_reference, pad)
        print(f"(reference: {args.train_reference} steps on {len(warm)} warmup rows"
              f"{', clean only' if args.clean_reference else ''})")
    else:
        ref = load_model(str(run / args.reference_stage / "model"), dtype="float32", device="cpu").eval()

    per_row = []  # (types, l_base, l_ref, eligible (r,) bool) per row
    for i in range(0, len(rows), 16):
        chunk = rows[i:i + 16]
        losses = row_token_losses({"base": base, "ref": ref}, chunk, pad)
        for k, r in enumerate(chunk):
            n, p = len(r["input_ids"]), int(r["prompt_len"])
            offsets = np.asarray(r["response_offsets"], dtype=np.int64).reshape(-1, 2)
            fixed_p, fixed_r = fixed_masks(p, n, r["prompt_offsets"], r["response_offsets"])
            per_row.append((token_types(r["response"], offsets), losses["base"][k, p:n].numpy().astype(np.float64),
                            losses["ref"][k, p:n].numpy().astype(np.float64), ~np.asarray(fixed_r, dtype=bool)))

    # RHO-1 per example and Token Cleaning corpus-wide at the same total (rho_p = 1: b_r = round(rho_r r)).
    scores = [(lb - lr)[elig] for _, lb, lr, elig in per_row]
    b_rows = np.array([tb.budgets(0, s.size, 1.0, args.rho_r)[1] for s in scores])
    b_glob = tb.global_response_budgets(scores, int(b_rows.sum()))
    acc: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for (types, lb, lr, elig), s, b1, b2 in zip(per_row, scores, b_rows, b_glob):
        m1 = np.zeros(elig.size, bool)
        m2 = np.zeros(elig.size, bool)
        m1[np.flatnonzero(elig)] = tb.top_b(s, int(b1))
        m2[np.flatnonzero(elig)] = tb.top_b(s, int(b2))
        for j, t in enumerate(types):
            if not elig[j]:
                continue
            d = acc[t]
            d["n"] += 1
            d["base"] += lb[j]
            d["ref"] += lr[j]
            d["excess"] += lb[j] - lr[j]
            d["nonpos"] += (lb[j] - lr[j]) <= 0
            d["rho1"] += m1[j]
            d["tc"] += m2[j]
    table = []
    for t in TYPES:
        d = acc.get(t)
        if not d:
            continue
        n = d["n"]
        table.append([t, int(n), fmt(d["base"] / n), fmt(d["ref"] / n), fmt(d["excess"] / n, 4),
                      fmt(d["nonpos"] / n), fmt(d["rho1"] / n), fmt(d["tc"] / n)])
    print(f"# Loss-difference baselines: {run}, {len(rows)} {args.domain} selection rows, rho_r={args.rho_r}; "
          f"selection rows also in the warmup split: {overlap}")
    print_table("Eligible response tokens by type",
                ["type", "tokens", "l_base", "l_ref", "mean l_base - l_ref", "share <= 0",
                 "RHO-1 (per example) supervised", "Token Cleaning (global) supervised"], table)
    sizes = np.array([s.size for s in scores])
    print(f"\nToken Cleaning global: rows with b_i = 0: {int((b_glob == 0).sum())} of {len(rows)}; "
          f"share of eligible tokens per row min {np.min(b_glob / np.maximum(sizes, 1)):.3f} "
          f"median {np.median(b_glob / np.maximum(sizes, 1)):.3f} max {np.max(b_glob / np.maximum(sizes, 1)):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
