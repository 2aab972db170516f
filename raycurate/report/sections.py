"""Report sections of the P2D, bilevel, evaluation and Tune parts of a run (empty when they did not run)."""

from __future__ import annotations

import json
from pathlib import Path

from raycurate.report.charts import HIGHER_IS_BETTER, LOWER_IS_BETTER, esc, heatmap, histogram, num, scatter, table

#: What the report calls P2D's head scorers (``p2d.head_scorer``).
HEAD_SCORERS = {"w1": "W1 (earth mover's) distance", "cosine": "cosine distance", "l2": "L2 distance",
                "kl": "KL divergence"}


def _stage(manifest: dict, name: str) -> dict:
    return (manifest.get("stages") or {}).get(name) or {}


def section_p2d(run_dir: Path, manifest: dict) -> str:
    """Head heatmap with the selected heads, the clean share of the selected rows, and P2D's cost relative to full
    fine-tuning."""
    heads_rec = _stage(manifest, "p2d_heads")
    if heads_rec.get("status") != "done":
        return ""
    parts = ["<h2 id='p2d'>P2D: heads and examples</h2>"]
    heads_path = run_dir / heads_rec["outputs"]["heads"]
    if heads_path.exists():
        data = json.loads(heads_path.read_text())
        grid = [[0.0] * data["n_heads"] for _ in range(data["n_layers"])]
        marked = set()
        for h in data["heads"]:
            grid[h["layer"]][h["head"]] = h["score"]
            if h["selected"]:
                marked.add((h["layer"], h["head"]))
        scorer = HEAD_SCORERS.get(data["method"], data["method"])
        parts.append(f"<p>How much each attention head changes when the base model is briefly fine-tuned on a sample "
                     f"of the rows (the proxy model): the {esc(scorer)} between the head's weight distributions "
                     f"before and after (<code>p2d.head_scorer</code>; softmax temperature {num(data['tau'])}, "
                     f"<code>p2d.head_tau</code>). Outlined: the {len(marked)} most changed heads "
                     f"({num(100 * data['ratio'])}% of heads, <code>p2d.head_ratio</code>), which P2D probes the rows "
                     "with and then fine-tunes alone.</p>")
        parts.append(heatmap(grid, title=f"Head sensitivity ({scorer})", row_label="layer",
                             col_label="head", marked=marked))
    select = _stage(manifest, "p2d_select").get("metrics") or {}
    if select:
        names = {"precision_selected": "rows P2D selected", "precision_random": "as many random rows",
                 "precision_pool": "the whole pool"}
        rows = [[name, "" if select.get(k) is None else f"{select[k]:.3f}"] for k, name in names.items()]
        parts.append(f"<p>P2D selected {select.get('selected')} of {select.get('pool')} pool rows, by how much each "
                     "helps the probed heads answer other questions when shown as an in-context example. Share of "
                     "clean rows (the embedded corpus's ground truth; higher is better):</p>"
                     + table(["rows", "share clean"], rows))
    aer = (manifest.get("p2d") or {}).get("aer")
    if aer:
        parts.append("<p>Cost relative to full fine-tuning: (selection + head fine-tuning seconds) / seconds of "
                     "fine-tuning the whole model on every row (the P2D paper's AER); below 1 P2D was cheaper.</p>"
                     + table(["selection s", "head fine-tuning s", "full fine-tuning s", "ratio (AER)"],
            [[f"{aer['selection_seconds']:.1f}", f"{aer['adaptation_seconds']:.1f}",
              f"{aer['full_sft_seconds']:.1f}", f"{aer['aer']:.3f}"]]))
    return "".join(parts)


def section_bilevel(run_dir: Path, manifest: dict) -> str:
    """BDS weight histograms split by ground-truth label, AUROC, top/bottom questions, generated responses."""
    bilevel = manifest.get("bilevel") or {}
    if not bilevel:
        return ""
    parts = ["<h2 id='bilevel'>Bilevel data weights</h2>"]
    for method, info in (bilevel.get("methods") or {}).items():
        hist = info.get("weights_by_label")
        if hist:
            auroc = info.get("auroc")
            low, high = info.get("auroc_ci95") or (None, None)
            interval = f" [{low:.3f}, {high:.3f}]" if low is not None else ""
            parts.append(f"<h3>{esc(method)}</h3><p>The weight BDS learned for each row (sigma(omega), mean 1; "
                         "higher: training on the row lowered the loss on the trusted rows more), by the embedded "
                         "corpus's ground-truth label"
                         + (f". AUROC clean vs corrupted = {auroc:.3f}{interval} (the chance that a random clean "
                            "row outweighs a random corrupted one: 0.5 is chance, 1 perfect)" if auroc is not None
                            else "")
                         + ".</p>")
            parts.append(histogram(hist, title=f"{method}: learned row weights by ground-truth label",
                                   x_label="learned weight sigma(omega)", y_label="rows"))
            parts.append(_auroc_by_kind(info))
        for key, title in (("top", "highest-weighted"), ("bottom", "lowest-weighted")):
            rows = info.get(key) or []
            if rows:
                parts.append(f"<p>{title} rows</p>" + table(
                    ["id", "weight", "clean", "corruption"],
                    [[r.get("id"), f"{r.get('sigma', 0):.3f}", r.get("clean"), r.get("corruption", "")]
                     for r in rows]))
        gens = info.get("generations") or []
        if gens:
            parts.append("<p>Responses BMO regenerated during training (the online method), next to the originals. "
                         "Importance weight: how likely the final model finds the generated response relative to the "
                         "model that generated it (per-token geometric mean; 1 = unchanged).</p>" + table(
                ["question", "original", "generated", "importance weight"],
                [[g.get("question_id"), g.get("original", "")[:200], g.get("generated", "")[:200],
                  f"{g.get('weight', 0):.3f}"] for g in gens]))
    losses = bilevel.get("losses")
    if losses:
        parts.append("<p>Final losses: on the trusted rows the weights are learned for (upper level) and on the "
                     "weighted training rows (lower level).</p>" + table(
            ["method", "validation loss (lower is better)", "training loss (lower is better)"],
            [[m, f"{v.get('validation_loss', float('nan')):.4f}", f"{v.get('train_loss', float('nan')):.4f}"]
             for m, v in losses.items()]))
    return "".join(parts)


