"""``raycurate curate``: your own data in, a curated dataset out::

    raycurate curate --data rows.jsonl --trusted checked.jsonl --model /ckpt/llama --out curated/

:func:`curate_folder` checks every input a user can get wrong first (:func:`check_inputs`, :func:`check_out`),
runs ``pipeline: curate``'s selection (:func:`raycurate.pipelines.curate.compose_pool`) on the whole input in
``<out>/run/`` (resumable), writes the outputs (:mod:`raycurate.stages.curated_outputs`, :func:`write_folder`,
``summary.json`` last) and, with ``--train`` / ``--heldout``, trains on the curated rows
(:func:`train_curated`) and compares base, all rows and curated (:func:`evaluate_models`).
Decisions (splits, kept-uncurated warmup rows, atomic outputs, resume): docs/design.md, "Curating your own data".
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raycurate.errors import InputError, OutputError, UserError

if TYPE_CHECKING:
    from raycurate.config.schema import JobConfig
    from raycurate.rundir import RunDir

log = logging.getLogger("raycurate")

RUN_NAME = "run"
MARKER = ".raycurate-curate.json"  # what command wrote the outputs of --out (so a re-run resumes, another refuses)
SUMMARY, REPORT, MODEL = "summary.json", "report.html", "model"
UNCURATED_ROWS, TRAIN_ROWS = "curate_uncurated_rows", "curate_train_rows"
MODELS = {"base": ("base_model", "eval_base"), "all rows": ("train_all", "eval_all"),
          "curated": ("train_curate", "eval_curate")}
_STORAGE_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                   errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                   errno.EPERM: "operation not permitted"}


@dataclasses.dataclass
class Curated:
    """A finished ``raycurate curate``: its summary (``summary.json``), config and run directory."""

    summary: dict
    cfg: JobConfig
    root: Path


# --------------------------------------------------------------------------------------------- checks


def parse_keep(text: str | float | None) -> float | None:
    """``--keep``: a share in (0, 1], or None (``curate.keep_fraction``'s default)."""
    if text is None:
        return None
    try:
        keep = float(text)
    except (TypeError, ValueError):
        raise UserError(f"--keep {text!r} is not a number; give the share of its rows each ranking step keeps, "
                        "in (0, 1], e.g. --keep 0.6") from None
    if not 0 < keep <= 1:  # also NaN
        raise UserError(f"--keep {text} must lie in (0, 1]: the share of its rows each ranking step keeps, e.g. "
                        "--keep 0.6 (1 keeps every row)")
    return keep


def parse_steps(text: str | Sequence[str] | None) -> list[str] | None:
    """``--steps a,b,c`` as a list (checked with the config: ``curate.steps``), or None (its default)."""
    if text is None:
        return None
    steps = [s.strip() for s in text.split(",")] if isinstance(text, str) else [str(s).strip() for s in text]
    return [s for s in steps if s]


def _paths(flag: str, value: str | os.PathLike | Sequence[str | os.PathLike] | None) -> list[str]:
    """A flag's input paths, absolute (so a re-run from another folder means the same files)."""
    items = [value] if isinstance(value, (str, os.PathLike)) else list(value or [])
    paths = [os.fspath(p) for p in items if os.fspath(p)]
    if not paths:
        raise InputError(f"{flag} is required: a jsonl / parquet file, folder, glob or HF dataset folder")
    remote = [p for p in paths if "://" in p]
    if remote:
        raise InputError(f"{flag} {remote[0]}: inputs are read from a filesystem path, not a storage URI; copy the "
                         "files to a folder the driver can read (on a cluster: the shared filesystem)")
    return [os.path.abspath(p) for p in paths]


def check_inputs(cfg: JobConfig) -> None:
    """``--data`` and ``--trusted`` resolve to readable, non-empty files (before anything is written)."""
    from raycurate.data.readers import plan_inputs, require_rows

    for flag, paths in (("--data", cfg.data.input_paths()), ("--trusted", cfg.data.trusted_paths())):
        try:
            require_rows(plan_inputs(paths))
        except InputError as exc:
            raise type(exc)(f"{flag}: {exc}") from None


def read_heldout(path: str) -> list[dict]:
    """``--heldout`` rows as evaluation questions: ``id`` (given, else the content hash), ``prompt``, ``response``
    and ``label.answer`` (the response's ``####`` answer, ``""`` when it has none).

    Raises:
        InputError: Not a jsonl / parquet file, no rows, a row without prompt / response text, a repeated id.
    """
    from raycurate.data.answers import extract_final_answer
    from raycurate.data.validate import content_id
    from raycurate.stages.tables import source_rows

    try:
        rows = source_rows(path)
    except InputError as exc:
        raise InputError(f"--heldout: {exc}") from None
    if not rows:
        raise InputError(f"--heldout {path} holds no rows; give questions with prompt and response")
    questions, seen = [], set()
    for number, row in enumerate(rows, start=1):
        prompt, response = row.get("prompt"), row.get("response")
        if not (isinstance(prompt, str) and prompt.strip() and isinstance(response, str) and response.strip()):
            raise InputError(f"--heldout {path}: row {number} needs non-empty 'prompt' and 'response' strings")
        row_id = str(row["id"]) if row.get("id") is not None else content_id(prompt, response)
        if row_id in seen:
            raise InputError(f"--heldout {path}: row {number} repeats id {row_id!r}; ids must be unique")
        seen.add(row_id)
        questions.append({"id": row_id, "prompt": prompt, "response": response,
                          "label": {"answer": extract_final_answer(response) or ""}})
    return questions


def user_job_config(data: Any, trusted: Any, out: str, model: str | None, *, layers: Sequence[Mapping] = (),
                    overrides: Sequence[str] = (), keys: Mapping[str, Any] | None = None,
                    source: str = "raycurate curate", command_line: bool = False) -> JobConfig:
    """The job config of ``raycurate curate``: ``pipeline: curate`` over your files, run directory
    ``<out>/run``, ``curate.compare`` off and every row in the pool (module docstring, 2.); ``layers``,
    ``overrides`` and ``keys`` as :func:`raycurate.config.job.build_job_config` takes them."""
    from raycurate.config.data import DataConfig
    from raycurate.config.job import build_job_config

    flags: dict[str, Any] = {"pipeline": "curate",
                             "data": {"input": _paths("--data", data), "trusted_input": _paths("--trusted", trusted)},
                             "run": {"runs_dir": os.path.abspath(out), "name": RUN_NAME}}
    if model is not None:
        flags["model"] = {"name_or_path": model}

    def build(warmup: float) -> JobConfig:
        defaults = {"curate": {"compare": False},
                    "data": {"split_ratios": {"warmup": warmup, "validation": 0.0, "selection": 1.0 - warmup}}}
        return build_job_config(layers=[defaults, *layers, flags], overrides=overrides, keys=keys, pipeline="curate",
                                source=source, command_line=command_line)

    cfg = build(0.0)
    if "bridge" in cfg.curate.steps:  # BRIDGE's warmup fine-tuning needs rows of its own
        cfg = build(DataConfig().split_ratios.get("warmup", 0.05))
    return cfg


def request_of(cfg: JobConfig, *, train: bool, heldout: str | None) -> dict:
    """What makes two ``raycurate curate`` commands the same: the config (inputs, model, steps, every setting
    that changes a result), ``--train`` and ``--heldout``; not where the run lives, how Ray starts, the actor pools'
    sizes or the runtime-only settings (threads, logging)."""
    from raycurate.config.loader import to_dict
    from raycurate.config.pool import ActorPoolConfig

    pool_fields = {f.name for f in dataclasses.fields(ActorPoolConfig)}

    def plain(section: Any) -> Any:
        values = to_dict(section, runtime_defaults=True)
        if isinstance(section, ActorPoolConfig):
            return {k: v for k, v in values.items() if k not in pool_fields}
        return values

    config = {f.name: plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.name not in ("run", "ray")}
    for name, value in vars(cfg).items():  # pools nested one level down (eval.pool)
        if name in config and dataclasses.is_dataclass(value):
            for sub in dataclasses.fields(value):
                if isinstance(getattr(value, sub.name), ActorPoolConfig):
                    config[name][sub.name] = plain(getattr(value, sub.name))
    return json.loads(json.dumps({"config": config, "train": train, "heldout": heldout}, sort_keys=True, default=str))


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flat(item, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): value}


