"""BRIDGE stages: scoring direction (Ray task), fused score-and-select (Ray Data actors), compaction, diagnostics.

Warmup and final SFT reuse :func:`raycurate.stages.model_stages.train_stage`; split subsets reuse
:func:`raycurate.stages.data_stages.filter_tokens_stage`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from raycurate.config.pool import ActorPoolConfig
from raycurate.rundir import RunDir
from raycurate.stages.base import StageOutput, output_path, run_stage, scratch_dir
from raycurate.stages.ray_data import resolve_pool
from raycurate.stages.runtime import run_as_task

log = logging.getLogger("raycurate")

DIRECTION_FILE = "direction.safetensors"


def read_token_rows(path: Path, columns: list[str] | None = None, limit: int | None = None) -> list[dict]:
    """Rows of a token table folder (parquet files in name order)."""
    import pyarrow.parquet as pq

    rows: list[dict] = []
    for part in sorted(Path(path).glob("*.parquet")):
        rows.extend(pq.read_table(part, columns=columns).to_pylist())
        if limit is not None and len(rows) >= limit:
            return rows[:limit]
    return rows


def compute_direction(theta_bar_dir: str, theta_old_dir: str, validation_tokens: str, out_path: str, *,
                      last_layers: int, lam: float, max_rows: int | None, micro_batch: int) -> dict:
    """g_target at theta_bar on the validation rows, anchor theta_bar - theta_old, combined into v; saved as
    safetensors.  Runs inside a Ray task (on a GPU when the cluster has one)."""
    import torch
    from safetensors.torch import save_file

    from raycurate.algorithms.bridge import pad_rows
    from raycurate.algorithms.token_utility import (
        anchor_direction,
        global_norm,
        scoring_direction,
        scoring_parameters,
        validation_gradient,
    )
    from raycurate.models.loading import load_model, load_tokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(theta_bar_dir, dtype="float32", device=device).eval()
    old = load_model(theta_old_dir, dtype="float32", device="cpu")
    pad_id = load_tokenizer(theta_bar_dir).pad_token_id or 0
    rows = read_token_rows(Path(validation_tokens), ["input_ids", "loss_mask"], limit=max_rows)
    if not rows:
        raise ValueError(f"no validation rows in {validation_tokens}; check data.split_ratios has a 'validation' "
                         "share or pass data.validation_input")
    params = scoring_parameters(model, last_layers)
    batches = ({k: v.to(device) for k, v in pad_rows(rows[i:i + micro_batch], pad_id).items()}
               for i in range(0, len(rows), micro_batch))
    g_target = validation_gradient(model, batches, params)
    old_params = dict(old.named_parameters())
    g_anchor = anchor_direction({k: v for k, v in params.items()}, {k: old_params[k] for k in params})
    v = scoring_direction(g_target, g_anchor, lam=lam)
    save_file({k: t.detach().cpu().contiguous() for k, t in v.items()}, out_path)
    return {"validation_rows": len(rows), "parameters": sum(t.numel() for t in v.values()),
            "tensors": len(v), "g_target_norm": global_norm(g_target), "g_anchor_norm": global_norm(g_anchor),
            "v_norm": global_norm(v), "last_layers": last_layers, "lam": lam}


def direction_stage(run: RunDir, *, warmup_stage: str, base_stage: str, validation_stage: str, bridge_cfg: Any,
                    force: bool = False) -> dict:
    """Scoring direction v (SPEC §4) as a Ray task; writes ``bridge_direction/direction.safetensors``."""
    theta_bar = output_path(run, warmup_stage, "model")
    theta_old = output_path(run, base_stage, "model")
    validation = output_path(run, validation_stage, "tokens")

    def body(out: Path) -> StageOutput:
        info = run_as_task(
            compute_direction, str(theta_bar), str(theta_old), str(validation), str(out / DIRECTION_FILE),
            last_layers=bridge_cfg.last_layers, lam=bridge_cfg.lam, max_rows=bridge_cfg.validation_rows,
            micro_batch=bridge_cfg.micro_batch,
        )
        (out / "direction.json").write_text(json.dumps(info, indent=2))
        return StageOutput(outputs={"direction": DIRECTION_FILE, "info": "direction.json"}, metrics=info)

    config = {k: getattr(bridge_cfg, k) for k in ("last_layers", "lam", "validation_rows")}
    return run_stage(run, "bridge_direction", body, config=config,
                     upstream=[warmup_stage, base_stage, validation_stage], force=force)


def selection_settings(bridge_cfg: Any) -> Any:
    """The pure-algorithm settings mirrored from the BRIDGE config."""
    from raycurate.algorithms.bridge import SelectionSettings

    names = {f.name for f in dataclasses.fields(SelectionSettings)}
    return SelectionSettings(**{k: getattr(bridge_cfg, k) for k in names})


SELECTION_COLUMNS = {
    "prompt_keep": "list<int8>", "loss_mask": "list<int8>", "response_scores": "list<float32>",
    "u_sur": "list<float64>", "b_p": "int32", "b_r": "int32", "eligible_prompt": "int32",
    "eligible_response": "int32", "kept_prompt": "int32", "supervised_response": "int32", "rounds_run": "int32",
    "closure_fallback": "bool", "final_answer_kept": "int8", "final_answer_kept_score_only": "int8",
    "utility_retained": "float64", "closure_solver": "string",
}


def _arrow_type(name: str) -> Any:
    import pyarrow as pa

    simple = {"int8": pa.int8(), "int32": pa.int32(), "float32": pa.float32(), "float64": pa.float64(),
              "bool": pa.bool_(), "string": pa.string()}
    if name.startswith("list<"):
        return pa.list_(simple[name[5:-1]])
    return simple[name]


def selection_table(batch: Any, results: list[dict]) -> Any:
    """Append ``sel_*`` columns (one per :data:`SELECTION_COLUMNS` entry, plus U_sur per schedule) to a batch."""
    import pyarrow as pa

    out = batch
    for name, type_name in SELECTION_COLUMNS.items():
        values = [r[name].tolist() if hasattr(r[name], "tolist") else r[name] for r in results]
        out = out.append_column(f"sel_{name}", pa.array(values, type=_arrow_type(type_name)))
    for schedule in ("independent", "one_pass", "alternating"):
        out = out.append_column(f"sel_u_sur_{schedule}",
                                pa.array([r["u_sur_by_schedule"][schedule] for r in results], type=pa.float64()))
    return out


class BridgeScoreUDF:
    """Ray Data actor: token utilities + routing + coupled selection + closure for a batch of token rows."""

    def __init__(self, model_dir: str, direction_path: str, routing_layer: int | None, settings: Any,
                 micro_batch: int, threads: int):
        import torch
        from safetensors.torch import load_file

        from raycurate.algorithms.routing import default_routing_layer
        from raycurate.models.loading import load_model, load_tokenizer

        torch.set_num_threads(max(1, threads))
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cpu":
            torch.set_flush_denormal(True)  # denormals slow the forward-mode pass several-fold on CPU
        self.model = load_model(model_dir, dtype="float32", device=self.device).eval()
        self.direction = {k: v.to(self.device) for k, v in load_file(direction_path).items()}
        self.layer = default_routing_layer(self.model) if routing_layer is None else routing_layer
        self.pad_id = load_tokenizer(model_dir).pad_token_id or 0
        self.settings = settings
        self.micro_batch = micro_batch

    def __call__(self, batch: Any) -> Any:
        from raycurate.algorithms.bridge import score_and_select_rows

        rows = batch.select(["input_ids", "prompt_len", "loss_mask", "prompt_offsets", "response_offsets",
                             "response", "domain"]).to_pylist()
        results = score_and_select_rows(self.model, self.direction, self.layer, rows, self.settings,
                                        pad_id=self.pad_id, micro_batch=self.micro_batch)
        return selection_table(batch, results)


def score_select_stage(run: RunDir, *, tokens_stage: str, warmup_stage: str, direction_stage_name: str,
                       bridge_cfg: Any, pool_cfg: ActorPoolConfig, force: bool = False) -> dict:
    """Fused scoring and per-example selection on a fault-tolerant actor pool, in resumable shards
    (:mod:`raycurate.stages.sharded`); writes ``selection/part-*.parquet`` (+ per-shard ``.done`` markers)."""

    tokens = output_path(run, tokens_stage, "tokens")
    model_dir = output_path(run, warmup_stage, "model")
    direction = output_path(run, direction_stage_name, "direction")
    settings = selection_settings(bridge_cfg)

    def body(out: Path) -> StageOutput:
        from raycurate.stages.sharded import SHARDS_DIR, sharded_map

        pool = resolve_pool(pool_cfg)
        scratch = scratch_dir(run, "bridge_select")  # finished shards survive a killed job
        shard_metrics = sharded_map(str(tokens), scratch, BridgeScoreUDF, {
            "model_dir": str(model_dir), "direction_path": str(direction), "routing_layer": bridge_cfg.routing_layer,
            "settings": settings, "micro_batch": bridge_cfg.micro_batch,
            "threads": max(1, int(round(pool.num_cpus))),
        }, shard_rows=pool_cfg.shard_rows, num_actors=pool.num_actors, num_cpus_per_actor=pool.num_cpus,
            num_gpus_per_actor=pool.num_gpus, batch_rows=pool.batch_size)
        os.replace(scratch / SHARDS_DIR, out / "selection")
        metrics = selection_summary(out / "selection")
        metrics["shards"] = {k: v for k, v in shard_metrics.items() if not isinstance(v, (list, dict))}
        return StageOutput(outputs={"selection": "selection"}, metrics=metrics)

    config = {"settings": dataclasses.asdict(settings), "routing_layer": bridge_cfg.routing_layer}
    return run_stage(run, "bridge_select", body, config=config,
                     upstream=[tokens_stage, warmup_stage, direction_stage_name], force=force)


def selection_summary(selection_dir: Path) -> dict:
    """Realised budgets, U_sur per schedule, closure coverage and prompt-relevance drops over a selection table."""
    import numpy as np

    from raycurate.algorithms.bridge import prompt_relevance_drops

    rows = read_token_rows(selection_dir)
    if not rows:
        return {"rows": 0}
    sums = {"relevant_total": 0, "relevant_dropped": 0, "distractor_total": 0, "distractor_dropped": 0}
    for row in rows:
        label = row.get("label") or {}
        if label.get("distractor_spans") or label.get("relevant_spans"):
            counts = prompt_relevance_drops(row["sel_prompt_keep"], row["prompt_offsets"],
                                            label.get("relevant_spans") or [], label.get("distractor_spans") or [])
            for k, v in counts.items():
                sums[k] += v

    def mean(key: str) -> float:
        return float(np.mean([r[key] for r in rows]))

    def coverage(key: str) -> float | None:
        vals = [r[key] for r in rows if r[key] >= 0]
        return float(np.mean(vals)) if vals else None

    eligible_p = sum(r["sel_eligible_prompt"] for r in rows)
    eligible_r = sum(r["sel_eligible_response"] for r in rows)
    return {
        "rows": len(rows),
        "prompt_budget_ratio": sum(r["sel_kept_prompt"] for r in rows) / max(eligible_p, 1),
        "response_budget_ratio": sum(r["sel_supervised_response"] for r in rows) / max(eligible_r, 1),
        "budget_exact_share": float(np.mean([r["sel_kept_prompt"] == r["sel_b_p"] and
                                             r["sel_supervised_response"] <= r["sel_b_r"] for r in rows])),
        "u_sur_independent": mean("sel_u_sur_independent"),
        "u_sur_one_pass": mean("sel_u_sur_one_pass"),
        "u_sur_alternating": mean("sel_u_sur_alternating"),
        "final_answer_coverage_closure": coverage("sel_final_answer_kept"),
        "final_answer_coverage_score_only": coverage("sel_final_answer_kept_score_only"),
        "closure_fallback_share": float(np.mean([r["sel_closure_fallback"] for r in rows])),
        "distractor_dropped_share": sums["distractor_dropped"] / max(sums["distractor_total"], 1),
        "relevant_dropped_share": sums["relevant_dropped"] / max(sums["relevant_total"], 1),
        **{k: v for k, v in sums.items()},
    }
