"""Compaction of selected token rows, matched-budget baseline masks, and the BRIDGE fidelity diagnostics."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from raycurate.config.bridge import BridgeConfig
from raycurate.config.pool import ActorPoolConfig
from raycurate.rundir import RunDir
from raycurate.stages.base import StageOutput, output_path, run_stage

log = logging.getLogger("raycurate")

# Columns a compacted token table keeps (the token contract plus what evaluation and reports read).
KEEP_COLUMNS = ("id", "input_ids", "prompt_len", "loss_mask", "weight", "prompt_offsets", "response_offsets",
                "prompt", "response", "domain", "split", "label")


def compact_part(table: Any, prefix: str) -> tuple[Any, dict]:
    """Compact one parquet part: ``<prefix>_prompt_keep`` / ``<prefix>_loss_mask`` -> a token table.

    Returns:
        (compacted pyarrow table, counts of tokens before/after and supervised positions).
    """
    import numpy as np
    import pyarrow as pa

    from raycurate.algorithms.bridge.compaction import compact_table_rows

    rows = table.to_pylist()
    masks = {r["id"]: (np.asarray(r[f"{prefix}_prompt_keep"], dtype=bool), np.asarray(r[f"{prefix}_loss_mask"],
                                                                                      dtype=bool)) for r in rows}
    base = [{k: r[k] for k in KEEP_COLUMNS if k in r} for r in rows]
    compact = compact_table_rows(base, masks)
    counts = {
        "rows": len(rows),
        "tokens_full": sum(len(r["input_ids"]) for r in rows),
        "tokens_compact": sum(len(r["input_ids"]) for r in compact),
        "supervised_full": sum(int(sum(r["loss_mask"])) for r in rows),
        "supervised_compact": sum(int(sum(r["loss_mask"])) for r in compact),
    }
    schema = table.select([c for c in KEEP_COLUMNS if c in table.schema.names]).schema
    fields = [schema.field(n) for n in schema.names]
    fields.append(pa.field("n_tokens_full", pa.int32()))
    return pa.Table.from_pylist(compact, schema=pa.schema(fields)), counts


def compact_stage(run: RunDir, stage: str, *, selection_stage: str, mask_prefix: str, force: bool = False) -> dict:
    """Physically compact kept prompt tokens and mask unselected response positions (BRIDGE's compact SFT;
    docs/bridge.md)."""
    import pyarrow.parquet as pq

    record = run.stage_record(selection_stage) or {}
    source_name = "selection" if "selection" in record.get("outputs", {}) else "masks"
    source = output_path(run, selection_stage, source_name)

    def body(out: Path) -> StageOutput:
        (out / "tokens").mkdir()
        totals: dict[str, int] = {}
        for index, part in enumerate(sorted(source.glob("*.parquet"))):
            table, counts = compact_part(pq.read_table(part), mask_prefix)
            pq.write_table(table, out / "tokens" / f"part-{index:05d}.parquet")
            for k, v in counts.items():
                totals[k] = totals.get(k, 0) + v
        totals_f: dict[str, Any] = dict(totals)
        if totals.get("tokens_full"):
            totals_f["executed_token_ratio"] = totals["tokens_compact"] / totals["tokens_full"]
        if totals.get("supervised_full"):
            totals_f["supervised_ratio"] = totals["supervised_compact"] / totals["supervised_full"]
        return StageOutput(outputs={"tokens": "tokens"}, metrics=totals_f)

    return run_stage(run, stage, body, config={"prefix": mask_prefix}, upstream=[selection_stage], force=force)


BASELINES = ("random", "rho1", "token_cleaning", "independent", "sequential")


def random_baseline_columns(rows: list[dict], bridge_cfg: BridgeConfig) -> dict[str, list]:
    """Random masks with BRIDGE's budgets (matched ratios), seeded per (seed, example id)."""
    from raycurate.algorithms.bridge.rows import fixed_masks
    from raycurate.algorithms.bridge.token_baselines import example_rng, random_masks

    keep, loss = [], []
    for r in rows:
        n, p = len(r["input_ids"]), int(r["prompt_len"])
        fixed_p, fixed_r = fixed_masks(p, n, r["prompt_offsets"], r["response_offsets"])
        masks = random_masks(n, p, bridge_cfg.rho_p, bridge_cfg.rho_r, example_rng(bridge_cfg.seed, r["id"]),
                             has_bos=bool(fixed_p[0]), fixed_prompt_mask=fixed_p, fixed_response_mask=fixed_r)
        keep.append(masks.prompt_keep.astype("int8").tolist())
        loss.append(masks.loss_mask.astype("int8").tolist())
    return {"prompt_keep": keep, "loss_mask": loss}


