"""The composition (``pipeline: curate``) against each of its steps alone and random rows, at a matched budget of
response tokens: held-out scores with paired bootstrap CIs of *composition minus arm*.

The pipeline records what each arm trained on (rows, response tokens, clean share); :func:`score_arms` adds the
held-out scores from the arms' ``eval_<model>/predictions.parquet`` (joined on the question id, as
:mod:`raycurate.report.curation`), and the result is the manifest's ``results.composition``, which
:func:`section_composition` renders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from raycurate.algorithms.stats import bootstrap_mean_ci, paired_bootstrap_ci
from raycurate.report.charts import esc, table
from raycurate.report.curation import (
    ARM_NAMES,
    BASE,
    aligned_scores,
    base_sentence,
    format_ci,
    gap_closed_text,
    metric_block,
    oracle_is_gap,
    oracle_sentence,
    scores_by_metric,
    scores_table,
)

COMPOSITION = "composition"
RANDOM = "random"
#: The reference models a curate run trains beside its arms (``eval_<model>``): not fine-tuned, SFT on the whole
#: pool, SFT on the pool's clean rows.
REFERENCES: dict[str, str] = {BASE: "base model", "mixed": "mixed (all pool rows)", "clean": "clean (clean pool rows)"}


def display_names(arms: dict[str, dict]) -> dict[str, str]:
    """``{evaluated model: what the report calls it}`` of the reference models and the arms."""
    return {**REFERENCES, **{arm["model"]: ARM_NAMES.get(name, f"{name} alone") for name, arm in arms.items()}}


def composition_metrics(run_dir: str | Path, manifest: dict, arms: dict[str, dict], *, replicates: int = 2000,
                        seed: int = 0) -> dict[str, dict]:
    """Greedy and sampled exact match of the reference models and every arm (:func:`metric_block`), with each
    arm minus the random rows (``pairs["<arm> vs random"]``, e.g. ``"bds vs random"``: BDS alone minus random rows
    at the matched budget)."""
    if RANDOM in arms:
        random = arms[RANDOM]["model"]
        pairs = {f"{name} vs random": (arm["model"], random) for name, arm in arms.items() if name != RANDOM}
    else:
        pairs = {}
    loaded = scores_by_metric(run_dir, manifest, list(display_names(arms)))
    return {key: metric_block(label, scores, pairs=pairs, replicates=replicates, seed=seed)
            for key, (label, scores) in loaded.items()}


def score_arms(run_dir: str | Path, manifest: dict, arms: dict[str, dict], *, replicates: int = 2000,
               seed: int = 0) -> dict:
    """Held-out score of each arm and the paired difference composition minus arm.

    Args:
        run_dir: The run directory.
        manifest: Its manifest.
        arms: ``{arm: {"model": evaluated model name, ...}}`` with a ``composition`` arm.

    Returns:
        ``metric``, ``metric_label``, ``questions``, ``arms`` (each input entry plus ``score``, mean with CI, and,
        except the composition, ``vs_composition``: composition minus arm, paired over questions) and
        ``by_metric`` (:func:`composition_metrics`: absolute scores, minus base, the oracle gap, each arm minus
        random rows, share of the gap closed); ``{}`` when the composition was not evaluated.
    """
    loaded = aligned_scores(run_dir, manifest, [a["model"] for a in arms.values()])
    if loaded is None or arms.get(COMPOSITION, {}).get("model") not in loaded[2]:
        return {}
    metric, label, scores = loaded
    base = scores[arms[COMPOSITION]["model"]]
    out: dict[str, Any] = {}
    for name, arm in arms.items():
        entry = dict(arm)
        if arm["model"] in scores:
            entry["score"] = bootstrap_mean_ci(scores[arm["model"]], replicates=replicates, seed=seed).as_dict()
            if name != COMPOSITION:
                entry["vs_composition"] = paired_bootstrap_ci(base, scores[arm["model"]], replicates=replicates,
                                                              seed=seed).as_dict()
        out[name] = entry
    return {"metric": metric, "metric_label": label, "questions": len(base), "arms": out,
            "by_metric": composition_metrics(run_dir, manifest, arms, replicates=replicates, seed=seed)}


def section_composition(run_dir: Path, manifest: dict) -> str:
    """The "Composition" section: whether any arm beats the base model, the absolute scores, the oracle gap, each
    arm minus random rows (BDS alone among them), the share of the gap closed, and the arms' table (rows, response
    tokens and share of the budget T, clean share, held-out score, composition minus arm)."""
    block = (manifest.get("results") or {}).get("composition") or {}
    arms = block.get("arms") or {}
    if not arms:
        return ""
    budget = block.get("budget_tokens") or 0
    steps = " &rarr; ".join(esc(s) for s in block.get("steps", []))
    keep = block.get("keep_fraction")
    settings = [f"each ranking step keeps {keep:.0%} of the rows it receives"] if isinstance(keep, float) else []
    if "bds" in block.get("steps", []):
        settings.append(f"BDS mode {esc(block.get('bds_mode', ''))}")
    rows = []
    for name, arm in arms.items():
        tokens = arm.get("response_tokens", 0)
        share = "" if arm.get("clean_share") is None else f"{arm['clean_share']:.3f}"
        rows.append([ARM_NAMES.get(name, name), arm.get("rows", ""),
                     f"{tokens} ({tokens / budget:.3f})" if budget else tokens, share, format_ci(arm.get("score")),
                     format_ci(arm.get("vs_composition"), True)])
    label = esc(block.get("metric_label", "held-out score"))
    by_metric = composition_metrics(run_dir, manifest, arms)
    return (f"<h2 id='composition'>Composition</h2><p>The steps {steps} applied one after another"
            f"{' (' + '; '.join(settings) + ')' if settings else ''}, compared with each step alone over the whole "
            "pool and with random rows. Each of these alternatives (an arm) is cut to the same number of response "
            f"tokens as the composition trains on (T = {budget}), so they differ in which tokens they keep, not how "
            "many. 95% paired bootstrap intervals over the held-out questions; <b>*</b>: the interval of a difference "
            "excludes 0, <i>(noise)</i>: it does not.</p>"
            + _verdicts(by_metric, arms, list(block.get("steps", [])))
            + f"<h3>Arms at the matched budget</h3><p>Held-out {label} on {block.get('questions', '?')} "
            "questions.</p>"
            + table(["arm", "rows", "response tokens (/ T)", "clean share", label, "composition minus arm"], rows)
            + _separation(block.get("separation") or {}))


def _separation(separation: dict) -> str:
    """How well the composition's ranking tells clean rows from each corruption kind (empty without labels)."""
    from raycurate.report.sections import auroc_kind_table

    by_kind = separation.get("auroc_by_kind") or {}
    if not by_kind:
        return ""
    return ("<h3>Which bad rows the steps found</h3><p>AUROC of the steps' ranking, clean rows vs each kind of "
            "corruption in the pool (the chance that a random clean row ranks above a random corrupted one: 0.5 is "
            f"chance, 1 perfect); overall {separation.get('auroc', float('nan')):.2f}. Rows a step dropped rank "
            "below every row it passed on.</p>" + auroc_kind_table(by_kind, digits=2))


