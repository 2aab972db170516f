"""The laptop demo: embedded corpus + tiny model, SFT on the mixed corpus vs its clean part, held-out accuracy.

Stages: corpus -> base_model -> ingest -> tokenize -> subset_clean -> train_mixed / train_clean ->
eval_base / eval_mixed / eval_clean -> report.html.  Re-running skips every stage whose outputs are current.
"""

from __future__ import annotations

import logging

from raycurate.config.schema import DEMO_METHODS, JobConfig
from raycurate.pipelines.common import lm_eval_models, open_run, prepare_data, record_heldout, write_report
from raycurate.report.curation import record_curation

log = logging.getLogger("raycurate")

LM_EVAL_MODELS = ("base", "mixed", "clean", "curate", "bridge", "p2d", "bilevel_bds", "bilevel_online")


def run_demo(cfg: JobConfig) -> dict:
    """Run the demo pipeline; returns the final manifest (with ``results`` comparing the models)."""
    from raycurate.stages.model_stages import evaluate_stage, train_stage
    from raycurate.stages.rows import clean_rows, filter_tokens_stage

    run = open_run(cfg)
    records = prepare_data(run, cfg)
    if "corpus" not in records:
        raise ValueError("the demo runs on the embedded corpus (it needs ground-truth labels); leave data.input "
                         "empty, or use pipeline=sft for your own data")
    unknown = set(cfg.demo.methods) - set(DEMO_METHODS)
    if unknown:
        raise ValueError(f"demo.methods has unknown entries {sorted(unknown)}; choose from {list(DEMO_METHODS)}")
    variants = [("base", "base_model")]
    if "sft" in cfg.demo.methods:
        filter_tokens_stage(run, "subset_clean", tokens_stage="tokenize", description="label.clean == true",
                            keep=clean_rows, config={"filter": "label.clean"})
        for variant, tokens in (("mixed", "tokenize"), ("clean", "subset_clean")):
            train_stage(run, f"train_{variant}", tokens_stage=tokens, init_stage="base_model", train_cfg=cfg.train)
            variants.append((variant, f"train_{variant}"))
    results = {}
    for variant, model_stage in variants:
        record = evaluate_stage(run, f"eval_{variant}", model_stage=model_stage, heldout_stage="corpus",
                                eval_cfg=cfg.eval, max_length=cfg.data.max_length,
                                system_prompt=cfg.tokenize.system_prompt)
        results[variant] = record["metrics"]
    if "bridge" in cfg.demo.methods:
        from raycurate.pipelines.bridge import run_bridge_stages

        results.update(run_bridge_stages(run, cfg, evaluate=True))
    if "p2d" in cfg.demo.methods:
        from raycurate.pipelines.p2d import run_p2d_stages

        full_sft = "train_mixed" if "sft" in cfg.demo.methods else None
        results.update(run_p2d_stages(run, cfg, evaluate=True, full_sft_stage=full_sft))
    if "curate" in cfg.demo.methods:
        from raycurate.pipelines.curate import run_curate_in_demo

        results.update(run_curate_in_demo(run, cfg, evaluate=True))
    if "bilevel" in cfg.demo.methods:
        from raycurate.pipelines.bilevel import run_bilevel_stages

        results.update(run_bilevel_stages(run, cfg, evaluate=True))
    record_heldout(run, results, cfg.eval.split)
    record_curation(run, cfg.eval.split)
    main = [name for name in results if name in LM_EVAL_MODELS]  # baselines are compared on the held-out eval only
    lm_eval_models(run, cfg, {name: f"train_{name}" if name != "base" else "base_model" for name in main})
    report = write_report(run)
    log.info("report: %s", report)
    return run.load_manifest()
