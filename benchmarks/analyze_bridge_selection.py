"""Why BRIDGE's masks train worse than random masks: per-token-type and per-corruption tables from a run directory.

Reads a run directory that ran the BRIDGE stages (``raycurate demo demo.methods=[bridge]`` or the proving ground's
``seed-<n>/``): ``bridge_score`` (stored utilities), ``bridge_select`` (masks) and, when present, the held-out
predictions of ``eval_*``.  Random masks are recomputed here exactly as ``baseline_random_masks`` draws them
(``token_baselines.random_masks`` seeded per (bridge.seed, id)), at the selection's own ratios.

Tables (issue #26):

1. per response token type (fixed EOS / end-of-turn, ``####``, final answer, digits, operators, newline,
   capitalised names, other words, punctuation): tokens, supervision rate under BRIDGE and random, mean utility
   a_j and its share of the total |a| mass (is the validation direction dominated by a few types?);
2. the first response token's supervision rate by domain (a math row whose first token is left out teaches
   nothing about how a math answer starts); per corruption kind: rows, kept share of eligible response tokens
   under BRIDGE and random, mean row utility, share of rows with a negative utility sum;
3. prompt side: kept share of relevant-sentence / distractor-sentence / other prompt tokens, digits and names;
4. held-out failures per ``eval_*`` stage: right, wrong ``####`` answer, no ``####``, empty, and the share of
   equation operands that are neither in the question nor an earlier result (made-up numbers);
5. closure at other budgets: supervision rate of ``####`` / answer / digits and final-answer coverage when the
   stored scores are re-selected at ``--rhos`` with and without closure (first ``--rows`` math rows).

Usage::

    python benchmarks/analyze_bridge_selection.py runs/demo [--select-stage bridge_select] [--rhos 0.25 0.5]

Single-threaded; a few seconds per run directory (the re-selection of table 5 dominates).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

TYPES = ("fixed", "####", "answer", "digit", "operator", "newline", "name", "word", "punct")
OPERATORS = set("+-*/=×÷")
# Capitalised words that are not entities (sentence starts, pronouns) in the corpus's responses.
NOT_NAMES = {"He", "She", "They", "It", "The", "There", "Then", "Each", "How", "So", "A", "An", "If", "In", "To",
             "This", "That", "First", "Next", "Finally", "Write", "Use", "Return", "Add", "Check", "Keep"}


def token_types(response: str, offsets: np.ndarray) -> list[str]:
    """Type of every response-side token from its character span.

    Args:
        response: Response text.
        offsets: (r, 2) char spans of the response-side tokens, -1 for template / special tokens.

    Returns:
        One of :data:`TYPES` per token.
    """
    marker = response.rfind("####")
    answer_lo = marker + 4 if marker >= 0 else len(response) + 1
    newline = response.find("\n", answer_lo) if marker >= 0 else -1
    answer_hi = newline if newline >= 0 else len(response)
    out = []
    for lo, hi in offsets:
        if lo < 0:
            out.append("fixed")
            continue
        text = response[lo:hi]
        core = text.strip()
        if marker >= 0 and lo < marker + 4 and hi > marker:
            out.append("####")
        elif marker >= 0 and lo >= answer_lo and lo < answer_hi and core:
            out.append("answer")
        elif not core:
            out.append("newline" if "\n" in text else "punct")
        elif any(ch.isdigit() for ch in core):
            out.append("digit")
        elif core in OPERATORS or set(core) <= OPERATORS:
            out.append("operator")
        elif core[0].isalpha() and core[0].isupper() and core not in NOT_NAMES:
            out.append("name")
        elif any(ch.isalpha() for ch in core):
            out.append("word")
        else:
            out.append("punct")
    return out


def read_parts(folder: Path, columns: list[str] | None = None) -> list[dict]:
    import pyarrow.parquet as pq

    rows: list[dict] = []
    for part in sorted(folder.glob("*.parquet")):
        table = pq.read_table(part)
        rows.extend(table.select([c for c in columns if c in table.schema.names]).to_pylist() if columns
                    else table.to_pylist())
    return rows


def stage_dir(run: Path, stage: str) -> Path:
    record = json.loads((run / "manifest.json").read_text())["stages"].get(stage)
    if record is None:
        raise SystemExit(f"{run} has no stage {stage!r}; run the BRIDGE stages first")
    return run / stage


def random_response_masks(rows: list[dict], rho_p: float, rho_r: float, seed: int) -> list[np.ndarray]:
    """(n,) loss masks of the random baseline, drawn as ``baseline_random_masks`` draws them."""
    from raycurate.algorithms.bridge.rows import fixed_masks
    from raycurate.algorithms.bridge.token_baselines import example_rng, random_masks

    out = []
    for r in rows:
        n, p = len(r["input_ids"]), int(r["prompt_len"])
        fixed_p, fixed_r = fixed_masks(p, n, r["prompt_offsets"], r["response_offsets"])
        masks = random_masks(n, p, rho_p, rho_r, example_rng(seed, r["id"]), has_bos=bool(fixed_p[0]),
                             fixed_prompt_mask=fixed_p, fixed_response_mask=fixed_r)
        out.append(np.stack([np.concatenate([masks.prompt_keep, np.zeros(n - p, bool)]), masks.loss_mask]))
    return out


def fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and not np.isfinite(x)) else f"{x:.{digits}f}"


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


def type_table(rows: list[dict], utilities: dict[str, np.ndarray], random_masks: list[np.ndarray],
               domains: set[str], prefix: str = "sel") -> list[list]:
    """Table 1 rows: per token type counts, supervision rates, utility."""
    count = defaultdict(int)
    bridge = defaultdict(int)
    rand = defaultdict(int)
    util_sum = defaultdict(float)
    util_abs = defaultdict(float)
    for r, rm in zip(rows, random_masks):
        if r["domain"] not in domains:
            continue
        p = int(r["prompt_len"])
        offsets = np.asarray(r["response_offsets"], dtype=np.int64).reshape(-1, 2)
        types = token_types(r["response"], offsets)
        loss = np.asarray(r[f"{prefix}_loss_mask"], dtype=bool)[p:]
        rloss = rm[1][p:]
        a = utilities.get(r["id"])
        for j, t in enumerate(types):
            count[t] += 1
            bridge[t] += int(loss[j])
            rand[t] += int(rloss[j])
            if a is not None and t != "fixed":
                util_sum[t] += float(a[j])
                util_abs[t] += abs(float(a[j]))
    total_abs = sum(util_abs.values()) or 1.0
    out = []
    for t in TYPES:
        if count[t] == 0:
            continue
        out.append([t, count[t], fmt(bridge[t] / count[t]), fmt(rand[t] / count[t]),
                    fmt(util_sum[t] / count[t], 4) if t != "fixed" else "-",
                    fmt(util_abs[t] / total_abs) if t != "fixed" else "-"])
    return out


def corruption_table(rows: list[dict], utilities: dict[str, np.ndarray], random_masks: list[np.ndarray],
                     prefix: str = "sel") -> list[list]:
    """Table 2 rows: per corruption kind, kept share of eligible response tokens and row utility."""
    acc: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r, rm in zip(rows, random_masks):
        kind = (r.get("label") or {}).get("corruption", "?")
        p = int(r["prompt_len"])
        offsets = np.asarray(r["response_offsets"], dtype=np.int64).reshape(-1, 2)
        eligible = offsets[:, 0] >= 0
        eligible[-1] = False  # EOS is fixed whatever its offset
        loss = np.asarray(r[f"{prefix}_loss_mask"], dtype=bool)[p:]
        a = utilities.get(r["id"])
        d = acc[kind]
        d["rows"] += 1
        d["eligible"] += eligible.sum()
        d["bridge"] += (loss & eligible).sum()
        d["random"] += (rm[1][p:] & eligible).sum()
        if a is not None:
            s = float(np.sum(a[eligible]))
            d["util"] += s / max(eligible.sum(), 1)
            d["negative"] += s < 0
    out = []
    for kind in sorted(acc, key=lambda k: (k != "none", k)):
        d = acc[kind]
        out.append([kind, int(d["rows"]), fmt(d["bridge"] / max(d["eligible"], 1)),
                    fmt(d["random"] / max(d["eligible"], 1)), fmt(d["util"] / d["rows"], 4),
                    fmt(d["negative"] / d["rows"])])
    return out


def first_token_table(rows: list[dict], random_masks: list[np.ndarray], prefix: str = "sel") -> list[list]:
    """Supervision rate of each row's first eligible response token (it decides which kind of answer the model
    starts: a math sentence, ``def``, a list item), by domain."""
    acc: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for r, rm in zip(rows, random_masks):
        p = int(r["prompt_len"])
        starts = np.asarray(r["response_offsets"], dtype=np.int64).reshape(-1, 2)[:, 0]
        eligible = np.flatnonzero(starts >= 0)
        if not eligible.size:
            continue
        j = p + int(eligible[0])
        a = acc[r["domain"]]
        a[0] += 1
        a[1] += int(r[f"{prefix}_loss_mask"][j])
        a[2] += int(rm[1][j])
    return [[d, a[0], fmt(a[1] / a[0]), fmt(a[2] / a[0])] for d, a in sorted(acc.items())]


def prompt_table(rows: list[dict], random_masks: list[np.ndarray], prefix: str = "sel") -> list[list]:
    """Table 3 rows: kept share of prompt tokens by sentence role (math rows) and by token kind."""
    count = defaultdict(int)
    bridge = defaultdict(int)
    rand = defaultdict(int)
    for r, rm in zip(rows, random_masks):
        if r["domain"] != "math":
            continue
        p = int(r["prompt_len"])
        offsets = np.asarray(r["prompt_offsets"], dtype=np.int64).reshape(-1, 2)
        keep = np.asarray(r[f"{prefix}_prompt_keep"], dtype=bool)
        label = r.get("label") or {}
        rel = label.get("relevant_spans") or []
        dis = label.get("distractor_spans") or []
        question = max(rel, key=lambda s: s[0]) if rel else None  # the question is the last relevant sentence
        for i in range(p):
            lo, hi = offsets[i]
            if lo < 0:
                continue
            text = r["prompt"][lo:hi].strip()
            role = ("question" if question and question[0] <= lo < question[1] else
                    "relevant" if any(a <= lo < b for a, b in rel) else
                    "distractor" if any(a <= lo < b for a, b in dis) else "other")
            kind = ("digit" if any(ch.isdigit() for ch in text) else
                    "name" if text[:1].isupper() and text not in NOT_NAMES else "other")
            for key in (f"role={role}", f"kind={kind}", f"{role}/{kind}"):
                count[key] += 1
                bridge[key] += int(keep[i])
                rand[key] += int(rm[0][i])
    return [[k, count[k], fmt(bridge[k] / count[k]), fmt(rand[k] / count[k])] for k in sorted(count)]


EQUATION = re.compile(r"(\d+)\s*[-+*/x×]\s*(\d+)\s*=\s*(\d+)")


def ungrounded_operands(prompt: str, generated: str) -> tuple[int, int]:
    """(operands, operands that are neither a number of the prompt nor an earlier equation's result) of the
    ``a op b = c`` equations in a generation: numbers the model made up instead of reading them."""
    known = set(re.findall(r"\d+", prompt))
    total = bad = 0
    for a, b, c in EQUATION.findall(generated.split("####")[0]):
        for x in (a, b):
            total += 1
            bad += x not in known
        known.add(c)
    return total, bad


def failure_table(run: Path) -> list[list]:
    """Table 4 rows: greedy held-out outcome shares per eval stage (and sampled exact match when stored)."""
    import pyarrow.parquet as pq

    prompts = {}
    heldout = run / "corpus" / "heldout.jsonl"
    if heldout.exists():
        for line in heldout.read_text().splitlines():
            record = json.loads(line)
            prompts[record["id"]] = record["prompt"]
    out = []
    for folder in sorted(run.glob("eval_*")):
        path = folder / "predictions.parquet"
        if not path.exists():
            continue
        preds = pq.read_table(path).to_pylist()
        n = len(preds)
        right = sum(bool(p["correct"]) for p in preds)
        has = sum(bool(p["has_final_answer"]) for p in preds)
        empty = sum(not str(p.get("generated") or "").strip() for p in preds)
        sampled = (sum(p["sampled_accuracy"] for p in preds) / n) if preds and "sampled_accuracy" in preds[0] else None
        counts = [ungrounded_operands(prompts[p["id"]], p.get("generated") or "") for p in preds if p["id"] in prompts]
        operands = sum(c[0] for c in counts)
        ungrounded = sum(c[1] for c in counts) / operands if operands else None
        out.append([folder.name, n, fmt(right / n), fmt((has - right) / n), fmt((n - has) / n), fmt(empty / n),
                    fmt(ungrounded), fmt(sampled)])
    return out


def closure_table(rows: list[dict], score_rows: dict[str, object], settings: object, rhos: list[float],
                  limit: int) -> list[list]:
    """Table 5 rows: re-selection of the stored scores at other response budgets, with and without closure."""
    import dataclasses

    from raycurate.algorithms.bridge.rows import full_utilities, select_example

    math_rows = [r for r in rows if r["domain"] == "math" and r["id"] in score_rows][:limit]
    out = []
    for rho in rhos:
        for closure in (True, False):
            s = dataclasses.replace(settings, rho_r=rho, closure=closure)
            count = defaultdict(int)
            sup = defaultdict(int)
            covered = []
            for r in math_rows:
                sc = score_rows[r["id"]]
                n, p = len(r["input_ids"]), int(r["prompt_len"])
                res = select_example(full_utilities(sc, n), sc.a_p, sc.c, r, s, prompt_scores=sc.prompt_scores)
                offsets = np.asarray(r["response_offsets"], dtype=np.int64).reshape(-1, 2)
                types = token_types(r["response"], offsets)
                loss = res["loss_mask"][p:].astype(bool)
                for j, t in enumerate(types):
                    count[t] += 1
                    sup[t] += int(loss[j])
                if "####" in r["response"]:
                    ans = [j for j, t in enumerate(types) if t in ("####", "answer")]
                    covered.append(all(loss[j] for j in ans))
            out.append([rho, "on" if closure else "off", len(math_rows),
                        *[fmt(sup[t] / count[t]) if count[t] else "-" for t in ("####", "answer", "digit",
                                                                               "operator", "name", "word")],
                        fmt(float(np.mean(covered)) if covered else None)])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--select-stage", default="bridge_select")
    parser.add_argument("--score-stage", default="bridge_score")
    parser.add_argument("--rhos", type=float, nargs="*", default=[0.25, 0.5, 0.75])
    parser.add_argument("--rows", type=int, default=400, help="math rows re-selected for the closure table")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from raycurate.stages.bridge import scores_from_table

    run = args.run_dir
    import dataclasses

    import yaml

    from raycurate.algorithms.bridge.rows import SelectionSettings

    config = yaml.safe_load((run / "config.yaml").read_text()) or {}
    bridge_cfg = config.get("bridge") or {}
    names = {f.name for f in dataclasses.fields(SelectionSettings)}
    settings = SelectionSettings(**{k: v for k, v in bridge_cfg.items() if k in names})
    rows = read_parts(stage_dir(run, args.select_stage) / "selection")
    rho_p, rho_r = settings.rho_p, settings.rho_r
    seed = int(bridge_cfg.get("seed", 0))
    print(f"# BRIDGE selection analysis: {run} ({args.select_stage}: {len(rows)} rows, rho_p={rho_p}, "
          f"rho_r={rho_r}, random seed {seed})")

    import pyarrow.parquet as pq

    score_rows: dict[str, object] = {}
    utilities: dict[str, np.ndarray] = {}
    for part in sorted((stage_dir(run, args.score_stage) / "scores").glob("*.parquet")):
        table = pq.read_table(part)
        for rid, sc in zip(table["id"].to_pylist(), scores_from_table(table)):
            score_rows[rid] = sc
            utilities[rid] = np.asarray(sc.utilities, dtype=np.float64)
    rand = random_response_masks(rows, rho_p, rho_r, seed)

    header = ["type", "tokens", "BRIDGE supervised", "random supervised", "mean a_j", "share of |a| mass"]
    print_table("Response tokens by type, math rows", header, type_table(rows, utilities, rand, {"math"}))
    print_table("Response tokens by type, code + instruction rows", header,
                type_table(rows, utilities, rand, {"code", "instruction"}))
    print_table("First response token supervised, by domain", ["domain", "rows", "BRIDGE", "random"],
                first_token_table(rows, rand))
    print_table("Kept share of eligible response tokens by corruption kind",
                ["corruption", "rows", "BRIDGE kept", "random kept", "mean a_j of the row", "rows with sum a < 0"],
                corruption_table(rows, utilities, rand))
    print_table("Prompt tokens kept (math rows; question = the last relevant sentence)",
                ["role / kind", "tokens", "BRIDGE kept", "random kept"], prompt_table(rows, rand))
    print_table("Held-out greedy outcomes", ["stage", "questions", "right", "wrong #### answer", "no ####",
                                             "empty", "made-up operands", "sampled EM"], failure_table(run))
    print_table(f"Re-selection at other response budgets (first {args.rows} math rows, rho_p={rho_p})",
                ["rho_r", "closure", "rows", "####", "answer", "digit", "operator", "name", "word",
                 "#### + answer all supervised"], closure_table(rows, score_rows, settings, args.rhos, args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
