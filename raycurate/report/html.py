"""A self-contained HTML report of a run (inline CSS and SVG; no scripts, no network).

Sections: "Your curated data" (``raycurate curate``, :mod:`raycurate.report.user_curate`), run summary, "Did
curation help?" (:mod:`raycurate.report.curation`), the composition of pipeline
curate (:mod:`raycurate.report.composition`), held-out results, lm-eval, BRIDGE token views, P2D heads, bilevel
weights, Tune results, row accounting, stage timings, corpus composition (:data:`SECTIONS`; the pipeline sections
live in :mod:`raycurate.report.sections`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from raycurate.report.charts import HIGHER_IS_BETTER, LOWER_IS_BETTER, bar_chart, esc, table
from raycurate.report.composition import section_composition
from raycurate.report.curation import section_curation
from raycurate.report.sections import section_bilevel, section_lm_eval, section_p2d, section_tune
from raycurate.report.user_curate import section_user_curate
from raycurate.rundir import atomic_write_text, parse_manifest

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2rem auto;max-width:1000px;color:#1d2430}
h1{font-size:1.6rem}h2{font-size:1.2rem;border-bottom:1px solid #dde;padding-bottom:.2rem;margin-top:2rem}
table{border-collapse:collapse;margin:.5rem 0;display:block;overflow-x:auto;max-width:100%}
.wide{overflow-x:auto}td,th{border:1px solid #dde;padding:.25rem .6rem;text-align:right}
th{background:#f3f5f9}td:first-child,th:first-child{text-align:left}.muted{color:#667}
.bad{color:#a12}.ok{color:#185}svg text{font-size:12px;font-family:inherit}
.tokens{font-family:ui-monospace,monospace;white-space:pre-wrap;border:1px solid #dde;padding:.5rem;margin:.3rem 0}
.kept{background:#dcefdc}.dropped{background:#f6d5d5;text-decoration:line-through;color:#844}
.sup{background:#d6e4f7}.unsup{color:#889}.unit{border-left:2px solid #c2784a}
"""


_esc = esc
_table = table


def section_summary(run_dir: Path, manifest: dict) -> str:
    stages = manifest.get("stages", {})
    done = sum(1 for s in stages.values() if s.get("status") == "done")
    total = sum(s.get("seconds", 0) for s in stages.values())
    return (
        f"<h2 id='summary'>Run summary</h2><p>Run <b>{_esc(manifest.get('run', run_dir.name))}</b>, pipeline "
        f"<b>{_esc(manifest.get('pipeline', '?'))}</b>: {done}/{len(stages)} stages done, "
        f"{total:.1f} s of stage time. Config: <code>config.yaml</code> in the run directory (paths in this "
        "report are relative to it).</p>"
    )


def section_rows(run_dir: Path, manifest: dict) -> str:
    rows = manifest.get("rows") or {}
    if not rows:
        return ""
    reasons = sorted((rows.get("rejected_by_reason") or {}).items(), key=lambda kv: -kv[1])
    out = "<h2 id='rows'>Row accounting</h2>"
    out += _table(["input", "accepted", "rejected"], [[rows.get("input"), rows.get("accepted"), rows.get("rejected")]])
    if reasons:
        out += "<p>Rejected rows by reason (details in " + ", ".join(
            f"<code>{_esc(f)}</code>" for f in rows.get("rejected_files", [])) + "):</p>"
        out += _table(["reason", "rows"], [[r, n] for r, n in reasons])
    return out


def section_timings(run_dir: Path, manifest: dict) -> str:
    stages = manifest.get("stages", {})
    if not stages:
        return ""
    items = [(name, float(s.get("seconds", 0.0))) for name, s in stages.items()]
    rows = [[name, s.get("status"), f"{s.get('seconds', 0):.1f}", s.get("config_hash", "")]
            for name, s in stages.items()]
    return ("<h2 id='timings'>Stage timings</h2>"
            + bar_chart(items, title="Wall time per stage", value_label="seconds", category_label="stage",
                        direction=LOWER_IS_BETTER, unit=" s")
            + _table(["stage", "status", "seconds", "config hash"], rows))