class TokenLossUDF:
    """Ray Data actor: per-token losses of the base and reference (warmup) models -> masks of a loss-based baseline."""

    def __init__(self, base_dir: str, reference_dir: str, method: str, rho_p: float, rho_r: float, threads: int):
        import torch

        from raycurate.models.loading import best_device, load_model, load_tokenizer

        torch.set_num_threads(max(1, threads))
        self.base = load_model(base_dir, dtype="float32", device=best_device()).eval()
        self.reference = load_model(reference_dir, dtype="float32", device=best_device()).eval()
        self.pad_id = load_tokenizer(base_dir).pad_token_id or 0
        self.method, self.rho_p, self.rho_r = method, rho_p, rho_r

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa

        rows = batch.select(["input_ids", "prompt_len", "loss_mask", "prompt_offsets", "response_offsets"]).to_pylist()
        if self.method == "token_cleaning":  # corpus-wide threshold: scores here, masks in the driver
            scores = token_cleaning_row_scores(self.base, self.reference, rows, self.pad_id)
            return batch.append_column("token_cleaning_scores", pa.array(scores, type=pa.list_(pa.float64())))
        columns = loss_baseline_columns(self.method, self.base, self.reference, rows, self.rho_p, self.rho_r,
                                        self.pad_id)
        out = batch
        for name, values in columns.items():
            out = out.append_column(f"{self.method}_{name}", pa.array(values, type=pa.list_(pa.int8())))
        return out


def token_cleaning_row_scores(base: Any, reference: Any, rows: list[dict], pad_id: int) -> list[list[float]]:
    """Token Cleaning scores ``l_base - l_ref`` over every position of each row (0 outside the loss mask)."""
    from raycurate.algorithms.bridge import token_baselines as tb

    losses = row_token_losses({"base": base, "reference": reference}, rows, pad_id)
    out = []
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        out.append(tb.response_scores("token_cleaning", losses["base"][i, :n].numpy(),
                                      losses["reference"][i, :n].numpy()).tolist())
    return out


def token_cleaning_global_columns(rows: list[dict], scores: list[list[float]], rho_p: float,
                                  rho_r: float) -> dict[str, list]:
    """Token Cleaning masks of ALL rows from one corpus-wide threshold (``tb.token_cleaning_global_masks``).

    Returns:
        ``{"prompt_keep": [...], "loss_mask": [...]}`` int8 lists per row, in the order of ``rows``.
    """
    from raycurate.algorithms.bridge import token_baselines as tb
    from raycurate.algorithms.bridge.rows import fixed_masks

    prompt_lens, bos, fixed_p, fixed_r = [], [], [], []
    for r in rows:
        n, p = len(r["input_ids"]), int(r["prompt_len"])
        fp, fr = fixed_masks(p, n, r["prompt_offsets"], r["response_offsets"])
        prompt_lens.append(p)
        bos.append(bool(fp[0]))
        fixed_p.append(fp)
        fixed_r.append(fr)
    masks = tb.token_cleaning_global_masks(scores, prompt_lens, rho_p, rho_r, has_bos=bos,
                                           fixed_prompt_masks=fixed_p, fixed_response_masks=fixed_r)
    return {"prompt_keep": [m.prompt_keep.astype("int8").tolist() for m in masks],
            "loss_mask": [m.loss_mask.astype("int8").tolist() for m in masks]}


