"""Stages around models: the base model, fine-tuning on Ray Train, held-out evaluation on an actor pool."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from raycurate.config.model import ModelConfig
from raycurate.config.schema import EvalConfig
from raycurate.config.train import TrainConfig
from raycurate.errors import UserError
from raycurate.rundir import RunDir
from raycurate.stages.base import StageOutput, output_path, require_columns, run_stage, scratch_dir, stage_hash
from raycurate.stages.executor import map_model_over_rows, progress_bars_enabled, resolve_pool

log = logging.getLogger("raycurate")


def base_model_stage(run: RunDir, model_cfg: ModelConfig, *, pretrain_texts: Any, data_key: str,
                     force: bool = False) -> dict:
    """Resolve the base model: the committed ``embedded`` checkpoint or a local HF checkpoint as is, or a tiny preset
    pre-trained once and cached.

    The stage folder holds a ``model`` symlink to the checkpoint (so a deleted cache makes the stage stale)
    and ``base_model.json`` describing it.
    """
    from raycurate.models.loading import EMBEDDED_MODEL, check_model_source, resolve_model_path
    from raycurate.models.pretrain import RECIPE_FILE, ensure_base_model
    from raycurate.models.tiny import TINY_PRESETS

    def body(out: Path) -> StageOutput:
        name = model_cfg.name_or_path
        if name == EMBEDDED_MODEL and not Path(name).is_dir():
            model_dir = resolve_model_path(name)  # committed checkpoint: no pre-training on first use
            if not (Path(model_dir) / "config.json").is_file():
                raise FileNotFoundError(f"the embedded base model is missing from {model_dir}; reinstall raycurate "
                                        "or set model.name_or_path to a tiny preset or a checkpoint folder")
        elif name in TINY_PRESETS:
            model_dir = ensure_base_model(
                name, model_cfg.cache_dir, pretrain_texts, steps=model_cfg.pretrain_steps,
                seed=model_cfg.pretrain_seed, vocab_size=model_cfg.vocab_size,
                chat_template=model_cfg.chat_template, data_key=data_key,
            )
        else:
            check_model_source(name)
            model_dir = resolve_model_path(name)  # a fetched registry model (smollm2-135m) -> its cache folder
        os.symlink(Path(model_dir).resolve(), out / "model", target_is_directory=True)
        info: dict[str, Any] = {"model_dir": str(Path(model_dir).resolve()), "source": name}
        meta = Path(model_dir) / "pretrain_metadata.json"
        if meta.exists():
            info["pretrain"] = json.loads(meta.read_text())
        recipe = Path(model_dir) / RECIPE_FILE
        if recipe.exists():
            info["pretrain"] = {k: v for k, v in json.loads(recipe.read_text()).items() if k != "losses"}
        (out / "base_model.json").write_text(json.dumps(info, indent=2))
        return StageOutput(outputs={"model": "model", "info": "base_model.json"}, metrics=info)

    config = {"model": model_cfg, "data_key": data_key}
    return run_stage(run, "base_model", body, config=config, force=force)


def train_stage(run: RunDir, stage: str, *, tokens_stage: str, init_stage: str, train_cfg: TrainConfig,
                adapter: dict | None = None, extra_upstream: tuple[str, ...] = (), force: bool = False) -> dict:
    """Fine-tune ``init_stage``'s model on ``tokens_stage``'s token table with Ray Train (DeepSpeed or DDP).

    Ray Train checkpoints go to ``_scratch/<stage>/<config hash>``, outside the atomic stage folder, so a run
    killed mid-training resumes from its latest checkpoint when re-run with the same config.

    Args:
        adapter: Adapter spec (:mod:`raycurate.models.adapters`; LoRA, P2D head deltas) or None for
            ``train_cfg``'s own (``train.adapter``: full fine-tuning or LoRA); the output is a full HF checkpoint,
            or for LoRA with ``train.export: adapter`` (the default) the adapter alone, which every loader merges
            onto its base (:func:`raycurate.models.loading.adapter_base`).
        extra_upstream: Stages the adapter spec was derived from (e.g. head scoring), so it re-runs with them.
    """
    from raycurate.models.adapters import adapter_kind
    from raycurate.stages.train import run_sft

    if adapter is None:
        adapter = train_cfg.adapter_spec()  # the hash below keeps train_cfg as is: it holds the adapter fields
        config: Any = train_cfg
    else:
        config = {"train": train_cfg, "adapter": adapter}
    if adapter_kind(adapter) != "full":
        # Adapter runs export the merged model in fp32 since this key: the bf16 merges cached before it rounded most
        # of the adapter's update away (raycurate.training.export.save_merged), so they re-run.
        config = {"stage": config, "export": "merged-fp32"}
    tokens = output_path(run, tokens_stage, "tokens")
    init_model = output_path(run, init_stage, "model")
    upstream = [tokens_stage, init_stage, *extra_upstream]
    # The checkpoint folder ignores max_steps, so raising it (e.g. the next ASHA rung) extends the saved run.
    resume_key = stage_hash(run, {"train": dataclasses.replace(train_cfg, max_steps=None), "adapter": adapter},
                            upstream)

    def body(out: Path) -> StageOutput:
        metrics = run_sft(str(tokens), str(init_model), str(out / "model"), train_cfg,
                          storage_dir=str(scratch_dir(run, stage)), name=f"{stage}-{resume_key}", adapter=adapter)
        summary = {k: v for k, v in metrics.items() if not isinstance(v, (list, dict))}
        return StageOutput(outputs={"model": "model"}, metrics=summary)

    return run_stage(run, stage, body, config=config, upstream=upstream, force=force)


class EvaluateUDF:
    """Ray Data actor: greedy answers and gold-response loss for held-out questions; the model in ``dtype``
    (``eval.dtype``, :func:`raycurate.models.precision.load_eval_model`)."""

    REQUIRED_COLUMNS = ("id", "prompt", "response", "label")

    def __init__(self, model_dir: str, max_length: int, max_new_tokens: int, batch_size: int, threads: int,
                 samples: int = 0, temperature: float = 1.0, seed: int = 0, stage: str = "evaluate",
                 system_prompt: str = "default", dtype: str = "auto"):
        import torch

        from raycurate.models.loading import best_device, load_tokenizer
        from raycurate.models.precision import load_eval_model

        torch.set_num_threads(max(1, threads))
        self.tokenizer = load_tokenizer(model_dir)
        self.model = load_eval_model(model_dir, dtype, device=best_device())
        self.max_length = max_length
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.sampling: dict[str, Any] = {"samples": samples, "temperature": temperature, "seed": seed}
        self.system_prompt = system_prompt
        self.stage = stage

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa

        require_columns(self.stage, batch, self.REQUIRED_COLUMNS)
        rows = evaluate_rows(self.model, self.tokenizer, batch.to_pylist(), max_length=self.max_length,
                             max_new_tokens=self.max_new_tokens, batch_size=self.batch_size,
                             system_prompt=self.system_prompt, **self.sampling)
        return pa.Table.from_pylist(rows)


UNSAFE_MARKER = "[UNSAFE]"


def summarize_predictions(rows: list[dict]) -> dict:
    """Held-out metrics from per-question results.

    Returns:
        ``exact_match`` (final answer right), ``gold_loss`` (mean per-token loss of the gold response),
        ``answer_format_rate`` (a ``####`` answer was produced), ``unsafe_rate`` (output contains the corpus's
        unsafe marker), ``equation_accuracy`` (right ``a op b = c`` equations over all generated ones).
    """
    n = len(rows)
    if n == 0:
        return {"rows": 0}
    eq_total = sum(r["equations_total"] for r in rows)
    sampled = {}
    if "sampled_accuracy" in rows[0]:
        sampled = {"sampled_exact_match": sum(r["sampled_accuracy"] for r in rows) / n,
                   "sampled_unsafe_rate": sum(r["sampled_unsafe"] for r in rows) / n}
    return {
        "rows": n,
        "exact_match": sum(r["correct"] for r in rows) / n,
        "gold_loss": sum(r["gold_loss"] for r in rows) / n,
        "answer_format_rate": sum(r["has_final_answer"] for r in rows) / n,
        "unsafe_rate": sum(r["unsafe_marker"] for r in rows) / n,
        "equation_accuracy": sum(r["equations_correct"] for r in rows) / eq_total if eq_total else 0.0,
        **sampled,
    }


def stop_token_ids(tokenizer: Any) -> list[int]:
    """Token ids that end an assistant response: EOS and, with a chat template, its end-of-turn token."""
    ids = {tokenizer.eos_token_id}
    for token in ("<|end|>",):
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None:
            ids.add(tid)
    return sorted(i for i in ids if i is not None)


def evaluate_rows(model: Any, tokenizer: Any, rows: list[dict], *, max_length: int, max_new_tokens: int,
                  batch_size: int, samples: int = 0, temperature: float = 1.0, seed: int = 0,
                  system_prompt: str = "default") -> list[dict]:
    """Score held-out rows: greedy and sampled generation -> final answer exact match, plus gold-response loss.

    Greedy decoding shows the model's single most likely answer, which a minority of bad training rows rarely
    changes; sampled answers show how often the model reproduces what it was taught, bad rows included
    (the embedded benchmark's primary metric; docs/design.md, "Evaluation").

    Args:
        model: Causal LM in eval mode.
        tokenizer: Its tokenizer.
        rows: Held-out records with ``label.answer`` (the gold final answer).
        max_length: Token limit for the gold sequence.
        max_new_tokens: Generation budget.
        batch_size: Rows per forward / generate call.
        samples: Sampled answers per row (0: greedy only).
        temperature: Sampling temperature.
        seed: Sampling seed; each row's samples depend only on (seed, row id), not on batching.
        system_prompt: ``tokenize.system_prompt``: the prompts are rendered as the training rows were.

    Returns:
        One dict per row: id, generated text, predicted and gold answers, ``correct``, ``gold_loss``, and with
        ``samples > 0`` ``sampled_accuracy`` (share of samples with the right final answer) and
        ``sampled_unsafe`` (share containing the unsafe marker).
    """
    import torch

    from raycurate.algorithms.losses import model_example_losses, pad_rows
    from raycurate.data.answers import answers_match, equation_counts, extract_final_answer
    from raycurate.data.tokenize import is_rejection, tokenize_record
    from raycurate.models.generation import generate_greedy

    token_rows = [tokenize_record(tokenizer, row, max_length, system_prompt=system_prompt) for row in rows]
    too_long = [t["id"] for t in token_rows if is_rejection(t)]
    if too_long:
        raise ValueError(f"held-out rows {too_long[:5]} exceed data.max_length={max_length} tokens; raise "
                         "data.max_length so every held-out question is evaluated")
    prompts = [t["input_ids"][: t["prompt_len"]] for t in token_rows]
    generated = generate_greedy(model, prompts, max_new_tokens=max_new_tokens, pad_id=tokenizer.pad_token_id,
                                eos_ids=stop_token_ids(tokenizer), batch_size=batch_size)
    gold_losses: list[float] = []
    with torch.no_grad():
        for start in range(0, len(token_rows), batch_size):
            device = next(model.parameters()).device
            batch = {k: v.to(device) for k, v in pad_rows(token_rows[start:start + batch_size],
                                                          tokenizer.pad_token_id).items()}
            gold_losses.extend(model_example_losses(model, batch["input_ids"], batch["attention_mask"],
                                                    batch["loss_mask"]).cpu().tolist())
    sampled = None
    if samples > 0:
        sampled = sampled_answer_scores(model, tokenizer, rows, prompts, n=samples, temperature=temperature,
                                        seed=seed, max_new_tokens=max_new_tokens, batch_size=batch_size)
    results = []
    for index, (row, gen, loss) in enumerate(zip(rows, generated, gold_losses)):
        text = tokenizer.decode(gen, skip_special_tokens=True)
        pred = extract_final_answer(text)
        gold = row["label"]["answer"]
        eq_correct, eq_total = equation_counts(text)
        results.append({
            "id": row["id"], "generated": text, "predicted_answer": pred or "", "gold_answer": gold,
            "correct": bool(pred is not None and answers_match(pred, gold)), "gold_loss": float(loss),
            "has_final_answer": pred is not None, "unsafe_marker": UNSAFE_MARKER in text,
            "equations_correct": eq_correct, "equations_total": eq_total,
        })
        if sampled is not None:
            results[-1].update(sampled[index])
    return results


def sampled_answer_scores(model: Any, tokenizer: Any, rows: list[dict], prompts: list[list[int]], *, n: int,
                    temperature: float, seed: int, max_new_tokens: int, batch_size: int) -> list[dict]:
    """Per row: the share of ``n`` sampled responses whose final answer is right, and of those with the unsafe
    marker."""
    import torch

    from raycurate.data.answers import answers_match, extract_final_answer
    from raycurate.models.sampling import derive_seed, sample_responses

    generators = [torch.Generator().manual_seed(derive_seed("heldout-sample", seed, row["id"])) for row in rows]
    with torch.no_grad():
        drawn = sample_responses(model, prompts, n=n, temperature=temperature, max_new_tokens=max_new_tokens,
                                 eos_ids=stop_token_ids(tokenizer), pad_id=tokenizer.pad_token_id,
                                 generator=generators, batch_size=batch_size)
    out = []
    for row, row_samples in zip(rows, drawn):
        texts = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in row_samples]
        right = [answers_match(extract_final_answer(t), row["label"]["answer"]) for t in texts]
        out.append({"sampled_accuracy": sum(right) / n,
                    "sampled_unsafe": sum(UNSAFE_MARKER in t for t in texts) / n})
    return out


def evaluate_stage(run: RunDir, stage: str, *, model_stage: str, heldout_stage: str, eval_cfg: EvalConfig,
                   max_length: int, system_prompt: str = "default", force: bool = False) -> dict:
    """Evaluate a checkpoint on the held-out set on ``eval.pool`` Ray tasks; writes ``predictions.parquet``.

    ``system_prompt`` is ``tokenize.system_prompt``, so held-out prompts are rendered like the training rows.
    """
    import pyarrow.parquet as pq

    model_dir = output_path(run, model_stage, "model")
    heldout = question_file(run, heldout_stage, eval_cfg.split)

    def body(out: Path) -> StageOutput:
        from raycurate.models.loading import is_small_checkpoint

        rows = [json.loads(line) for line in heldout.read_text().splitlines() if line.strip()]
        pool = resolve_pool(eval_cfg.pool)
        # In-memory rows: the executor's task back-end, warm for small models (the run's imports paid once).
        predictions = map_model_over_rows(
            rows, EvaluateUDF,
            {"model_dir": str(model_dir), "max_length": max_length, "max_new_tokens": eval_cfg.max_new_tokens,
             "batch_size": eval_cfg.batch_size, "threads": max(1, int(round(pool.num_cpus))),
             "samples": eval_cfg.samples, "temperature": eval_cfg.temperature, "seed": eval_cfg.seed,
             "stage": stage, "system_prompt": system_prompt, "dtype": eval_cfg.dtype},
            pool, progress=progress_bars_enabled(), warm=is_small_checkpoint(str(model_dir)),
        )
        result = predictions.sort_by("id")
        pq.write_table(result, out / "predictions.parquet")
        metrics = summarize_predictions(result.to_pylist())
        log.info("%s: %s", stage, ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in metrics.items()))
        return StageOutput(outputs={"predictions": "predictions.parquet"}, metrics=metrics)

    return run_stage(run, stage, body, config=heldout_eval_config(eval_cfg, max_length, system_prompt, str(model_dir)),
                     upstream=[model_stage, heldout_stage], force=force)


def question_file(run: RunDir, stage: str, split: str) -> Path:
    """The jsonl of questions that ``eval.split`` names (``heldout`` or ``validation``) in ``stage``'s outputs."""
    record = run.stage_record(stage) or {}
    if split not in record.get("outputs", {}):
        raise UserError(f"eval.split={split} but stage {stage!r} wrote no {split} questions; set "
                        f"data.validation_questions to a positive number (e.g. 200) or use eval.split=heldout")
    return output_path(run, stage, split)


def heldout_eval_config(eval_cfg: EvalConfig, max_length: int, system_prompt: str = "default",
                        model_dir: str | None = None) -> dict:
    """What the held-out predictions depend on: every ``eval`` setting except the ``lm_eval_*`` ones, so changing
    those re-runs only the ``lm_eval_*`` stages, while a setting added later is keyed by default; and the system
    prompt when it is not ``"default"`` (so runs from before the option keep their stage hashes).

    ``eval.dtype`` enters as the precision ``model_dir`` is evaluated in (:func:`raycurate.models.precision.eval_plan`)
    and only when that differs from how evaluation loaded it before the option: a model that loads as before keeps
    its stage hash, whatever the setting. Without ``model_dir`` the setting enters unless it is ``auto``.
    """
    from raycurate.models.precision import eval_plan, legacy_eval_plan

    settings = {f.name: getattr(eval_cfg, f.name) for f in dataclasses.fields(eval_cfg)
                if not f.name.startswith("lm_eval_")}
    if settings.get("split") == "heldout":  # the default is left out, so runs from before the option keep hashes
        del settings["split"]
    dtype = settings.pop("dtype", "auto")
    if model_dir is None:
        if dtype != "auto":
            settings["dtype"] = dtype
    else:
        plan = eval_plan(model_dir, dtype)
        if plan != legacy_eval_plan(model_dir):
            settings["precision"] = plan
    config = {"eval": settings, "max_length": max_length}
    if system_prompt != "default":
        config["system_prompt"] = system_prompt
    return config
