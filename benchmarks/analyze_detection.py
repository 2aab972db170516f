#!/usr/bin/env python
"""Detection table of a finished run (embedded corpus, with labels): how well each signal the run computed
separates clean rows from each corruption kind (row-level AUROC with bootstrap 95% intervals), and what share of the
corrupted response tokens each token selector takes the loss off, against its share of the other tokens.

Signals read when their stages are in the run: the trusted reference's row signals and the base model's row loss
(``curate_reference_scores``), dedup (``curate_dedup`` / ``bilevel_dedup``), BDS sigma(omega) (``curate_bds`` /
``bilevel_bds``), P2D's s_final (``p2d_select``), BRIDGE's token utilities per row (``bridge_score``: the minimum,
and the sum of the negative ones), IFD (``p2d_ifd``), LESS and DSIR (``bilevel_{less,dsir}_select``).
Token selectors: ``curate_masked`` (mask step), ``bridge_select`` (BRIDGE), ``baseline_random_masks``.
Token scores ranked within each corrupted row (where its corrupted tokens rank among its response tokens: 0 the
most suspect, 0.5 blind): BRIDGE's utility (``bridge_score``), the trusted reference's loss and its excess over the
base (``curate_reference_scores``).

Usage::

    .venv/bin/python benchmarks/analyze_detection.py runs/det_s0 [runs/det_s1 ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raycurate.algorithms.detection import corrupted_token_ranks, corrupted_tokens, dropped_counts  # noqa: E402
from raycurate.algorithms.ranking import label_separation  # noqa: E402

POOL_TABLES = ("curate_pool_rows", "bilevel_candidate_rows", "bridge_selection_rows", "tokenize")


def read_table(folder: Path, columns: list[str] | None = None) -> list[dict]:
    files = sorted(folder.glob("*.parquet")) if folder.is_dir() else [folder]
    return [r for f in files for r in pq.read_table(f, columns=columns).to_pylist()]


def pool_rows(run: Path, columns: list[str]) -> dict[str, dict]:
    """id -> row (``columns``) of the run's pool: the first pool table present."""
    for name in POOL_TABLES:
        folder = run / name / "tokens"
        if folder.is_dir():
            return {r["id"]: r for r in read_table(folder, ["id", *columns])}
    raise SystemExit(f"{run}: no pool token table ({', '.join(POOL_TABLES)})")


def pool_labels(run: Path) -> dict[str, dict]:
    """id -> label of the run's pool."""
    return {row_id: r["label"] for row_id, r in pool_rows(run, ["label"]).items()}


def row_signals(run: Path) -> dict[str, dict[str, float]]:
    """signal name -> {id: score}, higher = cleaner."""
    out: dict[str, dict[str, float]] = {}
    ref = run / "curate_reference_scores" / "reference_scores.parquet"
    if ref.exists():
        table = pq.read_table(ref)
        ids = table["id"].to_pylist()
        for name in [c.removeprefix("signal_") for c in table.column_names if c.startswith("signal_")]:
            values = -np.nan_to_num(table[f"signal_{name}"].to_numpy(), nan=np.inf)
            out[f"reference {name}"] = dict(zip(ids, values.tolist()))
        base = [-(float(np.mean(x)) if len(x) else np.inf) for x in table["base_losses"].to_pylist()]
        out["base row loss"] = dict(zip(ids, base))
    for stage in ("curate_dedup", "bilevel_dedup"):
        path = run / stage / "duplicates.parquet"
        if path.exists():
            out["dedup"] = {r["id"]: 0.0 if r["duplicate"] else 1.0 for r in read_table(path, ["id", "duplicate"])}
    for stage in ("curate_bds", "bilevel_bds"):
        path = run / stage / "weights.parquet"
        if path.exists():
            rows = read_table(path, ["id", "step", "sigma"])
            last = max(r["step"] for r in rows)
            out["BDS sigma"] = {r["id"]: r["sigma"] for r in rows if r["step"] == last}
            break
    path = run / "p2d_select" / "selection.parquet"
    if path.exists():
        out["P2D s_final"] = {r["id"]: r["s_final"] for r in read_table(path, ["id", "s_final"])}
    scores = run / "bridge_score" / "scores"
    if scores.is_dir():
        minimum, negative = {}, {}
        for r in read_table(scores, ["id", "score_utility", "score_utility_scale"]):
            u = np.asarray(r["score_utility"], dtype=np.float64) * (r["score_utility_scale"] or 1.0)
            minimum[r["id"]] = float(u.min()) if u.size else 0.0
            negative[r["id"]] = float(u[u < 0].sum())
        out["BRIDGE min utility"], out["BRIDGE sum of negative utilities"] = minimum, negative
    path = run / "p2d_ifd" / "ifd.parquet"
    if path.exists():
        out["IFD"] = {r["id"]: r["ifd"] for r in read_table(path, ["id", "ifd"])}
    for method, column in (("less", "score"), ("dsir", "log_weight")):
        path = run / f"bilevel_{method}_select" / "selection.parquet"
        if path.exists():
            out[method.upper()] = {r["id"]: r[column] for r in read_table(path, ["id", column])}
    return out


