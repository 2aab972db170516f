"""The per-step bookkeeping of the SFT and BDS loops (:class:`StepBook`): the :class:`TrainState` counters, the
rank-0 log line and the checkpoint cadence (steps, epoch ends, the last step, the wall clock).

Next: :mod:`raycurate.training.checkpoint` (what a checkpoint holds), :mod:`raycurate.training.order` (cadences).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from raycurate.config.train import TrainConfig
from raycurate.training.checkpoint import TrainState
from raycurate.training.order import CheckpointClock, should_checkpoint

logger = logging.getLogger(__name__)


@dataclass
class StepBook:
    """What a training loop records after each optimizer step; built right before the loop (the clock starts).

    Attributes:
        state: The run's progress, updated in place (checkpoints save it).
        cfg: Training config (``log_every_steps``, ``checkpoint_every_steps``, ``checkpoint_every_minutes``).
        run_steps: The run's last step.
        per_epoch: Optimizer steps per epoch (the default checkpoint cadence).
        micro_steps: Loss terms summed into a step's loss over all ranks (accumulation steps x world size).
        rank: This worker's rank (rank 0 logs).
        clock: The wall-clock checkpoint cadence; sum :meth:`CheckpointClock.due_flag` over ranks with the step.
    """

    state: TrainState
    cfg: TrainConfig
    run_steps: int
    per_epoch: int
    micro_steps: int
    rank: int
    clock: CheckpointClock = field(init=False)

    def __post_init__(self) -> None:
        self.clock = CheckpointClock(self.cfg.checkpoint_every_minutes)

    def record(self, step: int, *, loss_sum: float, lr: float, tokens: float, supervised: float, examples: int,
               started: float) -> None:
        """Count 0-based step ``step`` into the state.

        Args:
            step: The step just taken.
            loss_sum: Sum over all ranks and micro-steps of the micro-batch losses.
            lr: Learning rate the step used (read before it).
            tokens: Attention tokens of the step (all ranks; an all-reduced sum, counted as ``int``).
            supervised: Supervised target tokens of the step (all ranks; likewise).
            examples: Rows of the step (all ranks).
            started: ``time.perf_counter()`` when the step began.
        """
        state = self.state
        state.step = step + 1
        state.loss_per_step.append(loss_sum / self.micro_steps)
        state.lr_per_step.append(lr)
        state.tokens += int(tokens)
        state.supervised_tokens += int(supervised)
        state.examples += examples
        state.seconds += time.perf_counter() - started

    def close(self, clock_due: float, save: Callable[[], None], log: tuple[str, tuple[Any, ...]]) -> None:
        """After :meth:`record` (and the loop's own records): log on rank 0, checkpoint when due.

        Args:
            clock_due: The all-reduced :meth:`CheckpointClock.due_flag` of the step (> 0: some rank's clock is due).
            save: Writes the checkpoint (collective: every rank calls it at the same steps).
            log: ``(format, args)`` appended to rank 0's ``step i/n loss x`` line.
        """
        state = self.state
        if self.rank == 0 and (state.step % self.cfg.log_every_steps == 0 or state.step == self.run_steps):
            fmt, args = log
            logger.info("step %d/%d loss %.4f " + fmt, state.step, self.run_steps, state.loss_per_step[-1], *args)
        if should_checkpoint(state.step, self.run_steps, self.per_epoch, self.cfg.checkpoint_every_steps) \
                or clock_due > 0:
            save()
            self.clock.saved()
