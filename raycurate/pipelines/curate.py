"""Composable curation: ``pipeline: curate`` runs ``curate.steps`` in order (e.g. ``[dedup, reference]``,
``[dedup, bds, bridge]``), then one SFT on what they kept, and compares it with each step alone.

:func:`compose_pool` scores the whole ``selection`` pool once per step (:func:`score_step`; the trusted
reference: :func:`reference_step`) and applies the steps in order
(:func:`raycurate.algorithms.composition.compose`); :func:`matched_arms` / :func:`matched_bridge` cut each step
alone to the composition's response-token budget; :func:`train_arms` trains and evaluates every arm (plus base,
``mixed`` and ``clean`` references with ``curate.compare``) and :func:`record_composition` writes
``results.composition``.  :func:`run_curate` is the pipeline, :func:`run_curate_in_demo` its demo part.
Decisions (pool, score once, weights, matched budget, references): docs/design.md, "Composable curation".
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

    from raycurate.algorithms.composition import Step
    from raycurate.config.schema import JobConfig
    from raycurate.config.train import TrainConfig
    from raycurate.rundir import RunDir

log = logging.getLogger("raycurate")

COMPOSITION_MODEL = "curate"


def score_step(run: RunDir, cfg: JobConfig, name: str) -> tuple[Step, dict]:
    """Run one example-level step's stages over the whole pool.

    Returns:
        (:class:`raycurate.algorithms.composition.Step`, info recorded in the manifest).
    """
    from raycurate.algorithms.composition import Step
    from raycurate.config.curate import POOL_SPLIT

    if name == "dedup":
        from raycurate.stages.dedup import dedup_stage, flagged_ids

        record = dedup_stage(run, "curate_dedup", tokens_stage="tokenize", split_column="split",
                             reference_split=cfg.bilevel.validation_split, candidate_split=POOL_SPLIT,
                             threshold=cfg.curate.dedup_threshold, seed=cfg.curate.seed,
                             reference_stage=trusted_table(cfg), measure=cfg.curate.dedup_similarity,
                             keep=cfg.curate.dedup_keep, num_perm=128, bands=32)
        return Step(name, dropped=frozenset(flagged_ids(run, "curate_dedup"))), dict(record["metrics"])
    if name == "bds":
        from raycurate.pipelines.bilevel import adapter_spec, bilevel_train_config, split_rows
        from raycurate.stages.bilevel import bds_stage, final_weights, weight_analysis

        # score the whole pool: near-duplicates are the dedup step's job, not a filter inside BDS
        bds_cfg = dataclasses.replace(cfg, bilevel=dataclasses.replace(cfg.bilevel, dedup_threshold=None))
        split_rows(run, bds_cfg)
        bds_stage(run, "curate_bds", candidate_stage="bilevel_candidate_rows",
                  validation_stage="bilevel_validation_rows", base_stage="base_model",
                  train_cfg=bilevel_train_config(bds_cfg), bilevel=bds_cfg.bilevel,
                  adapter=adapter_spec(bds_cfg.bilevel), online=False)
        analysis = weight_analysis(run, "curate_bds", "bilevel_candidate_rows")
        info = {k: analysis[k] for k in ("auroc", "auroc_ci95", "candidates") if k in analysis}
        return Step(name, scores=final_weights(run, "curate_bds")), info
    if name == "reference":
        return reference_step(run, cfg)
    if name == "p2d":
        from raycurate.pipelines.p2d import run_p2d_scoring
        from raycurate.stages.p2d import selection_scores

        p2d_cfg = dataclasses.replace(cfg, p2d=dataclasses.replace(cfg.p2d, pool_split=POOL_SPLIT))
        run_p2d_scoring(run, p2d_cfg)
        return Step(name, scores=selection_scores(run, "p2d_select")), {}
    raise ValueError(f"curate step {name!r} is not an example-level step (dedup, reference, bds, p2d)")


REFERENCE_MODEL = "curate_reference"
REFERENCE_SCORES = "curate_reference_scores"
CALIBRATION_SCORES = "curate_reference_calibration"


def reference_scores(run: RunDir, cfg: JobConfig) -> dict:
    """Train the trusted reference (LoRA on the trusted rows, less the ``curate.calibration_fraction`` held out,
    ``curate.reference_epochs``) and score every pool row's and every held-out trusted row's response tokens under
    it and the base model; returns the pool scores stage's record."""
    from raycurate.stages.data_stages import TRUSTED_TOKENS
    from raycurate.stages.model_stages import train_stage
    from raycurate.stages.reference import reference_scores_stage
    from raycurate.stages.rows import ids_subset_stage, seeded_sample, token_ids

    curate = cfg.curate
    fit = TRUSTED_TOKENS
    if curate.calibration_fraction > 0:
        trusted = token_ids(run, TRUSTED_TOKENS)
        held = seeded_sample(trusted, max(1, round(curate.calibration_fraction * len(trusted))), curate.seed)
        if len(held) == len(trusted):
            raise ValueError(f"curate.calibration_fraction={curate.calibration_fraction} holds out all "
                             f"{len(trusted)} trusted rows; lower it or add trusted rows")
        ids_subset_stage(run, "curate_trusted_fit", tokens_stage=TRUSTED_TOKENS, ids=sorted(set(trusted) - set(held)),
                         description="trusted rows the reference trains on")
        ids_subset_stage(run, "curate_trusted_calibration", tokens_stage=TRUSTED_TOKENS, ids=held,
                         description="trusted rows held out to calibrate the reference's signals")
        fit = "curate_trusted_fit"
    train_cfg = dataclasses.replace(cfg.train, epochs=curate.reference_epochs, max_steps=None)
    train_stage(run, REFERENCE_MODEL, tokens_stage=fit, init_stage="base_model", train_cfg=train_cfg)
    if curate.calibration_fraction > 0:
        reference_scores_stage(run, CALIBRATION_SCORES, pool_stage="curate_trusted_calibration",
                               base_stage="base_model", reference_stage=REFERENCE_MODEL, pool_cfg=cfg.p2d_pool)
    return reference_scores_stage(run, REFERENCE_SCORES, pool_stage="curate_pool_rows", base_stage="base_model",
                                  reference_stage=REFERENCE_MODEL, pool_cfg=cfg.p2d_pool, seed=curate.seed)