def check_out(out: Path, request: dict, force: bool) -> None:
    """``--out`` may be new, empty, or hold this same command's outputs (a re-run resumes); another command's
    outputs, or other files, only with ``force``.

    Raises:
        OutputError: Naming what is there and what to do.
    """
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out} is a file; give a folder (new or empty) for the curated data")
    if not out.is_dir() or not any(out.iterdir()):
        return
    marker = out / MARKER
    previous = None
    if marker.is_file():
        try:
            previous = json.loads(marker.read_text(encoding="utf-8"))["request"]
        except (OSError, ValueError, KeyError, TypeError):
            previous = {}
        if previous == request:
            return
    if force:
        log.warning("--out %s holds other outputs; --force: they are replaced when this run finishes", out)
        return
    if previous is not None:
        before, now = _flat(previous), _flat(request)
        changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
        shown = ", ".join(k.removeprefix("config.") for k in changed[:4]) + (" ..." if len(changed) > 4 else "")
        raise OutputError(f"--out {out} holds the outputs of another `raycurate curate` (different {shown}); "
                          "choose another --out, or pass --force to replace them (finished stages whose settings "
                          "match are reused)")
    raise OutputError(f"--out {out} is not empty and holds no `raycurate curate` outputs; choose a new or empty "
                      "folder, or pass --force to write into it (only curated.jsonl, dropped.jsonl, rejected.jsonl, "
                      f"scores.parquet, summary.json, report.html, model/, {RUN_NAME}/ and {MARKER} are written)")


