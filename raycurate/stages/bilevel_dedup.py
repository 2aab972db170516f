"""Near-duplicate filter before BDS (optional; docs/bilevel.md): word 3-gram MinHash with LSH banding, verified by
the exact Jaccard similarity, signatures computed on Ray Data.

A candidate is a near-duplicate when its ``prompt + "\\n" + response`` shares a word 3-gram Jaccard similarity >=
``threshold`` with an EARLIER row: the validation rows come first (the trusted set; never flagged), then the
candidates in id order, so of two candidates with the same content the first one (by id) is kept.  A loss-based
weight cannot see such rows (a copy has its source's loss), which is why they are filtered by content instead.

The pure pieces (:func:`word_shingles`, :func:`minhash_signatures`, :func:`duplicate_pairs`,
:func:`earlier_duplicates`) are numpy/hashlib only; :func:`dedup_stage` is the Ray stage.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import numpy as np

from raycurate.rundir import RunDir
from raycurate.stages.base import StageOutput, output_path, run_stage
from raycurate.stages.bridge import read_token_rows

DUPLICATES_FILE = "duplicates.parquet"
_MERSENNE_31 = (1 << 31) - 1
_WORD = re.compile(r"\w+")


def word_shingles(text: str, n: int = 3) -> frozenset[str]:
    """The set of lowercased word n-grams of ``text`` (the whole text as one shingle when it has < n words)."""
    words = _WORD.findall(text.lower())
    if len(words) < n:
        return frozenset([" ".join(words)])
    return frozenset(" ".join(words[i:i + n]) for i in range(len(words) - n + 1))


def _shingle_hashes(shingles: frozenset[str]) -> np.ndarray:
    """(S,) uint64 32-bit hashes of the shingles (blake2b: the same in every process, unlike ``hash``)."""
    return np.array([int.from_bytes(hashlib.blake2b(s.encode("utf-8"), digest_size=4).digest(), "little")
                     for s in shingles], dtype=np.uint64)


def minhash_signatures(texts: list[str], num_perm: int = 64, seed: int = 0, n: int = 3) -> np.ndarray:
    """MinHash signatures: for each of ``num_perm`` seeded hash functions ``(a x + b) mod (2^31 - 1)``, the minimum
    over the text's word n-gram hashes; two texts agree on one row with probability = their Jaccard similarity.

    Args:
        texts: R texts.
        num_perm: Signature length P.
        seed: Seed of the hash functions (same seed, same signatures).
        n: Words per shingle.

    Returns:
        (R, P) uint64 signatures.
    """
    rng = np.random.default_rng([seed, 61])
    prime = np.uint64(_MERSENNE_31)
    a = rng.integers(1, _MERSENNE_31, size=num_perm, dtype=np.uint64)  # a x + b < 2^62 for x < 2^31: no overflow
    b = rng.integers(0, _MERSENNE_31, size=num_perm, dtype=np.uint64)
    out = np.empty((len(texts), num_perm), dtype=np.uint64)
    for r, text in enumerate(texts):
        x = _shingle_hashes(word_shingles(text, n)) % prime  # (S,)
        out[r] = ((np.outer(x, a) + b) % prime).min(axis=0)
    return out


def duplicate_pairs(signatures: np.ndarray, shingles: list[frozenset[str]], threshold: float,
                    bands: int = 16) -> list[tuple[int, int, float]]:
    """Pairs (i < j) whose exact Jaccard similarity is >= ``threshold``, among the LSH candidates (rows that agree
    on all rows of at least one of ``bands`` signature bands).

    Args:
        signatures: (R, P) MinHash signatures, P divisible by ``bands``.
        shingles: R shingle sets (for the exact check).
        threshold: Jaccard similarity in (0, 1].
        bands: LSH bands.

    Returns:
        Sorted (i, j, jaccard) triples.
    """
    rows, perms = signatures.shape
    if perms % bands:
        raise ValueError(f"signature length {perms} must be divisible by bands={bands}")
    width = perms // bands
    candidates: set[tuple[int, int]] = set()
    for band in range(bands):
        buckets: dict[bytes, list[int]] = {}
        for r in range(rows):
            buckets.setdefault(signatures[r, band * width:(band + 1) * width].tobytes(), []).append(r)
        for members in buckets.values():
            candidates.update((members[x], members[y]) for x in range(len(members))
                              for y in range(x + 1, len(members)))
    pairs = []
    for i, j in sorted(candidates):
        union = len(shingles[i] | shingles[j])
        jaccard = len(shingles[i] & shingles[j]) / union if union else 1.0
        if jaccard >= threshold:
            pairs.append((i, j, jaccard))
    return pairs


def earlier_duplicates(pairs: list[tuple[int, int, float]], rows: int) -> tuple[np.ndarray, np.ndarray]:
    """For each row, the earliest row it near-duplicates (-1 if none) and that pair's Jaccard similarity.

    Returns:
        (R,) int64 index of the earlier row, (R,) float64 similarity (0 where none).
    """
    source, similarity = np.full(rows, -1, dtype=np.int64), np.zeros(rows)
    for i, j, jaccard in sorted(pairs):
        if source[j] < 0:
            source[j], similarity[j] = i, jaccard
    return source, similarity


def _signature_batch(batch: dict[str, Any], num_perm: int, seed: int) -> dict[str, Any]:
    return {"row": batch["row"], "signature": minhash_signatures(list(batch["text"]), num_perm, seed)}


def dedup_stage(run: RunDir, stage: str, *, tokens_stage: str, split_column: str, reference_split: str,
                candidate_split: str, threshold: float, num_perm: int = 64, bands: int = 16, seed: int = 0,
                reference_stage: str | None = None, force: bool = False) -> dict:
    """Flag the candidates that near-duplicate an earlier row (validation first, then candidates by id).

    ``reference_stage`` (the trusted set's token table) replaces the ``reference_split`` rows as the rows that come
    first and are never flagged.

    Outputs ``duplicates.parquet`` (``id``, ``duplicate``, ``duplicate_of``, ``jaccard``) for the candidates; metrics
    ``candidates``, ``flagged`` and, on labelled data, ``flagged_by_kind`` and ``near_duplicate_recall`` (share of
    the ``label.corruption == near_duplicate`` rows that were flagged) and ``precision`` (share of flagged rows that
    are labelled near-duplicates).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray

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
        items = [{"row": i, "text": t} for i, t in enumerate(texts)]
        signed = ray.data.from_items(items).map_batches(
            _signature_batch, fn_kwargs={"num_perm": num_perm, "seed": seed}, batch_format="numpy").take_all()
        signatures = np.empty((len(rows), num_perm), dtype=np.uint64)
        for item in signed:
            signatures[int(item["row"])] = item["signature"]
        pairs = duplicate_pairs(signatures, [word_shingles(t) for t in texts], threshold, bands)
        earlier, similarity = earlier_duplicates(pairs, len(rows))
        first = len(reference)
        flagged = earlier[first:] >= 0
        table = pa.table({
            "id": [r["id"] for r in cands],
            "duplicate": flagged.tolist(),
            "duplicate_of": [rows[k]["id"] if k >= 0 else "" for k in earlier[first:]],
            "jaccard": similarity[first:].tolist(),
        })
        pq.write_table(table, out / DUPLICATES_FILE)
        metrics: dict[str, Any] = {"candidates": len(cands), "flagged": int(flagged.sum()),
                                   "reference_rows": len(reference), "threshold": threshold}
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
    upstream = [tokens_stage] + ([reference_stage] if reference_stage else [])
    return run_stage(run, stage, body, config=config, upstream=upstream, force=force)


def flagged_ids(run: RunDir, stage: str) -> list[str]:
    """Ids the dedup stage flagged, sorted."""
    import pyarrow.parquet as pq

    table = pq.read_table(output_path(run, stage, "duplicates")).to_pylist()
    return sorted(r["id"] for r in table if r["duplicate"])