def _verdicts(by_metric: dict[str, dict], arms: dict[str, dict], steps: list[str]) -> str:
    """Per metric: does any arm beat the base model, the oracle gap, each arm minus random rows and the share of
    the gap closed; then the absolute scores of every model."""
    if not by_metric:
        return "<p>No held-out evaluation of the arms: nothing to compare.</p>"
    names = display_names(arms)
    parts = []
    for block in by_metric.values():
        label = esc(block["label"])
        items = [base_sentence(block, names), oracle_sentence(block)]
        if RANDOM not in arms:
            items.append("<p>No random-rows arm in this run (<code>curate.compare: false</code>).</p>")
        elif steps == ["bds"]:
            items.append("<p>The composition is one step, BDS: composition minus random rows below is BDS alone "
                         "minus random rows.</p>")
        elif "bds" not in arms:
            items.append(f"<p>BDS alone is not an arm of this run (steps {esc(' -> '.join(steps))}).</p>")
        versus = [f"{esc(ARM_NAMES.get(name, name))} {format_ci(block['pairs'][f'{name} vs random'], True)}"
                  for name in arms if f"{name} vs random" in block["pairs"]]
        if versus:
            items.append(f"<p>Minus random rows at the matched budget, in {label}: " + "; ".join(versus) + ".</p>")
        shares = "; ".join(f"{esc(names[a['model']])} {gap_closed_text(block, a['model'])}" for a in arms.values()
                           if a["model"] in block["models"])
        if block.get("oracle") is None:
            items.append(f"<p>Share of the oracle gap closed in {label}: undefined (no mixed and clean models in "
                         "this run).</p>")
        elif not oracle_is_gap(block["oracle"]):
            items.append(f"<p>Share of the oracle gap closed in {label}: not meaningful (no oracle gap).</p>")
        elif shares:
            items.append(f"<p>Share of the oracle gap closed in {label}, (arm &minus; mixed) / (clean &minus; "
                         f"mixed): {shares}.</p>")
        parts.append(f"<h3>{label.capitalize()}</h3>" + "".join(items))
    return "".join(parts) + "<h3>Absolute scores</h3>" + scores_table(by_metric, names)