def reference_step(run: RunDir, cfg: JobConfig) -> tuple[Step, dict]:
    """The reference step: each pool row's badness (its worst calibrated standing over
    ``curate.reference_signals``), ranked; with ``keep_rule: calibrated`` the rows at most
    ``calibration_quantile`` bad are kept, else the ``keep_fraction`` best."""
    import numpy as np

    from raycurate.algorithms.composition import Step
    from raycurate.algorithms.reference_signals import badness
    from raycurate.stages.reference import read_signal
    from raycurate.stages.rows import clean_labels, corruption_kinds, score_separation

    curate = cfg.curate
    reference_scores(run, cfg)
    pool = {name: read_signal(run, REFERENCE_SCORES, name) for name in curate.reference_signals}
    ids = list(next(iter(pool.values())))
    calibration = None
    if curate.calibration_fraction > 0:
        calibration = {name: np.array(list(read_signal(run, CALIBRATION_SCORES, name).values()))
                       for name in curate.reference_signals}
    bad = badness({name: np.array([values[i] for i in ids]) for name, values in pool.items()}, calibration)
    scores = dict(zip(ids, (-bad).tolist()))
    calibrated = curate.keep_rule == "calibrated"
    info: dict = {"signals": list(curate.reference_signals), "keep_rule": curate.keep_rule,
                  "kept_by_rule": int((bad <= curate.calibration_quantile).sum()) if calibrated else None}
    labels = clean_labels(run, "curate_pool_rows")
    if labels:
        separation = score_separation(ids, -bad, labels, corruption_kinds(run, "curate_pool_rows"), curate.seed)
        info.update({k: separation[k] for k in ("auroc", "auroc_ci95", "auroc_by_kind") if k in separation})
    step = Step("reference", scores=scores, min_score=-curate.calibration_quantile if calibrated else None)
    return step, info


