"""P2D pipeline (docs/p2d.md): attention heads as the compass for example selection and sparse head adaptation.

Stages after the shared data preparation (the pool is the whole tokenized training table):
p2d_proxy_rows (100 seeded examples) -> p2d_proxy (20 full-batch steps; skipped with p2d.task_model) ->
p2d_heads (W1 head scores, top rho_P heads, heads.json) -> p2d_probe (ICL probing on Ray Data actors) ->
p2d_select (top rho_D by s_final, with reasons) -> p2d_rows -> train_p2d (head-delta adapter on the selected
heads) -> eval_p2d; baselines (random data, random heads, full heads, LoRA, IFD, full data) -> train_p2d_<name>
-> eval_p2d_<name>; the AER table from the stage timings.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raycurate.config.schema import JobConfig
    from raycurate.rundir import RunDir

log = logging.getLogger("raycurate")

SELECTION_STAGES = ["p2d_proxy_rows", "p2d_proxy", "p2d_heads", "p2d_probe", "p2d_select"]


def _variants(run: RunDir, cfg: JobConfig) -> dict[str, tuple[str, dict | None, tuple[str, ...]]]:
    """``name -> (token stage, adapter spec, extra upstream)`` of P2D and its configured baselines."""
    from raycurate.stages.p2d import random_heads, selected_heads

    p2d = cfg.p2d
    heads = {"kind": "head_delta", "heads": selected_heads(run, "p2d_heads"), "train_o": p2d.train_o}
    variants: dict[str, tuple[str, dict | None, tuple[str, ...]]] = {"p2d": ("p2d_rows", heads, ("p2d_heads",))}
    options = {
        "random_data": ("p2d_random_rows", heads, ("p2d_heads",)),
        "random_heads": ("p2d_rows", {**heads, "heads": random_heads(run, "p2d_heads", p2d.seed)}, ("p2d_heads",)),
        "full_heads": ("p2d_rows", None, ()),
        "lora": ("p2d_rows", {"kind": "lora", "r": p2d.lora_r, "alpha": p2d.lora_r,
                              "targets": ["q_proj", "k_proj", "v_proj"]}, ()),
        "ifd": ("p2d_ifd_rows", heads, ("p2d_heads",)),
        "full_data": (pool_stage(run, cfg), None, ()),
    }
    for name in p2d.baselines:
        if name not in options:
            raise ValueError(f"p2d.baselines has unknown entry {name!r}; choose from {', '.join(options)}")
        variants[name] = options[name]
    return variants


def pool_stage(run: RunDir, cfg: JobConfig) -> str:
    """The token stage holding the selection pool: ``tokenize``, or its ``p2d.pool_split`` rows."""
    if cfg.p2d.pool_split is None:
        return "tokenize"
    from raycurate.pipelines.bridge import split_equals
    from raycurate.stages.rows import filter_tokens_stage

    split = cfg.p2d.pool_split
    filter_tokens_stage(run, "p2d_pool_rows", tokens_stage="tokenize", description=f"split == {split}",
                        keep=split_equals(split), config={"split": split})
    return "p2d_pool_rows"


def run_p2d_heads(run: RunDir, cfg: JobConfig) -> str:
    """Proxy fine-tune (unless ``p2d.task_model``) and W1 head scoring (``p2d_heads``); returns the pool stage.

    Shared by :func:`run_p2d_selection` and :func:`raycurate.api.identify_heads`.
    """
    from raycurate.config.train import full_batch_train_config
    from raycurate.stages.model_stages import train_stage
    from raycurate.stages.p2d import heads_stage
    from raycurate.stages.rows import ids_subset_stage, seeded_sample, token_ids

    p2d = cfg.p2d
    pool = pool_stage(run, cfg)
    proxy_stage = None
    if not p2d.task_model:
        pool_ids = token_ids(run, pool)
        proxy_ids = seeded_sample(pool_ids, min(p2d.proxy_examples, len(pool_ids)), p2d.seed)
        ids_subset_stage(run, "p2d_proxy_rows", tokens_stage=pool, ids=proxy_ids,
                         description=f"{len(proxy_ids)} seeded proxy examples")
        proxy_cfg = full_batch_train_config(cfg.train, len(proxy_ids), p2d.proxy_steps, p2d.proxy_lr)
        train_stage(run, "p2d_proxy", tokens_stage="p2d_proxy_rows", init_stage="base_model", train_cfg=proxy_cfg)
        proxy_stage = "p2d_proxy"
    heads = heads_stage(run, "p2d_heads", base_stage="base_model", proxy_stage=proxy_stage,
                        task_model=p2d.task_model, p2d_cfg=p2d)
    log.info("p2d heads: %s", heads["metrics"].get("selected_heads"))
    return pool


def run_p2d_scoring(run: RunDir, cfg: JobConfig) -> str:
    """Proxy, head scoring, ICL probing and ``p2d_select`` (every pool row's s_final, the top rho_D selected);
    returns the pool stage.  Shared by :func:`run_p2d_selection` and the curate pipeline."""
    from raycurate.stages.p2d import probe_stage, select_stage

    p2d = cfg.p2d
    pool = run_p2d_heads(run, cfg)
    from raycurate.stages.data_stages import TRUSTED_TOKENS

    # queries (with their gold answers) from the trusted set; without one from the pool, as the paper
    probe_stage(run, "p2d_probe", pool_stage=pool, base_stage="base_model", heads_stage_name="p2d_heads",
                p2d_cfg=p2d, pool_cfg=cfg.p2d_pool, max_new_tokens=cfg.eval.max_new_tokens,
                query_stage=TRUSTED_TOKENS if cfg.data.has_trusted() else None)
    select = select_stage(run, "p2d_select", pool_stage=pool, probe_stage_name="p2d_probe", p2d_cfg=p2d)
    log.info("p2d selection: %s", select["metrics"])
    return pool


def run_p2d_selection(run: RunDir, cfg: JobConfig) -> None:
    """Proxy, head scoring, ICL probing and example selection, plus the data subsets the variants train on."""
    from raycurate.stages.p2d import ifd_select_stage, selected_ids
    from raycurate.stages.rows import ids_subset_stage, seeded_sample, token_ids

    p2d = cfg.p2d
    pool = run_p2d_scoring(run, cfg)
    pool_ids = token_ids(run, pool)
    chosen = selected_ids(run, "p2d_select")
    ids_subset_stage(run, "p2d_rows", tokens_stage=pool, ids=chosen, description="P2D selection")
    if "random_data" in p2d.baselines:
        ids_subset_stage(run, "p2d_random_rows", tokens_stage=pool,
                         ids=seeded_sample(pool_ids, len(chosen), p2d.seed + 1),
                         description="random data at the P2D ratio")
    if "ifd" in p2d.baselines:
        ifd_select_stage(run, "p2d_ifd", pool_stage=pool, base_stage="base_model", ratio=p2d.data_ratio,
                         pool_cfg=cfg.p2d_pool)
        ids_subset_stage(run, "p2d_ifd_rows", tokens_stage=pool, ids=selected_ids(run, "p2d_ifd"),
                         description="IFD top rho_D")


def run_p2d_stages(run: RunDir, cfg: JobConfig, *, evaluate: bool, full_sft_stage: str | None = None) -> dict:
    """The P2D stages on top of ``prepare_data``'s outputs; returns ``{method: heldout metrics}``."""
    from raycurate.stages.model_stages import evaluate_stage, train_stage

    run_p2d_selection(run, cfg)
    train_cfg = dataclasses.replace(cfg.train, epochs=cfg.p2d.epochs, max_steps=None,
                                    lr=cfg.p2d.lr if cfg.p2d.lr is not None else cfg.train.lr)
    results: dict[str, dict] = {}
    for name, (tokens, adapter, extra) in _variants(run, cfg).items():
        stage = "train_p2d" if name == "p2d" else f"train_p2d_{name}"
        variant_cfg = cfg.train if name == "full_data" else train_cfg
        train_stage(run, stage, tokens_stage=tokens, init_stage="base_model", train_cfg=variant_cfg,
                    adapter=adapter, extra_upstream=extra)
        if evaluate:
            eval_name = stage.replace("train_", "eval_", 1)
            record = evaluate_stage(run, eval_name, model_stage=stage, heldout_stage="corpus", eval_cfg=cfg.eval,
                                    max_length=cfg.data.max_length,
                                    system_prompt=cfg.tokenize.system_prompt)
            results[stage.replace("train_", "", 1)] = record["metrics"]
    full = "train_p2d_full_data" if "full_data" in cfg.p2d.baselines else full_sft_stage
    if full is not None:
        record_aer(run, full)
    return results


def record_aer(run: RunDir, full_sft_stage: str) -> dict:
    """AER (paper Table 2) from the manifest's stage timings, saved under ``p2d.aer`` in the manifest."""
    from raycurate.stages.p2d import aer_table

    stages = run.load_manifest().get("stages", {})
    seconds = {name: float(s.get("seconds", 0.0)) for name, s in stages.items() if s.get("status") == "done"}
    selection = [s for s in SELECTION_STAGES if s in seconds]
    aer = aer_table(seconds, selection_stages=selection, adaptation_stage="train_p2d", full_sft_stage=full_sft_stage)
    run.update_manifest(p2d={"aer": aer})
    log.info("p2d AER = %.3f (selection %.1f s + adaptation %.1f s) / full SFT %.1f s", aer["aer"],
             aer["selection_seconds"], aer["adaptation_seconds"], aer["full_sft_seconds"])
    return aer


def run_p2d_pipeline(cfg: JobConfig) -> dict:
    """``pipeline: p2d``: data preparation, P2D, its baselines and (on the embedded corpus) evaluation."""
    from raycurate.pipelines.common import run_standalone

    return run_standalone(cfg, run_p2d_stages)
