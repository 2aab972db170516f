"""Stages that produce the data a pipeline trains on: embedded corpus, ingest, tokenization, subsets."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from raycurate.config.data import DataConfig
from raycurate.config.pool import ActorPoolConfig
from raycurate.rundir import RunDir
from raycurate.stages.base import StageOutput, output_path, require_columns, run_stage
from raycurate.stages.executor import map_model_over_rows, resolve_pool
from raycurate.stages.sharded import apply_udf, list_input_files

log = logging.getLogger("raycurate")

TOKEN_COLUMNS = ("input_ids", "prompt_len", "loss_mask", "weight", "prompt_offsets", "response_offsets")


def corpus_stage(run: RunDir, *, rows: int, seed: int, corrupt_fraction: float, heldout_rows: int,
                 bad_lines: int = 0, validation_questions: int = 0, corruption_mix: dict[str, float] | None = None,
                 trusted_rows: int = 0, force: bool = False) -> dict:
    """Generate the embedded benchmark corpus (+ ``bad_lines`` invalid lines), its held-out set and (when
    ``validation_questions`` > 0) its validation questions as jsonl, and (when ``trusted_rows`` > 0) the trusted
    set: clean rows whose prompts are none of the others'."""
    from raycurate.data.corpus import (
        bad_input_lines,
        corpus_summary,
        generate_corpus,
        generate_heldout,
        generate_trusted,
        generate_validation_questions,
        write_jsonl,
    )

    def body(out: Path) -> StageOutput:
        corpus = generate_corpus(rows, seed=seed, corrupt_fraction=corrupt_fraction, corruption_mix=corruption_mix)
        heldout = generate_heldout(heldout_rows, seed=seed)
        write_jsonl(corpus, out / "corpus.jsonl")
        with open(out / "corpus.jsonl", "ab") as fh:  # the stage folder itself is published atomically
            fh.writelines(bad_input_lines(corpus, bad_lines, seed=seed))
        write_jsonl(heldout, out / "heldout.jsonl")
        outputs = {"corpus": "corpus.jsonl", "heldout": "heldout.jsonl"}
        metrics = {"corpus_rows": len(corpus), "bad_lines": bad_lines, "heldout_rows": len(heldout),
                   "summary": corpus_summary(corpus)}
        exclude = {row["prompt"] for row in heldout}
        if validation_questions:
            validation = generate_validation_questions(validation_questions, seed, exclude)
            write_jsonl(validation, out / "validation.jsonl")
            exclude |= {row["prompt"] for row in validation}
            outputs["validation"] = "validation.jsonl"
            metrics["validation_questions"] = validation_questions
        if trusted_rows:
            trusted = generate_trusted(trusted_rows, seed, exclude | {row["prompt"] for row in corpus})
            write_jsonl(trusted, out / "trusted.jsonl")
            outputs["trusted"] = "trusted.jsonl"
            metrics["trusted_rows"] = len(trusted)
        return StageOutput(outputs=outputs, metrics=metrics)

    config: dict[str, Any] = {"rows": rows, "seed": seed, "corrupt_fraction": corrupt_fraction,
                              "heldout_rows": heldout_rows, "bad_lines": bad_lines}
    if validation_questions:  # only when asked, so the runs from before the option keep their hashes
        config["validation_questions"] = validation_questions
    if corruption_mix:  # likewise: the balanced default keeps the old hashes
        config["corruption_mix"] = dict(sorted(corruption_mix.items()))
    if trusted_rows:
        config["trusted_rows"] = trusted_rows
    return run_stage(run, "corpus", body, config=config, force=force)


TRUSTED_SPLIT = "trusted"
#: The token table of the trusted set (a stage name), when the job has one.
TRUSTED_TOKENS = "tokenize_trusted"


