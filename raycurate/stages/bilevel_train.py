"""BDS (bilevel data selection) on Ray Train, offline or online (BMO): the driver :func:`run_bds`, its worker entry
and online BMO's generation requests.  The loop and the step are :mod:`raycurate.training.bds_loop` and
:mod:`raycurate.training.bds_step`; the stage is :func:`raycurate.stages.bilevel.bds_stage`.  Run it::

    from raycurate.config.bilevel import BilevelConfig
    from raycurate.config.train import TrainConfig
    from raycurate.stages.bilevel_train import run_bds
    metrics = run_bds("runs/x/cand.parquet", "runs/x/val.parquet", "models/base", "runs/x/bds/model",
                      TrainConfig(lr=5e-6), BilevelConfig(), storage_dir="runs/x/ray_train", name="bds")
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from raycurate.config.bilevel import BilevelConfig
from raycurate.config.train import TrainConfig
from raycurate.stages.train import check_launcher, launch_trainer, worker_resources
from raycurate.training.batches import TokenTable
from raycurate.training.bds_loop import BDSJob, GenerationHook, bds_train_loop
from raycurate.training.bds_online import prompt_ids
from raycurate.training.bds_step import check_bds_batches
from raycurate.training.export import METRICS_FILE
from raycurate.training.protocol import TrainSession
from raycurate.training.session import prepare_worker


def generation_requests(table: TokenTable, rows: np.ndarray) -> list[Any]:
    """:class:`raycurate.stages.generation.GenerationRequest` for candidate rows (question id = example id)."""
    from raycurate.stages.generation import GenerationRequest

    return [GenerationRequest(str(table.ids[i]), prompt_ids(table, int(i)).tolist()) for i in rows]


def bds_entry(config: dict[str, Any], session: TrainSession) -> None:
    """Worker entry of ``launch_trainer`` for BDS: ``config`` holds ``job`` and (or None) ``generation_hook``."""
    prepare_worker(config["job"])
    bds_train_loop(config["job"], session, config.get("generation_hook"))


def run_bds(candidate_table: str, validation_table: str, init_model: str, output_dir: str, cfg: TrainConfig,
            bds: BilevelConfig, *, storage_dir: str, name: str, adapter: dict[str, Any] | None = None,
            generation_hook: GenerationHook | None = None) -> dict:
    """Learn omega and fine-tune ``init_model`` with BDS on Ray Train (online BMO with a generation hook).

    Args:
        candidate_table: Token table (parquet file or directory) of the low-quality candidates.
        validation_table: Token table of the high-quality validation set (the upper level).
        init_model: Local HF checkpoint directory.
        output_dir: Where the HF model, tokenizer files, ``train_metrics.json`` and ``weights.parquet`` go.
        cfg: theta's training config (engine, workers, lr, micro/effective batch, epochs, ...).
        bds: The bilevel settings (omega, rho schedule, batch split, seed, online importance weights).
        storage_dir: Checkpoint storage; a run resumes from the latest checkpoint in ``storage_dir/name``.
        name: Ray Train run name.
        adapter: ``raycurate.models.adapters`` spec (e.g. ``{"kind": "lora", "r": 16, "alpha": 16}``), or None
            for full fine-tuning.
        generation_hook: Online BMO (every ``bds.generation_every`` steps): a picklable
            :class:`~raycurate.training.bds_loop.GenerationHook` (e.g. holding a generation pool's actor handles),
            shipped to every worker; None trains offline BDS.

    Returns:
        The metrics of ``train_metrics.json`` (SFT's plus ``gamma_per_step``, ``val_loss_per_step``,
        ``cand_loss_per_step``, ``omega_loss_per_step``, ``omega_digests``, ``weights_file`` (relative), ...).
    """
    check_launcher(cfg)  # fail on the driver, before any worker starts
    check_bds_batches(cfg, bds, cfg.num_workers)
    if not os.path.isdir(init_model):
        raise FileNotFoundError(f"init_model={init_model} is not a directory; pass a local HF checkpoint dir.")
    use_gpu, cpus = worker_resources(cfg)
    job = BDSJob(os.path.abspath(candidate_table), os.path.abspath(validation_table), os.path.abspath(init_model),
                 os.path.abspath(output_dir), cfg, bds, use_gpu, cpus, adapter)
    launch_trainer(bds_entry, {"job": job, "generation_hook": generation_hook}, cfg, use_gpu, cpus,
                   storage_dir=storage_dir, name=name)
    with open(os.path.join(job.output_dir, METRICS_FILE)) as f:
        return json.load(f)
