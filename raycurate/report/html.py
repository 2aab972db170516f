"""A self-contained HTML report of a run (inline CSS and SVG; no scripts, no network).

Sections: "Your curated data" (``raycurate curate``, :mod:`raycurate.report.user_curate`), run summary, "Did
curation help?" (:mod:`raycurate.report.curation`), the composition of pipeline curate
(:mod:`raycurate.report.composition`), held-out results, lm-eval, BRIDGE token views, P2D heads, bilevel weights,
Tune results, outputs and next steps, row accounting, stage timings, corpus composition (:data:`SECTIONS`; the
pipeline sections live in :mod:`raycurate.report.sections`).  Every paper term is explained where it appears, and
tables round their floats (:func:`raycurate.report.charts.num`).
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


#: What each pipeline does, in a sentence.
PIPELINE_TEXT = {
    "demo": "every curation method against its matched baseline, on the embedded corpus",
    "sft": "fine-tuning on your data",
    "bridge": "BRIDGE token selection, then fine-tuning on the prompt and response tokens it kept",
    "p2d": "P2D: the rows that help most as in-context examples, then fine-tuning of a few attention heads",
    "bilevel": "learned row weights (BDS), online regeneration of responses (BMO) and example-selection baselines",
    "curate": "curation steps one after another, then one fine-tuning on what they kept",
    "proving_ground": "the demo repeated over corpus seeds",
}


def _duration(seconds: float) -> str:
    """``42 s``, ``12 min``, ``2.5 h``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def section_summary(run_dir: Path, manifest: dict) -> str:
    stages = manifest.get("stages", {})
    done = sum(1 for s in stages.values() if s.get("status") == "done")
    total = sum(s.get("seconds", 0) for s in stages.values())
    pipeline = manifest.get("pipeline", "?")
    anchor = "your-data" if (manifest.get("results") or {}).get("user_curate") else "outputs"
    what = f": {_esc(PIPELINE_TEXT[pipeline])}" if pipeline in PIPELINE_TEXT else ""
    unfinished = ", ".join(f"{_esc(name)} {_esc(s.get('status', '?'))}" for name, s in stages.items()
                           if s.get("status") != "done")
    return (
        f"<h2 id='summary'>Run summary</h2><p>Run <b>{_esc(manifest.get('run', run_dir.name))}</b>, pipeline "
        f"<b>{_esc(pipeline)}</b>{what}. {done} of {len(stages)} stages finished"
        f"{f' ({unfinished})' if unfinished else ''}, {_duration(total)} of stage time. Paths in this report are "
        f"relative to the run directory; <a href='#{anchor}'>where the outputs are and what to do next</a>.</p>"
    )