def trusted_stage(run: RunDir, inputs: list[str], data_cfg: DataConfig, *, evaluation_files: list[str],
                  upstream: list[str], progress: bool, force: bool = False) -> dict:
    """Validate the trusted set into ``trusted/accepted`` (split ``trusted``) plus ``rejected.jsonl``.

    A trusted row whose prompt is a held-out or validation question's (``evaluation_files``) is rejected as
    ``overlaps_evaluation``: aiming at the questions that results report would leak them.

    Raises:
        InputError: every trusted row was rejected (or the files hold none).
    """
    from raycurate.data.ingest import ingest
    from raycurate.data.schema import OVERLAPS_EVALUATION, Exclusions
    from raycurate.errors import InputError

    def body(out: Path) -> StageOutput:
        questions = [(row["id"], row["prompt"]) for path in evaluation_files for row in _jsonl_rows(Path(path))]
        exclude = [Exclusions(OVERLAPS_EVALUATION, "evaluation question", questions)] if questions else []
        try:
            result = ingest(inputs, str(out / "accepted"), strict=data_cfg.strict, split_seed=data_cfg.split_seed,
                            split_ratios={TRUSTED_SPLIT: 1.0}, shard_rows=data_cfg.shard_rows, progress=progress,
                            exclude=exclude)
        except InputError as exc:
            raise InputError(f"data.trusted_input: {exc}") from exc
        _publish_rejected(out)
        info = result.to_dict()
        info["accepted_files"] = [f"trusted/accepted/{Path(p).name}" for p in info["accepted_files"]]
        info["rejected_file"] = "trusted/rejected.jsonl"
        return StageOutput(outputs={"accepted": "accepted", "rejected": "rejected.jsonl"}, metrics=info)

    from raycurate.data.readers import plan_inputs

    plan = plan_inputs(inputs)
    config = {"inputs": [_file_fingerprint(p, run) for p in inputs],
              "files": [_file_fingerprint(inp.path, run) for inp in plan.inputs],
              "evaluation": [_file_fingerprint(p, run) for p in evaluation_files], "strict": data_cfg.strict}
    record = run_stage(run, "trusted", body, config=config, upstream=upstream, force=force)
    rows = record["metrics"]["rows"]
    if not rows["accepted"]:
        by_reason = record["metrics"].get("rejected_by_reason") or {}
        raise InputError(f"data.trusted_input: none of its {rows['input']} rows is usable (rejected: "
                         f"{', '.join(f'{k} {v}' for k, v in by_reason.items()) or 'none'}); see "
                         f"{run.root / 'trusted' / 'rejected.jsonl'}, fix the file and re-run")
    return record


def trusted_rows_in(run: RunDir, tokens_stage: str) -> int:
    """How many rows of a token table are trusted rows (split ``trusted``): what a method's target used."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    return sum(int(pc.sum(pc.equal(pq.read_table(path, columns=["split"])["split"], TRUSTED_SPLIT)).as_py() or 0)
               for path in sorted(output_path(run, tokens_stage, "tokens").glob("*.parquet")))


def trusted_exclusions(run: RunDir, stage: str) -> Any:
    """The trusted rows' prompts and ids, as the pool's ingest rejects them (``overlaps_trusted``)."""
    import pyarrow.parquet as pq

    from raycurate.data.schema import OVERLAPS_TRUSTED, Exclusions

    folder = output_path(run, stage, "accepted")
    rows = [(r["id"], r["prompt"]) for path in sorted(folder.glob("*.parquet"))
            for r in pq.read_table(path, columns=["id", "prompt"]).to_pylist()]
    return Exclusions(OVERLAPS_TRUSTED, "trusted row", rows)


def _jsonl_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _publish_rejected(out: Path) -> None:
    """Move ingest's ``accepted/rejected.jsonl`` to the stage folder (an empty file when nothing was rejected)."""
    (out / "accepted").mkdir(exist_ok=True)
    rejected = out / "accepted" / "rejected.jsonl"
    if rejected.exists():
        rejected.rename(out / "rejected.jsonl")
    else:
        (out / "rejected.jsonl").write_text("")