def row_token_losses(models: dict[str, Any], rows: list[dict], pad_id: int, *, whole_row: bool = False) -> dict:
    """Per-position next-token losses of each model on a padded batch of token rows.

    Args:
        models: name -> causal LM.
        rows: token rows (``input_ids``, ``loss_mask``).
        pad_id: padding token id.
        whole_row: score every position (prompt included, for surprisal) instead of the row's loss mask.

    Returns:
        name -> (B, T) float tensor (0 at unscored positions).
    """
    import torch

    from raycurate.algorithms.losses import model_token_losses, pad_rows

    out = {}
    for name, model in models.items():
        device = next(model.parameters()).device
        batch = {k: v.to(device) for k, v in pad_rows(rows, pad_id).items()}
        mask = batch["attention_mask"] if whole_row else batch["loss_mask"]
        with torch.no_grad():
            out[name] = model_token_losses(model, batch["input_ids"], batch["attention_mask"], mask).cpu()
    return out


def loss_baseline_columns(method: str, base: Any, reference: Any, rows: list[dict], rho_p: float, rho_r: float,
                          pad_id: int) -> dict[str, list]:
    """Masks of a loss-based token baseline (paper App. B.2, D.1; docs/bridge.md) for a batch of token rows.

    * ``rho1``: response tokens ranked by excess loss (base - reference) within each row, prompt intact, at the
      one-sided matched budget of App. B.2.  (``token_cleaning`` ranks the same score over the whole corpus:
      :func:`token_cleaning_row_scores` + :func:`token_cleaning_global_columns`; here it is ranked per row.)
    * ``independent``: prompt tokens by base-model surprisal (the offline LLMLingua stand-in, see
      :mod:`raycurate.algorithms.bridge.token_baselines`) and response tokens by Token Cleaning scores, both on the full
      example, at BRIDGE's per-side budgets ("LLM+TC (Ind.)").
    * ``sequential``: the same prompt selection first, then Token Cleaning scores recomputed on the compacted row
      ("LLM -> TC (Seq.)").

    Returns:
        ``{"prompt_keep": [...], "loss_mask": [...]}`` int8 lists per row.
    """
    from raycurate.algorithms.bridge import token_baselines as tb
    from raycurate.algorithms.bridge.rows import fixed_masks

    models = {"base": base, "reference": reference}
    losses = row_token_losses(models, rows, pad_id)
    surprisal = row_token_losses({"base": base}, rows, pad_id, whole_row=True)["base"] if method in (
        "independent", "sequential") else None
    keep, loss = [], []
    for i, r in enumerate(rows):
        n, p = len(r["input_ids"]), int(r["prompt_len"])
        fixed_p, fixed_r = fixed_masks(p, n, r["prompt_offsets"], r["response_offsets"])
        layout: dict[str, Any] = {"has_bos": bool(fixed_p[0]), "fixed_prompt_mask": fixed_p,
                                  "fixed_response_mask": fixed_r}
        if method in ("rho1", "token_cleaning"):
            scores = tb.response_scores(method, losses["base"][i, :n].numpy(), losses["reference"][i, :n].numpy())
            masks = tb.token_cleaning_masks(scores, p, rho_r, budget="matched", rho_p=rho_p, **layout)
        else:
            assert surprisal is not None  # computed above for the composed methods
            prompt_scores = tb.surprisal_prompt_scores(surprisal[i, :n].numpy(), p)
            if method == "independent":
                scores = tb.response_scores("token_cleaning", losses["base"][i, :n].numpy(),
                                            losses["reference"][i, :n].numpy())
                masks = tb.independent_composition(prompt_scores, scores, n, rho_p, rho_r, **layout)
            else:
                masks = tb.sequential_composition(prompt_scores, _compacted_rescorer(models, r, pad_id), n, rho_p,
                                                  rho_r, **layout)
        keep.append(masks.prompt_keep.astype("int8").tolist())
        loss.append(masks.loss_mask.astype("int8").tolist())
    return {"prompt_keep": keep, "loss_mask": loss}


def _compacted_rescorer(models: dict[str, Any], row: dict, pad_id: int) -> Any:
    """``prompt_keep -> Token Cleaning scores`` of ``row`` recomputed with only the kept prompt tokens in context."""
    import numpy as np

    from raycurate.algorithms.bridge.compaction import compact_example
    from raycurate.algorithms.bridge.token_baselines import response_scores

    def rescore(prompt_keep: np.ndarray) -> np.ndarray:
        n = len(row["input_ids"])
        compact = compact_example(row["input_ids"], int(row["prompt_len"]), prompt_keep, np.asarray(
            row["loss_mask"], dtype=bool) | (np.arange(n) >= int(row["prompt_len"])))
        losses = row_token_losses(models, [compact], pad_id)
        m = len(compact["input_ids"])
        return response_scores("token_cleaning", losses["base"][0, :m].numpy(), losses["reference"][0, :m].numpy())

    return rescore