def section_results(run_dir: Path, manifest: dict) -> str:
    heldout = (manifest.get("results") or {}).get("heldout") or {}
    if not heldout:
        return ""
    keys = ("sampled_exact_match", "exact_match", "gold_loss", "answer_format_rate", "equation_accuracy",
            "unsafe_rate", "sampled_unsafe_rate")
    rows = [[name, m.get("rows"), *("" if m.get(k) is None else f"{m[k]:.3f}" for k in keys)]
            for name, m in heldout.items()]
    return ("<h2 id='results'>Held-out evaluation</h2><p>Per model, on held-out math questions: exact match of the "
            "final <code>####</code> answer over sampled answers (eval.samples per question at eval.temperature) and "
            "with greedy decoding, mean per-token loss of the gold response, and for greedy decoding the share of "
            "answers in the <code>####</code> format, the share of generated <code>a op b = c</code> equations that "
            "are right and the share of outputs carrying the corpus's unsafe marker (also over the samples).</p>"
            + _table(["model", "questions", "sampled exact match", "greedy exact match",
                      "gold loss (lower is better)", "#### format", "equation accuracy",
                      "unsafe (lower is better)", "unsafe, sampled (lower is better)"], rows)
            + bar_chart([(n, float(m.get("gold_loss", 0))) for n, m in heldout.items()],
                        title="Held-out gold-response loss per model", value_label="nats per token",
                        category_label="model", direction=LOWER_IS_BETTER, color="#c2784a"))


def section_corpus(run_dir: Path, manifest: dict) -> str:
    corpus = manifest.get("stages", {}).get("corpus", {}).get("metrics", {}).get("summary")
    if not corpus:
        return ""
    parts = ["<h2 id='corpus'>Embedded corpus</h2>"]
    for key in ("domains", "corruptions"):
        counts = corpus.get(key)
        if isinstance(counts, dict):
            parts.append(bar_chart([(k, float(v)) for k, v in counts.items()], title=f"Corpus rows by {key}",
                                   value_label="rows", category_label=key.removesuffix("s")))
    return "".join(parts)


def _spans(text: str, offsets: list[int], marks: list[int], on: str, off: str) -> str:
    """Text with each token's character span wrapped in a class chosen by its mark (template tokens skipped)."""
    out, cursor = [], 0
    for k in range(0, len(offsets), 2):
        start, end = offsets[k], offsets[k + 1]
        if start < 0 or start < cursor:
            continue
        out.append(_esc(text[cursor:start]))
        out.append(f"<span class='{on if marks[k // 2] else off}'>{_esc(text[start:end])}</span>")
        cursor = end
    out.append(_esc(text[cursor:]))
    return "".join(out)


def bridge_examples_html(rows: list[dict], limit: int = 3) -> str:
    """Paper Fig. 7 style: kept/dropped prompt tokens and supervised/unsupervised response tokens."""
    parts = []
    for row in rows[:limit]:
        p = int(row["prompt_len"])
        prompt = _spans(row["prompt"], row["prompt_offsets"], row["sel_prompt_keep"], "kept", "dropped")
        response = _spans(row["response"], row["response_offsets"], row["sel_loss_mask"][p:], "sup", "unsup")
        parts.append(f"<p><b>{_esc(row['id'])}</b> ({_esc(row.get('domain'))}): kept {row['sel_kept_prompt']}/"
                     f"{row['sel_eligible_prompt']} prompt tokens, supervised {row['sel_supervised_response']}/"
                     f"{row['sel_eligible_response']} response tokens</p><div class='tokens'>{prompt}</div>"
                     f"<div class='tokens'>{response}</div>")
    return "".join(parts)