def ingest_stage(run: RunDir, inputs: list[str], data_cfg: DataConfig, *, upstream: list[str], progress: bool,
                 trusted: str | None = None, evaluation_files: list[str] | None = None, force: bool = False) -> dict:
    """Validate input files into accepted parquet shards plus ``rejected.jsonl``; record row accounting.

    Args:
        trusted: The :func:`trusted_stage` whose rows the pool may not repeat (same prompt or id), or None.
        evaluation_files: jsonl files of held-out questions the pool may not repeat (same prompt or id: rejected
            as ``overlaps_evaluation``); their stages belong in ``upstream``.
    """
    from raycurate.data.ingest import ingest
    from raycurate.data.schema import OVERLAPS_EVALUATION, Exclusions

    def body(out: Path) -> StageOutput:
        exclude = [trusted_exclusions(run, trusted)] if trusted else []
        questions = [(row["id"], row["prompt"]) for path in evaluation_files or [] for row in _jsonl_rows(Path(path))]
        if questions:
            exclude.append(Exclusions(OVERLAPS_EVALUATION, "held-out question", questions))
        result = ingest(
            inputs, str(out / "accepted"), strict=data_cfg.strict, split_seed=data_cfg.split_seed,
            split_ratios=data_cfg.split_ratios, shard_rows=data_cfg.shard_rows, progress=progress,
            validation_paths=[data_cfg.validation_input] if data_cfg.validation_input else None,
            exclude=exclude or None,
        )
        info = result.to_dict()
        _publish_rejected(out)
        # record where the files end up (the run-relative final paths), not the temp folder they were written in
        info["accepted_files"] = [f"ingest/accepted/{Path(p).name}" for p in info["accepted_files"]]
        info["rejected_file"] = "ingest/rejected.jsonl"
        return StageOutput(outputs={"accepted": "accepted", "rejected": "rejected.jsonl"}, metrics=info)

    from raycurate.data.readers import plan_inputs

    validation = [data_cfg.validation_input] if data_cfg.validation_input else []
    # every file a folder / glob expands to (and every file it skips), so an added or edited file re-runs ingest
    found = [plan_inputs(paths) for paths in (inputs, validation) if paths]
    config = {"inputs": [_file_fingerprint(p, run) for p in inputs],
              "files": [_file_fingerprint(inp.path, run) for plan in found for inp in plan.inputs],
              "unread": [item["path"] for plan in found for item in plan.unread],
              "validation_inputs": [_file_fingerprint(p, run) for p in validation], "strict": data_cfg.strict,
              "split_seed": data_cfg.split_seed, "split_ratios": data_cfg.split_ratios}
    if evaluation_files:  # keyed only when given, so runs without a held-out set keep their hashes
        config["evaluation"] = [_file_fingerprint(p, run) for p in evaluation_files]
    if trusted:
        upstream = [*upstream, trusted]
    record = run_stage(run, "ingest", body, config=config, upstream=upstream, force=force)
    check_rows_accepted(run, record, "ingest")
    return record


def check_rows_accepted(run: RunDir, record: dict, stage: str) -> None:
    """An ingest or tokenize stage that accepted no row is an error naming where the reasons are.

    Raises:
        InputError: ``record`` accepted 0 rows.
    """
    from raycurate.errors import InputError

    metrics = record["metrics"]
    rows = metrics.get("rows") or {"accepted": metrics.get("accepted", 0),
                                   "rejected": metrics.get("rejected", 0)}
    if rows.get("accepted", 0):
        return
    by_reason = metrics.get("rejected_by_reason") or {}
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(by_reason.items(), key=lambda kv: -kv[1])) or "none"
    where = run.root / record["outputs"]["rejected"]
    names = [f["path"] for f in metrics.get("files") or [] if isinstance(f, dict) and f.get("path")]
    inputs = f" of {', '.join(names[:3])}{f' (+{len(names) - 3} more)' if len(names) > 3 else ''}" if names else ""
    raise InputError(f"{stage} accepted 0 of {rows.get('rejected', 0)} rows{inputs} (rejected by reason: {reasons}); "
                     f"see {where} for each row's reason, fix the data and re-run")


def _file_fingerprint(path: str, run: RunDir | None = None) -> dict:
    """Path, size and mtime: enough to notice an edited input without hashing its contents.

    An input inside the run directory (an upstream stage's output, e.g. the corpus) is named by its run-relative
    path only: the upstream hash covers its content, while its absolute path and mtime change when the run directory
    is copied or moved, or mirrored from remote storage on another machine.
    """
    p = Path(path)
    if run is not None and p.resolve().is_relative_to(Path(run.root).resolve()):
        return {"run_path": run.relative(p)}
    if p.is_file():
        stat = p.stat()
        return {"path": str(p.resolve()), "size": stat.st_size, "mtime": int(stat.st_mtime)}
    return {"path": str(p.resolve()) if p.exists() else str(p)}