def separation(scores: dict[str, float], labels: dict[str, dict], seed: int = 0) -> dict:
    ids = [i for i in scores if i in labels]
    clean = np.array([bool(labels[i]["clean"]) for i in ids])
    kinds = np.array([labels[i]["corruption"] if not labels[i]["clean"] else "none" for i in ids])
    return label_separation(np.array([scores[i] for i in ids], dtype=np.float64), clean, kinds, seed)


def token_selectors(run: Path) -> dict[str, dict[str, list]]:
    """selector -> {id: (loss_mask, prompt_len, response_offsets, response)} of the pool rows it masked."""
    out = {}
    sources = {"mask step (trusted reference)": ("curate_masked/tokens", "loss_mask"),
               "BRIDGE": ("bridge_select/selection", "sel_loss_mask"),
               "random tokens": ("baseline_random_masks/masks", "random_loss_mask")}
    for name, (rel, column) in sources.items():
        folder = run / rel
        if not folder.is_dir():
            continue
        rows = read_table(folder, ["id", column, "prompt_len", "response_offsets", "response"])
        out[name] = {r["id"]: (r[column], r["prompt_len"], r["response_offsets"], r["response"]) for r in rows}
    return out


def token_table(selectors: dict, labels: dict[str, dict]) -> dict[str, dict[str, dict]]:
    """selector -> kind -> dropped shares of corrupted and other tokens."""
    out: dict[str, dict[str, dict]] = {}
    for name, rows in selectors.items():
        totals: dict[str, dict[str, int]] = {}
        for row_id, (mask, prompt_len, offsets, _) in rows.items():
            label = labels.get(row_id)
            if label is None:
                continue
            kind = label["corruption"] if not label["clean"] else "none"
            counts = dropped_counts(mask, prompt_len, offsets, label.get("corrupted_spans") or [])
            for k in (kind, "all"):
                acc = totals.setdefault(k, dict.fromkeys(counts, 0))
                for key, value in counts.items():
                    acc[key] += value
        out[name] = {k: {"corrupted_tokens": t["corrupted"],
                         "corrupted_dropped": t["corrupted_dropped"] / t["corrupted"] if t["corrupted"] else None,
                         "other_dropped": t["other_dropped"] / t["other"] if t["other"] else None}
                     for k, t in sorted(totals.items())}
    return out


def final_line_table(selectors: dict, labels: dict[str, dict]) -> dict[str, dict[str, dict]]:
    """selector -> kind -> corrupted tokens in the final-answer line (from ``####`` on) and elsewhere, and the
    share of each whose loss it drops (BRIDGE's closure keeps the ``####`` unit in every row)."""
    out: dict[str, dict[str, dict]] = {}
    for name, rows in selectors.items():
        totals: dict[str, np.ndarray] = {}
        for row_id, (mask, prompt_len, offsets, response) in rows.items():
            label = labels.get(row_id)
            if label is None or label["clean"] or "####" not in (response or ""):
                continue
            bad = corrupted_tokens(offsets, label.get("corrupted_spans") or [])
            kept = np.asarray(mask, dtype=bool)[prompt_len:]
            final = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)[:, 0] >= response.index("####")
            acc = totals.setdefault(label["corruption"], np.zeros(4))
            acc += [(bad & final).sum(), (bad & final & ~kept).sum(),
                    (bad & ~final).sum(), (bad & ~final & ~kept).sum()]
        out[name] = {kind: {"final_line": int(t[0]), "final_line_dropped": t[1] / t[0] if t[0] else None,
                            "elsewhere": int(t[2]), "elsewhere_dropped": t[3] / t[2] if t[2] else None}
                     for kind, t in sorted(totals.items()) if t[0] + t[2]}
    return out


def token_scores(run: Path) -> dict[str, dict[str, tuple]]:
    """score -> {id: (suspicion per response-side position (NaN where unscored), response offsets)}."""
    out: dict[str, dict[str, tuple]] = {}
    scores = run / "bridge_score" / "scores"
    if scores.is_dir():
        rows = read_table(scores, ["id", "score_utility", "score_utility_scale", "response_offsets"])
        out["BRIDGE utility (negated)"] = {
            r["id"]: (-np.asarray(r["score_utility"], dtype=np.float64) * (r["score_utility_scale"] or 1.0),
                      r["response_offsets"]) for r in rows}
    ref = run / "curate_reference_scores" / "reference_scores.parquet"
    if ref.exists():
        tokens = pool_rows(run, ["prompt_len", "loss_mask", "response_offsets"])
        reference, excess = {}, {}
        for r in pq.read_table(ref, columns=["id", "reference_losses", "base_losses"]).to_pylist():
            row = tokens.get(r["id"])
            if row is None:
                continue
            supervised = np.asarray(row["loss_mask"], dtype=bool)[row["prompt_len"]:]  # (R,)
            if supervised.sum() != len(r["reference_losses"]):
                continue  # supervised positions outside the response: no per-token alignment
            full = np.full(supervised.size, np.nan)
            full[supervised] = r["reference_losses"]
            reference[r["id"]] = (full.copy(), row["response_offsets"])
            full[supervised] -= np.asarray(r["base_losses"], dtype=np.float64)
            excess[r["id"]] = (full, row["response_offsets"])
        out["reference loss"], out["reference excess over base"] = reference, excess
    return out


