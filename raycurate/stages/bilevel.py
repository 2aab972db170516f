"""Bilevel stages (docs/bilevel.md): BDS / BMO training with the online generation hook, training tables for direct
mixing and the selection baselines, the lower-level loss evaluation and the weight analysis (AUROC by label).

The BDS driver is :mod:`raycurate.stages.bilevel_train` (loop: :mod:`raycurate.training.bds_loop`); DSIR and LESS are
:mod:`raycurate.stages.bilevel_select`; plain fine-tuning of the baselines reuses
:func:`raycurate.stages.model_stages.train_stage`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from raycurate.algorithms.ranking import auroc, label_separation
from raycurate.config.bilevel import BilevelConfig
from raycurate.config.train import TrainConfig
from raycurate.rundir import RunDir
from raycurate.stages.base import StageOutput, output_path, run_stage, scratch_dir, stage_hash
from raycurate.stages.bridge import read_token_rows
from raycurate.stages.data_stages import trusted_rows_in

log = logging.getLogger("raycurate")

GENERATIONS_FILE = "generations.parquet"
WEIGHTS_FILE = "weights.parquet"


# --------------------------------------------------------------------------------------------- online generation


@dataclasses.dataclass
class PoolGenerationHook:
    """Online BMO generation (Algorithm 1, lines 5-7) for :func:`raycurate.stages.bilevel_train.run_bds`.

    Called on every Ray Train rank at each generation round.  Rank 0 picks the masked questions (a fixed seeded
    set, or the bottom-R by sigma(omega)), saves the current policy where the generation actors can read it (the
    LoRA adapter alone, or the full model), asks its :class:`raycurate.stages.generation.GenerationPool` (vLLM on
    GPUs, HF generate on CPU; created on first use inside the rank-0 worker) for G responses per question, appends
    the rows to ``out_dir/round-<step>.parquet`` and broadcasts them; every rank returns the same rows.
    """

    candidate_table: str
    base_model: str
    adapter: dict | None
    out_dir: str
    ratio: float
    mask: str
    samples: int
    temperature: float
    max_new_tokens: int
    seed: int
    backend: str = "auto"
    num_actors: int = 1
    gpus_per_actor: float | None = None

    def __call__(self, step: int, omega: Any, module: Any) -> list[dict] | None:
        from raycurate.training.collectives import broadcast_from_rank0

        policy = self._save_policy(module, step)  # collective under ZeRO-3
        rows = self._generate(step, omega, policy) if _rank() == 0 else None
        return broadcast_from_rank0(rows)

    def masked(self, omega: Any) -> Any:
        """Indices of the masked questions for this round."""
        from raycurate.algorithms.bilevel import data_weights
        from raycurate.algorithms.bmo import masked_questions_dynamic, masked_questions_fixed

        if self.mask == "dynamic":
            return masked_questions_dynamic(data_weights(omega), self.ratio)
        return masked_questions_fixed(len(omega), self.ratio, self.seed)

    def _generate(self, step: int, omega: Any, policy: str) -> list[dict]:
        from raycurate.stages.bilevel_train import generation_requests
        from raycurate.stages.generation import write_generations
        from raycurate.training.batches import load_token_table

        table = load_token_table(self.candidate_table)
        masked = self.masked(omega)
        rows = self._pool().generate(generation_requests(table, masked), adapter_dir=policy, n=self.samples,
                                     temperature=self.temperature, max_new_tokens=self.max_new_tokens, step=step,
                                     seed=self.seed)
        write_generations(rows, Path(self.out_dir) / f"round-{step:07d}.parquet")
        log.info("online generation at step %d: %d questions x %d responses", step, len(masked), self.samples)
        return rows

    def _save_policy(self, module: Any, step: int) -> str:
        """The current policy as a directory the actors load: a PEFT adapter (LoRA) or a full HF checkpoint.

        Called on every rank: under ZeRO-3 the saved parameters (the LoRA weights, or all of them) are gathered
        collectively first; rank 0 writes.
        """
        import contextlib

        from raycurate.models.adapters import adapter_kind

        kind = adapter_kind(self.adapter)
        if kind not in ("lora", "full"):
            raise ValueError("online generation supports LoRA or full fine-tuning; head-delta adapters have no "
                             "loadable adapter format")
        path = Path(self.out_dir) / "policy" / f"step-{step:07d}"
        partitioned = [p for p in module.parameters() if hasattr(p, "ds_id") and (kind == "full" or p.requires_grad)]
        gather = contextlib.nullcontext()
        if partitioned:
            import deepspeed

            gather = deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)
        with gather:
            if _rank() == 0:
                path.parent.mkdir(parents=True, exist_ok=True)
                module.save_pretrained(str(path))
        if _rank() == 0 and kind == "full":
            for name in os.listdir(self.base_model):  # tokenizer / generation config next to the weights
                if name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
                    shutil.copy2(os.path.join(self.base_model, name), path / name)
        return str(path)

    def _pool(self) -> Any:
        from raycurate.stages.generation import GenerationPool

        if getattr(self, "_pool_handle", None) is None:
            from raycurate.models.adapters import adapter_kind

            # vLLM serves LoRA adapters on one engine; a fully fine-tuned policy is loaded by the HF actors
            backend = "hf" if self.backend == "auto" and adapter_kind(self.adapter) == "full" else self.backend
            self._pool_handle = GenerationPool(self.base_model, backend=backend, num_actors=self.num_actors,
                                               num_gpus_per_actor=self.gpus_per_actor, seed=self.seed)
        return self._pool_handle


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


# --------------------------------------------------------------------------------------------- BDS stage


#: The bilevel settings the BDS loop reads, as hashed under ``bds`` in the BDS stage's config.
BDS_HASHED_KEYS = ("omega_lr", "omega_optimizer", "omega_baseline", "rho0", "rho_step", "rho_max", "variant", "seed",
                   "importance", "importance_clip")


def bds_hash_config(bilevel: BilevelConfig, train_cfg: TrainConfig, online: bool) -> dict[str, Any]:
    """The ``bds`` entry of the BDS stage's config hash: what the loop reads of ``bilevel``, the resolved batch split,
    the omega Adam constants and ``generation_every`` (None offline), under the keys finished and checkpointed runs
    were hashed with (changing a key or a value re-trains them)."""
    from raycurate.algorithms.bilevel import OMEGA_ADAM_BETAS, OMEGA_ADAM_EPS
    from raycurate.training.bds_step import bds_batches

    val_batch, cand_batch = bds_batches(train_cfg, bilevel)
    return {**{k: getattr(bilevel, k) for k in BDS_HASHED_KEYS}, "omega_betas": OMEGA_ADAM_BETAS,
            "omega_eps": OMEGA_ADAM_EPS, "val_batch": val_batch, "cand_batch": cand_batch,
            "generation_every": bilevel.generation_every if online else None}


def bds_stage(run: RunDir, stage: str, *, candidate_stage: str, validation_stage: str, base_stage: str,
              train_cfg: TrainConfig, bilevel: BilevelConfig, adapter: dict | None, online: bool,
              force: bool = False) -> dict:
    """Offline BDS (``online=False``) or BDS + BMO online regeneration on Ray Train.

    Outputs: ``model`` (the LoRA adapter alone with ``train.export: adapter``, else the merged HF checkpoint),
    ``weights.parquet`` (id, omega, sigma, rank per epoch snapshot) and,
    online, ``generations.parquet`` (question id, step, sample, response ids, generation-time log-probs and the
    final policy's importance weight).
    """
    from raycurate.stages.bilevel_train import run_bds

    candidates = output_path(run, candidate_stage, "tokens")
    validation = output_path(run, validation_stage, "tokens")
    base = output_path(run, base_stage, "model")
    upstream = [candidate_stage, validation_stage, base_stage]
    online_cfg: dict[str, Any] | None
    online_cfg = {k: getattr(bilevel, k) for k in ("online_ratio", "online_mask", "online_samples", "temperature",
                                                   "max_new_tokens", "generation_backend", "generation_actors")}
    if not online:
        online_cfg = None
    config = {"train": train_cfg, "bds": bds_hash_config(bilevel, train_cfg, online), "adapter": adapter,
              "online": online_cfg}
    # the checkpoint folder ignores max_steps, so raising it (e.g. the next ASHA rung) extends the saved run
    resume_key = stage_hash(run, {**config, "train": dataclasses.replace(train_cfg, max_steps=None)}, upstream)
    scratch = scratch_dir(run, stage)

    def body(out: Path) -> StageOutput:
        hook = None
        rounds_dir = scratch / f"generations-{resume_key}"
        if online:
            rounds_dir.mkdir(parents=True, exist_ok=True)
            hook = PoolGenerationHook(
                str(candidates), str(base), adapter, str(rounds_dir), bilevel.online_ratio,
                bilevel.online_mask, bilevel.online_samples, bilevel.temperature, bilevel.max_new_tokens,
                bilevel.seed, backend=bilevel.generation_backend, num_actors=bilevel.generation_actors)
        metrics = run_bds(str(candidates), str(validation), str(base), str(out / "model"), train_cfg, bilevel,
                          storage_dir=str(scratch), name=f"{stage}-{resume_key}", adapter=adapter,
                          generation_hook=hook)
        os.replace(out / "model" / WEIGHTS_FILE, out / WEIGHTS_FILE)
        outputs = {"model": "model", "weights": WEIGHTS_FILE}
        summary = {k: v for k, v in metrics.items() if not isinstance(v, (list, dict))}
        summary["trusted_rows"] = trusted_rows_in(run, validation_stage)
        if online:
            generated = collect_generations(rounds_dir, out / "model", candidates, out / GENERATIONS_FILE)
            summary.update(generated)
            outputs["generations"] = GENERATIONS_FILE
        return StageOutput(outputs=outputs, metrics=summary)

    return run_stage(run, stage, body, config=config, upstream=upstream, force=force)


def collect_generations(rounds_dir: Path, final_model: Path, candidates: Path, dest: Path) -> dict:
    """Concatenate the generation rounds and add each response's importance weight under the final policy.

    ``importance_weight`` = exp(mean over response tokens of (log pi_final - log pi_old)), the per-token geometric
    mean ratio (a diagnostic of how far the policy moved since the response was generated; 1 = not at all).
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    parts = sorted(rounds_dir.glob("round-*.parquet"))
    if not parts:
        pq.write_table(pa.table({"question_id": pa.array([], pa.string())}), dest)
        return {"generation_rounds": 0, "generated_responses": 0}
    table = pa.concat_tables([pq.read_table(p) for p in parts], promote_options="default")
    rows = table.to_pylist()
    from raycurate.stages.runtime import run_as_task

    new_logprobs = run_as_task(response_logprobs, final_model, candidates, rows)
    weights = [float(np.exp(np.mean(np.asarray(new) - np.asarray(r["token_logprobs"])))) if r["token_logprobs"]
               else 1.0 for r, new in zip(rows, new_logprobs)]
    table = table.append_column("importance_weight", pa.array(weights, pa.float64()))
    pq.write_table(table, dest)
    return {"generation_rounds": len(parts), "generated_responses": len(rows),
            "mean_importance_weight": float(np.mean(weights)) if weights else None}


def response_logprobs(model_dir: Path, candidates: Path, rows: list[dict]) -> list[list[float]]:
    """Teacher-forced log-probs of each generated response (after its question's prompt) under ``model_dir``."""
    import torch

    from raycurate.algorithms.bmo import token_logprobs
    from raycurate.models.loading import best_device, load_model

    prompts = {r["id"]: r["input_ids"][: r["prompt_len"]]
               for r in read_token_rows(candidates, ["id", "input_ids", "prompt_len"])}
    device = best_device()
    model = load_model(str(model_dir), dtype="float32", device=device).eval()
    out = []
    with torch.no_grad():
        for r in rows:
            prompt, response = list(prompts[r["question_id"]]), list(r["response_ids"])
            ids = torch.tensor([prompt + response], device=device)
            mask = torch.zeros_like(ids)
            mask[0, len(prompt):] = 1
            logits = model(input_ids=ids).logits.float()
            lp = token_logprobs(logits, ids, mask)[0].cpu()  # (T,) log p at supervised positions, 0 elsewhere
            out.append(lp[len(prompt):].tolist())
    return out


# --------------------------------------------------------------------------------------------- training tables


def mixing_weights(n_candidates: int, n_validation: int, rho: float) -> tuple[float, float]:
    """Per-row weights realising direct mixing (paper eq. 3) under uniform row sampling over the union.

    ``rho / N_c * sum_c l + (1 - rho) / N_v * sum_v l`` equals the mean over the union of ``w_i l_i`` with
    ``w_c = rho (N_c + N_v) / N_c`` and ``w_v = (1 - rho) (N_c + N_v) / N_v``.

    Returns:
        (candidate weight, validation weight).
    """
    if not 0.0 < rho <= 1.0:
        raise ValueError(f"mixing ratio rho={rho} must be in (0, 1]")
    if n_candidates < 1 or n_validation < 1:
        raise ValueError(f"direct mixing needs rows on both sides (candidates={n_candidates}, "
                         f"validation={n_validation})")
    total = n_candidates + n_validation
    return rho * total / n_candidates, (1.0 - rho) * total / n_validation


def weighted_union_stage(run: RunDir, stage: str, *, candidate_stage: str, validation_stage: str, rho: float,
                         candidate_ids: list[str] | None = None, description: str = "",
                         force: bool = False) -> dict:
    """Token table of candidates (optionally only ``candidate_ids``) + validation rows with direct-mixing weights.

    ``rho = 1`` drops the validation rows (their weight would be 0): training on the candidates alone.
    """
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    def body(out: Path) -> StageOutput:
        (out / "tokens").mkdir()
        cand = _read_table(output_path(run, candidate_stage, "tokens"))
        if candidate_ids is not None:
            import pyarrow as pa

            cand = cand.filter(pc.is_in(cand["id"], value_set=pa.array(sorted(set(candidate_ids)))))
        val = _read_table(output_path(run, validation_stage, "tokens"))
        if rho >= 1.0:
            pq.write_table(_with_weight(cand, 1.0), out / "tokens" / "part-00000.parquet")
            return StageOutput(outputs={"tokens": "tokens"}, metrics={"candidates": cand.num_rows, "validation": 0,
                                                                      "rho": rho, "description": description})
        w_c, w_v = mixing_weights(cand.num_rows, val.num_rows, rho)
        pq.write_table(_with_weight(cand, w_c), out / "tokens" / "part-00000.parquet")
        pq.write_table(_with_weight(val, w_v), out / "tokens" / "part-00001.parquet")
        return StageOutput(outputs={"tokens": "tokens"}, metrics={
            "candidates": cand.num_rows, "validation": val.num_rows, "rho": rho, "candidate_weight": w_c,
            "validation_weight": w_v, "description": description})

    config = {"rho": rho, "ids": sorted(candidate_ids) if candidate_ids is not None else None}
    return run_stage(run, stage, body, config=config, upstream=[candidate_stage, validation_stage], force=force)


def _read_table(path: Path) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pa.concat_tables([pq.read_table(p) for p in sorted(Path(path).glob("*.parquet"))],
                            promote_options="default")


def _with_weight(table: Any, weight: float) -> Any:
    import pyarrow as pa

    column = pa.array([float(weight)] * table.num_rows, pa.float32())
    if "weight" in table.schema.names:
        return table.set_column(table.schema.get_field_index("weight"), "weight", column)
    return table.append_column("weight", column)


# --------------------------------------------------------------------------------------------- evaluation


def mean_loss_task(model_dir: str, tokens_dir: str, batch_size: int = 16) -> dict:
    """Mean per-example loss (masked mean over response tokens) of a model on a token table (a Ray task)."""
    import torch

    from raycurate.algorithms.losses import model_example_losses, pad_rows
    from raycurate.models.loading import best_device, load_model, load_tokenizer

    device = best_device()
    model = load_model(model_dir, dtype="float32", device=device).eval()
    pad_id = load_tokenizer(model_dir).pad_token_id or 0
    rows = read_token_rows(Path(tokens_dir), ["input_ids", "loss_mask"])
    losses: list[float] = []
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = {k: v.to(device) for k, v in pad_rows(rows[start:start + batch_size], pad_id).items()}
            losses.extend(model_example_losses(model, batch["input_ids"], batch["attention_mask"],
                                               batch["loss_mask"]).cpu().tolist())
    return {"rows": len(losses), "loss": sum(losses) / max(len(losses), 1)}


def loss_eval_stage(run: RunDir, stage: str, *, model_stage: str, tokens_stage: str, force: bool = False) -> dict:
    """Mean loss of ``model_stage``'s model on ``tokens_stage``'s rows (e.g. the lower-level clean candidates)."""
    from raycurate.stages.runtime import run_as_task

    def body(out: Path) -> StageOutput:
        metrics = run_as_task(mean_loss_task, str(output_path(run, model_stage, "model")),
                              str(output_path(run, tokens_stage, "tokens")))
        (out / "loss.json").write_text(__import__("json").dumps(metrics))
        return StageOutput(outputs={"loss": "loss.json"}, metrics=metrics)

    return run_stage(run, stage, body, config={}, upstream=[model_stage, tokens_stage], force=force)


def final_weights(run: RunDir, bds_stage_name: str) -> dict[str, float]:
    """``id -> sigma(omega)`` of a BDS stage's last weight snapshot (mean 1 over its candidates)."""
    import pyarrow.parquet as pq

    weights = pq.read_table(output_path(run, bds_stage_name, "weights"), columns=["id", "step", "sigma"]).to_pylist()
    last = max(w["step"] for w in weights)
    return {w["id"]: float(w["sigma"]) for w in weights if w["step"] == last}


def weight_analysis(run: RunDir, bds_stage_name: str, candidate_stage: str, top: int = 5, seed: int = 0) -> dict:
    """sigma(omega) of the last snapshot by ground-truth label, and the sampling-order diagnostic.

    Keys: ``snapshot_step``, ``candidates``, ``top``/``bottom`` (extremes); with labels also ``auroc`` (sigma, clean
    vs corrupted) with ``auroc_ci95`` (seeded per-class bootstrap of the rows), ``auroc_by_kind`` (clean vs each
    ``label.corruption``, with counts), ``auroc_excluding_near_duplicate``, ``weights_by_label`` and
    ``auroc_neg_loss`` (AUROC of minus each row's latest omega loss: the loss-based score BDS can at best
    reproduce); and ``spearman_first_step``, Spearman(omega, the step each row was first sampled) -- near +-1
    means omega records the sampling order instead of data quality (docs/bilevel.md, "The omega optimizer").
    """
    import numpy as np
    import pyarrow.parquet as pq

    from raycurate.algorithms.ranking import spearman

    weights = pq.read_table(output_path(run, bds_stage_name, "weights")).to_pylist()
    last = max(w["step"] for w in weights)
    final = {w["id"]: w for w in weights if w["step"] == last}
    labels = {r["id"]: (r.get("label") or {}) for r in read_token_rows(output_path(run, candidate_stage, "tokens"),
                                                                       label_columns(run, candidate_stage))}
    ids = sorted(final)
    sigma = np.array([final[i]["sigma"] for i in ids])
    info: dict[str, Any] = {"snapshot_step": int(last), "candidates": len(ids)}
    if "first_step" in weights[0]:
        omega = np.array([final[i]["omega"] for i in ids])
        first = np.array([final[i]["first_step"] for i in ids])
        seen = first >= 0
        info["spearman_first_step"] = spearman(omega[seen], first[seen]) if seen.sum() > 1 else None
        info["sampled_candidates"] = int(seen.sum())
    clean = [labels.get(i, {}).get("clean") for i in ids]
    if all(c is not None for c in clean) and 0 < sum(map(bool, clean)) < len(clean):
        flags = np.array(clean, dtype=bool)
        kinds = np.array([labels[i].get("corruption") or ("none" if labels[i]["clean"] else "unknown") for i in ids])
        info.update(label_separation(sigma, flags, kinds, seed))
        if "loss" in weights[0]:
            loss = np.array([final[i]["loss"] for i in ids], dtype=np.float64)
            known = np.isfinite(loss)
            if 0 < flags[known].sum() < known.sum():
                info["auroc_neg_loss"] = auroc(-loss[known], flags[known])
        info["weights_by_label"] = {"clean": sigma[flags].tolist(), "corrupted": sigma[~flags].tolist()}
    order = np.argsort(-sigma, kind="stable")

    def describe(index: int) -> dict:
        label = labels.get(ids[index], {})
        return {"id": ids[index], "sigma": float(sigma[index]), "clean": label.get("clean"),
                "corruption": label.get("corruption", "")}

    info["top"] = [describe(i) for i in order[:top]]
    info["bottom"] = [describe(i) for i in order[::-1][:top]]
    return info


def label_columns(run: RunDir, stage: str) -> list[str]:
    """The row-key columns of a stage's token table: ``["id", "label"]`` when it carries labels, else ``["id"]``.

    Args:
        run: The run directory.
        stage: Stage whose ``tokens`` output is read (its first parquet file's schema only).
    """
    import pyarrow.parquet as pq

    first = next(iter(sorted(output_path(run, stage, "tokens").glob("*.parquet"))))
    names = pq.read_schema(first).names
    return ["id", "label"] if "label" in names else ["id"]


def generation_samples(run: RunDir, stage: str, candidate_stage: str, tokenizer_dir: str, limit: int = 5) -> list:
    """A few original vs generated responses with their importance weights, decoded for the report."""
    import pyarrow.parquet as pq

    from raycurate.models.loading import load_tokenizer

    path = output_path(run, stage, "generations")
    rows = pq.read_table(path).to_pylist()[:limit]
    if not rows:
        return []
    tokenizer = load_tokenizer(tokenizer_dir)
    originals = {r["id"]: r.get("response", "") for r in read_token_rows(output_path(run, candidate_stage, "tokens"),
                                                                        ["id", "response"])}
    return [{"question_id": r["question_id"], "original": originals.get(r["question_id"], ""),
             "generated": tokenizer.decode(r["response_ids"], skip_special_tokens=True),
             "weight": r.get("importance_weight", 1.0)} for r in rows]
