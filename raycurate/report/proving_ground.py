"""The proving ground's page (``<runs_dir>/<name>/report.html``) from the pooled summary of
:func:`raycurate.pipelines.proving_ground.summarize_seeds`."""

from __future__ import annotations

from raycurate.report.charts import esc, table


def fmt(e: dict) -> str:
    """A difference with its interval: ``+0.123 [+0.045, +0.201]``."""
    return f"{e['value']:+.3f} [{e['low']:+.3f}, {e['high']:+.3f}]"


def seeds_text(seeds: list[int | str]) -> str:
    """``"seeds 0, 1, 2 (3 seeds)"`` / ``"1 seed (seed 0)"`` / ``"runs 0, 0-train-1 (2 runs: corpus seed-train
    seed)"``: which runs, and how many."""
    if any(isinstance(s, str) for s in seeds):
        return (f"runs {', '.join(str(s) for s in seeds)} ({len(seeds)} runs; "
                "&lt;corpus seed&gt;-train-&lt;train.seed&gt; repeats a corpus seed with another training seed)")
    if len(seeds) == 1:
        return f"1 seed (seed {seeds[0]})"
    return f"seeds {', '.join(str(s) for s in seeds)} ({len(seeds)} seeds)"


def _base_verdict(summary: dict) -> str:
    """One plain sentence: which fine-tuned models beat the base model pooled over the seeds (HTML)."""
    metric = esc(summary["metric"])
    versus = {name.removesuffix(" vs base"): c["pooled"] for name, c in summary["comparisons"].items()
              if name.endswith(" vs base")}
    if not versus:
        return f"<p>{metric}: the base model was not evaluated, so whether fine-tuning beat it is unknown.</p>"
    winners = [m for m, e in versus.items() if e["low"] > 0]
    if not winners:
        best = max(versus, key=lambda m: versus[m]["value"])
        return (f"<p><b>No fine-tuned arm beats the base model in {metric}</b> (pooled): the best, {esc(best)}, "
                f"minus base {fmt(versus[best])}.</p>")
    return (f"<p><b>{len(winners)} of {len(versus)} fine-tuned arms beat the base model in {metric}</b> (pooled), "
            "minus base: " + "; ".join(f"{esc(m)} {fmt(versus[m])}" for m in winners) + ".</p>")


def _metric_table(summary: dict) -> str:
    """The verdict against the base model and the per-seed / pooled table of one metric's summary."""
    seeds = summary["seeds"]
    with_t = any(c.get("over_runs") for c in summary["comparisons"].values())
    rows = [[name, *(fmt(c["per_seed"][str(s)]) if str(s) in c["per_seed"] else "" for s in seeds),
             fmt(c["pooled"]), *([fmt(c["over_runs"]) if c.get("over_runs") else ""] if with_t else []),
             f"{c['seeds_excluding_zero']} of {len(c['per_seed'])}"]
            for name, c in summary["comparisons"].items()]
    t_text = (" The t-interval over runs treats each run's difference as one draw; with runs that repeat a corpus "
              "seed under another training seed it includes training noise, which the question bootstrap does not."
              if with_t else "")
    oracle = summary["comparisons"].get("oracle: clean vs mixed")
    note = ""
    if oracle and not oracle["pooled"]["low"] > 0:
        note = ("<p><b>No oracle gap</b> (pooled clean minus mixed includes 0 or lies below it): a share of the gap "
                "closed is not meaningful here.</p>")
    return (f"<h2>{esc(summary['metric'])}</h2>" + _base_verdict(summary) + note
            + f"<p>Paired differences (A minus B) with 95% bootstrap intervals per corpus seed, and pooled over "
            f"{seeds_text(seeds)}, questions resampled within each seed. The last column counts the seeds whose own "
            f"interval excludes 0.{t_text}</p>"
            + table(["comparison (A vs B)", *(f"seed {s}" for s in seeds), "pooled",
                     *(["over runs (t, 95%)"] if with_t else []), "seeds whose interval excludes 0"], rows))


def _separation_table(separation: dict[str, dict]) -> str:
    """Corruption kind x run: the AUROC of the composition's ranking, clean rows vs that kind, and the lowest over the
    runs (the number a claim "separates every kind" rests on); empty without ``separation``."""
    if not separation:
        return ""
    runs = list(separation)
    by_kind = {run: separation[run].get("auroc_by_kind") or {} for run in runs}
    kinds = sorted({kind for found in by_kind.values() for kind in found})

    def cell(run: str, kind: str) -> str:
        v = by_kind[run].get(kind)
        return f"{v['auroc']:.2f} ({v['rows']})" if v else ""

    def lowest(kind: str) -> str:
        return f"{min(found[kind]['auroc'] for found in by_kind.values() if kind in found):.2f}"

    rows = [[kind, *(cell(r, kind) for r in runs), lowest(kind)] for kind in kinds]
    rows.append(["all corrupted rows", *(f"{separation[r]['auroc']:.2f}" if "auroc" in separation[r] else ""
                                         for r in runs),
                 f"{min(s['auroc'] for s in separation.values() if 'auroc' in s):.2f}"])
    return ("<h2>Which bad rows the recipe found</h2><p>AUROC of the composition's ranking, clean pool rows vs each "
            "corruption kind (the chance that a random clean row ranks above a random row of that kind: 0.5 is "
            "chance, 1 perfect), per run, with that kind's rows in brackets; rows a step dropped rank below every "
            "row it passed on. The last column is the lowest over the runs.</p>"
            + table(["corruption", *(f"run {r}" for r in runs), "lowest"], rows))


def render_proving_ground(summary: dict) -> str:
    """The proving ground's ``report.html``: each metric's verdict and per-seed / pooled table, and the composition
    arms' rows and tokens per seed."""
    blocks = list((summary.get("by_metric") or {}).values()) or [summary]
    body = ("<h1>raycurate proving ground</h1><p>Held-out "
            + " and ".join(esc(b["metric"]) for b in blocks)
            + f" over {seeds_text(summary['seeds'])}.</p>" + "".join(_metric_table(b) for b in blocks))
    budgets = summary.get("composition_budgets") or {}
    if budgets:
        arms = list(next(iter(budgets.values()))["arms"])
        body += ("<p>Composition arms: rows / response tokens per seed (T = the composition's tokens).</p>"
                 + table(["seed", "T", *arms], [[seed, b["budget_tokens"], *(
                     f"{b['arms'][a]['rows']} / {b['arms'][a]['response_tokens']}" if a in b["arms"] else ""
                     for a in arms)] for seed, b in budgets.items()]))
    body += _separation_table(summary.get("separation") or {})
    return ("<!doctype html><html lang='en'><head><meta charset='utf-8'><title>raycurate proving ground</title>"
            "<style>body{font-family:system-ui,sans-serif;margin:2rem auto;max-width:1100px}table{border-collapse:"
            "collapse;display:block;overflow-x:auto}td,th{border:1px solid #dde;padding:.25rem .6rem}</style>"
            f"</head><body>{body}</body></html>")
