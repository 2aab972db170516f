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
from raycurate.report.curation import aligned_scores, format_ci

COMPOSITION = "composition"


def score_arms(run_dir: str | Path, manifest: dict, arms: dict[str, dict], *, replicates: int = 2000,
               seed: int = 0) -> dict:
    """Held-out score of each arm and the paired difference composition minus arm.

    Args:
        run_dir: The run directory.
        manifest: Its manifest.
        arms: ``{arm: {"model": evaluated model name, ...}}`` with a ``composition`` arm.

    Returns:
        ``metric``, ``metric_label``, ``questions`` and ``arms``: each input entry plus ``score`` (mean with CI)
        and, except the composition, ``vs_composition`` (composition minus arm, paired over questions); ``{}``
        when the composition was not evaluated.
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
    return {"metric": metric, "metric_label": label, "questions": len(base), "arms": out}


def section_composition(run_dir: Path, manifest: dict) -> str:
    """The "Composition" table: each arm's rows, response tokens (share of the budget T), clean share, held-out
    score and composition minus arm."""
    block = (manifest.get("results") or {}).get("composition") or {}
    arms = block.get("arms") or {}
    if not arms:
        return ""
    budget = block.get("budget_tokens") or 0
    steps = " &rarr; ".join(esc(s) for s in block.get("steps", []))
    rows = []
    for name, arm in arms.items():
        tokens = arm.get("response_tokens", 0)
        share = "" if arm.get("clean_share") is None else f"{arm['clean_share']:.3f}"
        rows.append([name, arm.get("rows", ""), f"{tokens} ({tokens / budget:.3f})" if budget else tokens, share,
                     format_ci(arm.get("score")), format_ci(arm.get("vs_composition"), True)])
    label = esc(block.get("metric_label", "held-out score"))
    return (f"<h2 id='composition'>Composition</h2><p>Steps {steps} (keep fraction {block.get('keep_fraction')}, "
            f"BDS mode {esc(block.get('bds_mode', ''))}) against each step alone over the whole pool and seeded "
            f"random rows, every arm cut to the composition's T = {budget} response tokens. Held-out {label} on "
            f"{block.get('questions', '?')} questions, 95% paired bootstrap intervals; <b>*</b>: the interval of "
            "composition minus arm excludes 0.</p>"
            + table(["arm", "rows", "response tokens (/ T)", "clean share", label, "composition minus arm"], rows))