def section_outputs(run_dir: Path, manifest: dict) -> str:
    """Where a run's outputs are and what to do next (a ``raycurate curate`` run has its own list at the top)."""
    if (manifest.get("results") or {}).get("user_curate"):
        return ""
    stages = {name: s for name, s in (manifest.get("stages") or {}).items() if s.get("status") == "done"}

    def files(prefix: str, key: str) -> list[str]:
        return [s["outputs"][key] for name, s in stages.items()  # outputs are relative to the run directory
                if name.startswith(prefix) and key in (s.get("outputs") or {})]

    def listed(paths: list[str], limit: int = 6) -> str:
        shown = ", ".join(f"<a href='{_esc(p)}'><code>{_esc(p)}</code></a>" for p in paths[:limit])
        return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")

    items = [("the settings of this run (<code>raycurate run RUN_DIR/config.yaml</code>, from the folder the run "
              "was started in, repeats it)", ["config.yaml"]),
             ("every stage's status, metrics and output files (<code>raycurate inspect</code> prints them)",
              ["manifest.json"]),
             ("fine-tuned models (Hugging Face checkpoint folders, or LoRA adapters that name their base)",
              files("train_", "model")),
             ("each held-out question's answers and scores, per model", files("eval_", "predictions")),
             ("input rows that could not be used, with the reason", list((manifest.get("rows") or {}).get(
                 "rejected_files") or []))]
    out = ["<h2 id='outputs'>Outputs and next steps</h2><p>In the run directory:</p><ul>"]
    out += [f"<li>{what}: {listed(paths)}</li>" for what, paths in items if paths]
    out.append("</ul><p>Next:</p><ul>")
    if (manifest.get("results") or {}).get("curation") or (manifest.get("results") or {}).get("composition"):
        out.append("<li>The comparisons above come from one corpus seed and one training seed: before trusting a "
                   "difference, repeat them over several (<code>raycurate run jobs/proving_ground.yaml</code>).</li>")
    out.append("<li>Try other settings: <code>raycurate run RUN_DIR/config.yaml train.lr=1e-4 run.name=lr1e-4</code> "
               "(every setting: <code>raycurate run --help-config</code>). Running the same command again resumes "
               "this run: finished stages whose settings did not change are reused.</li>")
    trained = [name for name, s in stages.items() if name.startswith("train_") and "model" in (s.get("outputs") or {})]
    if trained:
        out.append("<li>Score a fine-tuned model on standard benchmarks: <code>raycurate eval RUN_DIR --model-stage "
                   f"{_esc(trained[0])} --tasks arc_challenge,hellaswag</code>.</li>")
    out.append("<li>Curate your own data toward a small hand-checked set: <code>raycurate curate --data rows.jsonl "
               "--trusted checked.jsonl --model MODEL --out curated/</code>.</li></ul>")
    return "".join(out)


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
    return ("<h2 id='timings'>Stage timings</h2><p>The config hash identifies a stage's settings and inputs: a stage "
            "whose hash has not changed is reused when the run is repeated.</p>"
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
    """A few rows with their kept / dropped prompt tokens and trained-on / not-trained-on response tokens."""
    parts = []
    for row in rows[:limit]:
        p = int(row["prompt_len"])
        prompt = _spans(row["prompt"], row["prompt_offsets"], row["sel_prompt_keep"], "kept", "dropped")
        response = _spans(row["response"], row["response_offsets"], row["sel_loss_mask"][p:], "sup", "unsup")
        domain = f" ({_esc(row['domain'])})" if row.get("domain") else ""
        parts.append(f"<p><b>{_esc(row['id'])}</b>{domain}: kept {row['sel_kept_prompt']} of "
                     f"{row['sel_eligible_prompt']} prompt tokens, trained on {row['sel_supervised_response']} of "
                     f"{row['sel_eligible_response']} response tokens</p><div class='tokens'>{prompt}</div>"
                     f"<div class='tokens'>{response}</div>")
    return "".join(parts)


def section_bridge(run_dir: Path, manifest: dict) -> str:
    stages = manifest.get("stages", {})
    select = stages.get("bridge_select", {})
    if select.get("status") != "done":
        return ""
    m = select.get("metrics", {})

    def share(key: str) -> str:
        return "" if m.get(key) is None else f"{m[key]:.3f}"

    out = ["<h2 id='bridge'>BRIDGE token selection</h2><p>BRIDGE scores every prompt and response token by how much "
           "training on it would lower the loss on the target rows (the trusted set, or the pool's validation split), "
           "keeps the best share of each row's prompt tokens and trains on the best share of its response tokens. "
           "Template and special tokens are not eligible: they are always kept.</p>"]
    budget_rows = [["prompt tokens kept, share of eligible (bridge.rho_p)", share("prompt_budget_ratio")],
                   ["response tokens trained on, share of eligible (bridge.rho_r)", share("response_budget_ratio")],
                   ["rows whose budgets were met exactly", share("budget_exact_share")],
                   ["rows whose final-answer line is trained on, with closure (bridge.closure)",
                    share("final_answer_coverage_closure")],
                   ["rows whose final-answer line is trained on, by the scores alone",
                    share("final_answer_coverage_score_only")]]
    if "corpus" in stages:  # the embedded corpus labels its distractor sentences
        budget_rows += [["distractor prompt tokens dropped (higher is better)", share("distractor_dropped_share")],
                        ["relevant prompt tokens dropped (lower is better)", share("relevant_dropped_share")]]
    from raycurate.config.bridge import BRIDGE_BASELINES

    for stage in ("bridge_compact", *(f"baseline_{name}_compact" for name in BRIDGE_BASELINES)):
        cm = stages.get(stage, {}).get("metrics", {})
        if "executed_token_ratio" in cm:
            budget_rows.append([f"tokens left in the training rows after dropping prompt tokens ({stage})",
                                f"{cm['executed_token_ratio']:.3f}"])
    out.append("<h3>Token budgets</h3><p>Closure keeps whole lines and sentences of a response together (the "
               "final-answer line always), so a row is not trained on scattered tokens.</p>"
               + _table(["quantity", "value"], budget_rows))
    out.append("<h3>Selection schedules compared</h3><p>The surrogate utility (U_sur) of a row's selection is "
               "BRIDGE's first-order estimate of how much training on the selected tokens lowers the target loss: "
               "the sum of their scores, prompt and response chosen together (higher is better). independent "
               "chooses each side once against the whole other side; one_pass updates each side once; alternating "
               "(<code>bridge.schedule</code>, the default) repeats until the selection stops changing.</p>"
               + bar_chart([(k, float(m.get(f"u_sur_{k}", 0.0))) for k in ("independent", "one_pass", "alternating")],
                           title="Mean surrogate utility (U_sur) of the selection per schedule",
                           value_label="mean U_sur", category_label="schedule", direction=HIGHER_IS_BETTER))
    fidelity_path = run_dir / "bridge_diagnostics" / "fidelity.json"
    if fidelity_path.exists():
        fid = json.loads(fidelity_path.read_text())
        rows = [[r["side"], r["proxy"], *(f"{r[k]:.3f}" for k in ("spearman", "top_b_overlap", "jaccard",
                                                                   "normalized_regret"))] for r in fid["table"]]
        out.append(f"<h3>How closely the fast scores match exact ones ({fid['examples']} rows)</h3><p>On a sample of "
                   "rows (<code>bridge.diagnostics_rows</code>) each prompt token's score is recomputed exactly, by "
                   "removing the token and re-running the model, and compared with the fast scores BRIDGE selects "
                   "with. Spearman: rank correlation (1 = same order). Top-b overlap and Jaccard: agreement of the "
                   "selected sets at the same budget (1 = identical). Normalised regret: share of the exact utility "
                   "lost by selecting with the fast score (0 = none, lower is better).</p>"
                   + _table(["side", "fast score", "Spearman", "top-b overlap", "Jaccard", "normalised regret"], rows)
                   + "<p class='muted'>attention: attention weights alone; attention_x_a: attention weights times "
                   "the response tokens' scores (BRIDGE's default); knockout_grad: the derivative of the response "
                   "score with respect to each prompt token's attention (<code>bridge.prompt_proxy</code>; its "
                   "response row is attention_x_a's).</p>")
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
            head = ["share of the other side kept", "prompt shift (random subsets)", "response shift (random subsets)"]
            out.append("<h3>Does one side's selection change the other's ranking?</h3><p>Shift = 1 minus the rank "
                       "correlation between a side's token ranking with the whole other side kept and with only the "
                       "given share of it kept (random nested subsets, or the top-scoring ones). Near 0: each side "
                       "could be chosen on its own; larger: choosing prompt and response tokens together "
                       "matters.</p>"
                       + _table(head + (["prompt shift (top-b)", "response shift (top-b)"] if top else []), srows))
    selection_dir = run_dir / "bridge_select" / "selection"
    parts = sorted(selection_dir.glob("*.parquet"))
    if parts:
        import pyarrow.parquet as pq

        rows = pq.read_table(parts[0]).slice(0, 3).to_pylist()
        out.append("<h3>Examples</h3><p>Prompt: <span class='kept'>kept</span> / <span class='dropped'>dropped"
                   "</span>; response: <span class='sup'>trained on</span> / <span class='unsup'>not trained on"
                   "</span> (the model still reads the whole response; only the loss skips those tokens).</p>"
                   + bridge_examples_html(rows))
    return "".join(out)


# The question a user runs the demo for comes first; timings and row accounting follow the method sections.
SECTIONS: list[Callable[[Path, dict], str]] = [
    section_summary, section_curation, section_composition, section_results, section_lm_eval, section_bridge,
    section_p2d, section_bilevel, section_tune, section_outputs, section_rows, section_timings, section_corpus,
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
