"""Pieces every pipeline starts with (the run directory, the saved config, Ray, the training data) and ends with
(held-out results, lm-eval, the report)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from raycurate import storage
from raycurate.config.loader import dump_yaml
from raycurate.config.schema import JobConfig
from raycurate.rundir import RunDir, atomic_write_text, open_run_dir

log = logging.getLogger("raycurate")


def check_job_inputs(cfg: JobConfig) -> None:
    """Fail before any stage runs (and before Ray starts) on inputs that cannot work: data paths that do not
    resolve to readable files, a model folder that is not a checkpoint.

    Raises:
        raycurate.errors.UserError: naming the config key / file and what to do.
    """
    from raycurate.data.readers import plan_inputs, require_rows
    from raycurate.models.loading import check_model_source

    if cfg.data.input_paths():
        plan = plan_inputs(cfg.data.input_paths())
        if not cfg.data.validation_input:
            require_rows(plan)
    if cfg.data.validation_input:
        plan_inputs([cfg.data.validation_input])
    if cfg.data.trusted_paths():
        from raycurate.errors import InputError

        try:
            require_rows(plan_inputs(cfg.data.trusted_paths()), key="data.trusted_input")
        except InputError as exc:
            message = str(exc) if str(exc).startswith("data.trusted_input") else f"data.trusted_input: {exc}"
            raise InputError(message) from exc
    check_model_source(cfg.model.name_or_path)
    if cfg.runs("p2d") and cfg.p2d.task_model:
        check_model_source(cfg.p2d.task_model, key="p2d.task_model")
    check_model_settings(cfg)
    check_split_sizes(cfg)


def check_model_settings(cfg: JobConfig) -> None:
    """Fail before any stage runs on settings the base model rules out, which would otherwise fail inside a Ray
    task or a training worker: BRIDGE's ``last_layers`` / ``routing_layer`` beyond its layers, LoRA target modules
    it does not have, and the vLLM generation backend where vLLM is not installed.

    Raises:
        ConfigError: One line per setting, naming the key, the model and the values that work.
    """
    import importlib.util

    from raycurate.config.loader import ConfigError
    from raycurate.models.shape import matches_module, model_settings, module_names

    name = cfg.model.name_or_path
    problems = []
    if cfg.runs("bridge") or "bridge" in cfg.curate_steps_run():
        layers = model_settings(name).get("num_hidden_layers")
        if isinstance(layers, int) and cfg.bridge.last_layers > layers:
            problems.append(f"bridge.last_layers: {cfg.bridge.last_layers} is more than the {layers} layers of "
                            f"model {name}; set bridge.last_layers={layers} or less")
        routing = cfg.bridge.routing_layer
        if isinstance(layers, int) and routing is not None and routing >= layers:
            problems.append(f"bridge.routing_layer: model {name} has layers 0-{layers - 1}, not {routing}; set it "
                            "below that, or null (its last full-attention layer)")
    if cfg.train.adapter == "lora":
        try:
            names = module_names(name)
        except Exception as exc:  # an architecture transformers cannot build on the meta device: PEFT will say
            log.debug("LoRA targets not checked: %s", exc)
        else:
            missing = [t for t in cfg.train.lora_targets if not matches_module(t, names)]
            if missing:
                known = sorted({module.rsplit(".", 1)[-1] for module, kind in names.items() if kind == "Linear"})
                problems.append(f"train.lora_targets: {missing} name no module of model {name}; choose among "
                                f"{', '.join(known)}")
    pipeline = cfg.proving_ground.pipeline if cfg.pipeline == "proving_ground" else cfg.pipeline
    online = pipeline != "curate" and cfg.runs("bilevel") and "online" in cfg.bilevel.methods
    if online and cfg.bilevel.generation_backend == "vllm" and importlib.util.find_spec("vllm") is None:
        problems.append("bilevel.generation_backend: vllm is not installed here; install it, or use "
                        "bilevel.generation_backend=hf (or auto)")
    if problems:
        raise ConfigError(f"the job config (model {name})", problems)


EXACT_SPLIT_CHECK_ROWS = 20_000  # embedded corpora up to this size are generated to count their split exactly


def check_split_sizes(cfg: JobConfig) -> None:
    """Fail before Ray starts when a split the job trains on cannot hold one effective batch.

    With the embedded corpus (no ``data.input``) the rows and their split are known from the config: the corpus
    is generated (0.4 s for 3,000 rows) and its ids assigned to splits as ingest will, which bounds each split
    from above (ingest only rejects rows).  Checked: BRIDGE's warmup SFT on the ``warmup`` split.

    Raises:
        ConfigError: Naming the split, its row count, the batch size and the keys to change.
    """
    from raycurate.config.loader import ConfigError

    if cfg.data.input_paths() or not cfg.runs("bridge") or "warmup" not in cfg.data.split_ratios \
            or cfg.data.corpus_rows > EXACT_SPLIT_CHECK_ROWS:
        return
    from raycurate.data.corpus import generate_corpus
    from raycurate.data.splits import SplitAssigner

    assign = SplitAssigner(cfg.data.split_seed, cfg.data.split_ratios)
    batch = cfg.train.effective_batch_size
    seeds = cfg.proving_ground.seeds if cfg.pipeline == "proving_ground" else [cfg.data.corpus_seed]
    for seed in seeds:
        rows = generate_corpus(cfg.data.corpus_rows, seed=seed, corrupt_fraction=cfg.data.corrupt_fraction,
                               corruption_mix=cfg.data.corruption_mix)
        warmup = sum(assign(row["id"]) == "warmup" for row in rows)
        if warmup < batch:
            raise ConfigError("the job config", [
                f"data.corpus_rows: the warmup split of BRIDGE's warmup SFT gets at most {warmup} of "
                f"{cfg.data.corpus_rows} rows (corpus seed {seed}, data.split_ratios.warmup="
                f"{cfg.data.split_ratios['warmup']}), fewer than one batch (train.effective_batch_size={batch}); "
                "raise data.corpus_rows or the warmup share, or lower train.effective_batch_size"])


def saved_config(cfg: JobConfig) -> JobConfig:
    """``cfg`` as written to ``config.yaml``: the storage URI without credentials or query secrets."""
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, runs_dir=storage.redact(cfg.run.runs_dir)))


def open_run(cfg: JobConfig) -> RunDir:
    """Check the job's inputs, create ``<runs_dir>/<name>`` (for a storage URI: its local mirror, pulled from the
    URI) holding its writer lock, save the resolved config (credentials redacted), start Ray and configure Ray
    Data (progress bars follow ``run.progress``)."""
    from raycurate.stages.executor import configure_data_context
    from raycurate.stages.runtime import init_ray

    check_job_inputs(cfg)
    run = open_run_dir(cfg.run.runs_dir, cfg.run.name, cfg.run.local_dir)
    run.force(cfg.run.force)
    atomic_write_text(run.root / "config.yaml", dump_yaml(saved_config(cfg)))
    init_ray(address=cfg.ray.address, num_cpus=cfg.ray.num_cpus, temp_dir=cfg.ray.temp_dir,
             object_store_memory=cfg.ray.object_store_memory, spill_dir=cfg.ray.spill_dir)
    configure_data_context(progress=cfg.run.progress)
    run.update_manifest(config_file="config.yaml", pipeline=cfg.pipeline)
    run.sync()
    return run


def prepare_data(run: RunDir, cfg: JobConfig, *, heldout_stage: str | None = None) -> dict:
    """corpus (embedded default only) -> ingest -> base_model -> tokenize; record row accounting.

    Args:
        heldout_stage: With your own data (``data.input``): a stage holding your held-out questions
            (:func:`raycurate.stages.tables.heldout_stage`); trusted and input rows with one of their prompts (or
            ids) are rejected as ``overlaps_evaluation``, so nothing trains on the questions results report.

    Returns:
        Stage records by name.
    """
    from raycurate.data.corpus import generate_pretraining_texts
    from raycurate.stages.base import output_path
    from raycurate.stages.data_stages import TRUSTED_TOKENS, corpus_stage, ingest_stage, tokenize_stage, trusted_stage
    from raycurate.stages.model_stages import base_model_stage

    records: dict[str, dict] = {}
    upstream: list[str] = []
    trusted_inputs, evaluation = cfg.data.trusted_paths(), []
    pool_evaluation: list[str] = []  # the questions the pool itself may not repeat (your own held-out set)
    if cfg.data.input:
        inputs = cfg.data.input_paths()
        if heldout_stage is not None:
            evaluation = pool_evaluation = [str(output_path(run, heldout_stage, "heldout"))]
            upstream = [heldout_stage]
    else:
        records["corpus"] = corpus_stage(
            run, rows=cfg.data.corpus_rows, seed=cfg.data.corpus_seed, corrupt_fraction=cfg.data.corrupt_fraction,
            heldout_rows=cfg.data.heldout_rows, bad_lines=cfg.data.corpus_bad_lines,
            validation_questions=cfg.data.validation_questions, corruption_mix=cfg.data.corruption_mix,
            trusted_rows=0 if trusted_inputs else cfg.data.trusted_rows,
        )
        outputs = records["corpus"]["outputs"]
        inputs = [str(run.root / outputs["corpus"])]
        evaluation = [str(run.root / outputs[k]) for k in ("heldout", "validation") if k in outputs]
        if not trusted_inputs and "trusted" in outputs:
            trusted_inputs = [str(run.root / outputs["trusted"])]
        upstream = ["corpus"]
    if trusted_inputs:
        records["trusted"] = trusted_stage(run, trusted_inputs, cfg.data, evaluation_files=evaluation,
                                           upstream=upstream, progress=cfg.run.progress)
    else:
        log.info(NO_TRUSTED_SET)
    # ingest first: data that is all rejected fails before a base model is pre-trained
    records["ingest"] = ingest_stage(run, inputs, cfg.data, upstream=upstream, progress=cfg.run.progress,
                                     trusted="trusted" if trusted_inputs else None, evaluation_files=pool_evaluation)
    model = cfg.model
    records["base_model"] = base_model_stage(
        run, model,
        pretrain_texts=lambda: generate_pretraining_texts(model.pretrain_rows, seed=model.pretrain_seed),
        data_key=f"embedded-pretrain-v1-{model.pretrain_rows}-{model.pretrain_seed}",
    )
    records["tokenize"] = tokenize_stage(run, accepted_stage="ingest", tokenizer_stage="base_model",
                                         max_length=cfg.data.max_length, pool_cfg=cfg.tokenize)
    record_row_accounting(run, records["ingest"], records["tokenize"])
    if trusted_inputs:
        records[TRUSTED_TOKENS] = tokenize_stage(run, accepted_stage="trusted", tokenizer_stage="base_model",
                                                 max_length=cfg.data.max_length, pool_cfg=cfg.tokenize,
                                                 stage=TRUSTED_TOKENS)
        record_row_accounting(run, records["trusted"], records[TRUSTED_TOKENS], key="trusted_rows")
    return records

NO_TRUSTED_SET = ("no trusted set (data.trusted_input): BRIDGE aims at the pool's validation split and P2D probes "
                  "with pool queries, as their papers do; BDS, BMO, LESS and DSIR need one")


def record_row_accounting(run: RunDir, ingest: dict, tokenize: dict, key: str = "rows") -> dict:
    """``<key>: {input, accepted, rejected}`` over ingest and tokenization, with ``input == accepted + rejected``
    (``rows`` for the pool, ``trusted_rows`` for the trusted set)."""
    ingest_rows = ingest["metrics"]["rows"]
    tok = tokenize["metrics"]
    by_reason = dict(ingest["metrics"].get("rejected_by_reason", {}))
    for reason, n in tok.get("rejected_by_reason", {}).items():
        by_reason[reason] = by_reason.get(reason, 0) + n
    rows = {
        "input": ingest_rows["input"],
        "accepted": tok["accepted"],
        "rejected": ingest_rows["rejected"] + tok["rejected"],
        "rejected_by_reason": by_reason,
        "rejected_files": [ingest["outputs"]["rejected"], tokenize["outputs"]["rejected"]],
    }
    if rows["input"] != rows["accepted"] + rows["rejected"]:
        raise RuntimeError(f"row accounting does not add up: {rows}; this is a bug, please report it")
    run.update_manifest(**{key: rows})
    return rows


def lm_eval_models(run: RunDir, cfg: JobConfig, model_stages: dict[str, str]) -> dict:
    """lm-eval (``eval.lm_eval_tasks``) on each ``{name: model stage}``; results go to ``results.lm_eval``."""
    if not cfg.eval.lm_eval_tasks:
        return {}
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        message = ("lm-eval is not installed, so eval.lm_eval_tasks were skipped; install it with "
                   "`pip install 'raycurate[eval]'` (or bash scripts/bootstrap.sh eval) and re-run")
        log.warning(message)
        results = run.load_manifest().get("results") or {}
        run.update_manifest(results={**results, "lm_eval_skipped": message})
        return {}
    from raycurate.stages.lm_eval import lm_eval_stage

    results = {}
    for name, model_stage in model_stages.items():
        stage = f"lm_eval_{name}"
        heldout = "corpus" if run.stage_record("corpus") is not None else None
        record = lm_eval_stage(run, stage, model_stage=model_stage, heldout_stage=heldout,
                               tasks=cfg.eval.lm_eval_tasks, num_fewshot=cfg.eval.lm_eval_num_fewshot,
                               limit=cfg.eval.lm_eval_limit, max_gen_toks=cfg.eval.max_new_tokens,
                               domain=cfg.eval.lm_eval_domain,
                               allow_code_execution=cfg.eval.lm_eval_allow_code_execution)
        results[name] = record["metrics"]
    manifest_results = run.load_manifest().get("results") or {}
    run.update_manifest(results={**manifest_results, "lm_eval": {**manifest_results.get("lm_eval", {}), **results}})
    return results


def record_heldout(run: RunDir, heldout: dict, split: str = "heldout") -> None:
    """Merge ``{model: metrics}`` into the manifest's ``results.<split>`` (``heldout``, or ``validation`` when
    ``eval.split`` says so; other pipelines' models and result sections such as ``lm_eval`` stay), so several
    pipelines run in one directory compare in one table."""
    results = run.load_manifest().get("results") or {}
    run.update_manifest(results={**results, split: {**results.get(split, {}), **heldout}})


def run_standalone(cfg: JobConfig, stages: Callable[..., dict]) -> dict:
    """A method pipeline on its own: data preparation, ``stages(run, cfg, evaluate=...)``, held-out results,
    lm-eval on the trained models and the report; returns the final manifest."""
    run = open_run(cfg)
    records = prepare_data(run, cfg)
    results = stages(run, cfg, evaluate="corpus" in records)
    if results:
        from raycurate.report.curation import record_curation

        record_heldout(run, results, cfg.eval.split)
        record_curation(run, cfg.eval.split)
    trained = [name for name, rec in run.load_manifest()["stages"].items()
               if name.startswith("train_") and rec.get("status") == "done"]
    lm_eval_models(run, cfg, {name.removeprefix("train_"): name for name in trained})
    write_report(run)
    return run.load_manifest()


def write_report(run: RunDir) -> str:
    """Render ``report.html`` for the run, upload the run root's files to remote storage (if any) and return the
    report's path.  Every pipeline ends here."""
    from raycurate.report.html import write_run_report

    path = str(write_run_report(run.root))
    run.sync()
    return path
