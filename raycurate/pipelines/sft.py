"""Plain SFT on user data: ingest -> tokenize -> fine-tune (Ray Train) -> held-out eval when a held-out set exists."""

from __future__ import annotations

from raycurate.config.schema import JobConfig
from raycurate.pipelines.common import open_run, prepare_data, record_heldout, write_report


def run_sft_pipeline(cfg: JobConfig) -> dict:
    """Run the ``sft`` pipeline; returns the final manifest."""
    from raycurate.stages.model_stages import evaluate_stage, train_stage

    run = open_run(cfg)
    records = prepare_data(run, cfg)
    train_stage(run, "train", tokens_stage="tokenize", init_stage="base_model", train_cfg=cfg.train)
    if "corpus" in records:
        record = evaluate_stage(run, "eval", model_stage="train", heldout_stage="corpus", eval_cfg=cfg.eval,
                                max_length=cfg.data.max_length, system_prompt=cfg.tokenize.system_prompt)
        record_heldout(run, {"sft": record["metrics"]}, cfg.eval.split)
    write_report(run)
    return run.load_manifest()