def storage_problem(exc: BaseException) -> str | None:
    """One line for a full disk, a quota or a read-only / forbidden path anywhere in ``exc``'s chain, else None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _STORAGE_ERRNOS:
            where = current.filename or "the outputs"
            return (f"cannot write {where}: {_STORAGE_ERRNOS[current.errno]}; free space or choose a writable "
                    "--out, then run the same command again (finished stages are kept; the outputs already in "
                    "--out are untouched)")
        current = current.__cause__ or current.__context__
    return None


# --------------------------------------------------------------------------------------------- the recipe


def curate_folder(data: Any, *, trusted: Any, out: str | os.PathLike, model: str | None, train: bool = False,
                  heldout: str | os.PathLike | None = None, force: bool = False, layers: Sequence[Mapping] = (),
                  overrides: Sequence[str] = (), keys: Mapping[str, Any] | None = None,
                  source: str = "raycurate curate", command_line: bool = False) -> Curated:
    """``raycurate curate`` and ``raycurate.curate(out=...)``: check, curate, write the outputs into ``out``.

    Raises:
        UserError: Bad config, inputs or ``--out`` (before anything is written); a full disk or an unwritable
            path while running (:class:`OutputError`, nothing half-written: the outputs move into place only
            when all are complete).
    """
    started = time.perf_counter()
    if "://" in os.fspath(out):
        raise OutputError(f"--out {os.fspath(out)}: give a local folder (on a cluster: the shared filesystem); the "
                          "run directory alone may live in storage: add run.runs_dir=s3://... (docs/cluster.md)")
    out_dir = Path(os.path.abspath(out))
    cfg = user_job_config(data, trusted, str(out_dir), model, layers=layers, overrides=overrides, keys=keys,
                          source=source, command_line=command_line)
    heldout_path = os.path.abspath(heldout) if heldout is not None else None
    questions = read_heldout(heldout_path) if heldout_path else None
    check_inputs(cfg)
    train = bool(train or questions)
    request = request_of(cfg, train=train, heldout=heldout_path)
    check_out(out_dir, request, force)
    from raycurate.rundir import atomic_write_json, open_run_dir, release_lock

    try:
        run = open_run_dir(cfg.run.runs_dir, cfg.run.name, cfg.run.local_dir)  # the writer lock, before the marker
        try:
            atomic_write_json(out_dir / MARKER, {"written_by": "raycurate curate", "request": request})
            summary = _curate(cfg, out_dir, train=train, questions=questions, heldout=heldout_path, started=started)
        finally:
            release_lock(run.root)
    except OSError as exc:
        problem = storage_problem(exc)
        if problem is None:
            raise
        raise OutputError(problem) from exc
    return Curated(summary=summary, cfg=cfg, root=run.root)


def _curate(cfg: JobConfig, out: Path, *, train: bool, questions: list[dict] | None, heldout: str | None,
            started: float) -> dict:
    from raycurate.algorithms.composition import ledger
    from raycurate.config.curate import TOKEN_STEPS
    from raycurate.pipelines.common import open_run, prepare_data
    from raycurate.pipelines.curate import compose_pool
    from raycurate.stages.curated_outputs import Decisions
    from raycurate.stages.tables import heldout_stage

    run = open_run(cfg)
    if questions:
        heldout_stage(run, "heldout", questions)
    prepare_data(run, cfg, heldout_stage="heldout" if questions else None)
    if "bridge" in cfg.curate.steps:
        check_warmup_rows(run, cfg)
    try:
        composition = compose_pool(run, cfg)
    except ValueError as exc:  # compose's "step ... kept no rows": a threshold rule on rows unlike the trusted ones
        if "kept no rows" not in str(exc):
            raise
        raise UserError(f"{exc}; with the reference step's calibrated rule raise curate.calibration_quantile or use "
                        "curate.keep_rule=fraction, and check that the trusted rows look like your data") from None
    order = [s for s in cfg.curate.steps if s not in TOKEN_STEPS]
    steps = [composition.steps[name] for name in order]
    decided = ledger(composition.pool, steps, cfg.curate.keep_fraction, cfg.curate.seed)
    if decided.kept != sorted(composition.kept):
        raise RuntimeError("the row ledger disagrees with the composition; this is a bug, please report it")
    token_step = next((s for s in cfg.curate.steps if s in TOKEN_STEPS), None)
    decisions = Decisions(steps=steps, ledger=decided, keep_fraction=cfg.curate.keep_fraction,
                          signals=list(cfg.curate.reference_signals),
                          calibrated=cfg.curate.calibration_fraction > 0, token_step=token_step)
    trained = train_curated(run, cfg) if train else None
    evaluation = evaluate_models(run, cfg) if questions else None
    return write_folder(run, cfg, out, decisions, composition.step_info, trained=trained, evaluation=evaluation,
                        heldout=heldout, started=started)


def check_warmup_rows(run: RunDir, cfg: JobConfig) -> None:
    """BRIDGE's warmup fine-tuning needs at least one batch of rows of its own (split ``warmup``).

    Raises:
        UserError: Fewer, naming the share to give it.
    """
    import pyarrow.parquet as pq

    from raycurate.stages.base import output_path

    splits = [s for path in sorted(output_path(run, "tokenize", "tokens").glob("*.parquet"))
              for s in pq.read_table(path, columns=["split"])["split"].to_pylist()]
    warmup, batch = splits.count("warmup"), cfg.train.effective_batch_size
    needed = batch if cfg.bridge.warmup_epochs > 0 else 1
    if warmup < needed:
        share = min(0.5, round(2 * needed / max(len(splits), 1) + 0.05, 2))
        raise UserError(f"--steps bridge: BRIDGE's warmup fine-tuning gets {warmup} of your {len(splits)} rows "
                        f"(data.split_ratios warmup share {cfg.data.split_ratios.get('warmup', 0)}), fewer than one "
                        f"batch (train.effective_batch_size={batch}); give it a larger share, e.g. "
                        f"'data.split_ratios={{warmup: {share}, validation: 0.0, selection: {1 - share:.2f}}}', or "
                        "curate without bridge (e.g. --steps dedup,reference,mask)")


def train_curated(run: RunDir, cfg: JobConfig) -> str:
    """Fine-tune the base model on the rows of ``curated.jsonl`` (the composed rows plus the rows kept uncurated);
    returns the training stage."""
    from raycurate.config.curate import POOL_SPLIT
    from raycurate.stages.model_stages import train_stage
    from raycurate.stages.rows import filter_tokens_stage, token_ids, union_rows_stage

    table = "curate_rows"
    if len(token_ids(run, "tokenize")) > len(token_ids(run, "curate_pool_rows")):
        import pyarrow.compute as pc

        filter_tokens_stage(run, UNCURATED_ROWS, tokens_stage="tokenize", description=f"split != {POOL_SPLIT}",
                            keep=lambda t: pc.not_equal(t["split"], POOL_SPLIT), config={"split_not": POOL_SPLIT})
        union_rows_stage(run, TRAIN_ROWS, tokens_stages=["curate_rows", UNCURATED_ROWS],
                         description="the rows of curated.jsonl")
        table = TRAIN_ROWS
    from raycurate.pipelines.curate import subset_train_config

    # curate.train_steps matched: as many optimizer steps as a fine-tune on every accepted row (train_all)
    train_stage(run, "train_curate", tokens_stage=table, init_stage="base_model",
                train_cfg=subset_train_config(run, cfg, table, whole_stage="tokenize"))
    return "train_curate"


def evaluate_models(run: RunDir, cfg: JobConfig) -> dict:
    """Base model, SFT on every accepted row, SFT on the curated rows, each on the ``--heldout`` questions: mean
    gold-response loss and exact match (questions whose response has a ``####`` answer) with 95% bootstrap
    intervals, and curated minus each of the others paired over the questions (one training seed)."""
    import numpy as np
    import pyarrow.parquet as pq

    from raycurate.algorithms.stats import bootstrap_mean_ci, paired_bootstrap_ci
    from raycurate.stages.base import output_path
    from raycurate.stages.model_stages import evaluate_stage, train_stage

    train_stage(run, "train_all", tokens_stage="tokenize", init_stage="base_model", train_cfg=cfg.train)
    scores: dict[str, dict[str, np.ndarray]] = {}
    answered: list[bool] = []
    for name, (model_stage, stage) in MODELS.items():
        evaluate_stage(run, stage, model_stage=model_stage, heldout_stage="heldout", eval_cfg=cfg.eval,
                       max_length=cfg.data.max_length, system_prompt=cfg.tokenize.system_prompt)
        rows = pq.read_table(output_path(run, stage, "predictions")).sort_by("id").to_pylist()
        answered = [bool(r["gold_answer"]) for r in rows]
        scores[name] = {"gold_loss": np.array([r["gold_loss"] for r in rows]),
                        "exact_match": np.array([float(r["correct"]) for r, a in zip(rows, answered) if a])}
    block: dict[str, Any] = {"questions": len(answered), "questions_with_answer": int(sum(answered)),
                             "training_seeds": 1, "models": {}, "curated_minus": {}}
    for name, values in scores.items():
        block["models"][name] = {metric: bootstrap_mean_ci(v).as_dict() if v.size else None
                                 for metric, v in values.items()}
        if name != "curated":
            block["curated_minus"][name] = {
                metric: paired_bootstrap_ci(scores["curated"][metric], v).as_dict() if v.size else None
                for metric, v in values.items()}
    return block


# --------------------------------------------------------------------------------------------- outputs


def write_folder(run: RunDir, cfg: JobConfig, out: Path, decisions: Any, step_info: dict, *, trained: str | None,
                 evaluation: dict | None, heldout: str | None, started: float) -> dict:
    """Write every output into a temp folder in ``out``, then move them into place (``summary.json`` last) and
    remove the outputs of an earlier command this run did not produce; returns the summary."""
    from raycurate.pipelines.common import write_report
    from raycurate.report.html import render_report
    from raycurate.stages.base import output_path
    from raycurate.stages.curated_outputs import (
        CURATED,
        DROPPED,
        REJECTED,
        SCORES,
        copy_model,
        lowest_rows,
        write_outputs,
    )

    for stale in out.glob(".curate-outputs.*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out / f".curate-outputs.{os.getpid()}.tmp"
    tmp.mkdir()
    try:
        inputs = cfg.data.input_paths() + ([cfg.data.validation_input] if cfg.data.validation_input else [])
        counts = write_outputs(run, tmp, decisions, inputs)
        files = {"curated": CURATED, "dropped": DROPPED, "rejected": REJECTED, "scores": SCORES, "summary": SUMMARY,
                 "report": REPORT}
        if trained:
            copy_model(output_path(run, trained, "model"), tmp / MODEL)
            files["model"] = MODEL
        summary = summarize(run, cfg, out, decisions, step_info, counts, files, evaluation, heldout, started)
        run.update_manifest(results={**(run.load_manifest().get("results") or {}), "user_curate": {
            **summary, "out_dir": os.path.relpath(out, run.root), "lowest": lowest_rows(run, decisions)}})
        write_report(run)
        (tmp / REPORT).write_text(render_report(run.root, report_dir=out), encoding="utf-8")
        (tmp / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        _publish(tmp, out, list(files.values()))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return summary


def _publish(tmp: Path, out: Path, names: list[str]) -> None:
    """Move the finished outputs from ``tmp`` into ``out`` (renames in one folder: no copy that could fail half
    way), ``summary.json`` last; remove output names this run did not write."""
    for name in (MODEL, "curated.jsonl", "dropped.jsonl", "rejected.jsonl", "scores.parquet", REPORT, SUMMARY):
        target = out / name
        if name not in names:
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
            continue
        if (tmp / name).is_dir() and target.exists():
            old = out / f".{name}.old-{os.getpid()}"
            os.replace(target, old)
            os.replace(tmp / name, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp / name, target)


def _trusted_use(manifest: dict) -> dict[str, int]:
    """``{stage: trusted rows it used}`` from the stage metrics that record it."""
    from raycurate.stages.data_stages import TRUSTED_TOKENS

    used = {}
    for stage, record in manifest.get("stages", {}).items():
        metrics = record.get("metrics") or {}
        found = metrics.get("trusted_rows")
        for value in metrics.values():
            if found is None and isinstance(value, dict):
                found = value.get("trusted_rows")
        if stage == "curate_dedup":
            found = metrics.get("reference_rows")
        if stage == "curate_reference":
            found = (manifest.get("stages", {}).get(TRUSTED_TOKENS, {}).get("metrics") or {}).get("accepted")
        if isinstance(found, int) and found:
            used[stage] = found
    return used


def summarize(run: RunDir, cfg: JobConfig, out: Path, decisions: Any, step_info: dict, counts: dict,
              files: dict[str, str], evaluation: dict | None, heldout: str | None, started: float) -> dict:
    """``summary.json``: the row accounting (every input row curated, dropped or rejected), what each step did,
    the settings, the trusted rows used, the held-out comparison, the wall time per stage and the paths.

    Raises:
        RuntimeError: The counts do not add up (a bug).
    """
    manifest = run.load_manifest()
    rows = manifest["rows"]
    kept = counts["curated"]
    if rows["input"] != kept + counts["dropped"] + counts["rejected"] or counts["rejected"] != rows["rejected"]:
        raise RuntimeError(f"row accounting does not add up: {rows['input']} input rows, {kept} kept, "
                           f"{counts['dropped']} dropped, {counts['rejected']} rejected; this is a bug, please "
                           "report it")
    ledger = decisions.ledger
    steps = {}
    for step in decisions.steps:
        info = {k: v for k, v in step_info.get(step.name, {}).items()
                if v is not None and k not in ("kept_clean_share", "kept_rows")}
        steps[step.name] = {**info, "received": ledger.received[step.name], "kept": ledger.passed[step.name],
                            "dropped": counts["dropped_by_step"].get(step.name, 0)}
    curate = cfg.curate
    trusted = manifest.get("trusted_rows") or {}
    location = cfg.run.runs_dir.rstrip("/") + "/" + cfg.run.name
    return {
        "rows": {"input": rows["input"], "kept": kept, "dropped": counts["dropped"], "rejected": counts["rejected"],
                 "kept_uncurated": counts["not_curated"], "dropped_by_step": counts["dropped_by_step"],
                 "rejected_by_reason": counts["rejected_by_reason"]},
        "steps": steps,
        "token_level": counts["token_level"] if decisions.token_step else None,
        "settings": {"steps": list(curate.steps), "keep_fraction": curate.keep_fraction, "bds_mode": curate.bds_mode,
                     "reference_signals": list(curate.reference_signals), "keep_rule": curate.keep_rule,
                     "calibration_fraction": curate.calibration_fraction,
                     "calibration_quantile": curate.calibration_quantile, "mask_threshold": curate.mask_threshold,
                     "dedup_threshold": curate.dedup_threshold, "seed": curate.seed,
                     "split_ratios": cfg.data.split_ratios, "max_length": cfg.data.max_length,
                     "model": cfg.model.name_or_path, "train": "model" in files, "heldout": heldout},
        "inputs": {"data": cfg.data.input_paths(), "trusted": cfg.data.trusted_paths(), "heldout": heldout},
        "trusted": {"input": trusted.get("input"), "accepted": trusted.get("accepted"),
                    "rejected": trusted.get("rejected"), "rejected_by_reason": trusted.get("rejected_by_reason", {}),
                    "used_by_stage": _trusted_use(manifest)},
        "added_fields": counts["field_names"],
        "heldout": evaluation,
        "stage_seconds": {name: rec.get("seconds") for name, rec in manifest.get("stages", {}).items()},
        "wall_seconds": round(time.perf_counter() - started, 1),
        "files": files,
        "run_dir": os.path.relpath(run.root, out) if "://" not in location else location,
    }
