"""The trusted reference: per-token losses of every pool row under a model fine-tuned on the trusted set, and under
the base model, on a Ray Data actor pool; the row signals and (on labelled data) their detection AUROC per kind.

The reference itself is a training stage on the trusted token table (:func:`raycurate.stages.model_stages.train_stage`);
the signals are :mod:`raycurate.algorithms.reference_signals`.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from raycurate.config.pool import ActorPoolConfig
from raycurate.rundir import RunDir
from raycurate.stages.base import StageOutput, output_path, require_columns, run_stage
from raycurate.stages.executor import map_model_over_rows, resolve_pool

log = logging.getLogger("raycurate")

SCORES_FILE = "reference_scores.parquet"


class ReferenceLossUDF:
    """Ray Data actor: each row's supervised-position losses under the reference and the base model, and its row
    signals (``signal_<name>``)."""

    REQUIRED_COLUMNS = ("id", "input_ids", "loss_mask")

    def __init__(self, base_dir: str, reference_dir: str, threads: int, micro_batch: int = 16,
                 stage: str = "reference_scores"):
        import torch

        from raycurate.models.loading import best_device, load_model, load_tokenizer

        torch.set_num_threads(max(1, threads))
        device = best_device()
        self.models = {"reference": load_model(reference_dir, dtype="float32", device=device).eval(),
                       "base": load_model(base_dir, dtype="float32", device=device).eval()}
        self.pad_id = load_tokenizer(base_dir).pad_token_id or 0
        self.micro_batch = micro_batch
        self.stage = stage

    def __call__(self, batch: Any) -> Any:

        require_columns(self.stage, batch, self.REQUIRED_COLUMNS)
        rows = batch.select(["input_ids", "loss_mask"]).to_pylist()
        losses = supervised_losses(self.models, rows, self.pad_id, self.micro_batch)
        return signal_columns(batch.select(["id"]), losses)


def supervised_losses(models: dict[str, Any], rows: list[dict], pad_id: int, micro_batch: int) -> dict[str, list]:
    """``{model name: [(R_i,) float32 losses of row i's supervised positions]}`` over ``rows`` (token rows), in
    their order.  Micro-batches are cut from the rows sorted by length, so each pads to a similar row (on the real
    proving ground's pool, blocks of 64 rows in micro-batches of 16: benchmarks/RESULTS.md, eleventh session)."""
    import numpy as np

    from raycurate.stages.bridge_compact import row_token_losses

    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))
    found: dict[str, list] = {name: [None] * len(rows) for name in models}
    for start in range(0, len(rows), micro_batch):
        chunk = order[start:start + micro_batch]
        per_model = row_token_losses(models, [rows[i] for i in chunk], pad_id)
        for j, i in enumerate(chunk):
            mask = np.asarray(rows[i]["loss_mask"], dtype=bool)
            for name, table in per_model.items():
                found[name][i] = table[j, :mask.size].numpy()[mask].astype(np.float32)
    return found


def signal_columns(ids: Any, losses: dict[str, list]) -> Any:
    """``ids`` (a one-column table) with ``reference_losses``, ``base_losses`` and one ``signal_<name>`` column
    per :data:`raycurate.algorithms.reference_signals.ROW_SIGNALS`."""
    import pyarrow as pa

    from raycurate.algorithms.reference_signals import ROW_SIGNALS, row_signals

    signals = [row_signals(ref, base) for ref, base in zip(losses["reference"], losses["base"])]
    out = ids
    for name in ("reference", "base"):
        out = out.append_column(f"{name}_losses", pa.array([x.tolist() for x in losses[name]],
                                                           type=pa.list_(pa.float32())))
    for name in ROW_SIGNALS:
        out = out.append_column(f"signal_{name}", pa.array([s[name] for s in signals], type=pa.float64()))
    return out


def score_in_memory(tokens: Path, udf_kwargs: dict, pool: Any) -> Any:
    """:class:`ReferenceLossUDF` over the token table at ``tokens`` on warm Ray tasks (in-memory rows), for a small
    model: a Ray Data actor pool's start-up (processes, imports, two model loads) was most of a tiny model's scoring
    (the demo's two reference maps: 44 s, benchmarks/RESULTS.md, eleventh session).  Returns the UDF's score table."""
    import pyarrow.parquet as pq

    rows = pq.read_table(tokens, columns=["id", "input_ids", "loss_mask"]).to_pylist()
    return map_model_over_rows(rows, ReferenceLossUDF, udf_kwargs, pool, warm=True, progress=False)


def reference_scores_stage(run: RunDir, stage: str, *, pool_stage: str, base_stage: str, reference_stage: str,
                           pool_cfg: ActorPoolConfig, seed: int = 0, force: bool = False) -> dict:
    """Score every row of ``pool_stage`` under ``reference_stage``'s model and the base; writes
    ``reference_scores.parquet`` (id, per-position losses, row signals).  On labelled data the metrics hold each
    signal's AUROC (clean vs corrupted, per kind, bootstrap 95% intervals)."""
    import pyarrow.parquet as pq
    import ray.data

    from raycurate.algorithms.reference_signals import ROW_SIGNALS, signal_scores

    def body(out: Path) -> StageOutput:
        from raycurate.models.loading import is_small_checkpoint

        pool = resolve_pool(pool_cfg)
        base_dir = str(output_path(run, base_stage, "model"))
        kwargs = {"base_dir": base_dir, "reference_dir": str(output_path(run, reference_stage, "model")),
                  "threads": max(1, int(round(pool.num_cpus))), "stage": stage}
        tokens = output_path(run, pool_stage, "tokens")
        if is_small_checkpoint(base_dir):
            result = score_in_memory(tokens, kwargs, pool)
        else:
            ds = ray.data.read_parquet(str(tokens)).select_columns(["id", "input_ids", "loss_mask"])
            map_model_over_rows(ds, ReferenceLossUDF, kwargs, pool).write_parquet(str(out / "_parts"))
            result = pq.read_table(out / "_parts")
            shutil.rmtree(out / "_parts")
        result = result.sort_by("id")
        pq.write_table(result, out / SCORES_FILE)
        metrics: dict[str, Any] = {"rows": result.num_rows}
        separation = signal_separation(run, pool_stage, result["id"].to_pylist(),
                                       {name: signal_scores(result[f"signal_{name}"].to_numpy())
                                        for name in ROW_SIGNALS}, seed)
        if separation:
            metrics["separation"] = separation
        return StageOutput(outputs={"scores": SCORES_FILE}, metrics=metrics)

    return run_stage(run, stage, body, config={"signals": list(ROW_SIGNALS)},
                     upstream=[pool_stage, base_stage, reference_stage], force=force)


def signal_separation(run: RunDir, tokens_stage: str, ids: list[str], scores: dict[str, Any],
                      seed: int) -> dict[str, dict]:
    """Per signal, :func:`raycurate.stages.rows.score_separation` of its scores (higher = cleaner) on labelled
    rows; ``{}`` without labels."""
    from raycurate.stages.rows import clean_labels, corruption_kinds, score_separation

    labels = clean_labels(run, tokens_stage)
    if not labels:
        return {}
    kinds = corruption_kinds(run, tokens_stage)
    return {name: score_separation(ids, values, labels, kinds, seed) for name, values in scores.items()}


def read_signal(run: RunDir, stage: str, signal: str) -> dict[str, float]:
    """``id -> signal value`` (higher = worse) of a reference scores stage."""
    import pyarrow.parquet as pq

    table = pq.read_table(output_path(run, stage, "scores"), columns=["id", f"signal_{signal}"])
    return dict(zip(table["id"].to_pylist(), table[f"signal_{signal}"].to_pylist()))


def read_losses(run: RunDir, stage: str) -> dict[str, list[float]]:
    """``id -> reference losses of the row's supervised positions`` of a reference scores stage."""
    import pyarrow.parquet as pq

    table = pq.read_table(output_path(run, stage, "scores"), columns=["id", "reference_losses"])
    return dict(zip(table["id"].to_pylist(), table["reference_losses"].to_pylist()))


def masked_table_stage(run: RunDir, stage: str, *, tokens_stage: str, scores_stage: str, threshold: float,
                       force: bool = False) -> dict:
    """``tokens_stage``'s rows with the loss of each response token above ``threshold`` nats under the trusted
    reference removed from ``loss_mask`` (the end-of-turn token keeps it).

    Metrics: ``rows``, ``masked_tokens`` / ``supervised_tokens`` (before masking), ``rows_with_masked_tokens``, and
    on labelled data ``masked_tokens_by_kind``.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raycurate.algorithms.reference_signals import high_loss_mask

    def body(out: Path) -> StageOutput:
        losses = read_losses(run, scores_stage)
        (out / "tokens").mkdir()
        counts = {"rows": 0, "supervised_tokens": 0, "masked_tokens": 0, "rows_with_masked_tokens": 0}
        by_kind: dict[str, int] = {}
        for index, path in enumerate(sorted(output_path(run, tokens_stage, "tokens").glob("*.parquet"))):
            table = pq.read_table(path)
            kinds = [(label or {}).get("corruption", "none") for label in table["label"].to_pylist()] \
                if "label" in table.schema.names else None
            masks = []
            for i, (row_id, mask) in enumerate(zip(table["id"].to_pylist(), table["loss_mask"].to_pylist())):
                mask = np.asarray(mask, dtype=np.int8)
                supervised = np.flatnonzero(mask)
                keep = high_loss_mask(np.asarray(losses[row_id]), threshold)
                if keep.size != supervised.size:
                    raise ValueError(f"{stage}: row {row_id!r} has {supervised.size} supervised positions but "
                                     f"{keep.size} reference losses; re-run {scores_stage}")
                mask[supervised[~keep]] = 0
                masks.append(mask.tolist())
                masked = int((~keep).sum())
                counts["rows"] += 1
                counts["supervised_tokens"] += int(supervised.size)
                counts["masked_tokens"] += masked
                counts["rows_with_masked_tokens"] += int(masked > 0)
                if kinds is not None and masked:
                    by_kind[kinds[i]] = by_kind.get(kinds[i], 0) + masked
            column = table.schema.get_field_index("loss_mask")
            table = table.set_column(column, "loss_mask", pa.array(masks, type=table.schema.field(column).type))
            pq.write_table(table, out / "tokens" / f"part-{index:05d}.parquet")
        metrics: dict[str, Any] = dict(counts)
        if by_kind:
            metrics["masked_tokens_by_kind"] = dict(sorted(by_kind.items()))
        log.info("%s: masked %d of %d supervised tokens in %d of %d rows", stage, counts["masked_tokens"],
                 counts["supervised_tokens"], counts["rows_with_masked_tokens"], counts["rows"])
        return StageOutput(outputs={"tokens": "tokens"}, metrics=metrics)

    return run_stage(run, stage, body, config={"threshold": threshold}, upstream=[tokens_stage, scores_stage],
                     force=force)
