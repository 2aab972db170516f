"""The per-worker BDS loop (:func:`bds_train_loop`, offline or online BMO): build, restore, alternate theta and
omega steps (:mod:`raycurate.training.bds_step`), checkpoint, export the model and ``weights.parquet``.

:class:`BDSJob` is what the driver (:func:`raycurate.stages.bilevel_train.run_bds`) ships to every worker;
:class:`GenerationHook` is online BMO's extension point.  State files: :mod:`~raycurate.training.bds_state`,
:mod:`~raycurate.training.bds_online`; step bookkeeping: :mod:`~raycurate.training.bookkeeping`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from raycurate.algorithms import bilevel
from raycurate.config.bilevel import BilevelConfig
from raycurate.config.train import TrainConfig
from raycurate.training.batches import TokenTable, load_token_table, stack_tables
from raycurate.training.bds_online import (
    ONLINE_STATE_FILE,
    OnlineResponses,
    load_online,
    online_from_rows,
    save_online,
)
from raycurate.training.bds_state import (
    BDS_STATE_FILE,
    OMEGA_STATE_FILE,
    WEIGHTS_FILE,
    BDSCurves,
    OmegaState,
    ids_digest,
    load_omega_state,
    save_omega_state,
    write_weights,
)
from raycurate.training.bds_step import (
    StepContext,
    bds_batches,
    bds_step,
    bds_steps_per_epoch,
    bds_total_steps,
    check_bds_batches,
)
from raycurate.training.bookkeeping import StepBook
from raycurate.training.checkpoint import TrainState, save_checkpoint
from raycurate.training.collectives import all_reduce_sum, gathered_omega_digests
from raycurate.training.export import export_hf, run_metrics
from raycurate.training.protocol import TrainSession
from raycurate.training.session import build_resumed_engine

logger = logging.getLogger(__name__)


@dataclass
class BDSJob:
    """Everything a worker needs (pickled to the Ray Train workers).

    Attributes:
        cfg: theta's training config (engine, workers, lr, micro/effective batch, epochs, ...).
        bds: The bilevel settings (``bilevel:``: omega optimizer, rho schedule, val_batch, variant, seed, online
            importance weights and ``generation_every``, read only with a generation hook).
    """

    candidate_table: str
    validation_table: str
    init_model: str
    output_dir: str
    cfg: TrainConfig
    bds: BilevelConfig = field(default_factory=BilevelConfig)
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    adapter: dict[str, Any] | None = None


class GenerationHook(Protocol):
    """Online BMO extension point (Algorithm 1, lines 5-7), called on every rank before 0-based step ``s`` when
    ``(s + 1) % bilevel.generation_every == 0`` (the paper's ``k mod K_gen = 0`` with ``k = s + 1``).

    An implementation picks the masked questions (:func:`~raycurate.algorithms.bmo.masked_questions_fixed`, or
    ``masked_questions_dynamic(data_weights(omega), R)``), asks a generation pool for G responses each from the
    current policy (``module``: save its adapter where the pool can read it) and returns the pool's rows
    (``question_id``, ``response_ids``, ``token_logprobs``, ...) -- the same rows on every rank, e.g. generated on
    rank 0 and shared with :func:`~raycurate.training.collectives.broadcast_from_rank0` -- or None to keep the
    previous responses (:class:`raycurate.stages.bilevel.PoolGenerationHook` is the stages' implementation).  The
    loop then trains every masked question on its latest responses (eq. 9-10); see
    :class:`~raycurate.training.bds_online.OnlineResponses`.
    """

    def __call__(self, step: int, omega: np.ndarray, module: Any) -> list[dict] | None:
        """Generate for the masked questions; return the generation pool's rows or None."""


@dataclass
class LoopState:
    """Everything a checkpoint restores besides the engine."""

    train: TrainState
    omega: OmegaState
    curves: BDSCurves
    online: OnlineResponses | None = None


def restore_loop_state(path: str | None, train: TrainState, n: int, digest: str) -> LoopState:
    """The loop state of checkpoint folder ``path`` (None: a fresh run); ``train`` was read with the engine."""
    if path is None:
        return LoopState(train, OmegaState.fresh(n), BDSCurves())
    with open(os.path.join(path, BDS_STATE_FILE)) as f:
        curves = BDSCurves(**json.load(f))
    online_path = os.path.join(path, ONLINE_STATE_FILE)
    online = load_online(online_path) if os.path.exists(online_path) else None
    return LoopState(train, load_omega_state(os.path.join(path, OMEGA_STATE_FILE), digest), curves, online)


def _loop_state_writer(loop: LoopState, digest: str) -> Callable[[str], None]:
    """What rank 0 adds to a BDS checkpoint besides the engine and ``trainer_state.json``."""

    def write(ckpt_dir: str) -> None:
        with open(os.path.join(ckpt_dir, BDS_STATE_FILE), "w") as f:
            json.dump(dataclasses.asdict(loop.curves), f)
        save_omega_state(os.path.join(ckpt_dir, OMEGA_STATE_FILE), loop.omega, digest)
        if loop.online is not None:
            save_online(os.path.join(ckpt_dir, ONLINE_STATE_FILE), loop.online)

    return write


def _check_in_sync(digests: list[str], step: int) -> None:
    if len(set(digests)) != 1:
        raise RuntimeError(f"omega diverged across workers at step {step} (digests {digests}); this is a bug in the "
                           "BDS loop, please report it with the run's config.")


def _bds_metrics(job: BDSJob, loop: LoopState, digests: list[str], start_step: int, run_steps: int,
                 per_epoch: int, world: int, seconds: float, trainable: int) -> dict[str, Any]:
    metrics = run_metrics(job, loop.train, start_step, run_steps, per_epoch, world, seconds, trainable)
    sigma = bilevel.data_weights(loop.omega.omega)
    metrics.update({
        "method": "bds_online" if loop.online is not None else "bds",
        "variant": job.bds.variant,
        "omega_optimizer": job.bds.omega_optimizer,
        "omega_baseline": job.bds.omega_baseline,
        **{k: list(v) for k, v in dataclasses.asdict(loop.curves).items()},
        "masked_questions": len(loop.online.sequences) if loop.online is not None else 0,
        "omega_digests": digests,
        "sigma_min": float(sigma.min()),
        "sigma_max": float(sigma.max()),
    })
    return metrics


def _maybe_generate(hook: GenerationHook | None, ctx: StepContext, loop: LoopState, step: int,
                    cand_table: TokenTable) -> None:
    """Algorithm 1, lines 5-7: every K_gen steps, new responses (and pi_old) for the masked questions."""
    every = ctx.bds.generation_every
    if hook is None or not every or (step + 1) % every != 0:
        return
    rows = hook(step, loop.omega.omega.copy(), ctx.engine.module)
    if rows is not None:
        loop.online = ctx.online = online_from_rows(rows, cand_table, step)
    loop.curves.generation_steps.append(step)


def bds_train_loop(job: BDSJob, session: TrainSession, generation_hook: GenerationHook | None = None) -> dict:
    """The per-worker BDS loop: build, restore, alternate theta and omega steps, checkpoint, export.

    Args:
        job: Inputs, outputs and settings.
        session: Runtime (rank, world size, device, checkpoint restore/report).
        generation_hook: Online BMO: called every ``bilevel.generation_every`` steps (see :class:`GenerationHook`).

    Returns:
        The final metrics (same on every rank; rank 0 also writes them and ``weights.parquet`` to ``output_dir``).
    """
    import torch

    cfg, bds, device = job.cfg, job.bds, session.device
    accum = check_bds_batches(cfg, bds, session.world_size)
    val_batch, cand_batch = bds_batches(cfg, bds)
    torch.manual_seed(cfg.seed + session.rank)
    val_table, cand_table = load_token_table(job.validation_table), load_token_table(job.candidate_table)
    per_epoch = bds_steps_per_epoch(len(cand_table), cand_batch)
    run_steps = bds_total_steps(len(cand_table), cfg, bds)
    digest = ids_digest(cand_table.ids)
    with session.restore_dir() as ckpt_dir:
        engine, trainable, pad_id, train_state = build_resumed_engine(job, run_steps, session, ckpt_dir)
        loop = restore_loop_state(ckpt_dir, train_state, len(cand_table), digest)
    state, curves = loop.train, loop.curves
    if state.step > run_steps:
        raise ValueError(f"the checkpoint being resumed is at step {state.step}, beyond this run's {run_steps} steps; "
                         "raise train.max_steps, or delete the run's checkpoints to train from scratch")
    ctx = StepContext(engine, stack_tables(val_table, cand_table), len(val_table), len(cand_table), cfg, bds,
                      session.rank, session.world_size, device, pad_id, accum, loop.online)
    start_step, started = state.step, time.perf_counter()
    if session.rank == 0:
        logger.info("BDS (%s): %d candidates, %d validation rows, %d steps/epoch, steps %d -> %d, world %d",
                    bds.variant, len(cand_table), len(val_table), per_epoch, start_step, run_steps, session.world_size)
    # the clock plus the step cadence: a long epoch resumes mid-way
    book = StepBook(state, cfg, run_steps, per_epoch, accum * session.world_size, session.rank)

    def save() -> None:
        digests = gathered_omega_digests(loop.omega.omega, device)
        _check_in_sync(digests, state.step)
        metrics = _bds_metrics(job, loop, digests, start_step, run_steps, per_epoch, session.world_size,
                               time.perf_counter() - started, trainable)
        save_checkpoint(engine, session, loop.train, metrics, cfg, _loop_state_writer(loop, digest))

    for step in range(start_step, run_steps):
        _maybe_generate(generation_hook, ctx, loop, step, cand_table)
        step_started, step_lr = time.perf_counter(), engine.lr()
        loop.omega, stats = bds_step(ctx, loop.omega, step)
        loss_sum, val_sum, cand_sum, tokens, supervised, online, clock_due = all_reduce_sum(
            [stats.loss_sum, stats.val_loss_sum, stats.cand_loss_sum, stats.tokens, stats.supervised,
             stats.online_slots, book.clock.due_flag()], device)
        book.record(step, loss_sum=loss_sum, lr=step_lr, tokens=tokens, supervised=supervised,
                    examples=val_batch + cand_batch, started=step_started)
        curves.gamma_per_step.append(stats.gamma)
        curves.val_loss_per_step.append(val_sum / val_batch)
        curves.cand_loss_per_step.append(cand_sum / cand_batch)
        curves.omega_loss_per_step.append(stats.omega_loss_mean)
        curves.online_questions_per_step.append(int(online))
        if state.step % per_epoch == 0 or state.step == run_steps:
            loop.omega = loop.omega.snapshot(step // per_epoch, state.step)
        book.close(clock_due, save, ("val %.4f cand %.4f gamma %.3f",
                                     (curves.val_loss_per_step[-1], curves.cand_loss_per_step[-1], stats.gamma)))

    digests = gathered_omega_digests(loop.omega.omega, device)
    _check_in_sync(digests, state.step)
    metrics = _bds_metrics(job, loop, digests, start_step, run_steps, per_epoch, session.world_size,
                           time.perf_counter() - started, trainable)
    metrics["weights_file"] = WEIGHTS_FILE  # relative: an absolute path named the stage's temporary folder
    export_hf(engine, job, metrics, session)
    if session.rank == 0:
        write_weights(job.output_dir, cand_table.ids, loop.omega)
    session.report(metrics, None)
    return metrics