def token_table(run: RunDir, cfg: JobConfig) -> str:
    """The pool's token table after the token-level step: BRIDGE's compacted rows, the rows with their most
    surprising response tokens masked (``mask``), or the pool as it is."""
    if "bridge" in cfg.curate.steps:
        from raycurate.pipelines.bridge import run_bridge_core

        return run_bridge_core(run, cfg)
    if "mask" in cfg.curate.steps:
        from raycurate.stages.reference import masked_table_stage

        reference_scores(run, cfg)
        masked_table_stage(run, "curate_masked", tokens_stage="curate_pool_rows", scores_stage=REFERENCE_SCORES,
                           threshold=cfg.curate.mask_threshold)
        return "curate_masked"
    return "curate_pool_rows"


def trusted_table(cfg: JobConfig) -> str | None:
    """The trusted set's token table (a stage name), or None when the job has no trusted set."""
    from raycurate.stages.data_stages import TRUSTED_TOKENS

    return TRUSTED_TOKENS if cfg.data.has_trusted() else None


def arm_weights(cfg: JobConfig, steps: dict[str, Step], ids: list[str], *, uses_bds: bool) -> dict[str, float] | None:
    """The SFT weights of a set of rows: their BDS weights (mean 1) in ``bds_mode: weight``, else None."""
    from raycurate.algorithms.composition import normalised_weights

    if cfg.curate.bds_mode != "weight" or not uses_bds:
        return None
    scores = steps["bds"].scores
    assert scores is not None, "the bds step ranks (it has scores)"
    return normalised_weights(scores, ids)


def matched_arms(run: RunDir, cfg: JobConfig, pool: list[str], steps: dict[str, Step],
                 budget: int) -> dict[str, tuple[str, dict]]:
    """Each step alone over the whole pool, and seeded random rows, cut to ``budget`` response tokens.

    Returns:
        ``{arm: (training-table stage, its metrics)}`` (stages of :func:`raycurate.stages.rows.subset_rows_stage`).
    """
    from raycurate.algorithms.composition import ranked_ids, rows_until_tokens
    from raycurate.stages.rows import response_tokens, subset_rows_stage

    curate = cfg.curate
    tokens = response_tokens(run, "curate_pool_rows")
    rankings: dict[str, Mapping[str, float]] = {}
    from raycurate.config.curate import TOKEN_STEPS

    for name in curate.steps if len(curate.steps) > 1 else []:
        if name in TOKEN_STEPS:
            continue
        step = steps[name]
        rankings[name] = step.scores if step.scores is not None else {
            i: 0.0 if i in (step.dropped or ()) else 1.0 for i in pool}  # dedup: undropped rows first, then random
    rankings["random"] = {i: 0.0 for i in pool}  # constant score: the seeded tie-break is the order
    if curate.arms is not None:
        rankings = {name: scores for name, scores in rankings.items() if name in curate.arms}
    arms: dict[str, tuple[str, dict]] = {}
    for name, scores in rankings.items():
        order = ranked_ids(pool, scores, curate.seed)
        ids = order[:rows_until_tokens([tokens[i] for i in order], budget)]
        record = subset_rows_stage(
            run, f"curate_{name}_rows", tokens_stage="curate_pool_rows", ids=ids,
            weights=arm_weights(cfg, steps, ids, uses_bds=name == "bds"),
            description=f"{name} alone: top-ranked rows until {budget} response tokens")
        arms[name] = (f"curate_{name}_rows", record["metrics"])
    if "bridge" in curate.steps and len(curate.steps) > 1 and (curate.arms is None or "bridge" in curate.arms):
        arms["bridge"] = matched_bridge(run, cfg, pool, budget)
    return arms


