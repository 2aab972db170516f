""""Did curation help?": each method against its matched baseline and the mixed corpus, with paired CIs.

Every evaluated model's held-out predictions are joined on the question id, so each difference is paired
(:func:`raycurate.algorithms.stats.paired_bootstrap_ci`); the per-question score is the sampled accuracy when the
run sampled answers, else greedy exact match.  :func:`curation_comparisons` builds the comparisons,
:func:`metric_block` the per-metric verdicts (does any model beat the base model, is there an oracle gap, the share
closed only when the oracle interval lies above 0), :func:`section_curation` the HTML, and :func:`record_curation`
stores the same numbers as ``results.curation`` in the manifest for ``raycurate inspect`` and the proving ground.
Why these metrics: docs/design.md, "The proving ground".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raycurate.algorithms.stats import (
    Estimate,
    bootstrap_mean_ci,
    gap_closed,
    paired_bootstrap_ci,
)
from raycurate.report.charts import esc, table

METRICS: tuple[tuple[str, str], ...] = (("sampled_accuracy", "sampled exact match"), ("correct", "greedy exact match"))


@dataclass(frozen=True)
class MethodSpec:
    """A curation method as it appears among the held-out models.

    Attributes:
        model: Held-out model name (``eval_<model>`` is its evaluation stage).
        label: What the report calls it.
        baseline: The model trained on a random choice at the same budget.
        stages: Name prefixes of the stages whose seconds count as the method's cost.
    """

    model: str
    label: str
    baseline: str | None
    stages: tuple[str, ...]


METHODS: tuple[MethodSpec, ...] = (
    MethodSpec("curate", "Curation (curate.steps toward the trusted set)", "curate_random",
               ("curate_", "train_curate", "eval_curate")),
    MethodSpec("bridge", "BRIDGE (token selection)", "random", ("bridge_", "train_bridge", "eval_bridge")),
    MethodSpec("rho1", "RHO-1 (excess loss, per example)", "random", ("baseline_rho1", "train_rho1")),
    MethodSpec("token_cleaning", "Token Cleaning (excess loss, corpus-wide)", "random",
               ("baseline_token_cleaning", "train_token_cleaning")),
    MethodSpec("independent", "surprisal + Token Cleaning (independent)", "random",
               ("baseline_independent", "train_independent")),
    MethodSpec("sequential", "surprisal -> Token Cleaning (sequential)", "random",
               ("baseline_sequential", "train_sequential")),
    MethodSpec("p2d", "P2D (examples + heads)", "p2d_random_data",
               ("p2d_proxy", "p2d_heads", "p2d_probe", "p2d_select", "p2d_rows", "train_p2d", "eval_p2d")),
    MethodSpec("bilevel_bds", "BDS (learned weights)", "bilevel_random",
               ("bilevel_bds", "train_bilevel_bds", "eval_bilevel_bds")),
    MethodSpec("bilevel_online", "BDS + BMO (online)", "bilevel_random",
               ("bilevel_online", "train_bilevel_online", "eval_bilevel_online")),
    MethodSpec("bilevel_dsir", "DSIR", "bilevel_random", ("bilevel_dsir", "train_bilevel_dsir")),
    MethodSpec("bilevel_less", "LESS", "bilevel_random", ("bilevel_less", "train_bilevel_less")),
)


#: The token-selection baselines of ``bridge.baselines`` other than random tokens (their models share the names);
#: each is compared with random tokens (its ``MethodSpec.baseline``) and with BRIDGE at the same budgets.
TOKEN_BASELINES: tuple[str, ...] = ("rho1", "token_cleaning", "independent", "sequential")


def _predictions(run_dir: Path, manifest: dict, model: str) -> dict[str, dict] | None:
    """``{question id: prediction row}`` of a model's held-out evaluation, or None when it did not run."""
    import pyarrow.parquet as pq

    record = (manifest.get("stages") or {}).get(f"eval_{model}") or {}
    relative = (record.get("outputs") or {}).get("predictions")
    if record.get("status") != "done" or not relative or not (run_dir / relative).exists():
        return None
    return {row["id"]: row for row in pq.read_table(run_dir / relative).to_pylist()}


