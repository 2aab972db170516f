"""What ``raycurate curate`` hands back, written from a finished curate run (no Ray: parquet, jsonl, the input files).

:func:`write_outputs` writes ``curated.jsonl`` (each kept record re-read from its file and line by
:func:`original_records`, plus the added fields of :func:`added_names`), ``dropped.jsonl`` (step, reason in words
from :func:`drop_reason`, score, rank, source, line), ``scores.parquet`` (every accepted row's outcome and every
score each step computed) and ``rejected.jsonl`` (:func:`copy_rejected`); :func:`copy_model` links a ``--train``
model.  Field by field, and why the records are re-read: docs/design.md, "Curating your own data".
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from raycurate.algorithms.composition import Ledger, Step
from raycurate.errors import InputError
from raycurate.rundir import RunDir
from raycurate.stages.base import output_path
from raycurate.stages.bridge import read_token_rows

CURATED, DROPPED, REJECTED, SCORES = "curated.jsonl", "dropped.jsonl", "rejected.jsonl", "scores.parquet"
#: Outcomes of an accepted row in ``scores.parquet``: curated and kept, dropped by a step, or kept without being
#: curated (rows of another split than the pool, e.g. BRIDGE's warmup rows).
KEPT, DROPPED_OUTCOME, UNCURATED = "curated", "dropped", "kept_uncurated"
REFERENCE_STAGE = "curate_reference_scores"
DEDUP_STAGE = "curate_dedup"
#: How a reason names the reference's row signals (``curate.reference_signals``).
SIGNAL_WORDS = {"max": "worst-token loss", "mean": "mean token loss", "top3": "mean loss of the 3 worst tokens",
                "eos": "end-of-turn token loss", "excess_max": "worst-token loss above the base model's"}
RANKED_BY = {"reference": "the trusted reference", "bds": "its BDS weight, learned against the trusted set",
             "p2d": "its P2D probing score, in context of the trusted questions"}
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})
_TOKEN_COLUMNS = ["id", "split", "source", "line", "weight", "prompt_len", "loss_mask", "prompt_offsets",
                  "response_offsets"]


@dataclass
class Decisions:
    """What the curate steps decided (from :func:`raycurate.pipelines.curate.compose_pool`).

    Attributes:
        steps: The example-level steps in order.
        ledger: :func:`raycurate.algorithms.composition.ledger` of those steps over the pool.
        keep_fraction: ``curate.keep_fraction``.
        signals: ``curate.reference_signals`` (the losses the reference step's badness is the worst standing in).
        calibrated: The badness is a percentile among held-out trusted rows (``curate.calibration_fraction`` > 0),
            else among the pool's rows.
        token_step: ``mask``, ``bridge`` or None.
        pool_stage: The pool's token table (every row the steps curated).
        composed_stage: The kept rows after the token-level step, with their SFT weights (``curate_rows``).
    """

    steps: list[Step]
    ledger: Ledger
    keep_fraction: float
    signals: list[str]
    calibrated: bool
    token_step: str | None
    pool_stage: str = "curate_pool_rows"
    composed_stage: str = "curate_rows"


def json_line(entry: dict) -> str:
    """``entry`` as one JSON line for every reader (Unicode line breaks escaped too), non-ASCII kept."""
    return json.dumps(entry, ensure_ascii=False, default=str).translate(_LINE_BREAKS) + "\n"


def _finite(value: Any) -> float | None:
    return None if value is None or not math.isfinite(float(value)) else float(value)


def _spans(row: dict, prompt: bool) -> list[list[int]]:
    from raycurate.data.tokenize import kept_spans

    p = int(row["prompt_len"])
    if prompt:
        return kept_spans(row["prompt_offsets"], [1] * p)
    return kept_spans(row["response_offsets"], row["loss_mask"][p:])


def original_records(inputs: list[str], wanted: dict[tuple[str, int], str]) -> Iterator[tuple[str, dict]]:
    """The input records at ``(source, line)``, read again from their files, in file order.

    Args:
        inputs: The run's input paths (``data.input`` plus ``data.validation_input``), as ingest read them.
        wanted: ``(source, line) -> id`` of the rows to return (``source`` / ``line`` as ingest recorded them).

    Yields:
        ``(id, record)`` with ``record`` exactly as parsed from the file.

    Raises:
        InputError: A row is no longer there or is another row now (the file was edited since it was ingested).
    """
    from raycurate.data.readers import iter_input, plan_inputs
    from raycurate.data.validate import check_record

    sources = {source for source, _ in wanted}
    found = 0
    for inp in plan_inputs(inputs).inputs:
        if inp.source not in sources:
            continue
        for raw in iter_input(inp):
            row_id = wanted.get((raw.source, raw.line))
            if row_id is None:
                continue
            verdict = check_record(raw.record, seen_ids=set()) if raw.record is not None else None
            if raw.record is None or verdict is None or verdict.record is None or verdict.record["id"] != row_id:
                raise InputError(f"{raw.source}:{raw.line} is not the row that was curated (id {row_id!r}): the file "
                                 "changed during the run; run the same command again (ingest re-reads it)")
            found += 1
            yield row_id, raw.record
    if found != len(wanted):
        raise InputError(f"{len(wanted) - found} curated rows are no longer in their input files (e.g. "
                         f"{sorted(wanted)[0]}): the files changed during the run; run the same command again")


def added_names(run: RunDir, token_step: str | None) -> dict[str, str]:
    """``{field raycurate adds: the name it is written under}``: ``raycurate_<name>`` where an input field has it."""
    import pyarrow.parquet as pq

    names = set()
    for path in sorted(output_path(run, "ingest", "accepted").glob("*.parquet")):
        names.update(pq.read_schema(path).names)
    added = ["weight"] + (["kept_response_spans"] if token_step else []) + \
        (["kept_prompt_spans"] if token_step == "bridge" else [])
    return {name: f"raycurate_{name}" if name in names else name for name in added}


def _step_values(run: RunDir, decisions: Decisions) -> dict[str, Any]:
    """Per step what its reasons and columns show: dedup's duplicate pairs, the reference's raw signals."""
    import pyarrow.parquet as pq

    values: dict[str, Any] = {}
    names = [s.name for s in decisions.steps]
    if "dedup" in names:
        table = pq.read_table(output_path(run, DEDUP_STAGE, "duplicates")).to_pylist()
        values["dedup"] = {r["id"]: r for r in table}
    if run.stage_record(REFERENCE_STAGE) is not None and ("reference" in names or decisions.token_step == "mask"):
        table = pq.read_table(output_path(run, REFERENCE_STAGE, "scores"))
        signals = table.drop_columns(["reference_losses", "base_losses"]).to_pylist()
        values["reference"] = {r["id"]: r for r in signals}
    return values


def drop_reason(step: Step, row_id: str, decisions: Decisions, values: dict[str, Any],
                trusted: set[str]) -> dict[str, Any]:
    """The ``dropped.jsonl`` fields of a row ``step`` dropped: ``reason`` in plain words, ``score`` and ``rank``."""
    ledger = decisions.ledger
    if step.dropped is not None:
        pair = values.get("dedup", {}).get(row_id, {})
        other = pair.get("duplicate_of", "?")
        what = f"trusted row {other}" if other in trusted else other
        return {"reason": f"near-duplicate of {what} (Jaccard {pair.get('jaccard', float('nan')):.2f})",
                "score": None, "rank": None, "duplicate_of": other, "jaccard": pair.get("jaccard")}
    assert step.scores is not None
    rank, received, score = ledger.ranks[step.name][row_id], ledger.received[step.name], step.scores[row_id]
    if step.name == "reference":
        row = values["reference"][row_id]
        losses = ", ".join(f"{SIGNAL_WORDS.get(s, s)} {row[f'signal_{s}']:.2f} nats" for s in decisions.signals)
        scale = "the held-out trusted rows" if decisions.calibrated else "the pool's rows"
        shown = f"worse than {-score:.0%} of {scale}: {losses}"
        limit = None if step.min_score is None else f"the rows worse than at most {-step.min_score:.0%} of them"
    else:
        shown = f"{'weight' if step.name == 'bds' else 'score'} {score:.4g}"
        limit = None if step.min_score is None else f"the rows scoring at least {step.min_score:.4g}"
    kept = f"the top {decisions.keep_fraction:.0%}" if limit is None else limit
    reason = (f"ranked {rank} of {received} by {RANKED_BY.get(step.name, step.name)} ({shown}); kept {kept} "
              f"({ledger.passed[step.name]} rows)")
    return {"reason": reason, "score": _finite(score), "rank": rank}


def write_outputs(run: RunDir, folder: Path, decisions: Decisions, inputs: list[str]) -> dict:
    """Write ``curated.jsonl``, ``dropped.jsonl``, ``scores.parquet`` and ``rejected.jsonl`` into ``folder``.

    Every accepted row is curated, dropped or kept uncurated (another split than the pool); every input row is
    one of those or rejected, which the returned counts show.

    Returns:
        ``curated``, ``dropped``, ``rejected`` (row counts), ``dropped_by_step``, ``not_curated`` (by split),
        ``rejected_by_reason``, ``field_names`` (the names the added fields were written under) and
        ``token_level`` (response tokens of the kept rows before / after the token-level step).
    """
    pool_rows = {r["id"]: r for r in read_token_rows(output_path(run, "tokenize", "tokens"), _TOKEN_COLUMNS)}
    pool = set(decisions.ledger.kept) | set(decisions.ledger.dropped)
    composed = {r["id"]: r for r in read_token_rows(output_path(run, decisions.composed_stage, "tokens"),
                                                    [c for c in _TOKEN_COLUMNS if c not in ("split", "source",
                                                                                             "line")])}
    if set(composed) != set(decisions.ledger.kept):
        raise RuntimeError(f"{decisions.composed_stage} does not hold the rows the steps kept; this is a bug")
    outcome = {i: KEPT if i in composed else DROPPED_OUTCOME if i in pool else UNCURATED for i in pool_rows}
    names = added_names(run, decisions.token_step)
    final = {i: composed.get(i, row) for i, row in pool_rows.items() if outcome[i] != DROPPED_OUTCOME}
    counts = _write_curated(folder / CURATED, inputs, pool_rows, final, names, decisions.token_step)
    values = _step_values(run, decisions)
    trusted = _trusted_ids(run)
    by_name = {s.name: s for s in decisions.steps}
    dropped_by_step: dict[str, int] = {}
    with open(folder / DROPPED, "w", encoding="utf-8") as fh:
        for step in decisions.steps:
            ids = [i for i, s in decisions.ledger.dropped.items() if s == step.name]
            ranks = decisions.ledger.ranks.get(step.name, {})
            for row_id in sorted(ids, key=lambda i: (ranks.get(i, 0), i)):
                row = pool_rows[row_id]
                fh.write(json_line({"id": row_id, "step": step.name,
                                    **drop_reason(by_name[step.name], row_id, decisions, values, trusted),
                                    "source": row["source"], "line": row["line"]}))
            dropped_by_step[step.name] = len(ids)
    _write_scores(folder / SCORES, run, decisions, pool_rows, composed, outcome, values)
    rejected, by_reason = copy_rejected(run, folder / REJECTED)
    not_curated: dict[str, int] = {}
    for i, o in outcome.items():
        if o == UNCURATED:
            not_curated[pool_rows[i]["split"]] = not_curated.get(pool_rows[i]["split"], 0) + 1
    before = sum(int(sum(pool_rows[i]["loss_mask"])) for i in composed)
    after = sum(int(sum(r["loss_mask"])) for r in composed.values())
    return {"curated": counts, "dropped": sum(dropped_by_step.values()), "dropped_by_step": dropped_by_step,
            "not_curated": not_curated, "rejected": rejected, "rejected_by_reason": by_reason,
            "field_names": names, "token_level": {"step": decisions.token_step, "response_tokens": before,
                                                  "kept_response_tokens": after}}


def _trusted_ids(run: RunDir) -> set[str]:
    from raycurate.stages.data_stages import TRUSTED_TOKENS

    if run.stage_record(TRUSTED_TOKENS) is None:
        return set()
    return {r["id"] for r in read_token_rows(output_path(run, TRUSTED_TOKENS, "tokens"), ["id"])}


def _write_curated(path: Path, inputs: list[str], rows: dict[str, dict], final: dict[str, dict],
                   names: dict[str, str], token_step: str | None) -> int:
    """The kept records in input order with the added fields; returns how many."""
    wanted = {(rows[i]["source"], int(rows[i]["line"])): i for i in final}
    written = 0
    with open(path, "w", encoding="utf-8") as fh:
        for row_id, record in original_records(inputs, wanted):
            out = dict(record)
            if "id" not in out:
                out["id"] = row_id
            elif out["id"] is None:  # an explicit null stays; the id raycurate gave the row goes beside it
                out["raycurate_id"] = row_id
            kept = final[row_id]
            out[names["weight"]] = float(kept["weight"]) if kept.get("weight") is not None else 1.0
            if token_step:
                out[names["kept_response_spans"]] = _spans(kept, prompt=False)
            if token_step == "bridge":
                out[names["kept_prompt_spans"]] = _spans(kept, prompt=True)
            fh.write(json_line(out))
            written += 1
    return written


def _write_scores(path: Path, run: RunDir, decisions: Decisions, rows: dict[str, dict], composed: dict[str, dict],
                  outcome: dict[str, str], values: dict[str, Any]) -> None:
    """``scores.parquet``: one row per accepted row, in id order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raycurate.algorithms.reference_signals import ROW_SIGNALS

    ids = sorted(rows)
    columns: dict[str, Any] = {
        "id": pa.array(ids, pa.string()),
        "split": pa.array([rows[i]["split"] for i in ids], pa.string()),
        "source": pa.array([rows[i]["source"] for i in ids], pa.string()),
        "line": pa.array([rows[i]["line"] for i in ids], pa.int64()),
        "outcome": pa.array([outcome[i] for i in ids], pa.string()),
        "dropped_by": pa.array([decisions.ledger.dropped.get(i) for i in ids], pa.string()),
        "weight": pa.array([None if outcome[i] == DROPPED_OUTCOME else float(composed.get(i, rows[i])["weight"])
                            for i in ids], pa.float64()),
    }
    for step in decisions.steps:
        if step.dropped is not None:
            pairs = values.get("dedup", {})
            columns["dedup_duplicate_of"] = pa.array([pairs[i]["duplicate_of"] or None if i in pairs else None
                                                      for i in ids], pa.string())
            columns["dedup_jaccard"] = pa.array([pairs[i]["jaccard"] if i in pairs else None for i in ids],
                                                pa.float64())
            continue
        assert step.scores is not None
        ranks = decisions.ledger.ranks[step.name]
        columns[f"{step.name}_score"] = pa.array([_finite(step.scores.get(i)) for i in ids], pa.float64())
        columns[f"{step.name}_rank"] = pa.array([ranks.get(i) for i in ids], pa.int64())
    if "reference" in values:
        signals = values["reference"]
        for name in ROW_SIGNALS:
            columns[f"reference_{name}"] = pa.array([_finite(signals[i][f"signal_{name}"]) if i in signals else None
                                                     for i in ids], pa.float64())
    if decisions.token_step:
        columns["response_tokens"] = pa.array([int(sum(rows[i]["loss_mask"])) for i in ids], pa.int64())
        columns["kept_response_tokens"] = pa.array(
            [None if outcome[i] == DROPPED_OUTCOME else int(sum(composed.get(i, rows[i])["loss_mask"])) for i in ids],
            pa.int64())
    pq.write_table(pa.table(columns), path)


def copy_rejected(run: RunDir, path: Path) -> tuple[int, dict[str, int]]:
    """The run's rejected input rows (ingest's, then tokenization's) into one jsonl, line by line as written;
    returns (rows, rows by reason)."""
    count, by_reason = 0, dict[str, int]()
    with open(path, "w", encoding="utf-8") as out:
        for stage in ("ingest", "tokenize"):
            with open(output_path(run, stage, "rejected"), encoding="utf-8") as fh:
                for line in fh:
                    if line.strip():
                        reason = json.loads(line).get("reason", "?")
                        by_reason[reason] = by_reason.get(reason, 0) + 1
                        out.write(line if line.endswith("\n") else line + "\n")
                        count += 1
    return count, dict(sorted(by_reason.items()))


def lowest_rows(run: RunDir, decisions: Decisions, per_step: int = 5, excerpt: int = 160) -> list[dict]:
    """Per ranking step the ``per_step`` rows it scored lowest (over the whole pool; dedup: its most similar
    near-duplicates), with the start of their prompt and response, for the report."""
    picked: list[tuple[str, str]] = []
    for step in decisions.steps:
        if step.scores is not None:
            scores = step.scores
            worst = sorted(scores, key=lambda i: (scores[i], i))[:per_step]
        else:
            worst = sorted(step.dropped or ())[:per_step]
        picked.extend((step.name, i) for i in worst)
    wanted = {i for _, i in picked}
    texts = {r["id"]: r for r in read_token_rows(output_path(run, decisions.pool_stage, "tokens"),
                                                 ["id", "prompt", "response"]) if r["id"] in wanted}
    out = []
    for name, i in picked:
        ranks = decisions.ledger.ranks.get(name, {})
        step = next(s for s in decisions.steps if s.name == name)
        out.append({"step": name, "id": i, "rank": ranks.get(i), "received": decisions.ledger.received[name],
                    "score": None if step.scores is None else _finite(step.scores[i]),
                    "dropped_by": decisions.ledger.dropped.get(i),
                    "prompt": texts[i]["prompt"][:excerpt], "response": texts[i]["response"][:excerpt]})
    return out


def copy_model(source: Path, dest: Path) -> None:
    """A trained model folder into ``dest`` (files hard-linked where the filesystem allows, else copied); an
    adapter-only folder's ``adapter_config.json`` is rewritten to name its base relative to ``dest``."""
    import os

    from raycurate.models.loading import ADAPTER_CONFIG, adapter_base

    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    base = adapter_base(source)
    shutil.copytree(source, dest, copy_function=link_or_copy)
    if base is not None:
        config_path = dest / ADAPTER_CONFIG
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["base_model_name_or_path"] = os.path.relpath(base, dest)
        config_path.unlink()  # a hard link to the run's own file: write a new one
        config_path.write_text(json.dumps(config, indent=2), encoding="utf-8")