def matched_bridge(run: RunDir, cfg: JobConfig, pool: list[str], budget: int) -> tuple[str, dict]:
    """BRIDGE alone over the whole pool, re-selected from the stored scores at the response ratio that supervises
    about ``budget`` tokens (``rho_p`` unchanged); returns (training-table stage, its metrics + ``rho_r``)."""
    from raycurate.algorithms.composition import matched_response_ratio
    from raycurate.stages.bridge import response_totals, select_stage
    from raycurate.stages.bridge_compact import compact_stage
    from raycurate.stages.rows import subset_rows_stage

    totals = response_totals(run, "bridge_select")
    rho_r = matched_response_ratio(budget, totals["eligible"], totals["fixed"])
    log.info("curate: BRIDGE alone at rho_r=%.4f (T=%d, %d eligible + %d fixed response tokens in the pool)",
             rho_r, budget, totals["eligible"], totals["fixed"])
    select_stage(run, stage="curate_bridge_select", score_stage_name="bridge_score",
                 bridge_cfg=dataclasses.replace(cfg.bridge, rho_r=rho_r), pool_cfg=cfg.bridge_pool,
                 progress=cfg.run.progress)
    compact_stage(run, "curate_bridge_compact", selection_stage="curate_bridge_select", mask_prefix="sel")
    record = subset_rows_stage(run, "curate_bridge_rows", tokens_stage="curate_bridge_compact", ids=pool,
                               description=f"BRIDGE alone at rho_r={rho_r:.4f}")
    return "curate_bridge_rows", {**record["metrics"], "rho_r": rho_r}


def subset_train_config(run: RunDir, cfg: JobConfig, tokens_stage: str,
                        whole_stage: str = "curate_pool_rows") -> TrainConfig:
    """``train`` for a subset of the pool: as it is (``curate.train_steps: epochs``), or (``matched``) with as many
    optimizer steps as ``train.epochs`` over the whole pool (``whole_stage``'s rows): ``max_steps`` that count and
    enough epochs to reach it.
    """
    if cfg.curate.train_steps == "epochs":
        return cfg.train
    import math

    from raycurate.stages.rows import token_ids
    from raycurate.training.order import steps_per_epoch, total_steps

    pool_steps = total_steps(len(token_ids(run, whole_stage)), cfg.train)
    per_epoch = steps_per_epoch(len(token_ids(run, tokens_stage)), cfg.train.effective_batch_size)
    return dataclasses.replace(cfg.train, epochs=math.ceil(pool_steps / per_epoch), max_steps=pool_steps)


def reference_models(run: RunDir, cfg: JobConfig) -> dict[str, dict]:
    """Evaluate the base model and train + evaluate ``mixed`` (the whole pool) and ``clean`` (its clean rows).

    Returns:
        ``{model: held-out metrics}`` for base, mixed and clean.
    """
    from raycurate.config.curate import POOL_SPLIT
    from raycurate.stages.model_stages import evaluate_stage, train_stage
    from raycurate.stages.rows import clean_rows, filter_tokens_stage

    filter_tokens_stage(run, "curate_clean_rows", tokens_stage="curate_pool_rows",
                        description=f"split == {POOL_SPLIT} and label.clean == true", keep=clean_rows,
                        config={"split": POOL_SPLIT, "filter": "label.clean"})
    heldout = {}
    for model, tokens in (("base", None), ("mixed", "curate_pool_rows"), ("clean", "curate_clean_rows")):
        if tokens:
            train_cfg = cfg.train if model == "mixed" else subset_train_config(run, cfg, tokens)
            train_stage(run, f"train_{model}", tokens_stage=tokens, init_stage="base_model", train_cfg=train_cfg)
        heldout[model] = evaluate_stage(run, f"eval_{model}", model_stage=f"train_{model}" if tokens else "base_model",
                                        heldout_stage="corpus", eval_cfg=cfg.eval,
                                        max_length=cfg.data.max_length,
                                        system_prompt=cfg.tokenize.system_prompt)["metrics"]
    return heldout