class TokenizeUDF:
    """Ray Data actor: tokenizes a batch of accepted rows into the token-level table.

    Rejected rows (over-length) stay in the output with ``reject_reason`` set and empty token columns, so the
    stage can account for them; the stage splits them off afterwards.
    """

    REQUIRED_COLUMNS = ("id", "prompt", "response")

    def __init__(self, tokenizer_dir: str, max_length: int, stage: str = "tokenize", system_prompt: str = "default"):
        from raycurate.models.loading import load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.max_length = max_length
        self.system_prompt = system_prompt
        self.stage = stage

    def __call__(self, batch: Any) -> Any:
        require_columns(self.stage, batch, self.REQUIRED_COLUMNS)
        return tokenize_arrow_batch(self.tokenizer, batch, self.max_length, self.system_prompt)


def tokenize_arrow_batch(tokenizer: Any, batch: Any, max_length: int, system_prompt: str = "default") -> Any:
    """Append token columns (and ``reject_reason``/``reject_detail``) to a pyarrow batch of records.

    Args:
        tokenizer: A Hugging Face tokenizer.
        batch: ``pyarrow.Table`` of validated records.
        max_length: Longest allowed sequence in tokens.
        system_prompt: ``tokenize.system_prompt`` (:func:`raycurate.data.tokenize.tokenize_batch`).

    Returns:
        The same table with the token-level columns of the data contract appended; schema fixed so every batch
        writes the same parquet schema.
    """
    import pyarrow as pa

    from raycurate.data.tokenize import tokenize_batch

    rows = batch.to_pylist()
    token_rows, rejected = tokenize_batch(tokenizer, rows, max_length, system_prompt=system_prompt)
    by_id = {r["id"]: r for r in token_rows}
    reasons = {r["id"]: r for r in rejected}
    columns: dict[str, list] = {name: [] for name in TOKEN_COLUMNS}
    reject_reason, reject_detail = [], []
    for row in rows:
        tok = by_id.get(row["id"])
        bad = reasons.get(row["id"])
        if tok is None and bad is None:
            raise RuntimeError(f"tokenizer returned nothing for id {row['id']!r}")
        for name in TOKEN_COLUMNS:
            default: Any = 1.0 if name == "weight" else (0 if name == "prompt_len" else [])
            columns[name].append(tok[name] if tok is not None else default)
        reject_reason.append("" if bad is None else str(bad.get("reason", "")))
        reject_detail.append("" if bad is None else str(bad.get("detail", "")))
    types = {
        "input_ids": pa.list_(pa.int32()), "prompt_len": pa.int32(), "loss_mask": pa.list_(pa.int8()),
        "weight": pa.float32(), "prompt_offsets": pa.list_(pa.int32()), "response_offsets": pa.list_(pa.int32()),
    }
    out = batch.drop_columns([c for c in (*TOKEN_COLUMNS, "reject_reason", "reject_detail") if c in batch.schema.names])
    for name in TOKEN_COLUMNS:
        out = out.append_column(name, pa.array(columns[name], type=types[name]))
    out = out.append_column("reject_reason", pa.array(reject_reason, type=pa.string()))
    return out.append_column("reject_detail", pa.array(reject_detail, type=pa.string()))


def split_tokenized(all_dir: Path, tokens_dir: Path, rejected_path: Path) -> dict:
    """Split tokenizer output into the token table (accepted rows) and ``rejected.jsonl``, file by file.

    Returns:
        ``{"accepted": n, "rejected": n, "rejected_by_reason": {...}}``.
    """
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    tokens_dir.mkdir(parents=True, exist_ok=True)
    counts: dict[str, Any] = {"accepted": 0, "rejected": 0, "rejected_by_reason": {}}
    with open(rejected_path, "w", encoding="utf-8") as rejected_file:
        for index, path in enumerate(sorted(all_dir.glob("*.parquet"))):
            table = pq.read_table(path)
            ok = pc.equal(table["reject_reason"], "")
            good = table.filter(ok).drop_columns(["reject_reason", "reject_detail"])
            bad = table.filter(pc.invert(ok))
            if good.num_rows:
                pq.write_table(good, tokens_dir / f"part-{index:05d}.parquet")
            counts["accepted"] += good.num_rows
            for row in bad.select([c for c in ("id", "source", "line", "reject_reason", "reject_detail")
                                   if c in bad.schema.names]).to_pylist():
                reason = row.pop("reject_reason")
                row["reason"], row["detail"] = reason, row.pop("reject_detail")
                counts["rejected_by_reason"][reason] = counts["rejected_by_reason"].get(reason, 0) + 1
                counts["rejected"] += 1
                rejected_file.write(json.dumps(row) + "\n")
    return counts