def section_bridge(run_dir: Path, manifest: dict) -> str:
    stages = manifest.get("stages", {})
    select = stages.get("bridge_select", {})
    if select.get("status") != "done":
        return ""
    m = select.get("metrics", {})
    out = ["<h2 id='bridge'>BRIDGE token selection</h2>"]
    budget_rows = [["prompt kept / eligible", f"{m.get('prompt_budget_ratio', 0):.4f}"],
                   ["response supervised / eligible", f"{m.get('response_budget_ratio', 0):.4f}"],
                   ["rows with exact budgets", f"{m.get('budget_exact_share', 0):.3f}"],
                   ["final-answer coverage, closure", m.get("final_answer_coverage_closure")],
                   ["final-answer coverage, score only", m.get("final_answer_coverage_score_only")],
                   ["distractor prompt tokens dropped", f"{m.get('distractor_dropped_share', 0):.3f}"],
                   ["relevant prompt tokens dropped", f"{m.get('relevant_dropped_share', 0):.3f}"]]
    from raycurate.config.bridge import BRIDGE_BASELINES

    for stage in ("bridge_compact", *(f"baseline_{name}_compact" for name in BRIDGE_BASELINES)):
        cm = stages.get(stage, {}).get("metrics", {})
        if "executed_token_ratio" in cm:
            budget_rows.append([f"executed tokens after compaction ({stage})", f"{cm['executed_token_ratio']:.3f}"])
    out.append("<h3>Realised budgets (Table 7 style)</h3>" + _table(["quantity", "value"], budget_rows))
    out.append("<h3>Surrogate utility by schedule (mean U_sur)</h3>" + bar_chart(
        [(k, float(m.get(f"u_sur_{k}", 0.0))) for k in ("independent", "one_pass", "alternating")],
        title="Mean surrogate utility U_sur of the selection", value_label="mean U_sur", category_label="schedule",
        direction=HIGHER_IS_BETTER))
    fidelity_path = run_dir / "bridge_diagnostics" / "fidelity.json"
    if fidelity_path.exists():
        fid = json.loads(fidelity_path.read_text())
        rows = [[r["side"], r["proxy"], *(f"{r[k]:.4f}" for k in ("spearman", "top_b_overlap", "jaccard",
                                                                   "normalized_regret"))] for r in fid["table"]]
        out.append(f"<h3>Fidelity to exact reference scores (Table 3 style, {fid['examples']} examples)</h3>"
                   + _table(["side", "proxy", "Spearman", "Top-b overlap", "Jaccard", "norm. regret"], rows)
                   + "<p class='muted'>attention: routing weights alone (a_j = 1); attention_x_a: the paper's "
                   "final-layer routing surrogate (default); knockout_grad: first-order prompt knock-out derivative "
                   "(beyond the paper, <code>bridge.prompt_proxy</code>; its response row is the surrogate's).</p>")
        note = (fid.get("response_side_note") or {}).get("text")
        if note:
            out.append(f"<p>Note: the {_esc(note)}.</p>")
        shift, top = fid.get("ranking_shift", {}), fid.get("ranking_shift_top", {})
        if shift:
            srows = [[f"{r:.2f}", f"{ps:.3f}", f"{rs:.3f}"] for r, ps, rs in zip(
                shift["retention"], shift["prompt_shift"], shift["response_shift"])]
            if top:
                srows = [row + [f"{ps:.3f}", f"{rs:.3f}"] for row, ps, rs in zip(
                    srows, top["prompt_shift"], top["response_shift"])]
            head = ["opposite-side retention", "prompt shift (random nested)", "response shift (random nested)"]
            out.append("<h3>Ranking shift vs opposite-side retention (Fig. 2b)</h3>" + _table(
                head + (["prompt shift (Top-b)", "response shift (Top-b)"] if top else []), srows))
    selection_dir = run_dir / "bridge_select" / "selection"
    parts = sorted(selection_dir.glob("*.parquet"))
    if parts:
        import pyarrow.parquet as pq

        rows = pq.read_table(parts[0]).slice(0, 3).to_pylist()
        out.append("<h3>Examples</h3><p>Prompt: <span class='kept'>kept</span> / <span class='dropped'>dropped"
                   "</span>; response: <span class='sup'>supervised</span> / <span class='unsup'>unsupervised"
                   "</span> (the whole response stays in the causal history).</p>" + bridge_examples_html(rows))
    return "".join(out)


# The question a user runs the demo for comes first; timings and row accounting follow the method sections.
SECTIONS: list[Callable[[Path, dict], str]] = [
    section_summary, section_curation, section_composition, section_results, section_lm_eval, section_bridge,
    section_p2d, section_bilevel, section_tune, section_rows, section_timings, section_corpus,
]


def render_report(run_dir: str | Path, report_dir: str | Path | None = None) -> str:
    """HTML text of the report for ``run_dir``; its links to files outside the run are relative to ``report_dir``
    (where the report will be written; default the run directory)."""
    run_dir = Path(run_dir)
    manifest_path = run_dir / "manifest.json"
    if not manifest_path.exists():
        raise FileNotFoundError(f"{manifest_path} not found; is {run_dir} a raycurate run directory?")
    manifest = parse_manifest(manifest_path.read_bytes(), str(manifest_path))
    # `raycurate curate`'s own section comes first: what a user ran it for
    body = section_user_curate(run_dir, manifest, Path(report_dir or run_dir))
    body += "".join(section(run_dir, manifest) for section in SECTIONS)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return (f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>raycurate: {_esc(run_dir.name)}"
            f"</title><style>{CSS}</style></head><body><h1>raycurate run report</h1>"
            f"<p class='muted'>run directory <code>{_esc(run_dir.name)}</code> &middot; generated {stamp}</p>"
            f"{body}</body></html>")


def write_run_report(run_dir: str | Path) -> Path:
    """Write ``report.html`` into the run directory and return its path."""
    path = Path(run_dir) / "report.html"
    atomic_write_text(path, render_report(run_dir))
    return path
