"""The "Your curated data" section that heads the report of ``raycurate curate``: the counts per outcome and reason,
the lowest-scored rows, the held-out comparison (with ``--heldout``), links to the output files and what to do
next.  It renders the manifest's ``results.user_curate`` (written by :mod:`raycurate.pipelines.user_curate`)."""

from __future__ import annotations

import os
from pathlib import Path

from raycurate.config.curate import STEP_HELP
from raycurate.report.charts import esc, table

_FILES = (("curated", "kept records, original fields untouched, plus weight and kept spans"),
          ("dropped", "every dropped row: step, reason, score, rank"),
          ("rejected", "rows that could not be used, with the reason"),
          ("scores", "every row's scores from every step"), ("summary", "the counts, settings and timings"),
          ("model", "the model fine-tuned on curated.jsonl"))


def _ci(estimate: dict | None, signed: bool = False) -> str:
    if not estimate:
        return "-"
    sign = "+" if signed else ""
    return f"{estimate['value']:{sign}.3f} [{estimate['low']:{sign}.3f}, {estimate['high']:{sign}.3f}]"


def _heldout(block: dict) -> str:
    rows = [[name, _ci(m.get("exact_match")), _ci(m.get("gold_loss"))] for name, m in block["models"].items()]
    rows += [[f"curated minus {name}", _ci(d.get("exact_match"), True), _ci(d.get("gold_loss"), True)]
             for name, d in block["curated_minus"].items()]
    return (f"<h3>On your held-out questions</h3><p>{block['questions']} questions ({block['questions_with_answer']} "
            "with a <code>####</code> answer, on which exact match is measured); 95% bootstrap intervals over the "
            f"questions, one training seed ({block['training_seeds']}): a difference whose interval holds 0 is "
            "noise.</p>" + table(["model", "exact match", "gold-response loss (lower is better)"], rows))


def section_user_curate(run_dir: Path, manifest: dict, report_dir: Path) -> str:
    """The section, links relative to ``report_dir`` (where the report is written); "" for other runs."""
    block = (manifest.get("results") or {}).get("user_curate")
    if not block:
        return ""
    out = Path(run_dir) / block.get("out_dir", "..")

    def link(name: str) -> str:
        return f"<a href='{esc(os.path.relpath(out / name, report_dir))}'><code>{esc(name)}</code></a>"

    rows, files = block["rows"], block["files"]
    counts = [["kept (curated.jsonl)", rows["kept"]]]
    counts += [[f"  of which kept uncurated (split {split})", n] for split, n in rows["kept_uncurated"].items()]
    counts += [[f"dropped by {step} (dropped.jsonl)", n] for step, n in rows["dropped_by_step"].items()]
    counts += [[f"rejected: {reason} (rejected.jsonl)", n] for reason, n in rows["rejected_by_reason"].items()]
    settings = block["settings"]
    rule = f"ranking steps keep {settings['keep_fraction']:.0%} of the rows they receive"
    if "reference" in settings["steps"] and settings.get("keep_rule") == "calibrated":
        rule += (f", the reference the rows worse than at most {settings['calibration_quantile']:.0%} of the "
                 "held-out trusted rows")
    steps = "".join(f"<li><b>{esc(s)}</b>: {esc(STEP_HELP.get(s, ''))}</li>" for s in settings["steps"])
    parts = [f"<h2 id='your-data'>Your curated data</h2><p>{rows['input']} input rows: <b>{rows['kept']} kept</b>, "
             f"{rows['dropped']} dropped, {rows['rejected']} rejected, curated toward "
             f"{block['trusted'].get('accepted')} trusted rows by these steps, in order ({esc(rule)}):</p>"
             f"<ol>{steps}</ol>"
             + table(["outcome", "rows"], counts)]
    uncurated = sum(rows["kept_uncurated"].values())
    if uncurated:
        parts.append(f"<p>{uncurated} rows were set aside for BRIDGE's warmup fine-tuning (the model it scores tokens "
                     "with), so no step judged them: they are in curated.jsonl with their whole responses.</p>")
    lowest = [[r["step"], r["id"], "" if r["rank"] is None else f"{r['rank']} of {r['received']}",
               "" if r["score"] is None else f"{r['score']:.4g}", r["dropped_by"] or "kept", r["prompt"],
               r["response"]] for r in block.get("lowest", [])]
    if lowest:
        parts.append("<h3>Lowest-scored rows</h3><p>Per step, the rows it scored lowest (dedup: rows it found "
                     "repeated). Read them: if they are good rows, the step is too strict for your data.</p>"
                     + table(["step", "id", "rank", "score", "dropped by", "prompt", "response"], lowest))
    if block.get("heldout"):
        parts.append(_heldout(block["heldout"]))
    listed = "".join(f"<li>{link(files[key])}: {what}</li>" for key, what in _FILES if key in files)
    parts.append(f"<h3>Files</h3><ul>{listed}</ul><h3>What to do next</h3><ul>"
                 "<li>Skim the lowest-scored rows above and the top of dropped.jsonl; if good rows were dropped, "
                 "keep more (<code>--keep</code>) or change the steps (<code>--steps</code>).</li>"
                 "<li>Fine-tune on curated.jsonl: train on each row's <code>weight</code> and, where given, only on "
                 "the <code>kept_response_spans</code> of its response; or re-run with <code>--train</code>.</li>"
                 "<li>Check that curation helped on your own questions: re-run with <code>--heldout FILE</code> "
                 "(base vs all rows vs curated).</li>"
                 "<li>Re-running the same command resumes: finished stages are skipped.</li></ul>")
    return "".join(parts)