#: Up to this many accepted rows, ``tokenize`` runs in the driver: tokenizing 3,000 demo rows takes ~1 s, while the
#: first Ray Data job of a run (worker processes, actor start-up) took 15-25 s on 2 cores.
TOKENIZE_IN_PROCESS_ROWS = 20_000


def tokenize_stage(run: RunDir, *, accepted_stage: str, tokenizer_stage: str, max_length: int,
                   pool_cfg: ActorPoolConfig, in_process: bool | None = None, stage: str = "tokenize",
                   force: bool = False) -> dict:
    """Tokenize accepted rows into ``tokenize/tokens`` (+ ``rejected.jsonl``).

    Args:
        pool_cfg: The ``tokenize`` section: actor pool, and ``system_prompt`` when it has one
            (:class:`raycurate.config.data.TokenizeConfig`; a plain pool config means ``"default"``).
        in_process: Tokenize in the driver instead of on a Ray Data actor pool; None = when the accepted table
            has at most :data:`TOKENIZE_IN_PROCESS_ROWS` rows.  Both paths write the same rows in the same order.
    """
    import ray.data

    accepted = output_path(run, accepted_stage, "accepted")
    tokenizer_dir = output_path(run, tokenizer_stage, "model")
    system_prompt = getattr(pool_cfg, "system_prompt", "default")

    def body(out: Path) -> StageOutput:
        udf_kwargs: dict[str, Any] = {"tokenizer_dir": str(tokenizer_dir), "max_length": max_length,
                                      "stage": stage, "system_prompt": system_prompt}
        files = list_input_files(accepted)
        local = sum(f.rows for f in files) <= TOKENIZE_IN_PROCESS_ROWS if in_process is None else in_process
        if local:
            tokenize_files([f.path for f in files], TokenizeUDF(**udf_kwargs), pool_cfg.batch_size, out / "_all")
        else:
            ray.data.DataContext.get_current().execution_options.preserve_order = True
            ds = map_model_over_rows(ray.data.read_parquet(str(accepted)), TokenizeUDF, udf_kwargs,
                                     resolve_pool(pool_cfg))
            ds.write_parquet(str(out / "_all"))
        (out / "_all").mkdir(exist_ok=True)  # Ray writes no folder when every row was dropped
        counts = split_tokenized(out / "_all", out / "tokens", out / "rejected.jsonl")
        for path in (out / "_all").iterdir():
            path.unlink()
        (out / "_all").rmdir()
        return StageOutput(outputs={"tokens": "tokens", "rejected": "rejected.jsonl"},
                           metrics={**counts, "in_process": local})

    config: dict[str, Any] = {"max_length": max_length}
    if system_prompt != "default":  # keyed only when set, so runs from before the option keep their hashes
        config["system_prompt"] = system_prompt
    record = run_stage(run, stage, body, config=config, upstream=[accepted_stage, tokenizer_stage], force=force)
    check_rows_accepted(run, record, stage)
    return record


def tokenize_files(paths: list[str], udf: TokenizeUDF, batch_rows: int, out_dir: Path) -> None:
    """The actor pool's work in this process: ``udf`` over each parquet file in ``batch_rows`` batches, one output
    file per input file (``part-00000.parquet``, ... in input order)."""
    import pyarrow.parquet as pq

    out_dir.mkdir(parents=True, exist_ok=True)
    for index, path in enumerate(paths):
        table = pq.read_table(path)
        if table.num_rows:
            pq.write_table(apply_udf(udf, table, batch_rows), out_dir / f"part-{index:05d}.parquet")
