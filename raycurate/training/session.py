"""The session protocol a training loop runs against, resume, per-worker set-up and fault injection.

:class:`TrainSession` is the small runtime interface of a worker (rank, world size, device, restore, report).
``raycurate.stages.train.RaySession`` implements it on Ray Train; that implementation stays in the stages layer
because it is the only part that needs ``ray.train``.  Tests run the same loops in-process with a double.

Resume: a checkpoint stores the optimizer step it was taken after; a resumed run recomputes the same data order and
starts at the next step, so it sees exactly the data an uninterrupted run would.  The LR schedule is a function of
the *current* run's total steps, so extending a run changes the remaining schedule.
"""

from __future__ import annotations

import logging
import os
from typing import Any, ContextManager, Protocol

from raycurate.config.train import TrainConfig
from raycurate.training.checkpoint import TrainState, read_trainer_state
from raycurate.training.engines import build_model_engine

logger = logging.getLogger(__name__)

FAULT_ENV = "RAYCURATE_FAULT_KILL"


class TrainSession(Protocol):
    """What the training loop needs from its runtime (Ray Train, or an in-process test double)."""

    rank: int
    local_rank: int
    world_size: int
    device: Any

    def restore_dir(self) -> ContextManager[str | None]:
        """Directory of the checkpoint to resume from, or None for a fresh run."""

    def latest_checkpoint_dir(self) -> ContextManager[str | None]:
        """Directory of the newest checkpoint (every rank's files): the last one reported, else the restored one."""

    def report(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
        """Report metrics (and this rank's checkpoint files); a barrier over ranks."""


def needs_universal_resume(saved: TrainState | None, cfg: TrainConfig, world_size: int) -> bool:
    """Whether resuming ``saved`` needs a universal checkpoint: DeepSpeed ZeRO-1/2/3 shards written by another
    worker count (DDP and ZeRO-0 checkpoints hold full, unpartitioned state that any worker count loads).

    Raises:
        ValueError: The checkpoint was written with another ZeRO stage (DeepSpeed 0.19's universal loader fails
            on that; see :mod:`raycurate.training.zero_checkpoint` for the upgrade path).
    """
    if saved is None or cfg.engine != "deepspeed" or saved.world_size == 0:  # 0: written before this was recorded
        return False
    if saved.zero_stage is not None and saved.zero_stage != cfg.zero_stage:
        raise ValueError(f"the checkpoint being resumed was written with ZeRO-{saved.zero_stage}; resume it with "
                         f"train.zero_stage={saved.zero_stage} (not {cfg.zero_stage}), or delete the stage's "
                         "_scratch folder to train from scratch")
    return cfg.zero_stage != 0 and saved.world_size != world_size


def build_resumed_engine(job: Any, run_steps: int, session: TrainSession,
                         ckpt_dir: str | None) -> tuple[Any, int, int, TrainState]:
    """Build the engine for ``job`` and restore it from ``ckpt_dir`` (None: a fresh run).

    Returns:
        (engine, trainable parameter count, pad token id, the restored :class:`TrainState`).
    """
    saved = read_trainer_state(ckpt_dir)
    universal = needs_universal_resume(saved, job.cfg, session.world_size)
    if universal and session.rank == 0:
        logger.info("resuming a checkpoint written by %d workers on %d workers (ZeRO-%d universal checkpoint)",
                    saved.world_size, session.world_size, job.cfg.zero_stage)
    engine, trainable, pad_id = build_model_engine(job, run_steps, session.device, load_universal=universal)
    if ckpt_dir is None:
        return engine, trainable, pad_id, TrainState()
    engine.load(ckpt_dir, session)
    return engine, trainable, pad_id, saved


def prepare_worker(job: Any) -> None:
    """Per-worker set-up of every training loop: logging and (on CPU) the worker's thread count."""
    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not job.use_gpu:
        torch.set_num_threads(max(1, int(job.cpus_per_worker)))


def maybe_inject_fault(session: TrainSession, step: int) -> None:
    """Fault injection for failure tests: ``RAYCURATE_FAULT_KILL=rank:step:marker`` hard-kills that rank once
    after that optimizer step (the marker file records that it already happened, so the restart survives).

    Before dying it waits until the runtime has committed every checkpoint reported so far: Ray Train registers a
    report asynchronously, and a worker lost right after a report restarts from the previous committed one.
    """
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    kill_rank, kill_step, marker = spec.split(":", 2)
    rank = session.rank
    if rank == int(kill_rank) and step == int(kill_step) and not os.path.exists(marker):
        with session.latest_checkpoint_dir():
            pass
        with open(marker, "w") as f:
            f.write(f"killed rank {rank} after step {step}\n")
        logger.warning("fault injection: killing rank %d after step %d", rank, step)
        os._exit(1)
