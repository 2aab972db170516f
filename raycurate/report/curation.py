""""Did curation help?": each method against its matched baseline and the mixed corpus, with paired CIs.

The held-out predictions of every evaluated model (``eval_<model>/predictions.parquet``) are joined on the question
id, so every difference is paired: :func:`raycurate.algorithms.stats.paired_bootstrap_ci` resamples questions
and keeps both models' scores on each.  The per-question score is the share of sampled answers that are right
(``sampled_accuracy``) when the run sampled answers, else greedy exact match (``correct``).

The same numbers are stored in the manifest (``results.curation``) by :func:`record_curation`, so ``raycurate
inspect``, the seed loop of ``jobs/proving_ground.yaml`` and the closing notes read them without re-computing.
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
    MethodSpec("bridge", "BRIDGE (token selection)", "random", ("bridge_", "train_bridge", "eval_bridge")),
    MethodSpec("token_cleaning", "Token Cleaning", "random", ("baseline_token_cleaning", "train_token_cleaning")),
    MethodSpec("p2d", "P2D (examples + heads)", "p2d_random_data",
               ("p2d_proxy", "p2d_heads", "p2d_probe", "p2d_select", "p2d_rows", "train_p2d", "eval_p2d")),
    MethodSpec("bilevel_bds", "BDS (learned weights)", "bilevel_random",
               ("bilevel_bds", "train_bilevel_bds", "eval_bilevel_bds")),
    MethodSpec("bilevel_online", "BDS + BMO (online)", "bilevel_random",
               ("bilevel_online", "train_bilevel_online", "eval_bilevel_online")),
    MethodSpec("bilevel_dsir", "DSIR", "bilevel_random", ("bilevel_dsir", "train_bilevel_dsir")),
    MethodSpec("bilevel_less", "LESS", "bilevel_random", ("bilevel_less", "train_bilevel_less")),
)


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
                    "budget": (f"rho_p {m.get('prompt_budget_ratio', 0):.2f}, "
                               f"rho_r {m.get('response_budget_ratio', 0):.2f}")}
    if model == "p2d":
        m = (stages.get("p2d_select") or {}).get("metrics") or {}
        if m.get("precision_selected") is not None and m.get("selected"):
            ci = _share_ci(m["precision_selected"], int(m["selected"]))
            return {"kind": "precision (clean share) of selected vs pool", "value": m["precision_selected"],
                    "low": ci.low, "high": ci.high, "reference": m.get("precision_pool"),
                    "budget": f"{m.get('selected')} of {m.get('pool')} rows"}
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


def curation_comparisons(run_dir: str | Path, manifest: dict, *, replicates: int = 2000, seed: int = 0) -> dict:
    """Every method's held-out score against its matched random baseline and the mixed corpus, paired by question.

    Returns:
        ``{}`` when the run has no mixed-corpus model; else ``metric``, ``metric_label``, ``questions``,
        ``models`` (each model's mean with its CI), ``oracle`` (clean minus mixed) and ``methods`` (one entry per
        method that ran: its score, differences vs its baseline and vs mixed, share of the oracle gap closed,
        selection quality, seconds).  Estimates are :meth:`Estimate.as_dict` dicts.
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
        if "clean" in scores:
            entry["gap_closed"] = gap_closed(float(scores[spec.model].mean()), float(scores["mixed"].mean()),
                                             float(scores["clean"].mean()))
        methods.append(entry)
    out["methods"] = methods
    return out


def record_curation(run: Any) -> dict:
    """Compute :func:`curation_comparisons` for an open run and store it as the manifest's ``results.curation``."""
    manifest = run.load_manifest()
    comparisons = curation_comparisons(run.root, manifest)
    if comparisons:
        results = manifest.get("results") or {}
        run.update_manifest(results={**results, "curation": comparisons})
    return comparisons


def format_ci(est: dict | None, signed: bool = False) -> str:
    """``value [low, high]`` of an estimate dict; ``signed`` (a difference) adds `` *`` when the interval excludes
    0 and `` (noise)`` when it does not."""
    if not est:
        return ""
    sign = "+" if signed else ""
    verdict = "" if not signed else (" *" if est["low"] > 0 or est["high"] < 0 else " (noise)")
    return f"{est['value']:{sign}.3f} [{est['low']:{sign}.3f}, {est['high']:{sign}.3f}]{verdict}"


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
    """The report's first answer: did each method give better data and a better model than its baseline?"""
    comparisons = curation_comparisons(run_dir, manifest)
    if not comparisons:
        return ""
    metric, n = comparisons["metric_label"], comparisons["questions"]
    models = comparisons["models"]
    parts = [f"<h2 id='curation'>Did curation help?</h2><p>Held-out {esc(metric)} on {n} questions; 95% paired "
             "bootstrap intervals over questions (one corpus seed: rerun <code>jobs/proving_ground.yaml</code> for "
             "several). <b>*</b> marks a difference whose interval excludes 0; <i>(noise)</i> one that does not.</p>"]
    oracle = comparisons.get("oracle")
    if oracle:
        parts.append(f"<p>Oracle gap (SFT on the clean rows minus SFT on all rows): <b>{format_ci(oracle, True)}</b>; "
                     f"mixed {format_ci(models['mixed'])}, clean {format_ci(models['clean'])}. "
                     + ("A method can close at most this gap." if oracle["low"] > 0 else
                        "<span class='bad'>The interval includes 0: on this corpus no method can show a gain "
                        "over the mixed corpus.</span>") + "</p>")
    rows = [[m["label"], m["selection"].get("budget", ""), _selection_text(m["selection"]), format_ci(m["score"]),
             m["baseline"] or "", format_ci(m.get("vs_baseline"), True), format_ci(m["vs_mixed"], True),
             "" if m.get("gap_closed") is None else f"{m['gap_closed']:.2f}", f"{m['seconds']:.0f}"]
            for m in comparisons["methods"]]
    if rows:
        parts.append("<div class='wide'>" + table(
            ["method", "budget", "selection quality (ground truth)", metric, "baseline", "vs baseline",
             "vs mixed", "gap closed", "seconds"], rows) + "</div>")
    return "".join(parts)
