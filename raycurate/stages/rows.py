"""Row helpers and subset stages: the ids and response tokens of a token table, a seeded sample of them, the stages
that cut a token table (by predicate, by id, with weights, a union of tables), and the embedded corpus's
ground-truth labels (clean / corruption kind) with the separation and precision they allow."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from raycurate.rundir import RunDir
from raycurate.stages.base import StageOutput, output_path, run_stage
from raycurate.stages.bridge import read_token_rows


def token_ids(run: RunDir, tokens_stage: str) -> list[str]:
    """Sorted example ids of a token table."""
    return sorted(r["id"] for r in read_token_rows(output_path(run, tokens_stage, "tokens"), ["id"]))


def seeded_sample(ids: list[str], k: int, seed: int) -> list[str]:
    """``k`` ids drawn without replacement from the sorted ``ids`` with ``default_rng(seed)``."""
    import numpy as np

    if not 0 < k <= len(ids):
        raise ValueError(f"cannot sample {k} examples from a pool of {len(ids)}; lower the sample size")
    chosen = np.random.default_rng(seed).choice(len(ids), size=k, replace=False)
    return sorted(ids[i] for i in chosen)


def ids_subset_stage(run: RunDir, stage: str, *, tokens_stage: str, ids: list[str], description: str,
                     force: bool = False) -> dict:
    """The rows of ``tokens_stage`` whose id is in ``ids`` (the id list is part of the stage config)."""
    wanted = sorted(set(ids))

    def keep(table: Any) -> Any:
        import pyarrow as pa
        import pyarrow.compute as pc

        return pc.is_in(table["id"], value_set=pa.array(wanted))

    return filter_tokens_stage(run, stage, tokens_stage=tokens_stage, description=description, keep=keep,
                               config={"ids": wanted}, force=force)



def label_values(run: RunDir, tokens_stage: str, key: str) -> dict[str, Any]:
    """``id -> label[key]`` where the token table carries ground-truth labels (the embedded corpus), else ``{}``."""
    path = output_path(run, tokens_stage, "tokens")
    try:
        rows = read_token_rows(path, ["id", "label"])
    except Exception:  # noqa: BLE001 - user data has no label column
        return {}
    return {r["id"]: (r["label"] or {}).get(key) for r in rows}


def clean_labels(run: RunDir, tokens_stage: str) -> dict[str, Any]:
    """``id -> label.clean`` (``{}`` without labels)."""
    return label_values(run, tokens_stage, "clean")


def corruption_kinds(run: RunDir, tokens_stage: str) -> dict[str, str]:
    """``id -> label.corruption``, ``"none"`` on clean rows (``{}`` without labels)."""
    return {i: str(kind or "none") for i, kind in label_values(run, tokens_stage, "corruption").items()}


def score_separation(ids: list[str], scores: Any, labels: dict[str, Any], kinds: dict[str, str],
                     seed: int) -> dict[str, Any]:
    """AUROC of the selection score (N,) separating clean from corrupted rows, overall and per corruption kind,
    with seeded bootstrap intervals (``algorithms.ranking.label_separation``); ``{}`` without both classes."""
    import numpy as np

    from raycurate.algorithms.ranking import label_separation

    known = [i for i, example_id in enumerate(ids) if labels.get(example_id) is not None]
    clean = np.array([bool(labels[ids[i]]) for i in known], dtype=bool)
    if clean.all() or not clean.any():
        return {}
    kind = np.array([kinds.get(ids[i], "none") if not clean[j] else "none" for j, i in enumerate(known)])
    return label_separation(np.asarray(scores, dtype=np.float64)[known], clean, kind, seed)


def precision(chosen: list[str], labels: dict[str, Any]) -> float | None:
    """Share of clean rows among ``chosen`` (None without labels)."""
    known = [labels[i] for i in chosen if labels.get(i) is not None]
    return sum(bool(v) for v in known) / len(known) if known else None


def clean_rows(table: Any) -> Any:
    """A token-table filter: the rows whose ground-truth label says the response is clean."""
    import pyarrow.compute as pc

    return pc.struct_field(table["label"], "clean")


def filter_tokens_stage(run: RunDir, stage: str, *, tokens_stage: str, description: str,
                        keep: Callable[[Any], Any], config: Any, force: bool = False) -> dict:
    """Write the subset of a token table selected by ``keep`` (a pyarrow-table -> boolean-mask function)."""
    import pyarrow.parquet as pq

    source = output_path(run, tokens_stage, "tokens")

    def body(out: Path) -> StageOutput:
        (out / "tokens").mkdir()
        kept = total = 0
        for index, path in enumerate(sorted(source.glob("*.parquet"))):
            table = pq.read_table(path)
            subset = table.filter(keep(table))
            total += table.num_rows
            kept += subset.num_rows
            pq.write_table(subset, out / "tokens" / f"part-{index:05d}.parquet")
        if kept == 0:
            raise ValueError(f"subset '{stage}' ({description}) selected no rows out of {total}")
        return StageOutput(outputs={"tokens": "tokens"}, metrics={"rows_in": total, "rows_kept": kept,
                                                                   "description": description})

    return run_stage(run, stage, body, config=config, upstream=[tokens_stage], force=force)


def response_tokens(run: RunDir, tokens_stage: str) -> dict[str, int]:
    """``id -> number of loss-mask (response) tokens`` of every row of a token table."""
    return {r["id"]: int(sum(r["loss_mask"])) for r in read_token_rows(output_path(run, tokens_stage, "tokens"),
                                                                         ["id", "loss_mask"])}


def subset_rows_stage(run: RunDir, stage: str, *, tokens_stage: str, ids: list[str],
                      weights: Mapping[str, float] | None = None, description: str = "",
                      force: bool = False) -> dict:
    """The rows of ``tokens_stage`` whose id is in ``ids``, with ``weight`` set from ``weights`` (else kept).

    Metrics: ``rows``, ``response_tokens`` (sum of ``loss_mask``: what SFT trains on), ``prompt_tokens``
    (tokens before ``prompt_len``, i.e. the executed context), on labelled data ``clean_share`` (share of rows whose
    ``label.clean`` is true) and, with weights, ``weight_min`` / ``weight_max``.

    Raises:
        ValueError: when an id is not in the table (a kept row must exist in what it is cut from).
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    wanted = sorted(set(ids))
    if weights is not None:
        missing = [i for i in wanted if i not in weights]
        if missing:
            raise ValueError(f"{stage}: {len(missing)} kept rows have no weight (e.g. {missing[:3]})")

    def body(out: Path) -> StageOutput:
        (out / "tokens").mkdir()
        source = output_path(run, tokens_stage, "tokens")
        value_set = pa.array(wanted, pa.string())
        found: list[str] = []
        sums = {"response_tokens": 0, "prompt_tokens": 0}
        clean: list[bool] = []
        for index, path in enumerate(sorted(source.glob("*.parquet"))):
            table = pq.read_table(path)
            table = table.filter(pc.is_in(table["id"], value_set=value_set))
            if weights is not None:
                column = pa.array([float(weights[i]) for i in table["id"].to_pylist()], pa.float32())
                if "weight" in table.schema.names:
                    table = table.set_column(table.schema.get_field_index("weight"), "weight", column)
                else:
                    table = table.append_column("weight", column)
            found.extend(table["id"].to_pylist())
            sums["response_tokens"] += int(sum(sum(m) for m in table["loss_mask"].to_pylist()))
            sums["prompt_tokens"] += int(sum(table["prompt_len"].to_pylist()))
            if "label" in table.schema.names:
                clean.extend(bool((label or {}).get("clean")) for label in table["label"].to_pylist())
            pq.write_table(table, out / "tokens" / f"part-{index:05d}.parquet")
        absent = sorted(set(wanted) - set(found))
        if absent:
            raise ValueError(f"{stage}: {len(absent)} of {len(wanted)} ids are not in {tokens_stage} "
                             f"(e.g. {absent[:3]})")
        metrics: dict[str, Any] = {"rows": len(found), **sums, "description": description}
        if clean:
            metrics["clean_share"] = float(np.mean(clean))
        if weights is not None:
            kept = [weights[i] for i in wanted]
            metrics["weight_min"], metrics["weight_max"] = float(min(kept)), float(max(kept))
        return StageOutput(outputs={"tokens": "tokens"}, metrics=metrics)

    config = {"ids": wanted, "weights": None if weights is None else [round(float(weights[i]), 6) for i in wanted]}
    return run_stage(run, stage, body, config=config, upstream=[tokens_stage], force=force)


