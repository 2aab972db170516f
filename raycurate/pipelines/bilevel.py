"""Bilevel pipeline (docs/bilevel.md): BDS data weights, BMO online regeneration and the example-level baselines.

Stages after the shared data preparation:
bilevel_validation_rows (the trusted upper level: the validation split, clean rows only on the embedded corpus) and
bilevel_candidate_rows (the noisy lower level) -> per method: train_bilevel_<method> (bds: offline BDS; online:
BDS + BMO generation; mix_<rho>: direct mixing, eq. 3; random / dsir / less: validation + selected candidates at
rho = 0.5) -> eval_bilevel_<method> (held-out exact match and gold loss = upper level) and
loss_bilevel_<method> (loss on the clean candidates = lower level, the paper's "cleaned" set).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raycurate.config.bilevel import BilevelConfig
    from raycurate.config.schema import JobConfig
    from raycurate.config.train import TrainConfig
    from raycurate.rundir import RunDir

log = logging.getLogger("raycurate")


def has_labels(run: RunDir, tokens_stage: str) -> bool:
    """Whether a token table carries the embedded corpus's ground-truth labels."""
    from raycurate.stages.bilevel import label_columns

    return "label" in label_columns(run, tokens_stage)


def split_rows(run: RunDir, cfg: JobConfig) -> bool:
    """The validation and candidate tables (and the clean candidates when labels exist); returns has-labels."""
    import pyarrow.compute as pc

    from raycurate.stages.rows import filter_tokens_stage

    bilevel = cfg.bilevel
    labelled = has_labels(run, "tokenize")
    clean_only = bilevel.validation_clean_only and labelled

    def validation(table: Any) -> Any:
        keep = pc.equal(table["split"], bilevel.validation_split)
        return pc.and_(keep, pc.struct_field(table["label"], "clean")) if clean_only else keep

    dropped = near_duplicates(run, cfg)

    def candidates(table: Any) -> Any:
        keep = pc.equal(table["split"], bilevel.candidate_split)
        if dropped:
            import pyarrow as pa

            keep = pc.and_(keep, pc.invert(pc.is_in(table["id"], value_set=pa.array(dropped))))
        return keep

    def clean_candidates(table: Any) -> Any:
        return pc.and_(candidates(table), pc.struct_field(table["label"], "clean"))

    if cfg.data.has_trusted():  # the upper level is the trusted set, never rows of the noisy pool
        from raycurate.stages.data_stages import TRUSTED_TOKENS

        filter_tokens_stage(run, "bilevel_validation_rows", tokens_stage=TRUSTED_TOKENS,
                            description="the trusted set (data.trusted_input)", keep=every_row,
                            config={"trusted": True})
    else:
        filter_tokens_stage(run, "bilevel_validation_rows", tokens_stage="tokenize",
                            description=f"split == {bilevel.validation_split}" + (" and clean" if clean_only else ""),
                            keep=validation, config={"split": bilevel.validation_split, "clean_only": clean_only})
    filter_tokens_stage(run, "bilevel_candidate_rows", tokens_stage="tokenize",
                        description=f"split == {bilevel.candidate_split}"
                        + (f", minus {len(dropped)} near-duplicates" if dropped else ""), keep=candidates,
                        config={"split": bilevel.candidate_split, **({"dropped": dropped} if dropped else {})})
    if labelled:
        filter_tokens_stage(run, "bilevel_clean_candidates", tokens_stage="tokenize",
                            description=f"split == {bilevel.candidate_split} and clean", keep=clean_candidates,
                            config={"split": bilevel.candidate_split})
    return labelled


def every_row(table: Any) -> Any:
    """A token-table filter keeping every row."""
    import pyarrow as pa

    return pa.array([True] * table.num_rows)


