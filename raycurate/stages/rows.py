"""Row helpers every stage shares: the ids of a token table, a seeded sample of them, a subset by id, and the
embedded corpus's ground-truth labels (clean / corruption kind) with the separation and precision they allow."""

from __future__ import annotations

from typing import Any

from raycurate.rundir import RunDir
from raycurate.stages.base import output_path
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
    from raycurate.stages.data_stages import filter_tokens_stage

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