def auroc_kind_table(by_kind: dict, digits: int = 3) -> str:
    """A table of ``{kind: {auroc, ci95, rows}}``: corruption kind, rows, AUROC and its 95% interval."""
    rows = [[kind, v.get("rows"), f"{v['auroc']:.{digits}f}",
             "" if not v.get("ci95") else f"[{v['ci95'][0]:.{digits}f}, {v['ci95'][1]:.{digits}f}]"]
            for kind, v in sorted(by_kind.items())]
    return table(["corruption", "rows", "AUROC", "95% CI"], rows)


def _auroc_by_kind(info: dict) -> str:
    """Per-corruption-kind AUROC of the weights and the sampling-order check (empty when not recorded)."""
    by_kind = info.get("auroc_by_kind") or {}
    if not by_kind:
        return ""
    text = "<p>AUROC of the weights, clean rows vs each corruption kind (95% bootstrap intervals).</p>"
    spearman = info.get("spearman_first_step")
    if spearman is not None:
        text += (f"<p>Spearman(omega, step of first sampling) = {spearman:+.3f}: near +-1 would mean the weights "
                 "record when each row was drawn, not its quality.</p>")
    return text + auroc_kind_table(by_kind)


def section_lm_eval(run_dir: Path, manifest: dict) -> str:
    """lm-eval metrics per evaluated model, with the BRIDGE paper's General / Overall averages when available."""
    runs = {name: rec for name, rec in (manifest.get("stages") or {}).items()
            if rec.get("status") == "done" and "lm_eval" in (rec.get("outputs") or {})}
    if not runs:
        return ""
    keys = sorted({k for rec in runs.values() for k in rec.get("metrics", {})
                   if "/" in k and not k.endswith(("/samples", "_stderr"))})
    out = ("<h2 id='lm_eval'>lm-eval</h2><p>lm-eval harness metrics (<code>task/metric/filter</code>) per model; "
           "the raycurate_heldout tasks run over the embedded held-out set.</p>"
           + table(["stage", *keys], [[name, *(_fmt(rec["metrics"].get(k)) for k in keys)]
                                      for name, rec in runs.items()]))
    averages = [[name, *(_fmt(rec["metrics"].get(k)) or "n/a" for k in ("general_avg", "target", "overall_avg"))]
                for name, rec in runs.items()]
    if any(v != "n/a" for row in averages for v in row[1:]):
        out += ("<h3>Averages as in the BRIDGE paper</h3><p>General Avg: mean of the general benchmarks (ARC "
                "challenge, HellaSwag, MMLU and a fourth per target domain); target: the target domain's benchmark "
                "(<code>eval.lm_eval_domain</code>); Overall Avg: the mean of the two.</p>"
                + table(["stage", "General Avg", "target", "Overall Avg"], averages))
    return out


def _fmt(value: object) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else ""


def section_tune(run_dir: Path, manifest: dict) -> str:
    """Tune results table and metric-vs-parameter plots."""
    tune = manifest.get("tune")
    if not tune:
        return ""
    rows = tune.get("rows") or []
    params = [f"param.{p}" for p in tune.get("params", [])]
    parts = [f"<h2 id='tune'>Ray Tune sweep: {esc(tune['name'])}</h2>",
             f"<p>{tune['trials']} trials ({tune['finished']} finished), {esc(tune['search'])} search, scheduler "
             f"{esc(tune['scheduler'])}; metric <code>{esc(tune['metric'])}</code> "
             f"({'lower' if tune.get('mode') == 'min' else 'higher'} is better). Rung: how many rounds of training "
             "a trial reached before the scheduler stopped it.</p>",
             table(["trial", *[p.removeprefix("param.") for p in params], "metric", "rung", "status"],
                   [[r.get("trial"), *(r.get(p) for p in params), _fmt(r.get("metric")), r.get("rung"),
                     r.get("status")] for r in rows])]
    for p in params:
        points = [(r[p], r["metric"]) for r in rows if isinstance(r.get(p), (int, float)) and r.get("metric")
                  is not None]
        if points:
            direction = {"min": LOWER_IS_BETTER, "max": HIGHER_IS_BETTER}.get(tune.get("mode"))
            parts.append(scatter(points, title=f"{tune['metric']} vs {p.removeprefix('param.')}",
                                 x_label=p.removeprefix("param."), y_label=str(tune["metric"]), direction=direction))
    best = tune.get("best")
    if best:
        values = ", ".join(f"{p.removeprefix('param.')}={num(best.get(p))}" for p in params)
        parts.append(f"<p>Best trial {best['trial']} ({esc(values)}): metric {best['metric']:.4g}; its job file "
                     f"<code>{esc(tune.get('best_config', ''))}</code> (run it with <code>raycurate run</code>).</p>")
    return "".join(parts)
