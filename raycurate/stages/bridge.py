"""BRIDGE stages: scoring direction (Ray task), scoring (model actors), selection (CPU actors from the stored scores).

Warmup and final SFT reuse :func:`raycurate.stages.model_stages.train_stage`; split subsets reuse
:func:`raycurate.stages.rows.filter_tokens_stage`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raycurate.config.bridge import BridgeConfig
from raycurate.config.pool import ActorPoolConfig
from raycurate.rundir import RunDir
from raycurate.stages.base import StageOutput, output_path, run_stage, scratch_dir
from raycurate.stages.data_stages import TRUSTED_TOKENS
from raycurate.stages.executor import ShardedInput, map_model_over_rows, resolve_pool
from raycurate.stages.runtime import run_as_task

if TYPE_CHECKING:
    from raycurate.algorithms.bridge.rows import SelectionSettings

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
    from safetensors.torch import save_file

    from raycurate.algorithms.bridge.token_utility import (
        anchor_direction,
        global_norm,
        scoring_direction,
        scoring_parameters,
        validation_gradient,
    )
    from raycurate.algorithms.losses import pad_rows
    from raycurate.models.loading import best_device, load_model, load_tokenizer

    device = best_device()
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


def direction_stage(run: RunDir, *, warmup_stage: str, base_stage: str, validation_stage: str, bridge_cfg: BridgeConfig,
                    force: bool = False) -> dict:
    """Scoring direction v (docs/bridge.md) as a Ray task; writes ``bridge_direction/direction.safetensors``."""
    theta_bar = output_path(run, warmup_stage, "model")
    theta_old = output_path(run, base_stage, "model")
    validation = output_path(run, validation_stage, "tokens")

    def body(out: Path) -> StageOutput:
        info = run_as_task(
            compute_direction, str(theta_bar), str(theta_old), str(validation), str(out / DIRECTION_FILE),
            last_layers=bridge_cfg.last_layers, lam=bridge_cfg.lam, max_rows=bridge_cfg.validation_rows,
            micro_batch=bridge_cfg.micro_batch,
        )
        info["target"] = validation_stage
        if validation_stage == TRUSTED_TOKENS:
            info["trusted_rows"] = info["validation_rows"]
        (out / "direction.json").write_text(json.dumps(info, indent=2))
        return StageOutput(outputs={"direction": DIRECTION_FILE, "info": "direction.json"}, metrics=info)

    config = {k: getattr(bridge_cfg, k) for k in ("last_layers", "lam", "validation_rows")}
    return run_stage(run, "bridge_direction", body, config=config,
                     upstream=[warmup_stage, base_stage, validation_stage], force=force)


def selection_settings(bridge_cfg: BridgeConfig) -> SelectionSettings:
    """The pure-algorithm settings mirrored from the BRIDGE config."""
    from raycurate.algorithms.bridge.rows import SelectionSettings

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


SCORE_COLUMNS = ("score_utility", "score_utility_scale", "score_routing", "score_routing_scale", "score_history",
                 "score_history_scale", "score_prompt", "score_prompt_scale")


def score_table(batch: Any, scores: list[Any], dtype: str) -> Any:
    """Append the ``score_*`` columns of :data:`SCORE_COLUMNS` to a batch: per row the response-side utilities
    (r,), the routing weights A_p flattened row-major (r * p), the history mass c (r,) and the optional knock-out
    prompt scores (n,), each stored as ``list<dtype>`` with a float32 scale (:func:`raycurate.algorithms.bridge.rows.
    quantize`)."""
    import numpy as np
    import pyarrow as pa

    from raycurate.algorithms.bridge.rows import quantize

    value_type = pa.float16() if dtype == "float16" else pa.float32()
    columns: dict[str, tuple[list, list]] = {name: ([], []) for name in ("utility", "routing", "history", "prompt")}
    for s in scores:
        for name, x in (("utility", s.utilities), ("routing", s.a_p), ("history", s.c), ("prompt", s.prompt_scores)):
            values, scale = columns[name]
            if x is None:
                values.append(None)
                scale.append(None)
            else:
                q, sc = quantize(np.ravel(x), dtype)
                values.append(q)
                scale.append(sc)
    out = batch
    for name, (values, scale) in columns.items():
        out = out.append_column(f"score_{name}", pa.array(values, type=pa.list_(value_type)))
        out = out.append_column(f"score_{name}_scale", pa.array(scale, type=pa.float32()))
    return out


def scores_from_table(table: Any) -> list[Any]:
    """The :class:`~raycurate.algorithms.bridge.rows.RowScores` of each row of a table from :func:`score_table`."""
    from raycurate.algorithms.bridge.rows import RowScores, dequantize

    def column(name: str) -> list:
        col = table[f"score_{name}"].combine_chunks()
        flat = col.values.to_numpy(zero_copy_only=False, writable=True)  # one copy: torch wants writable
        offsets = col.offsets.to_numpy()  # absolute into .values, slice offset applied
        scales = table[f"score_{name}_scale"].to_pylist()
        return [None if scale is None else dequantize(flat[offsets[i]:offsets[i + 1]], scale)
                for i, scale in enumerate(scales)]

    prompt_lens = table["prompt_len"].to_pylist()
    utility, routing, history, prompt = (column(k) for k in ("utility", "routing", "history", "prompt"))
    return [RowScores(u, a.reshape(len(u), int(p)), c, k)
            for p, u, a, c, k in zip(prompt_lens, utility, routing, history, prompt)]


SELECT_INPUT_COLUMNS = ["input_ids", "prompt_len", "loss_mask", "prompt_offsets", "response_offsets", "response",
                        "domain"]


class BridgeScoreUDF:
    """Ray Data actor: token utilities + routing (+ knock-out prompt scores) for a batch of token rows; appends the
    ``score_*`` columns (:func:`score_table`).  The only BRIDGE actor that holds a model."""

    def __init__(self, model_dir: str, direction_path: str, routing_layer: int | None, settings: SelectionSettings,
                 micro_batch: int, threads: int, score_dtype: str = "float16"):
        import torch
        from safetensors.torch import load_file

        from raycurate.algorithms.bridge.routing import default_routing_layer
        from raycurate.models.loading import best_device, load_model, load_tokenizer

        torch.set_num_threads(max(1, threads))
        self.device = best_device()
        if self.device == "cpu":
            torch.set_flush_denormal(True)  # denormals slow the forward-mode pass several-fold on CPU
        self.model = load_model(model_dir, dtype="float32", device=self.device).eval()
        self.direction = {k: v.to(self.device) for k, v in load_file(direction_path).items()}
        self.layer = default_routing_layer(self.model) if routing_layer is None else routing_layer
        self.pad_id = load_tokenizer(model_dir).pad_token_id or 0
        self.settings = settings
        self.micro_batch = micro_batch
        self.score_dtype = score_dtype

    def __call__(self, batch: Any) -> Any:
        from raycurate.algorithms.bridge.rows import score_rows

        rows = batch.select(SELECT_INPUT_COLUMNS).to_pylist()
        scores = score_rows(self.model, self.direction, self.layer, rows, self.settings, pad_id=self.pad_id,
                            micro_batch=self.micro_batch)
        return score_table(batch, scores, self.score_dtype)


class BridgeSelectUDF:
    """Budgets, coupled selection and closure from the stored scores (CPU actor, or in the driver process); swaps
    the ``score_*`` columns for the ``sel_*`` columns (:func:`selection_table`).  No model."""

    def __init__(self, settings: SelectionSettings):
        self.settings = settings

    def __call__(self, batch: Any) -> Any:
        from raycurate.algorithms.bridge.rows import select_rows

        rows = batch.select(SELECT_INPUT_COLUMNS).to_pylist()
        results = select_rows(rows, scores_from_table(batch), self.settings)
        kept = batch.drop_columns([c for c in SCORE_COLUMNS if c in batch.column_names])
        return selection_table(kept, results)


#: Selection settings that change the knock-out prompt scores (they are conditioned on the routing S_r).
KNOCKOUT_SCORE_FIELDS = ("rho_p", "rho_r", "schedule", "rounds", "fold_fixed_response")


def score_config(bridge_cfg: BridgeConfig) -> dict:
    """What ``bridge_score``'s hash covers besides its upstream stages (data, theta_bar, and the direction, which
    carries the scoring layers L and lambda): the routing layer, the prompt proxy and the storage dtype.  The
    budgets only enter for ``prompt_proxy = knockout_grad``, whose prompt scores are conditioned on the routing
    selection."""
    config: dict[str, Any] = {"routing_layer": bridge_cfg.routing_layer, "prompt_proxy": bridge_cfg.prompt_proxy,
                              "score_dtype": bridge_cfg.score_dtype}
    if bridge_cfg.prompt_proxy == "knockout_grad":
        config["knockout_conditioned_on"] = {k: getattr(bridge_cfg, k) for k in KNOCKOUT_SCORE_FIELDS}
    return config


def score_stage(run: RunDir, *, tokens_stage: str, warmup_stage: str, direction_stage_name: str,
                bridge_cfg: BridgeConfig, pool_cfg: ActorPoolConfig, progress: bool = True,
                force: bool = False) -> dict:
    """``bridge_score``: the model pass (utilities, routing, optional knock-out scores) on a fault-tolerant actor
    pool in resumable shards (:mod:`raycurate.stages.sharded`); writes ``scores/part-*.parquet`` (token columns +
    ``score_*`` columns in ``bridge.score_dtype``).  Its hash ignores the budgets (:func:`score_config`), so a
    budget change re-runs only ``bridge_select``."""

    tokens = output_path(run, tokens_stage, "tokens")
    model_dir = output_path(run, warmup_stage, "model")
    direction = output_path(run, direction_stage_name, "direction")
    settings = selection_settings(bridge_cfg)
    if settings.prompt_proxy != "knockout_grad":  # the routing proxy's scores ignore the selection settings: keep
        settings = type(settings)(prompt_proxy=settings.prompt_proxy)  # them out of the shard plan key (resume)

    def body(out: Path) -> StageOutput:
        from raycurate.stages.sharded import SHARDS_DIR

        pool = resolve_pool(pool_cfg)
        scratch = scratch_dir(run, "bridge_score")  # finished shards survive a killed job
        shards = ShardedInput(str(tokens), scratch, pool_cfg.shard_rows)
        shard_metrics = map_model_over_rows(shards, BridgeScoreUDF, {
            "model_dir": str(model_dir), "direction_path": str(direction), "routing_layer": bridge_cfg.routing_layer,
            "settings": settings, "micro_batch": bridge_cfg.micro_batch,
            "threads": max(1, int(round(pool.num_cpus))), "score_dtype": bridge_cfg.score_dtype,
        }, pool, progress=progress)
        os.replace(scratch / SHARDS_DIR, out / "scores")
        metrics = {"rows": shard_metrics["rows"], "rows_scored": shard_metrics["rows_computed"],
                   "score_dtype": bridge_cfg.score_dtype,
                   "score_bytes": sum(f.stat().st_size for f in (out / "scores").glob("*.parquet")),
                   "shards": {k: v for k, v in shard_metrics.items() if not isinstance(v, (list, dict))}}
        return StageOutput(outputs={"scores": "scores"}, metrics=metrics)

    return run_stage(run, "bridge_score", body, config=score_config(bridge_cfg),
                     upstream=[tokens_stage, warmup_stage, direction_stage_name], force=force)


#: ``bridge.select_actors: null`` selects in the driver process up to this many rows: below it, starting CPU
#: actors (a Python process importing torch each, ~5 s idle, far more on a loaded machine) costs more than the
#: selection itself (~0.5-1 ms per example with closure).
SELECT_IN_PROCESS_ROWS = 20_000


def select_stage(run: RunDir, *, score_stage_name: str, bridge_cfg: BridgeConfig, pool_cfg: ActorPoolConfig,
                 progress: bool = True, force: bool = False, stage: str = "bridge_select") -> dict:
    """``bridge_select``: per-example budgets, coupled selection and closure from ``bridge_score``'s stored scores
    (no model, no GPU), in resumable shards, on CPU actors or in the driver process (``bridge.select_actors``);
    writes ``selection/part-*.parquet`` (token columns + ``sel_*`` columns).  Keyed by the selection settings
    (budgets, schedule, closure); where it runs does not change the output.  ``stage`` names it, so one run can
    hold selections at several budgets from the same scores (e.g. curate's matched-budget BRIDGE arm)."""
    scores = output_path(run, score_stage_name, "scores")
    settings = selection_settings(bridge_cfg)

    def body(out: Path) -> StageOutput:
        from raycurate.stages.sharded import SHARDS_DIR, list_input_files

        actors = bridge_cfg.select_actors
        if actors is None:
            rows = sum(f.rows for f in list_input_files(scores))
            actors = 0 if rows <= SELECT_IN_PROCESS_ROWS else pool_cfg.num_actors
        pool = resolve_pool(dataclasses.replace(pool_cfg, gpus_per_actor=0, num_actors=max(actors, 1)))
        scratch = scratch_dir(run, stage)
        shard_metrics = map_model_over_rows(
            ShardedInput(str(scores), scratch, pool_cfg.shard_rows, in_process=actors == 0), BridgeSelectUDF,
            {"settings": settings}, pool, progress=progress)
        if settings.budget == "corpus":
            apply_corpus_budget(scratch / SHARDS_DIR, settings)
        os.replace(scratch / SHARDS_DIR, out / "selection")
        metrics = selection_summary(out / "selection")
        metrics["budget"] = settings.budget
        metrics["shards"] = {k: v for k, v in shard_metrics.items() if not isinstance(v, (list, dict))}
        metrics["select_actors"] = actors
        return StageOutput(outputs={"selection": "selection"}, metrics=metrics)

    return run_stage(run, stage, body, config={"settings": dataclasses.asdict(settings)},
                     upstream=[score_stage_name], force=force)


#: Selection columns that :func:`apply_corpus_budget` rewrites (the response side; the prompt side stays).
CORPUS_BUDGET_COLUMNS = ("loss_mask", "b_r", "supervised_response", "closure_fallback", "final_answer_kept",
                         "final_answer_kept_score_only", "utility_retained", "closure_solver")


def apply_corpus_budget(selection_dir: Path, settings: SelectionSettings) -> dict:
    """``bridge.budget = corpus``: re-allocate the response budget of the per-example selections in
    ``selection_dir`` (every part, rewritten in place) over the whole corpus by their stored conditional response
    scores (:func:`raycurate.algorithms.bridge.rows.corpus_response_masks`).  Runs in the driver after the shards:
    the allocation needs every row's scores (one float32 per eligible response token)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raycurate.algorithms.bridge.rows import corpus_response_masks

    parts = sorted(Path(selection_dir).glob("*.parquet"))
    tables = [pq.read_table(part) for part in parts]
    columns = ["id", *SELECT_INPUT_COLUMNS, "sel_response_scores", "sel_loss_mask"]
    rows = [r for t in tables for r in t.select(columns).to_pylist()]
    results = corpus_response_masks(rows, [np.asarray(r["sel_response_scores"]) for r in rows], settings)
    start = 0
    for part, table in zip(parts, tables):
        chunk = results[start:start + table.num_rows]
        chunk_rows = rows[start:start + table.num_rows]
        start += table.num_rows
        loss = []
        for row, res in zip(chunk_rows, chunk):
            mask = np.asarray(row["sel_loss_mask"], dtype=np.int8)
            mask[res["response_idx"]] = res["response_mask"]
            loss.append(mask)
        values = {"loss_mask": loss, **{k: [res[k] for res in chunk] for k in CORPUS_BUDGET_COLUMNS[1:]}}
        for name in CORPUS_BUDGET_COLUMNS:
            index = table.schema.get_field_index(f"sel_{name}")
            data = [v.tolist() if hasattr(v, "tolist") else v for v in values[name]]
            table = table.set_column(index, f"sel_{name}", pa.array(data, type=_arrow_type(SELECTION_COLUMNS[name])))
        pq.write_table(table, part)
    return {"rows": len(rows), "supervised": sum(r["supervised_response"] for r in results)}


def response_totals(run: RunDir, select_stage_name: str) -> dict[str, int]:
    """Response-token totals of a BRIDGE selection over its rows: ``eligible`` (budgeted positions),
    ``supervised`` (selected eligible positions), ``fixed`` (always-supervised EOS / end-of-turn positions) and
    ``loss_tokens`` (= supervised + fixed, what the compact SFT trains on)."""
    columns = ["sel_loss_mask", "sel_eligible_response", "sel_supervised_response"]
    rows = read_token_rows(output_path(run, select_stage_name, "selection"), columns)
    eligible = sum(int(r["sel_eligible_response"]) for r in rows)
    supervised = sum(int(r["sel_supervised_response"]) for r in rows)
    loss_tokens = sum(int(sum(r["sel_loss_mask"])) for r in rows)
    return {"rows": len(rows), "eligible": eligible, "supervised": supervised, "fixed": loss_tokens - supervised,
            "loss_tokens": loss_tokens}


def selection_summary(selection_dir: Path) -> dict:
    """Realised budgets, U_sur per schedule, closure coverage and prompt-relevance drops over a selection table."""
    import numpy as np

    from raycurate.algorithms.bridge.rows import prompt_relevance_drops

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