#: The token-contract columns a training table needs (and what :func:`union_rows_stage` keeps of each table).
TRAINING_COLUMNS = ("id", "input_ids", "prompt_len", "loss_mask", "weight")


def union_rows_stage(run: RunDir, stage: str, *, tokens_stages: list[str], description: str = "",
                     force: bool = False) -> dict:
    """One training table holding every row of ``tokens_stages`` (their :data:`TRAINING_COLUMNS` only), e.g. the
    composed rows and the rows a step set aside uncurated.  Metrics: ``rows`` and ``response_tokens``.

    Raises:
        ValueError: An id appears in two of the tables.
    """
    import pyarrow.parquet as pq

    def body(out: Path) -> StageOutput:
        (out / "tokens").mkdir()
        seen: set[str] = set()
        response = index = 0
        for source in tokens_stages:
            for path in sorted(output_path(run, source, "tokens").glob("*.parquet")):
                table = pq.read_table(path, columns=list(TRAINING_COLUMNS))
                ids = table["id"].to_pylist()
                repeated = seen.intersection(ids)
                if repeated:
                    raise ValueError(f"{stage}: ids {sorted(repeated)[:3]} are in more than one of {tokens_stages}")
                seen.update(ids)
                response += int(sum(sum(m) for m in table["loss_mask"].to_pylist()))
                pq.write_table(table, out / "tokens" / f"part-{index:05d}.parquet")
                index += 1
        return StageOutput(outputs={"tokens": "tokens"},
                           metrics={"rows": len(seen), "response_tokens": response, "description": description})

    return run_stage(run, stage, body, config={"tables": list(tokens_stages)}, upstream=list(tokens_stages),
                     force=force)
