"""The final export of a training run: HF checkpoint (safetensors), tokenizer files and ``train_metrics.json``.

``output_dir`` is written by rank 0 atomically (temp dir + ``os.replace``).  A ZeRO-1/2/3 run's weights are
consolidated from the final checkpoint's persisted shards (``zero_to_fp32``, fp32 master weights cast to the
training dtype), not gathered from live parameters; DDP and ZeRO-0 export their full weights directly.  On a
multi-node cluster ``output_dir`` must be on storage shared by the workers and the driver.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from typing import Any

from raycurate.training.checkpoint import TrainState
from raycurate.training.engines import load_model, load_trainable_state_dict
from raycurate.training.protocol import TrainSession

METRICS_FILE = "train_metrics.json"
TOKENIZER_PREFIXES = ("tokenizer", "special_tokens_map", "added_tokens", "vocab", "merges", "chat_template")


def copy_tokenizer_files(init_model: str, dest: str) -> list[str]:
    """Copy the tokenizer files of checkpoint ``init_model`` into ``dest``; returns their names."""
    copied = []
    for name in sorted(os.listdir(init_model)):
        src = os.path.join(init_model, name)
        if os.path.isfile(src) and (name.startswith(TOKENIZER_PREFIXES) or name.endswith(".model")):
            shutil.copy2(src, os.path.join(dest, name))
            copied.append(name)
    return copied


def save_merged(job: Any, state_dict: dict[str, Any], dest: str) -> None:
    """Rebuild the adapted model on CPU from ``init_model``, load the trained state (the frozen base weights may be
    missing from it: they are ``init_model``'s), save adapter + merged model in float32.

    Float32 whatever the base's dtype, so the export equals the trained model: an adapter's update is small next
    to the weights it is added to, and a bf16 weight keeps 8 significant bits. Merged into SmolLM2-135M's bf16
    weights, one epoch of LoRA (lr 2e-4) lost 23-78% of each layer's update (relative norm). At that training
    length greedy answers barely moved (0.40 merged in bf16 vs 0.39 unmerged on 100 held-out questions,
    benchmarks/RESULTS.md, #25), but nothing bounds the loss for longer or smaller-lr runs."""
    import torch

    from raycurate.models.adapters import apply_adapter, export_model, save_adapter

    model = apply_adapter(load_model(job.init_model, torch.float32), job.adapter)
    load_trainable_state_dict(model, {k: v.float() for k, v in state_dict.items()})
    save_adapter(model, job.adapter, os.path.join(dest, "adapter"))
    export_model(model, job.adapter).to(torch.float32).save_pretrained(dest)


def replace_dir(tmp: str, output_dir: str) -> None:
    """Move the finished folder ``tmp`` to ``output_dir``, replacing an existing one (old one removed after)."""
    old = None
    if os.path.exists(output_dir):
        old = f"{output_dir}.old-{uuid.uuid4().hex[:8]}"
        os.replace(output_dir, old)
    os.replace(tmp, output_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export_hf(engine: Any, job: Any, metrics: dict[str, Any], session: TrainSession) -> None:
    """Write the trained model (safetensors), tokenizer files and metrics to ``job.output_dir`` atomically.

    Call it after the final checkpoint was reported: ZeRO-1/2/3 weights are consolidated from its shards
    (``zero_to_fp32``).  Only rank 0 writes.  With an adapter the checkpoint is the merged model (a plain HF
    checkpoint), and a LoRA adapter is also saved alone under ``adapter/``.

    Args:
        engine: The training engine.
        job: ``output_dir``, ``init_model`` and ``adapter`` of the run (an ``SFTJob`` or ``BDSJob``).
        metrics: Written as ``train_metrics.json``.
        session: The runtime (rank, latest checkpoint).
    """
    from raycurate.models.adapters import adapter_kind

    state_dict = engine.full_state_dict(session)
    if session.rank != 0:
        return
    output_dir = os.path.abspath(job.output_dir)
    parent = os.path.dirname(output_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(output_dir)}.tmp-", dir=parent)
    if adapter_kind(job.adapter) == "full":
        engine.module.save_pretrained(tmp, state_dict=state_dict)
    else:
        save_merged(job, state_dict, tmp)
    copy_tokenizer_files(job.init_model, tmp)
    with open(os.path.join(tmp, METRICS_FILE), "w") as f:
        json.dump(metrics, f, indent=1)
    replace_dir(tmp, output_dir)


def run_metrics(job: Any, state: TrainState, start_step: int, run_steps: int, per_epoch: int,
                world: int, seconds_this_run: float, trainable: int) -> dict[str, Any]:
    """The metrics of a run after ``state.step`` steps (reported with checkpoints, written to ``METRICS_FILE``).

    Args:
        job: ``cfg`` and ``adapter`` of the run.
        state: Progress so far.
        start_step: Step this run (process) started at.
        run_steps: Total optimizer steps of the run.
        per_epoch: Optimizer steps per epoch.
        world: Data-parallel workers.
        seconds_this_run: Wall time since this run started.
        trainable: Trainable parameter count.
    """
    from raycurate.models.adapters import adapter_kind

    return {
        "step": state.step,
        "steps": state.step,
        "start_step": start_step,
        "total_steps": run_steps,
        "steps_per_epoch": per_epoch,
        "epoch": state.step / per_epoch,
        "loss": state.loss_per_step[-1] if state.loss_per_step else None,
        "loss_per_step": list(state.loss_per_step),
        "lr_per_step": list(state.lr_per_step),
        "tokens": state.tokens,
        "supervised_tokens": state.supervised_tokens,
        "examples": state.examples,
        "seconds": state.seconds,
        "seconds_this_run": seconds_this_run,
        "engine": job.cfg.engine,
        "zero_stage": job.cfg.zero_stage if job.cfg.engine == "deepspeed" else None,
        "world_size": world,
        "adapter": adapter_kind(job.adapter),
        "trainable_parameters": trainable,
    }
