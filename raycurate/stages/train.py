"""Supervised fine-tuning on Ray Train: :class:`SFTJob`, the per-worker :func:`train_loop`, :class:`RaySession`
(the Ray Train ``TrainSession``), the launchers (``train.launcher``: a ``TorchTrainer`` worker group or one Ray task)
and the driver :func:`run_sft`.  The torch/DeepSpeed machinery is :mod:`raycurate.training`; the design is
docs/design.md ("Layers", "Training launcher").  Run it::

    from raycurate.config.train import TrainConfig
    from raycurate.stages.train import run_sft
    metrics = run_sft("runs/x/tokenize/train.parquet", "models/base", "runs/x/sft/model", TrainConfig(),
                      storage_dir="runs/x/ray_train", name="sft")
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from raycurate.config.train import TrainConfig
from raycurate.training.batches import (
    LossFn,
    collate,
    load_token_table,
    sft_loss,
    supervised_counts,
    to_device,
    token_sft_loss,
)
from raycurate.training.bookkeeping import StepBook
from raycurate.training.checkpoint import save_checkpoint
from raycurate.training.collectives import all_reduce_sum
from raycurate.training.deepspeed_config import check_offload, grad_accum_steps
from raycurate.training.export import METRICS_FILE, export_hf, run_metrics
from raycurate.training.order import epoch_order, micro_batch_rows, steps_per_epoch, total_steps
from raycurate.training.protocol import TrainSession
from raycurate.training.session import (
    FAULT_ENV,
    TaskSession,
    build_resumed_engine,
    maybe_inject_fault,
    prepare_worker,
    scoped_env,
    single_rank_process_group,
)

logger = logging.getLogger(__name__)


@dataclass
class SFTJob:
    """Everything a worker needs (pickled to the Ray Train workers)."""

    train_table: str
    init_model: str
    output_dir: str
    cfg: TrainConfig
    use_gpu: bool
    cpus_per_worker: float
    adapter: dict | None = None  # raycurate.models.adapters spec; None trains every parameter


# --------------------------------------------------------------------------------------------- session + loop


class RaySession:
    """:class:`TrainSession` on Ray Train V2 (``ray.train.get_context/get_checkpoint/report``)."""

    def __init__(self) -> None:
        import ray.train
        import ray.train.torch

        context = ray.train.get_context()
        self.rank = context.get_world_rank()
        self.local_rank = context.get_local_rank()
        self.world_size = context.get_world_size()
        self.device = ray.train.torch.get_device()

    @contextlib.contextmanager
    def restore_dir(self) -> Iterator[str | None]:
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            yield None
            return
        with checkpoint.as_directory() as path:
            yield path

    @contextlib.contextmanager
    def latest_checkpoint_dir(self) -> Iterator[str | None]:
        import ray.train

        reported = ray.train.get_all_reported_checkpoints()
        checkpoint = reported[-1].checkpoint if reported else ray.train.get_checkpoint()
        if checkpoint is None:
            yield None
            return
        with checkpoint.as_directory() as path:
            yield path

    def report(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
        import ray.train

        if checkpoint_dir is None:
            ray.train.report(metrics)
            return
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(checkpoint_dir),
            checkpoint_dir_name=f"checkpoint_step_{metrics['step']:08d}",
            delete_local_checkpoint_after_upload=True,
        )


def train_loop(job: SFTJob, session: TrainSession, loss_fn: LossFn | None = None) -> dict[str, Any]:
    """The per-worker SFT loop: build, restore, train to ``total_steps``, checkpoint, export.

    Args:
        job: Inputs, outputs and config.
        session: Runtime (rank, world size, device, checkpoint restore/report).
        loss_fn: ``(per_token (B, T), batch) -> ()`` loss of one micro-batch (see :data:`LossFn`); None: the one
            ``train.loss_normalization`` names (per-row means, or :func:`token_sft_loss` with each batch's
            ``token_norm``).

    Returns:
        The final metrics (same on every rank; rank 0 also writes them to ``output_dir``).
    """
    import torch

    cfg, device = job.cfg, session.device
    torch.manual_seed(cfg.seed + session.rank)
    table = load_token_table(job.train_table)
    by_token = loss_fn is None and cfg.loss_normalization == "token"
    loss_fn = token_sft_loss if by_token else (loss_fn or sft_loss)
    counts = supervised_counts(table)  # (N,) supervised targets per row
    accum = grad_accum_steps(cfg, session.world_size)
    per_epoch = steps_per_epoch(len(table), cfg.effective_batch_size)
    run_steps = total_steps(len(table), cfg)
    with session.restore_dir() as ckpt_dir:
        engine, trainable, pad_id, state = build_resumed_engine(job, run_steps, session, ckpt_dir)
    if state.step > run_steps:
        raise ValueError(f"the checkpoint being resumed is at step {state.step}, beyond this run's {run_steps} steps; "
                         "raise train.max_steps, or delete the stage's _scratch folder to train from scratch")
    start_step, started = state.step, time.perf_counter()
    if session.rank == 0:
        logger.info("SFT: %d rows, %d steps/epoch, steps %d -> %d, accum %d, world %d, engine %s, %d trainable "
                    "parameters", len(table), per_epoch, start_step, run_steps, accum, session.world_size, cfg.engine,
                    trainable)

    schedule: Any = None  # (per_epoch, accum, world) row indices of the current epoch
    schedule_epoch = -1
    book = StepBook(state, cfg, run_steps, per_epoch, accum * session.world_size, session.rank)

    def save() -> None:
        metrics = run_metrics(job, state, start_step, run_steps, per_epoch, session.world_size,
                              time.perf_counter() - started, trainable)
        save_checkpoint(engine, session, state, metrics, cfg)

    for step in range(start_step, run_steps):
        epoch, step_in_epoch = divmod(step, per_epoch)
        if epoch != schedule_epoch:
            order = epoch_order(len(table), cfg.seed, epoch)
            schedule, schedule_epoch = micro_batch_rows(order, session.world_size, cfg.micro_batch_size, accum), epoch
        step_started, step_lr = time.perf_counter(), engine.lr()
        loss_sum, tokens = 0.0, 0
        # every rank holds the whole step's (accum, world, micro) rows, so each knows its supervised total
        supervised_total = int(counts[schedule[step_in_epoch]].sum())
        # token_norm: the step's supervised tokens over the micro-batches its gradient is averaged over
        norm = max(1, supervised_total) / (accum * session.world_size)
        for k in range(accum):
            batch = collate(table, schedule[step_in_epoch, k, session.rank], pad_id)
            if by_token:
                batch["token_norm"] = torch.tensor(norm, dtype=torch.float32)
            tokens += int(batch["attention_mask"].sum())
            loss = engine.train_micro_batch(to_device(batch, device), loss_fn, is_boundary=k == accum - 1)
            loss_sum += float(loss)
        loss_total, tokens_total, clock_due = all_reduce_sum([loss_sum, tokens, book.clock.due_flag()], device)
        book.record(step, loss_sum=loss_total, lr=step_lr, tokens=tokens_total, supervised=supervised_total,
                    examples=cfg.effective_batch_size, started=step_started)
        book.close(clock_due, save, ("lr %.3g", (state.lr_per_step[-1],)))
        maybe_inject_fault(session, state.step)

    metrics = run_metrics(job, state, start_step, run_steps, per_epoch, session.world_size,
                          time.perf_counter() - started, trainable)
    export_hf(engine, job, metrics, session)
    session.report(metrics, None)
    return metrics


def sft_entry(config: dict[str, Any], session: TrainSession) -> None:
    """The worker entry point of :func:`launch_trainer` for SFT (``config["job"]``: an :class:`SFTJob`)."""
    prepare_worker(config["job"])
    train_loop(config["job"], session)


# --------------------------------------------------------------------------------------------- driver


def _worker_env(use_gpu: bool) -> dict[str, str]:
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if not use_gpu:
        env["DS_ACCELERATOR"] = "cpu"
    for name in ("TORCH_EXTENSIONS_DIR", FAULT_ENV):
        if name in os.environ:
            env[name] = os.environ[name]
    return env


def run_sft(train_table: str, init_model: str, output_dir: str, cfg: TrainConfig, *,
            storage_dir: str, name: str, adapter: dict | None = None) -> dict[str, Any]:
    """Fine-tune ``init_model`` on a token-level table with Ray Train; resumes ``storage_dir/name`` if it exists.

    Args:
        train_table: Parquet file or directory in the token-level table format.
        init_model: Local HF checkpoint directory (model, optionally tokenizer files).
        output_dir: Where the trained HF checkpoint, tokenizer files and ``train_metrics.json`` go.
        cfg: Training config.
        storage_dir: Ray Train storage (checkpoints); re-running with the same ``storage_dir`` and ``name``
            resumes from the latest checkpoint there.
        name: Ray Train run name.
        adapter: Adapter spec (:mod:`raycurate.models.adapters`): LoRA, P2D head deltas, or None (``cfg``'s own
            ``train.adapter``: full fine-tuning or LoRA).

    Returns:
        The metrics of ``train_metrics.json``: ``loss_per_step``, ``steps``, ``start_step``, ``tokens``,
        ``supervised_tokens``, ``seconds``, ...
    """
    check_launcher(cfg)  # fail on the driver, before any worker starts
    grad_accum_steps(cfg, cfg.num_workers)
    check_offload(cfg)
    if not os.path.isdir(init_model):
        raise FileNotFoundError(f"init_model={init_model} is not a directory; pass a local HF checkpoint dir.")
    use_gpu, cpus = worker_resources(cfg)
    job = SFTJob(os.path.abspath(train_table), os.path.abspath(init_model), os.path.abspath(output_dir),
                 cfg, use_gpu, cpus, adapter if adapter is not None else cfg.adapter_spec())
    launch_trainer(sft_entry, {"job": job}, cfg, use_gpu, cpus, storage_dir=storage_dir, name=name)
    with open(os.path.join(job.output_dir, METRICS_FILE)) as f:
        return json.load(f)


def worker_resources(cfg: TrainConfig) -> tuple[bool, float]:
    """(use GPUs, CPUs per worker) of a training run on the current Ray cluster (started when needed)."""
    from raycurate.stages.runtime import actor_cpus, cluster_cpus, cluster_gpus, init_ray

    init_ray()
    use_gpu = cfg.use_gpu if cfg.use_gpu is not None else cluster_gpus() >= 1
    return use_gpu, actor_cpus(cfg.cpus_per_worker, cfg.num_workers, cluster_cpus())


WorkerEntry = Callable[[dict[str, Any], TrainSession], None]


def check_launcher(cfg: TrainConfig) -> None:
    """Raise ``ValueError`` (naming the settings to change) when ``cfg.launcher`` cannot run ``cfg.num_workers``."""
    problems = cfg.launcher_problems()
    if problems:
        raise ValueError("; ".join(problems))


def launch_trainer(entry: WorkerEntry, loop_config: dict[str, Any], cfg: TrainConfig, use_gpu: bool,
                   cpus: float, *, storage_dir: str, name: str) -> None:
    """Run ``entry(loop_config, session)`` on every worker; checkpoints (and resume) in ``storage_dir/name``.

    ``cfg.launcher`` picks the runtime: ``ray_train`` runs ``cfg.num_workers`` TorchTrainer workers with a
    :class:`RaySession`; ``task`` runs one Ray task with a :class:`~raycurate.training.session.TaskSession`.
    """
    check_launcher(cfg)
    if cfg.launcher == "task":
        launch_task(entry, loop_config, cfg, use_gpu, cpus, storage_dir=storage_dir, name=name)
    else:
        launch_torch_trainer(entry, loop_config, cfg, use_gpu, cpus, storage_dir=storage_dir, name=name)


def ray_train_worker(entry: WorkerEntry, config: dict[str, Any]) -> None:
    """``train_loop_per_worker`` of the TorchTrainer (bound to ``entry`` with ``functools.partial``)."""
    entry(config, RaySession())


def launch_torch_trainer(entry: WorkerEntry, loop_config: dict[str, Any], cfg: TrainConfig, use_gpu: bool,
                         cpus: float, *, storage_dir: str, name: str) -> None:
    """Run ``entry`` on ``cfg.num_workers`` Ray Train workers (TorchTrainer); resumes ``storage_dir/name``."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    resources: dict[str, float] = {"CPU": cpus}
    if use_gpu:
        resources["GPU"] = 1
    trainer = TorchTrainer(
        functools.partial(ray_train_worker, entry),
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=use_gpu, resources_per_worker=resources),
        run_config=RunConfig(
            name=name,
            storage_path=os.path.abspath(storage_dir),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints),
            failure_config=FailureConfig(max_failures=cfg.max_failures),
            worker_runtime_env={"env_vars": _worker_env(use_gpu)},
        ),
    )
    trainer.fit()


