"""Data order, step counts and the checkpoint cadence of a training run (numpy/math, plus the wall clock of
:class:`CheckpointClock`; the LR schedule is :func:`raycurate.models.optim.cosine_with_warmup`).

Rows are sorted by ``id`` (file layout does not matter), then epoch ``e`` uses the permutation
``np.random.default_rng([seed, e])``.  Optimizer step ``s`` of the epoch takes the permuted rows ``[s*E, (s+1)*E)``
(``E`` = effective batch); micro-step ``k`` of rank ``r`` takes the ``micro_batch_size`` rows at ``[s, k, r]`` of
that block reshaped to (steps, accum, world, micro).  The remainder ``num_rows mod E`` of each epoch's permutation
is not trained on in that epoch; because the permutation changes per epoch, no row is left out systematically.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from raycurate.config.train import TrainConfig


def steps_per_epoch(num_rows: int, effective_batch_size: int) -> int:
    """Optimizer steps in one epoch (the remainder of ``num_rows / effective_batch_size`` is not used).

    Raises:
        ValueError: When the table holds fewer rows than one effective batch.
    """
    steps = num_rows // effective_batch_size
    if steps == 0:
        raise ValueError(
            f"The training table has {num_rows} rows, fewer than one effective batch "
            f"(train.effective_batch_size={effective_batch_size}); lower effective_batch_size or add data."
        )
    return steps


def total_steps(num_rows: int, cfg: TrainConfig) -> int:
    """Optimizer steps of the whole run: ``epochs * steps_per_epoch``, capped by ``max_steps``."""
    steps = cfg.epochs * steps_per_epoch(num_rows, cfg.effective_batch_size)
    return steps if cfg.max_steps is None else min(steps, cfg.max_steps)


def epoch_order(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    """Row permutation of one epoch, a pure function of ``(seed, epoch)``.

    Returns:
        (num_rows,) int64 permutation.
    """
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


def micro_batch_rows(
    order: np.ndarray, world_size: int, micro_batch_size: int, accum: int
) -> np.ndarray:
    """Split an epoch's permutation into equal per-rank micro-batches.

    Args:
        order: (N,) row permutation of the epoch.
        world_size: Data-parallel ranks.
        micro_batch_size: Rows per micro-batch.
        accum: Micro-steps per optimizer step.

    Returns:
        (S, accum, world_size, micro_batch_size) row indices, ``S = N // (accum * world_size * micro_batch_size)``;
        ``[s, k, r]`` is rank ``r``'s micro-batch ``k`` of optimizer step ``s``.
    """
    per_step = accum * world_size * micro_batch_size
    steps = len(order) // per_step
    return order[: steps * per_step].reshape(steps, accum, world_size, micro_batch_size)


def should_checkpoint(done: int, run_steps: int, per_epoch: int, every: int | None) -> bool:
    """Whether to checkpoint after ``done`` optimizer steps: every ``every`` steps (None: at each epoch's end),
    and always after the run's last step (so a later run with a larger ``max_steps`` can extend it)."""
    if done == run_steps:
        return True
    return done % every == 0 if every is not None else done % per_epoch == 0


class CheckpointClock:
    """Wall-clock checkpoint cadence (``train.checkpoint_every_minutes``), on top of the step cadence.

    A one-epoch run checkpoints only at its end under the step cadence, so a run killed at step 30 of 62 restarted
    from step 0.  Each rank reads its own clock; the loop sums :meth:`due_flag` over ranks with the step's
    loss all-reduce, so every rank takes the same decision (a checkpoint is a collective save).
    """

    def __init__(self, every_minutes: float | None, now: Callable[[], float] = time.monotonic):
        self.every_seconds = None if every_minutes is None else 60.0 * every_minutes
        self.now = now
        self.last = now()

    def due_flag(self) -> float:
        """1.0 when ``every_minutes`` have passed since the last checkpoint on this rank, else 0.0."""
        return float(self.every_seconds is not None and self.now() - self.last >= self.every_seconds)

    def saved(self) -> None:
        """Restart the interval (call after every checkpoint, whatever triggered it)."""
        self.last = self.now()
