"""The final export of a training run: HF checkpoint (safetensors) or, for LoRA, the adapter alone; tokenizer files
and ``train_metrics.json``.

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


def trained_adapted_model(job: Any, state_dict: dict[str, Any]) -> Any:
    """``job.init_model`` on CPU in float32 with ``job.adapter`` attached and the trained state loaded (the frozen
    base weights may be missing from ``state_dict``: they are ``init_model``'s)."""
    import torch

    from raycurate.models.adapters import apply_adapter

    model = apply_adapter(load_model(job.init_model, torch.float32), job.adapter)
    load_trainable_state_dict(model, {k: v.float() for k, v in state_dict.items()})
    return model


def save_merged(job: Any, state_dict: dict[str, Any], dest: str) -> None:
    """Save the trained adapted model (:func:`trained_adapted_model`) as adapter + merged model in float32.

    Float32 whatever the base's dtype, so the export equals the trained model: an adapter's update is small next
    to the weights it is added to, and a bf16 weight keeps 8 significant bits. Merged into SmolLM2-135M's bf16
    weights, one epoch of LoRA (lr 2e-4) lost 23-78% of each layer's update (relative norm). At that training
    length greedy answers barely moved (0.40 merged in bf16 vs 0.39 unmerged on 100 held-out questions,
    benchmarks/RESULTS.md), but nothing bounds the loss for longer or smaller-lr runs."""
    import torch

    from raycurate.models.adapters import export_model, save_adapter

    model = trained_adapted_model(job, state_dict)
    save_adapter(model, job.adapter, os.path.join(dest, "adapter"))
    export_model(model, job.adapter).to(torch.float32).save_pretrained(dest)


def adapter_base_reference(init_model: str, output_dir: str) -> str:
    """How an adapter saved in ``output_dir`` names its base ``init_model``: relative when both are stage folders of
    one run directory (``<run>/<stage>/model``), so the run can move or be mirrored to another machine; else the
    absolute path."""
    init_model, output_dir = os.path.abspath(init_model), os.path.abspath(output_dir)
    run_dir = os.path.dirname(os.path.dirname(output_dir))
    if os.path.commonpath([init_model, run_dir]) == run_dir:
        return os.path.relpath(init_model, output_dir)
    return init_model


def save_adapter_only(job: Any, state_dict: dict[str, Any], dest: str) -> None:
    """Save the trained LoRA adapter alone (PEFT format) in ``dest``, naming ``job.init_model`` as its base
    (:func:`adapter_base_reference`).

    The base is the folder training started from, even when that folder is itself an adapter: the loaders
    (:func:`raycurate.models.loading.load_model`) follow the chain."""
    from raycurate.models.adapters import save_adapter
    from raycurate.models.loading import ADAPTER_CONFIG

    save_adapter(trained_adapted_model(job, state_dict), job.adapter, dest)
    config_path = os.path.join(dest, ADAPTER_CONFIG)
    with open(config_path) as f:
        config = json.load(f)
    config["base_model_name_or_path"] = adapter_base_reference(job.init_model, job.output_dir)
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)


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
    (``zero_to_fp32``).  Only rank 0 writes.  A LoRA run with ``train.export: adapter`` writes the adapter alone
    (:func:`save_adapter_only`); other adapters, and LoRA with ``merged``, write the merged model (a plain HF
    checkpoint), a LoRA adapter also alone under ``adapter/``.

    Args:
        engine: The training engine.
        job: ``output_dir``, ``init_model``, ``adapter`` and ``cfg`` of the run (an ``SFTJob`` or ``BDSJob``).
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
    kind = adapter_kind(job.adapter)
    if kind == "full":
        engine.module.save_pretrained(tmp, state_dict=state_dict)
    elif kind == "lora" and job.cfg.export == "adapter":
        save_adapter_only(job, state_dict, tmp)
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