def token_rank_table(scores: dict[str, dict[str, tuple]], labels: dict[str, dict]) -> dict[str, dict[str, dict]]:
    """score -> kind -> mean rank of the corrupted tokens (per row, then over rows) and the share of rows whose
    most suspect corrupted token is in the row's top 10%."""
    out: dict[str, dict[str, dict]] = {}
    for name, rows in scores.items():
        ranks: dict[str, list[np.ndarray]] = {}
        for row_id, (suspicion, offsets) in rows.items():
            label = labels.get(row_id)
            if label is None or label["clean"]:
                continue
            bad = corrupted_tokens(offsets, label.get("corrupted_spans") or [])
            if bad.size != len(suspicion):
                continue
            r = corrupted_token_ranks(suspicion, np.isfinite(suspicion), bad)
            if r is not None:
                ranks.setdefault(label["corruption"], []).append(r)
        out[name] = {kind: {"rows": len(v), "mean_rank": float(np.mean([x.mean() for x in v])),
                            "top10": float(np.mean([x.min() <= 0.1 for x in v]))}
                     for kind, v in sorted(ranks.items())}
    return out


def fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def print_run(run: Path) -> dict:
    labels = pool_labels(run)
    signals = {name: separation(scores, labels) for name, scores in row_signals(run).items()}
    kinds = sorted({k for s in signals.values() for k in s["auroc_by_kind"]})
    print(f"\n### {run} — row-level AUROC, clean vs each kind ({len(labels)} pool rows)\n")
    print("| signal | all | " + " | ".join(kinds) + " |")
    print("|---|---|" + "---|" * len(kinds))
    for name, sep in signals.items():
        cells = [f"{sep['auroc']:.3f} [{sep['auroc_ci95'][0]:.2f}, {sep['auroc_ci95'][1]:.2f}]"]
        cells += [fmt(sep["auroc_by_kind"].get(k, {}).get("auroc")) for k in kinds]
        print(f"| {name} | " + " | ".join(cells) + " |")
    selectors = token_selectors(run)
    tokens = token_table(selectors, labels)
    if tokens:
        token_kinds = sorted({k for t in tokens.values() for k in t if k not in ("all", "none")})
        print("\nShare of corrupted response tokens whose loss is dropped / share of the other response tokens:\n")
        print("| selector | all | " + " | ".join(token_kinds) + " | clean rows |")
        print("|---|---|" + "---|" * len(token_kinds) + "---|")
        for name, by_kind in tokens.items():
            cells = [f"{fmt(v['corrupted_dropped'])} / {fmt(v['other_dropped'])}" if (v := by_kind.get(k)) else "–"
                     for k in ["all", *token_kinds]]
            clean = by_kind.get("none")
            cells.append(f"– / {fmt(clean['other_dropped'])}" if clean else "–")
            print(f"| {name} | " + " | ".join(cells) + " |")
    lines = final_line_table(selectors, labels)
    if lines:
        print("\nCorrupted tokens in the final-answer line (`####` on) and elsewhere: count, share dropped:\n")
        print("| selector | kind | in the `####` line | dropped | elsewhere | dropped |")
        print("|---|---|---|---|---|---|")
        for name, by_kind in lines.items():
            for kind, v in by_kind.items():
                print(f"| {name} | {kind} | {v['final_line']} | {fmt(v['final_line_dropped'])} | {v['elsewhere']} | "
                      f"{fmt(v['elsewhere_dropped'])} |")
    ranks = token_rank_table(token_scores(run), labels)
    if ranks:
        rank_kinds = sorted({k for t in ranks.values() for k in t})
        print("\nWhere corrupted tokens rank in their row (0 = most suspect, 0.5 = blind) / share of rows with one in "
              "the row's top 10%:\n")
        print("| token score | " + " | ".join(rank_kinds) + " |")
        print("|---|" + "---|" * len(rank_kinds))
        for name, by_kind in ranks.items():
            cells = [f"{v['mean_rank']:.2f} / {v['top10']:.2f}" if (v := by_kind.get(k)) else "–" for k in rank_kinds]
            print(f"| {name} | " + " | ".join(cells) + " |")
    return {"rows": signals, "tokens": tokens, "final_line": lines, "token_ranks": ranks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories")
    parser.add_argument("--json", type=Path, help="also write the tables as JSON here")
    args = parser.parse_args()
    result = {str(run): print_run(run) for run in args.runs}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=float))


if __name__ == "__main__":
    main()