def _primary_metric(predictions: dict[str, dict[str, dict]]) -> tuple[str, str]:
    for key, label in METRICS:
        if all(key in next(iter(rows.values()), {}) for rows in predictions.values()):
            return key, label
    raise ValueError("held-out predictions carry neither sampled_accuracy nor correct")


def _scores(rows: dict[str, dict], ids: list[str], metric: str) -> Any:
    import numpy as np

    return np.asarray([float(rows[i][metric]) for i in ids])


def _stage_seconds(manifest: dict, prefixes: tuple[str, ...]) -> float:
    return float(sum(rec.get("seconds", 0.0) for name, rec in (manifest.get("stages") or {}).items()
                     if name.startswith(prefixes)))


def _share_ci(share: float, n: int) -> Estimate:
    """Bootstrap interval of a share of ``n`` rows (resampling the rows: only the count of positives matters)."""
    import numpy as np

    positives = int(round(share * n))
    return bootstrap_mean_ci(np.r_[np.ones(positives), np.zeros(n - positives)])


def selection_quality(manifest: dict, model: str) -> dict[str, Any]:
    """Ground-truth quality of what the method selected or weighted, as the stages recorded it."""
    stages = manifest.get("stages") or {}
    if model == "bridge":
        m = (stages.get("bridge_select") or {}).get("metrics") or {}
        if "distractor_dropped_share" in m:
            return {"kind": "prompt tokens dropped, distractor vs relevant",
                    "value": m["distractor_dropped_share"], "reference": m.get("relevant_dropped_share"),
                    "budget": (f"{m.get('prompt_budget_ratio', 0):.0%} of prompt, "
                               f"{m.get('response_budget_ratio', 0):.0%} of response tokens")}
    if model == "p2d":
        m = (stages.get("p2d_select") or {}).get("metrics") or {}
        if m.get("precision_selected") is not None and m.get("selected"):
            ci = _share_ci(m["precision_selected"], int(m["selected"]))
            auroc = ""
            if m.get("auroc") is not None:
                low, high = m.get("auroc_ci95") or (float("nan"), float("nan"))
                auroc = f"; AUROC of P2D's row score, clean vs corrupted, {m['auroc']:.2f} [{low:.2f}, {high:.2f}]"
            return {"kind": "precision (clean share) of selected vs pool", "value": m["precision_selected"],
                    "low": ci.low, "high": ci.high, "reference": m.get("precision_pool"),
                    "budget": f"{m.get('selected')} of {m.get('pool')} rows{auroc}"}
    if model.startswith("bilevel_"):
        info = ((manifest.get("bilevel") or {}).get("methods") or {}).get(model.removeprefix("bilevel_")) or {}
        if info.get("auroc") is not None:
            low, high = info.get("auroc_ci95") or (None, None)
            return {"kind": "AUROC of weights, clean vs corrupted", "value": info["auroc"], "low": low, "high": high,
                    "budget": info.get("budget", "all rows, weighted")}
    return {}


def heldout_scores(run_dir: str | Path, manifest: dict) -> tuple[str, str, dict[str, Any]] | None:
    """Per-question scores of every evaluated model that the comparisons use, aligned on the question ids.

    Returns:
        ``(metric key, metric label, {model: (Q,) float array})`` with the same Q questions in the same order for
        every model, or None when the run has no mixed-corpus model to compare with.
    """
    names = ["mixed", "clean", "base"] + [n for s in METHODS for n in (s.model, s.baseline) if n]
    loaded = aligned_scores(run_dir, manifest, names)
    if loaded is None or "mixed" not in loaded[2]:
        return None
    return loaded


def evaluated_models(manifest: dict) -> list[str]:
    """Every model with a finished held-out evaluation (stage ``eval_<model>`` with predictions), in run order."""
    return [name.removeprefix("eval_") for name, rec in (manifest.get("stages") or {}).items()
            if name.startswith("eval_") and rec.get("status") == "done"
            and "predictions" in (rec.get("outputs") or {})]


