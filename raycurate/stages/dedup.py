"""The near-duplicate stage (docs/design.md, "The default curate recipe"): MinHash signatures on Ray Data, then
the pairs and clusters of :mod:`raycurate.algorithms.dedup`; the trusted rows (or the validation split) come first
and are never flagged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from raycurate.algorithms.dedup import cluster_duplicates, duplicate_pairs, minhash_signatures, word_shingles
from raycurate.rundir import RunDir
from raycurate.stages.base import StageOutput, output_path, run_stage
from raycurate.stages.bridge import read_token_rows
from raycurate.stages.executor import dataset_from_rows, map_model_over_rows

DUPLICATES_FILE = "duplicates.parquet"


def _signature_batch(batch: dict[str, Any], num_perm: int, seed: int) -> dict[str, Any]:
    return {"row": batch["row"], "signature": minhash_signatures(list(batch["text"]), num_perm, seed)}


def dedup_stage(run: RunDir, stage: str, *, tokens_stage: str, split_column: str, reference_split: str,
                candidate_split: str, threshold: float, num_perm: int = 64, bands: int = 16, seed: int = 0,
                reference_stage: str | None = None, measure: str = "jaccard", keep: str = "first",
                force: bool = False) -> dict:
    """Flag all but one copy of each near-duplicate cluster among the reference rows (validation split, or
    ``reference_stage``: the trusted set's token table) and the candidates, which come after them by id.

    A pair is a duplicate when its ``measure`` similarity (:data:`raycurate.algorithms.dedup.SIMILARITIES`) is >=
    ``threshold``; a cluster with a reference row flags every candidate in it, otherwise ``keep`` (``first`` by id,
    ``shortest`` text) picks the copy that stays (:func:`raycurate.algorithms.dedup.cluster_duplicates`).

    Outputs ``duplicates.parquet`` (``id``, ``duplicate``, ``duplicate_of``, ``jaccard``) for the candidates; metrics
    ``candidates``, ``flagged`` and, on labelled data, ``flagged_by_kind`` and ``near_duplicate_recall`` (share of
    the ``label.corruption == near_duplicate`` rows that were flagged) and ``precision`` (share of flagged rows that
    are labelled near-duplicates).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    def body(out: Path) -> StageOutput:
        source = output_path(run, tokens_stage, "tokens")
        names = pq.read_schema(next(iter(sorted(source.glob("*.parquet"))))).names
        columns = ["id", split_column, "prompt", "response"] + (["label"] if "label" in names else [])
        all_rows = read_token_rows(source, columns)
        if reference_stage is None:
            reference = sorted((r for r in all_rows if r[split_column] == reference_split), key=lambda r: r["id"])
        else:
            trusted = read_token_rows(output_path(run, reference_stage, "tokens"), ["id", "prompt", "response"])
            reference = sorted(trusted, key=lambda r: r["id"])
        cands = sorted((r for r in all_rows if r[split_column] == candidate_split), key=lambda r: r["id"])
        if not cands:
            raise ValueError(f"{stage}: no rows of split {candidate_split!r} in {tokens_stage} to deduplicate")
        rows = reference + cands
        texts = [f"{r['prompt']}\n{r['response']}" for r in rows]
        # "example" pairs share a response: bucket by the responses' signatures, verify prompts and responses
        hashed = [r["response"] for r in rows] if measure == "example" else texts
        items = [{"row": i, "text": t} for i, t in enumerate(hashed)]
        signed = map_model_over_rows(dataset_from_rows(items), _signature_batch, {"num_perm": num_perm, "seed": seed},
                                     None, batch_format="numpy").take_all()  # a function on Ray Data's tasks
        signatures = np.empty((len(rows), num_perm), dtype=np.uint64)
        for item in signed:
            signatures[int(item["row"])] = item["signature"]
        if measure == "example":
            pairs = duplicate_pairs(signatures, [word_shingles(r["prompt"]) for r in rows], threshold, bands,
                                    measure, [word_shingles(r["response"]) for r in rows])
        else:
            pairs = duplicate_pairs(signatures, [word_shingles(t) for t in texts], threshold, bands, measure)
        first = len(reference)
        earlier, similarity = cluster_duplicates(pairs, [len(t) for t in texts], keep=keep, protected=first)
        flagged = earlier[first:] >= 0
        table = pa.table({
            "id": [r["id"] for r in cands],
            "duplicate": flagged.tolist(),
            "duplicate_of": [rows[k]["id"] if k >= 0 else "" for k in earlier[first:]],
            "jaccard": similarity[first:].tolist(),  # the pair's similarity under ``measure`` (name kept)
        })
        pq.write_table(table, out / DUPLICATES_FILE)
        metrics: dict[str, Any] = {"candidates": len(cands), "flagged": int(flagged.sum()),
                                   "reference_rows": len(reference), "threshold": threshold,
                                   "measure": measure, "keep": keep}
        if "label" in names:
            kinds = np.array([(r["label"] or {}).get("corruption", "none") for r in cands])
            metrics["flagged_by_kind"] = {k: int((kinds[flagged] == k).sum()) for k in sorted(set(kinds[flagged]))}
            near = kinds == "near_duplicate"
            metrics["near_duplicate_rows"] = int(near.sum())
            metrics["near_duplicate_recall"] = float(flagged[near].mean()) if near.any() else None
            metrics["precision"] = float(near[flagged].mean()) if flagged.any() else None
        return StageOutput(outputs={"duplicates": DUPLICATES_FILE}, metrics=metrics)

    config = {"split_column": split_column, "reference": reference_stage or reference_split,
              "candidates": candidate_split, "threshold": threshold, "num_perm": num_perm, "bands": bands, "seed": seed}
    if (measure, keep) != ("jaccard", "first"):  # the original rule's key unchanged: finished runs keep their stage
        config.update({"measure": measure, "keep": keep})
    upstream = [tokens_stage] + ([reference_stage] if reference_stage else [])
    return run_stage(run, stage, body, config=config, upstream=upstream, force=force)


def flagged_ids(run: RunDir, stage: str) -> list[str]:
    """Ids the dedup stage flagged, sorted."""
    import pyarrow.parquet as pq

    table = pq.read_table(output_path(run, stage, "duplicates")).to_pylist()
    return sorted(r["id"] for r in table if r["duplicate"])