def near_duplicates(run: RunDir, cfg: JobConfig) -> list[str]:
    """Candidate ids the optional near-duplicate filter drops (``bilevel.dedup_threshold``; [] when off)."""
    from raycurate.stages.dedup import dedup_stage, flagged_ids

    bilevel = cfg.bilevel
    if bilevel.dedup_threshold is None:
        return []
    if not 0.0 < bilevel.dedup_threshold <= 1.0:
        raise ValueError(f"bilevel.dedup_threshold={bilevel.dedup_threshold} must lie in (0, 1] (a Jaccard "
                         "similarity), or be null to keep every candidate")
    from raycurate.stages.data_stages import TRUSTED_TOKENS

    dedup_stage(run, "bilevel_dedup", tokens_stage="tokenize", split_column="split",
                reference_split=bilevel.validation_split, candidate_split=bilevel.candidate_split,
                threshold=bilevel.dedup_threshold, seed=bilevel.seed,
                reference_stage=TRUSTED_TOKENS if cfg.data.has_trusted() else None)
    return flagged_ids(run, "bilevel_dedup")


def adapter_spec(bilevel: BilevelConfig) -> dict | None:
    """The theta adapter of every bilevel method (LoRA by default, as the paper)."""
    if bilevel.adapter == "full":
        return None
    return {"kind": "lora", "r": bilevel.lora_r, "alpha": bilevel.lora_alpha}


def selection_ids(run: RunDir, cfg: JobConfig, method: str) -> list[str]:
    """Candidate ids chosen by a selection baseline (random, dsir, less)."""
    from raycurate.stages.bilevel_select import dsir_select_stage, less_select_stage, selection_count
    from raycurate.stages.p2d import selected_ids
    from raycurate.stages.rows import seeded_sample, token_ids

    bilevel = cfg.bilevel
    if method == "random":
        ids = token_ids(run, "bilevel_candidate_rows")
        return seeded_sample(ids, selection_count(bilevel.select_fraction, len(ids)), bilevel.seed)

    stage = f"bilevel_{method}_select"
    if method == "dsir":
        dsir_select_stage(run, stage, candidate_stage="bilevel_candidate_rows",
                          validation_stage="bilevel_validation_rows", fraction=bilevel.select_fraction,
                          buckets=bilevel.dsir_buckets, seed=bilevel.seed)
    else:
        less_select_stage(run, stage, candidate_stage="bilevel_candidate_rows",
                          validation_stage="bilevel_validation_rows", base_stage="base_model",
                          fraction=bilevel.select_fraction, lora_r=bilevel.lora_r, lora_alpha=bilevel.lora_alpha,
                          dim=bilevel.less_dim, warmup_fraction=bilevel.less_warmup_fraction, seed=bilevel.seed)
    return selected_ids(run, stage)


def train_method(run: RunDir, cfg: JobConfig, method: str, train_cfg: TrainConfig) -> str:
    """Train one method; returns its model stage."""
    from raycurate.stages.bilevel import bds_stage, weighted_union_stage
    from raycurate.stages.model_stages import train_stage

    bilevel, adapter = cfg.bilevel, adapter_spec(cfg.bilevel)
    stage = f"train_bilevel_{method}"
    if method in ("bds", "online"):
        bds_stage(run, stage, candidate_stage="bilevel_candidate_rows", validation_stage="bilevel_validation_rows",
                  base_stage="base_model", train_cfg=train_cfg, bilevel=bilevel, adapter=adapter,
                  online=method == "online")
        return stage
    if method.startswith("mix_"):
        rho, ids, description = float(method.removeprefix("mix_")), None, f"direct mixing rho={method[4:]}"
    else:
        rho, ids, description = 0.5, selection_ids(run, cfg, method), f"validation + {method} selection"
    rows = f"bilevel_{method}_rows"
    weighted_union_stage(run, rows, candidate_stage="bilevel_candidate_rows",
                         validation_stage="bilevel_validation_rows", rho=rho, candidate_ids=ids,
                         description=description)
    train_stage(run, stage, tokens_stage=rows, init_stage="base_model", train_cfg=train_cfg, adapter=adapter)
    return stage


def check_methods(methods: list[str]) -> None:
    """Fail early on unknown method names (the names of :func:`raycurate.config.bilevel.is_bilevel_method`)."""
    from raycurate.config.bilevel import is_bilevel_method

    for method in methods:
        if not is_bilevel_method(method):
            raise ValueError(f"bilevel.methods has unknown entry {method!r}; use bds, online, random, dsir, less or "
                             "mix_<rho> with 0 < rho <= 1 (e.g. mix_0.5)")