def aligned_scores(run_dir: str | Path, manifest: dict,
                   names: list[str]) -> tuple[str, str, dict[str, Any]] | None:
    """Per-question scores of the ``names`` that were evaluated, on the questions they all answered, in one order.

    Returns:
        ``(metric key, metric label, {model: (Q,) float array})``, or None when none of them was evaluated.
    """
    run_dir = Path(run_dir)
    predictions = {n: p for n in dict.fromkeys(names) if (p := _predictions(run_dir, manifest, n)) is not None}
    if not predictions:
        return None
    metric, label = _primary_metric(predictions)
    ids = sorted(set.intersection(*(set(rows) for rows in predictions.values())))
    return metric, label, {name: _scores(rows, ids, metric) for name, rows in predictions.items()}


#: The metrics the verdicts state separately, in the order they are stated (greedy first).
VERDICT_METRICS: tuple[str, ...] = ("correct", "sampled_accuracy")
BASE = "base"
#: What the report calls the arms of ``pipeline: curate`` (arm name; its model is ``curate`` / ``curate_<arm>``).
ARM_NAMES: dict[str, str] = {"composition": "composition", "bds": "BDS alone", "p2d": "P2D alone",
                             "dedup": "dedup alone", "bridge": "BRIDGE alone", "random": "random rows"}


def display_name(model: str) -> str:
    """What the report calls an evaluated model: ``curate`` is the composition, ``curate_<arm>`` that arm."""
    if model == "curate":
        return ARM_NAMES["composition"]
    if model.startswith("curate_"):
        arm = model.removeprefix("curate_")
        return ARM_NAMES.get(arm, f"{arm} alone")
    return model