def task_worker(entry: WorkerEntry, loop_config: dict[str, Any], run_dir: str, keep_checkpoints: int,
                use_gpu: bool, env: dict[str, str]) -> None:
    """The body of the ``launcher=task`` Ray task: worker env, a 1-rank process group, ``entry`` on a TaskSession.

    The env and the group are undone on exit because Ray reuses the process for later tasks.
    """
    with scoped_env(env), single_rank_process_group(use_gpu):
        entry(loop_config, TaskSession(run_dir, keep_checkpoints, use_gpu))


def training_max_calls(init_model: str) -> int:
    """Ray's ``max_calls`` for a ``launcher=task`` training of ``init_model``: 0 (the process stays) for a small
    model, 1 (it exits) for a real one.

    A real model's training process, reused warm, carried ~6.8 GB RSS of heap into the evaluations that followed,
    which helped Ray's memory monitor kill a later stage; a small model's lets the next task skip the torch,
    transformers and DeepSpeed imports (:func:`task_worker` undoes its env and process group on exit).
    """
    from raycurate.models.loading import is_small_checkpoint

    return 0 if is_small_checkpoint(init_model) else 1


def launch_task(entry: WorkerEntry, loop_config: dict[str, Any], cfg: TrainConfig, use_gpu: bool, cpus: float, *,
                storage_dir: str, name: str) -> None:
    """Run ``entry`` in one Ray task (``cfg.num_workers`` must be 1); resumes ``storage_dir/name``.

    ``cfg.max_failures`` is the task's ``max_retries``, with exceptions retried too, as Ray Train's
    ``FailureConfig`` restarts the worker group after a worker dies or raises; each retry resumes from the newest
    checkpoint.
    """
    import ray

    max_calls = training_max_calls(loop_config["job"].init_model)
    task = ray.remote(max_calls=max_calls)(task_worker).options(
        num_cpus=cpus, num_gpus=1 if use_gpu else 0, max_retries=cfg.max_failures, retry_exceptions=True,
        name=f"train:{name}")
    run_dir = os.path.join(os.path.abspath(storage_dir), name)
    ray.get(task.remote(entry, loop_config, run_dir, cfg.keep_checkpoints, use_gpu, _worker_env(use_gpu)))