@dataclasses.dataclass
class Composition:
    """What the steps decided over the pool (:func:`compose_pool`).

    Attributes:
        pool: The pool's ids (the ``selection`` split, stage ``curate_pool_rows``).
        steps: The example-level steps by name, in order (each one's scores or dropped rows).
        step_info: Per example-level step: its stage metrics plus ``kept_rows`` and ``kept_clean_share``.
        kept: The ids the composition keeps (the last step's, else the whole pool).
        table: The token table after the token-level step (``bridge_compact``, ``curate_masked`` or the pool).
        composed: The record of stage ``curate_rows``: the kept rows of ``table`` (weighted in ``bds_mode:
            weight``), what the composition trains on.
        separation: On labelled data, the AUROC (overall and per corruption kind) of the whole composition's
            ranking (:func:`raycurate.algorithms.composition.composition_scores`); else empty.
    """

    pool: list[str]
    steps: dict[str, Step]
    step_info: dict[str, dict]
    kept: list[str]
    table: str
    composed: dict
    separation: dict = dataclasses.field(default_factory=dict)


def compose_pool(run: RunDir, cfg: JobConfig) -> Composition:
    """After :func:`raycurate.pipelines.common.prepare_data`: the pool, every example-level step scored once over
    it, the steps applied in order, the token-level step, and ``curate_rows`` (the composed training table)."""
    from raycurate.algorithms.composition import compose
    from raycurate.config.curate import POOL_SPLIT, TOKEN_STEPS
    from raycurate.pipelines.bridge import split_equals
    from raycurate.stages.rows import clean_labels, filter_tokens_stage, precision, subset_rows_stage, token_ids

    curate = cfg.curate
    filter_tokens_stage(run, "curate_pool_rows", tokens_stage="tokenize", description=f"split == {POOL_SPLIT}",
                        keep=split_equals(POOL_SPLIT), config={"split": POOL_SPLIT})
    pool = token_ids(run, "curate_pool_rows")
    labels = clean_labels(run, "curate_pool_rows")
    example_steps = [s for s in curate.steps if s not in TOKEN_STEPS]
    steps, step_info = {}, {}
    for name in example_steps:
        steps[name], step_info[name] = score_step(run, cfg, name)
    history = compose(pool, [steps[n] for n in example_steps], curate.keep_fraction, curate.seed)
    kept = history[-1] if history else pool
    for name, rows in zip(example_steps, history):
        step_info[name].update(kept_rows=len(rows), kept_clean_share=precision(rows, labels))
        log.info("curate: after %s %d of %d pool rows kept", name, len(rows), len(pool))
    table = token_table(run, cfg)
    composed = subset_rows_stage(run, "curate_rows", tokens_stage=table, ids=kept,
                                 weights=arm_weights(cfg, steps, kept, uses_bds="bds" in steps),
                                 description=f"composition {' -> '.join(curate.steps)}")
    separation: dict = {}
    if labels and history:
        from raycurate.algorithms.composition import composition_scores
        from raycurate.stages.rows import corruption_kinds, score_separation

        ranking = composition_scores(pool, [steps[n] for n in example_steps], history)
        found = score_separation(pool, ranking, labels, corruption_kinds(run, "curate_pool_rows"), curate.seed)
        separation = {k: found[k] for k in ("auroc", "auroc_ci95", "auroc_by_kind") if k in found}
    return Composition(pool=pool, steps=steps, step_info=step_info, kept=kept, table=table, composed=composed,
                       separation=separation)