def scores_by_metric(run_dir: str | Path, manifest: dict,
                     names: list[str]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Per-question scores of the evaluated ``names`` for every metric they all carry, on their common questions.

    Returns:
        ``{metric key: (metric label, {model: (Q,) float array})}`` in :data:`VERDICT_METRICS` order (greedy exact
        match, then sampled exact match when the run sampled answers); ``{}`` when none was evaluated.
    """
    run_dir = Path(run_dir)
    predictions = {n: p for n in dict.fromkeys(names) if (p := _predictions(run_dir, manifest, n)) is not None}
    if not predictions:
        return {}
    ids = sorted(set.intersection(*(set(rows) for rows in predictions.values())))
    labels = dict(METRICS)
    return {key: (labels[key], {name: _scores(rows, ids, key) for name, rows in predictions.items()})
            for key in VERDICT_METRICS
            if all(key in next(iter(rows.values()), {}) for rows in predictions.values())}


def oracle_is_gap(oracle: dict | None) -> bool:
    """Whether the oracle difference (clean minus mixed) is a gap at all: its interval lies above 0."""
    return oracle is not None and bool(oracle) and oracle["low"] > 0


def metric_block(label: str, scores: dict[str, Any], *, pairs: dict[str, tuple[str, str]] | None = None,
                 replicates: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Absolute scores and the base / oracle comparisons of one metric.

    Args:
        label: The metric's name in the report.
        scores: ``{model: (Q,) per-question scores}`` aligned on the same questions.
        pairs: Further paired differences to estimate, ``{name: (treatment model, control model)}`` (skipped when a
            model is missing).

    Returns:
        ``label``, ``questions``, ``models`` (mean with CI), ``vs_base`` (each other model minus ``base``, paired;
        empty without a base model), ``beats_base`` (the models whose interval of that difference lies above 0),
        ``oracle`` (clean minus mixed, or None), ``gap_closed`` (``{model: share}``, only when the oracle interval
        lies above 0: else there is no gap to close) and ``pairs``.
    """
    def paired(a: str, b: str) -> dict:
        return paired_bootstrap_ci(scores[a], scores[b], replicates=replicates, seed=seed).as_dict()

    vs_base = {m: paired(m, BASE) for m in scores if m != BASE} if BASE in scores else {}
    oracle = paired("clean", "mixed") if "clean" in scores and "mixed" in scores else None
    means = {m: float(s.mean()) for m, s in scores.items()}
    closed = ({m: gap_closed(means[m], means["mixed"], means["clean"]) for m in scores
               if m not in (BASE, "mixed", "clean")} if oracle_is_gap(oracle) else {})
    return {"label": label, "questions": len(next(iter(scores.values()))),
            "models": {m: bootstrap_mean_ci(s, replicates=replicates, seed=seed).as_dict() for m, s in scores.items()},
            "vs_base": vs_base, "beats_base": [m for m, e in vs_base.items() if e["low"] > 0], "oracle": oracle,
            "gap_closed": closed,
            "pairs": {name: paired(a, b) for name, (a, b) in (pairs or {}).items() if a in scores and b in scores}}


def base_sentence(block: dict, names: dict[str, str] | None = None) -> str:
    """One plain sentence (HTML): which fine-tuned models beat the base model in this metric, with paired CIs.

    Args:
        block: A :func:`metric_block`.
        names: Display name per model (default: the model name).
    """
    names = names or {}
    label, models, vs_base = esc(block["label"]), block["models"], block["vs_base"]
    if BASE not in models:
        return f"<p>{label}: the base model was not evaluated, so whether fine-tuning beat it is unknown.</p>"
    if not vs_base:
        return f"<p>{label}: only the base model was evaluated ({format_ci(models[BASE])}).</p>"

    def named(m: str) -> str:
        return esc(names.get(m, m))

    base = f"base model {format_ci(models[BASE])}"
    winners = block["beats_base"]
    if not winners:
        best = max(vs_base, key=lambda m: vs_base[m]["value"])
        return (f"<p class='verdict'><b class='bad'>No fine-tuned arm beats the base model in {label}</b>: "
                f"{base}; the best fine-tuned arm, {named(best)}, scores {format_ci(models[best])} "
                f"({named(best)} minus base {format_ci(vs_base[best], True)}). Every gain below is relative to "
                "models that are no better than not fine-tuning at all.</p>")
    listed = "; ".join(f"{named(m)} {format_ci(vs_base[m], True)}" for m in winners)
    others = [m for m in vs_base if m not in winners]
    rest = f" The other {len(others)} ({', '.join(named(m) for m in others)}) do not." if others else ""
    return (f"<p class='verdict'><b>{len(winners)} of {len(vs_base)} fine-tuned arms beat the base model in "
            f"{label}</b> ({base}), minus base: {listed}.{rest}</p>")


def oracle_sentence(block: dict) -> str:
    """The oracle gap (clean minus mixed) of one metric, saying plainly when there is none to close."""
    oracle, label = block.get("oracle"), esc(block["label"])
    if not oracle:
        return (f"<p>{label}: no oracle gap measured (the run has no model trained on the clean rows and one on "
                "all rows): the share of the gap closed is undefined.</p>")
    text = f"<p>Oracle gap in {label} (SFT on the clean rows minus SFT on all rows): <b>{format_ci(oracle, True)}</b>"
    if not oracle_is_gap(oracle):
        where = "lies below 0" if oracle["high"] < 0 else "includes 0"
        return (text + f". <span class='bad'>No oracle gap: its interval {where}, so the share of the gap closed is "
                "not meaningful and no method can show a gain over the mixed corpus here.</span></p>")
    text += ". A method can close at most this gap"
    if "clean" in block["vs_base"] and "clean" not in block["beats_base"]:
        text += (" <span class='bad'>but the clean model itself does not beat the base model, so closing it is no "
                 "gain over not fine-tuning</span>")
    return text + ".</p>"


def gap_closed_text(block: dict, model: str) -> str:
    """A model's share of the oracle gap closed, or why it has none ("n/a: no oracle gap")."""
    if not oracle_is_gap(block.get("oracle")):
        return "n/a: no oracle gap"
    share = block["gap_closed"].get(model)
    if share is None:
        return ""
    below = model in block["vs_base"] and model not in block["beats_base"]
    return f"{share:.2f}" + (" (not above base)" if below else "")


def curation_comparisons(run_dir: str | Path, manifest: dict, *, replicates: int = 2000, seed: int = 0) -> dict:
    """Every method's held-out score against its matched random baseline and the mixed corpus, paired by question.

    Returns:
        ``{}`` when the run has no mixed-corpus model; else ``metric``, ``metric_label``, ``questions``,
        ``models`` (each model's mean with its CI), ``oracle`` (clean minus mixed), ``methods`` (one entry per
        method that ran: its score, differences vs its baseline, vs mixed and vs base, share of the oracle gap
        closed (only when the oracle interval lies above 0), selection quality, seconds) and ``by_metric``
        (:func:`metric_block` of greedy and of sampled exact match).  Estimates are :meth:`Estimate.as_dict`
        dicts.
    """
    loaded = heldout_scores(run_dir, manifest)
    if loaded is None:
        return {}
    metric, label, scores = loaded
    ids_count = len(next(iter(scores.values())))

    def paired(a: str, b: str) -> Estimate:
        return paired_bootstrap_ci(scores[a], scores[b], replicates=replicates, seed=seed)

    out: dict[str, Any] = {
        "metric": metric, "metric_label": label, "questions": ids_count,
        "models": {n: bootstrap_mean_ci(s, replicates=replicates, seed=seed).as_dict() for n, s in scores.items()},
    }
    if "clean" in scores:
        out["oracle"] = paired("clean", "mixed").as_dict()
    everyone = list(dict.fromkeys([*scores, *evaluated_models(manifest)]))  # e.g. a curate run's arms too
    out["by_metric"] = {key: metric_block(lab, sc, replicates=replicates, seed=seed)
                        for key, (lab, sc) in scores_by_metric(run_dir, manifest, everyone).items()}
    methods = []
    for spec in METHODS:
        if spec.model not in scores:
            continue
        entry: dict[str, Any] = {"model": spec.model, "label": spec.label, "baseline": spec.baseline,
                                 "score": out["models"][spec.model], "vs_mixed": paired(spec.model, "mixed").as_dict(),
                                 "selection": selection_quality(manifest, spec.model),
                                 "seconds": _stage_seconds(manifest, spec.stages)}
        if spec.baseline in scores:
            entry["vs_baseline"] = paired(spec.model, spec.baseline).as_dict()
        if BASE in scores:
            entry["vs_base"] = paired(spec.model, BASE).as_dict()
        if oracle_is_gap(out.get("oracle")):  # no gap (interval includes 0 or lies below): nothing to close
            entry["gap_closed"] = gap_closed(float(scores[spec.model].mean()), float(scores["mixed"].mean()),
                                             float(scores["clean"].mean()))
        methods.append(entry)
    out["methods"] = methods
    return out


def record_curation(run: Any, split: str = "heldout") -> dict:
    """Compute :func:`curation_comparisons` for an open run and store it as the manifest's ``results.curation``
    (``results.curation_validation`` when the evaluations scored the validation questions, so the report's
    held-out verdicts never show numbers that settings were chosen on)."""
    manifest = run.load_manifest()
    comparisons = curation_comparisons(run.root, manifest)
    if comparisons:
        results = manifest.get("results") or {}
        run.update_manifest(results={**results, "curation" if split == "heldout" else f"curation_{split}": comparisons})
    return comparisons


def format_ci(est: dict | None, signed: bool = False) -> str:
    """``value [low, high]`` of an estimate dict; ``signed`` (a difference) adds `` *`` when the interval excludes
    0 and `` (noise)`` when it does not."""
    if not est:
        return ""
    sign = "+" if signed else ""
    verdict = "" if not signed else (" *" if est["low"] > 0 or est["high"] < 0 else " (noise)")
    return f"{est['value']:{sign}.3f} [{est['low']:{sign}.3f}, {est['high']:{sign}.3f}]{verdict}"


def _points(est: dict) -> str:
    """A difference of shares as signed points with its interval: ``+17.8 [+14.4, +21.4]``."""
    return f"{100 * est['value']:+.1f} [{100 * est['low']:+.1f}, {100 * est['high']:+.1f}]"


def console_summary(manifest: dict) -> list[str]:
    """The demo's first lines: each method's held-out difference from fine-tuning on every row and from its random
    baseline, in points of the primary metric; the methods whose gain over every row holds (interval above 0)
    first, the rest marked "within noise" or "worse"."""
    curation = (manifest.get("results") or {}).get("curation") or {}
    methods = [m for m in curation.get("methods", []) if m.get("vs_mixed")]
    if not methods:
        return []

    def verdict(est: dict) -> str:
        return "" if est["low"] > 0 else (" (worse)" if est["high"] < 0 else " (within noise)")

    methods.sort(key=lambda m: (m["vs_mixed"]["low"] <= 0, -m["vs_mixed"]["value"]))
    lines = [f"Did curation help? {curation['metric_label']} on {curation['questions']} held-out questions, points "
             "vs fine-tuning on every row, 95% paired intervals:"]
    for m in methods:
        line = f"  {m['label']}: {_points(m['vs_mixed'])}{verdict(m['vs_mixed'])}"
        if m.get("vs_baseline") and m.get("baseline"):
            line += f"; vs {display_name(m['baseline'])} {_points(m['vs_baseline'])}{verdict(m['vs_baseline'])}"
        lines.append(line)
    return lines


def _selection_text(sel: dict) -> str:
    if not sel:
        return ""
    text = f"{sel['kind']}: {sel['value']:.3f}"
    if sel.get("low") is not None:
        text += f" [{sel['low']:.3f}, {sel['high']:.3f}]"
    if sel.get("reference") is not None:
        text += f" vs {sel['reference']:.3f}"
    return text


def section_curation(run_dir: Path, manifest: dict) -> str:
    """The report's first answer: does any fine-tuned model beat the base model (greedy and sampled exact match
    separately), is there an oracle gap, and did each method give better data and a better model than its
    baseline?"""
    comparisons = curation_comparisons(run_dir, manifest)
    if not comparisons:
        return ""
    metric, n = comparisons["metric_label"], comparisons["questions"]
    by_metric = comparisons.get("by_metric") or {}
    parts = ["<h2 id='curation'>Did curation help?</h2>"]
    names = {m: display_name(m) for b in by_metric.values() for m in b["models"]}
    parts += [base_sentence(block, names) for block in by_metric.values()]
    parts.append(f"<p>Held-out scores on {n} questions (exact match: the share of questions whose final answer is "
                 "right, greedy or over sampled answers); 95% paired bootstrap intervals over questions (one corpus "
                 "seed: rerun <code>jobs/proving_ground.yaml</code> for several). <b>*</b> marks a difference whose "
                 "interval excludes 0; <i>(noise)</i> one that does not. Models: base (not fine-tuned), mixed "
                 "(fine-tuned, SFT, on every row of the pool), clean (SFT on the pool's clean rows only: what "
                 "perfect curation could reach), and each method. The oracle gap, clean minus mixed, is the most "
                 "that removing bad rows can gain.</p>")
    parts += [oracle_sentence(block) for block in by_metric.values()]
    if (manifest.get("results") or {}).get("composition"):
        parts.append("<p>Each arm's score, its difference from random rows and its share of the gap closed: "
                     "<a href='#composition'>Composition</a>.</p>")
    elif by_metric:
        parts.append(scores_table(by_metric, names))
    primary = next((b for k, b in by_metric.items() if k == comparisons["metric"]), None)
    rows = [[m["label"], m["selection"].get("budget", ""), _selection_text(m["selection"]), format_ci(m["score"]),
             m["baseline"] or "", format_ci(m.get("vs_baseline"), True), format_ci(m["vs_mixed"], True),
             format_ci(m.get("vs_base"), True), gap_closed_text(primary, m["model"]) if primary else "",
             f"{m['seconds']:.0f}"]
            for m in comparisons["methods"]]
    if rows:
        parts.append(f"<p>Methods, in held-out {esc(metric)}. Baseline: the same budget spent on random choices; "
                     "vs baseline / vs mixed / vs base: the method's score minus theirs; share of oracle gap closed: "
                     "(method &minus; mixed) / (clean &minus; mixed); selection quality: what the method kept, judged "
                     "by the embedded corpus's labels.</p><div class='wide'>" + table(
            ["method", "budget", "selection quality (ground truth)", metric, "baseline", "vs baseline",
             "vs mixed", "vs base", "share of oracle gap closed", "seconds"], rows) + "</div>")
    return "".join(parts)


def scores_table(by_metric: dict[str, dict], names: dict[str, str] | None = None) -> str:
    """Absolute held-out score of every model per metric, and each model minus the base model (paired)."""
    names = names or {}
    blocks = list(by_metric.values())
    models = sorted(dict.fromkeys(m for b in blocks for m in b["models"]), key=lambda m: m != BASE)  # base first
    header = ["model"] + [h for b in blocks for h in (b["label"], f"{b['label']} minus base")]
    rows = [[names.get(m, m), *(cell for b in blocks for cell in (
        format_ci(b["models"].get(m)), format_ci(b["vs_base"].get(m), True)))] for m in models]
    return "<div class='wide'>" + table(header, rows) + "</div>"