def baseline_masks_stage(run: RunDir, stage: str, *, method: str, selection_stage: str, warmup_stage: str,
                         base_stage: str, bridge_cfg: BridgeConfig, pool_cfg: ActorPoolConfig | None = None,
                         force: bool = False) -> dict:
    """Masks of a token-selection baseline for the same rows as BRIDGE; writes ``masks/*.parquet``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if method not in BASELINES:
        raise ValueError(f"unknown token baseline {method!r}; available: {', '.join(BASELINES)}")
    source = output_path(run, selection_stage, "selection")
    keep_cols = [*KEEP_COLUMNS]

    def body(out: Path) -> StageOutput:
        (out / "masks").mkdir()
        if method == "random":
            for index, part in enumerate(sorted(source.glob("*.parquet"))):
                table = pq.read_table(part)
                table = table.select([c for c in keep_cols if c in table.schema.names])
                cols = random_baseline_columns(table.to_pylist(), bridge_cfg)
                for name, values in cols.items():
                    table = table.append_column(f"random_{name}", pa.array(values, type=pa.list_(pa.int8())))
                pq.write_table(table, out / "masks" / f"part-{index:05d}.parquet")
        else:
            import ray.data

            from raycurate.config.pool import ActorPoolConfig
            from raycurate.stages.executor import map_model_over_rows, resolve_pool

            ray.data.DataContext.get_current().execution_options.preserve_order = True
            pool = resolve_pool(pool_cfg or ActorPoolConfig(batch_size=16))
            parts = [str(p) for p in sorted(source.glob("*.parquet"))]  # the folder also holds shard markers
            ds = ray.data.read_parquet(parts).select_columns(keep_cols)
            ds = map_model_over_rows(ds, TokenLossUDF, {
                "base_dir": str(output_path(run, base_stage, "model")),
                "reference_dir": str(output_path(run, warmup_stage, "model")), "method": method,
                "rho_p": bridge_cfg.rho_p, "rho_r": bridge_cfg.rho_r, "threads": max(1, int(round(pool.num_cpus))),
            }, pool)
            if method != "token_cleaning":
                ds.write_parquet(str(out / "masks"))
            else:
                _write_token_cleaning_global(ds, out, bridge_cfg)
        return StageOutput(outputs={"masks": "masks"}, metrics={"method": method})

    config = {"method": method, "rho_p": bridge_cfg.rho_p, "rho_r": bridge_cfg.rho_r, "seed": bridge_cfg.seed}
    if method == "token_cleaning":
        config["ranking"] = "corpus"  # its own global threshold (older runs ranked per row: a new hash)
    return run_stage(run, stage, body, config=config, upstream=[selection_stage, warmup_stage, base_stage],
                     force=force)


def _write_token_cleaning_global(ds: Any, out: Path, bridge_cfg: BridgeConfig) -> None:
    """Scores from the actor pool -> ``out/scores``; one corpus-wide Top-B in the driver -> ``out/masks``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ds.write_parquet(str(out / "scores"))
    parts = [pq.read_table(p) for p in sorted((out / "scores").glob("*.parquet"))]
    cols = ["input_ids", "prompt_len", "prompt_offsets", "response_offsets"]
    rows = [r for t in parts for r in t.select(cols).to_pylist()]
    scores = [s for t in parts for s in t["token_cleaning_scores"].to_pylist()]
    columns = token_cleaning_global_columns(rows, scores, bridge_cfg.rho_p, bridge_cfg.rho_r)
    (out / "masks").mkdir(exist_ok=True)  # the stage body made it
    start = 0
    for index, table in enumerate(parts):
        stop = start + table.num_rows
        table = table.drop_columns(["token_cleaning_scores"])
        for name, values in columns.items():
            table = table.append_column(f"token_cleaning_{name}", pa.array(values[start:stop],
                                                                            type=pa.list_(pa.int8())))
        pq.write_table(table, out / "masks" / f"part-{index:05d}.parquet")
        start = stop
