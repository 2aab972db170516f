"""BRIDGE pipeline (docs/bridge.md): coupled prompt-token / response-token selection, then compact SFT from theta_old.

Stages after the shared data preparation:
bridge_{warmup,validation,pool}_rows -> bridge_warmup (SFT, theta_old -> theta_bar) -> bridge_direction (v) ->
bridge_score (model actors: utilities, routing; stored per row, keyed without the budgets) -> bridge_select (CPU
actors: budgets, alternating selection, closure from the stored scores; keyed by the budgets) -> bridge_compact ->
train_bridge (compact SFT from theta_old) -> eval_bridge; baselines at matched budgets (random, ...) ->
train_<name> -> eval_<name>; bridge_diagnostics (fidelity table on a sample).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raycurate.config.schema import JobConfig
    from raycurate.rundir import RunDir

log = logging.getLogger("raycurate")


def split_equals(name: str):
    """A token-table filter keeping the rows of one split."""

    def keep(table: Any) -> Any:
        import pyarrow.compute as pc

        return pc.equal(table["split"], name)

    return keep


def warmup_stage_of(bridge_cfg: Any) -> str:
    """The stage holding theta_bar: ``bridge_warmup``, or ``base_model`` itself at ``bridge.warmup_epochs = 0``
    (no warmup SFT: the direction, the utilities and a warmup-referenced baseline use theta_old)."""
    return "bridge_warmup" if bridge_cfg.warmup_epochs > 0 else "base_model"


def run_bridge_selection(run: RunDir, cfg: JobConfig) -> dict[str, str]:
    """The BRIDGE selection on top of ``prepare_data``'s outputs: split subsets, warmup SFT, scoring direction,
    score + select, compaction, the configured baselines' masks and the fidelity diagnostics.

    The one sequence both :func:`run_bridge_stages` and :func:`raycurate.api.bridge_select` run.

    Returns:
        ``{method: compacted token stage}``: ``bridge`` -> ``bridge_compact`` and one entry per baseline.
    """
    from raycurate.stages.bridge_compact import baseline_masks_stage, compact_stage

    bridge = cfg.bridge
    methods = {"bridge": run_bridge_core(run, cfg)}
    for name in bridge.baselines:
        baseline_masks_stage(run, f"baseline_{name}_masks", method=name, selection_stage="bridge_select",
                             warmup_stage=warmup_stage_of(bridge), base_stage="base_model", bridge_cfg=bridge,
                             pool_cfg=cfg.bridge_pool)
        compact_stage(run, f"baseline_{name}_compact", selection_stage=f"baseline_{name}_masks", mask_prefix=name)
        methods[name] = f"baseline_{name}_compact"
    if bridge.diagnostics_rows > 0:
        from raycurate.stages.bridge_diagnostics import diagnostics_stage

        diagnostics_stage(run, selection_stage="bridge_select", warmup_stage=warmup_stage_of(bridge),
                          direction_stage_name="bridge_direction", bridge_cfg=bridge)
    return methods


def warmup_train_config(train_cfg: Any, bridge_cfg: Any, warmup_rows: int) -> Any:
    """The warmup SFT's training config: ``bridge.warmup_epochs`` of ``train``'s minibatches, or, at
    ``bridge.warmup_batch = full``, as many optimizer steps (``epochs * (rows // effective_batch_size)``, at least
    one) on the whole warmup split of ``warmup_rows`` rows, which makes theta_bar independent of ``train.seed``'s
    batch order."""
    if bridge_cfg.warmup_batch == "minibatch":
        return dataclasses.replace(train_cfg, epochs=bridge_cfg.warmup_epochs, max_steps=None)
    from raycurate.config.train import full_batch_train_config

    steps = bridge_cfg.warmup_epochs * max(1, warmup_rows // train_cfg.effective_batch_size)
    return full_batch_train_config(train_cfg, warmup_rows, steps, train_cfg.lr,
                                   rows_key="the warmup split of bridge.warmup_batch=full")


def run_bridge_core(run: RunDir, cfg: JobConfig) -> str:
    """Split subsets, warmup SFT, scoring direction, ``bridge_score`` (once), ``bridge_select`` at
    ``cfg.bridge``'s budgets and ``bridge_compact``; returns the compacted token stage (no baselines, no
    diagnostics).  Shared by :func:`run_bridge_selection` and the curate pipeline."""
    from raycurate.stages.bridge import direction_stage, score_stage, select_stage
    from raycurate.stages.bridge_compact import compact_stage
    from raycurate.stages.data_stages import TRUSTED_TOKENS
    from raycurate.stages.model_stages import train_stage
    from raycurate.stages.rows import filter_tokens_stage

    bridge = cfg.bridge
    trusted = cfg.data.has_trusted()
    splits = {split: filter_tokens_stage(run, f"bridge_{split}_rows", tokens_stage="tokenize",
                                         description=f"split == {split}", keep=split_equals(split),
                                         config={"split": split})
              for split in ("warmup", "selection") + (() if trusted else ("validation",))}
    warmup = warmup_stage_of(bridge)
    if warmup == "bridge_warmup":
        warmup_rows = int(splits["warmup"]["metrics"]["rows_kept"])
        warmup_cfg = warmup_train_config(cfg.train, bridge, warmup_rows)
        train_stage(run, warmup, tokens_stage="bridge_warmup_rows", init_stage="base_model", train_cfg=warmup_cfg)
    # The direction aims at the trusted set; without one at the pool's validation split, as the paper does.
    direction_stage(run, warmup_stage=warmup, base_stage="base_model",
                    validation_stage=TRUSTED_TOKENS if trusted else "bridge_validation_rows", bridge_cfg=bridge)
    # Score once, select per budget: a budget change (rho_p, rho_r, schedule, closure) re-runs only bridge_select.
    score_stage(run, tokens_stage="bridge_selection_rows", warmup_stage=warmup,
                direction_stage_name="bridge_direction", bridge_cfg=bridge, pool_cfg=cfg.bridge_pool,
                progress=cfg.run.progress)
    select = select_stage(run, score_stage_name="bridge_score", bridge_cfg=bridge, pool_cfg=cfg.bridge_pool,
                          progress=cfg.run.progress)
    log.info("bridge selection: %s", {k: v for k, v in select["metrics"].items() if not isinstance(v, dict)})
    compact_stage(run, "bridge_compact", selection_stage="bridge_select", mask_prefix="sel")
    return "bridge_compact"


def run_bridge_stages(run: RunDir, cfg: JobConfig, *, evaluate: bool) -> dict:
    """The BRIDGE stages on top of ``prepare_data``'s outputs; returns ``{method: heldout metrics}``."""
    from raycurate.stages.model_stages import evaluate_stage, train_stage

    methods = run_bridge_selection(run, cfg)
    results: dict[str, dict] = {}
    for name, tokens_stage in methods.items():
        train_stage(run, f"train_{name}", tokens_stage=tokens_stage, init_stage="base_model", train_cfg=cfg.train)
        if evaluate:
            record = evaluate_stage(run, f"eval_{name}", model_stage=f"train_{name}", heldout_stage="corpus",
                                    eval_cfg=cfg.eval, max_length=cfg.data.max_length,
                                    system_prompt=cfg.tokenize.system_prompt)
            results[name] = record["metrics"]
    return results


def run_bridge_pipeline(cfg: JobConfig) -> dict:
    """``pipeline: bridge``: data preparation, BRIDGE, its baselines and (on the embedded corpus) evaluation."""
    from raycurate.pipelines.common import run_standalone

    return run_standalone(cfg, run_bridge_stages)