def bilevel_train_config(cfg: JobConfig) -> TrainConfig:
    """``train`` with the bilevel learning rate and epochs (every bilevel method trains with it); logs each ``train``
    setting the bilevel methods replace or ignore (:func:`bilevel_overrides`)."""
    for note in bilevel_overrides(cfg):
        log.info("bilevel: %s", note)
    return dataclasses.replace(cfg.train, lr=cfg.bilevel.lr, epochs=cfg.bilevel.epochs)


def bilevel_overrides(cfg: JobConfig) -> list[str]:
    """What the bilevel methods do differently from the ``train`` section: ``bilevel.lr`` / ``epochs`` replace
    ``train``'s, BDS weighs per-row mean losses whatever ``train.loss_normalization`` says, and theta's adapter is
    ``bilevel.adapter`` (not ``train.adapter``) where :func:`adapter_spec` gives one."""
    notes = []
    replaced = {k: (getattr(cfg.train, k), getattr(cfg.bilevel, k)) for k in ("lr", "epochs")
                if getattr(cfg.train, k) != getattr(cfg.bilevel, k)}
    if replaced:
        notes.append(", ".join(f"train.{k}={old} -> bilevel.{k}={new}" for k, (old, new) in replaced.items())
                     + " (bilevel.* replaces train.* for every bilevel method)")
    if cfg.trains_bds() and cfg.train.loss_normalization == "token":
        notes.append("train.loss_normalization=token does not apply to BDS, whose lower level weighs each row's mean "
                     "loss by the row's learned weight (the paper's); the other trainings use it")
    if cfg.train.adapter == "lora":
        if cfg.bilevel.adapter == "lora":
            notes.append(f"train.adapter=lora (train.lora_*) -> bilevel.adapter=lora with bilevel.lora_r="
                         f"{cfg.bilevel.lora_r}, bilevel.lora_alpha={cfg.bilevel.lora_alpha} for every bilevel method")
        else:
            notes.append("train.adapter=lora does not apply to BDS, which trains the full model "
                         "(bilevel.adapter=full); the other bilevel methods train train's LoRA")
    return notes


def run_bilevel_stages(run: RunDir, cfg: JobConfig, *, evaluate: bool) -> dict:
    """The bilevel stages on top of ``prepare_data``'s outputs; returns ``{method: heldout metrics}``."""
    from raycurate.stages.base import output_path
    from raycurate.stages.bilevel import generation_samples, loss_eval_stage, weight_analysis
    from raycurate.stages.model_stages import evaluate_stage

    bilevel = cfg.bilevel
    check_methods(bilevel.methods)
    labelled = split_rows(run, cfg)
    train_cfg = bilevel_train_config(cfg)
    results: dict[str, dict] = {}
    summary: dict[str, Any] = {"methods": {}, "losses": {}}
    for method in bilevel.methods:
        model_stage = train_method(run, cfg, method, train_cfg)
        name = f"bilevel_{method}"
        losses: dict[str, float] = {}
        if evaluate:
            record = evaluate_stage(run, f"eval_{name}", model_stage=model_stage, heldout_stage="corpus",
                                    eval_cfg=cfg.eval, max_length=cfg.data.max_length,
                                    system_prompt=cfg.tokenize.system_prompt)
            results[name] = record["metrics"]
            losses["validation_loss"] = record["metrics"]["gold_loss"]  # upper level: held-out trusted data
        lower = "bilevel_clean_candidates" if labelled else "bilevel_candidate_rows"
        loss_record = loss_eval_stage(run, f"loss_{name}", model_stage=model_stage, tokens_stage=lower)
        losses["train_loss"] = loss_record["metrics"]["loss"]
        summary["losses"][method] = losses
        if method in ("bds", "online"):
            info = weight_analysis(run, model_stage, "bilevel_candidate_rows")
            if method == "online":
                info["generations"] = generation_samples(run, model_stage, "bilevel_candidate_rows",
                                                         str(output_path(run, "base_model", "model")))
            summary["methods"][method] = info
            log.info("bilevel %s: AUROC(sigma, clean) = %s", method, info.get("auroc"))
    run.update_manifest(bilevel=summary)
    return results


def run_bilevel_pipeline(cfg: JobConfig) -> dict:
    """``pipeline: bilevel``: data preparation, BDS / BMO, the baselines and (on the embedded corpus) evaluation."""
    from raycurate.pipelines.common import run_standalone

    return run_standalone(cfg, run_bilevel_stages)