def train_arms(run: RunDir, cfg: JobConfig, composition: Composition, *, evaluate: bool,
               arms_only: list[str] | None = None) -> tuple[dict[str, dict], dict[str, dict], int]:
    """Train (and with ``evaluate`` evaluate) the composition and, with ``curate.compare``, its matched-budget arms.

    Args:
        arms_only: Train only these matched arms (e.g. ``["random"]``) whatever ``curate.arms`` says; None: those.

    Returns:
        ``({model: held-out metrics}, {arm: description}, the composition's response-token budget T)``.
    """
    from raycurate.report.composition import COMPOSITION
    from raycurate.stages.model_stages import evaluate_stage, train_stage

    composed = composition.composed
    budget = int(composed["metrics"]["response_tokens"])
    arms = {COMPOSITION: ("curate_rows", composed["metrics"])}
    if cfg.curate.compare or arms_only:
        arm_cfg = cfg if arms_only is None else dataclasses.replace(
            cfg, curate=dataclasses.replace(cfg.curate, arms=arms_only))
        arms.update(matched_arms(run, arm_cfg, composition.pool, composition.steps, budget))
    heldout, described = {}, {}
    for arm, (rows_stage, m) in arms.items():
        model = COMPOSITION_MODEL if arm == COMPOSITION else f"{COMPOSITION_MODEL}_{arm}"
        train_stage(run, f"train_{model}", tokens_stage=rows_stage, init_stage="base_model",
                    train_cfg=subset_train_config(run, cfg, rows_stage))
        if evaluate:
            heldout[model] = evaluate_stage(run, f"eval_{model}", model_stage=f"train_{model}",
                                            heldout_stage="corpus", eval_cfg=cfg.eval,
                                            max_length=cfg.data.max_length,
                                            system_prompt=cfg.tokenize.system_prompt)["metrics"]
        described[arm] = {"model": model, "rows": m["rows"], "response_tokens": m["response_tokens"],
                          "token_ratio": m["response_tokens"] / max(budget, 1), "prompt_tokens": m["prompt_tokens"],
                          "clean_share": m.get("clean_share"), **({"rho_r": m["rho_r"]} if "rho_r" in m else {})}
    return heldout, described, budget


def record_composition(run: RunDir, cfg: JobConfig, composition: Composition, described: dict[str, dict],
                       budget: int) -> dict:
    """Store the composition block (steps, arms, paired CIs of composition minus each arm) as
    ``results.composition``; returns it."""
    from raycurate.report.composition import score_arms

    curate = cfg.curate
    scored = score_arms(run.root, run.load_manifest(), described)
    block = {"steps": list(curate.steps), "keep_fraction": curate.keep_fraction, "bds_mode": curate.bds_mode,
             "seed": curate.seed, "pool_rows": len(composition.pool), "budget_tokens": budget,
             "step_info": composition.step_info, "separation": composition.separation, "arms": described,
             **scored}
    results = run.load_manifest().get("results") or {}
    run.update_manifest(results={**results, "composition": block})
    return block


def run_curate(cfg: JobConfig) -> dict:
    """``pipeline: curate``: the steps, one SFT on the composed table, the matched-budget arms; returns the
    final manifest (``results.composition``)."""
    from raycurate.pipelines.common import lm_eval_models, open_run, prepare_data, record_heldout, write_report

    run = open_run(cfg)
    records = prepare_data(run, cfg)
    composition = compose_pool(run, cfg)
    evaluate = "corpus" in records
    heldout, described, budget = train_arms(run, cfg, composition, evaluate=evaluate)
    if evaluate and cfg.curate.compare:
        heldout.update(reference_models(run, cfg))
    if heldout:
        record_heldout(run, heldout, cfg.eval.split)
    record_composition(run, cfg, composition, described, budget)
    lm_eval_models(run, cfg, {name.removeprefix("train_"): name for name in run.load_manifest()["stages"]
                              if name.startswith(f"train_{COMPOSITION_MODEL}")})
    log.info("report: %s", write_report(run))
    return run.load_manifest()


def run_curate_in_demo(run: RunDir, cfg: JobConfig, *, evaluate: bool) -> dict[str, dict]:
    """The demo's curate arm: the composition and seeded random rows at its response-token budget (SFT on all
    rows and on the clean rows are the demo's own ``mixed`` / ``clean``); returns ``{model: held-out metrics}``."""
    composition = compose_pool(run, cfg)
    heldout, described, budget = train_arms(run, cfg, composition, evaluate=evaluate, arms_only=["random"])
    record_composition(run, cfg, composition, described, budget)
    return heldout
