"""The one checkpoint writer/reader of the SFT and BDS loops.

A checkpoint is taken after an optimizer step (always at an accumulation boundary).  Every rank writes its engine
files (its own ZeRO shards, or rank 0 the full DDP state) into a private temp folder and reports it through the
session; the runtime (Ray Train) puts all ranks' files into one checkpoint folder.  Rank 0 adds
``trainer_state.json`` (:class:`TrainState`, stamped with the world size and ZeRO stage that wrote it) and whatever
the loop's own state writer adds (BDS: omega, curves, online responses).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable

from raycurate.config.train import TrainConfig
from raycurate.training.protocol import TrainSession

TRAINER_STATE_FILE = "trainer_state.json"


@dataclass
class TrainState:
    """Progress that survives a resume (saved as ``trainer_state.json`` in every checkpoint)."""

    step: int = 0
    loss_per_step: list[float] = field(default_factory=list)
    lr_per_step: list[float] = field(default_factory=list)
    tokens: int = 0
    supervised_tokens: int = 0
    examples: int = 0
    seconds: float = 0.0
    world_size: int = 0  # of the run that wrote the checkpoint (0: unknown)
    zero_stage: int | None = None  # likewise; None for DDP


def write_trainer_state(ckpt_dir: str, state: TrainState, session: TrainSession, cfg: TrainConfig) -> None:
    """``trainer_state.json``, stamped with the world size and ZeRO stage that wrote the checkpoint."""
    state.world_size = session.world_size
    state.zero_stage = cfg.zero_stage if cfg.engine == "deepspeed" else None
    with open(os.path.join(ckpt_dir, TRAINER_STATE_FILE), "w") as f:
        json.dump(dataclasses.asdict(state), f)


def read_trainer_state(ckpt_dir: str | None) -> TrainState | None:
    """The ``trainer_state.json`` of a checkpoint folder, or None for a fresh run."""
    if ckpt_dir is None:
        return None
    with open(os.path.join(ckpt_dir, TRAINER_STATE_FILE)) as f:
        return TrainState(**json.load(f))


def save_checkpoint(engine: Any, session: TrainSession, state: TrainState, metrics: dict[str, Any],
                    cfg: TrainConfig, write_extra: Callable[[str], None] | None = None) -> None:
    """Collective: write this rank's checkpoint files and report them with ``metrics``.

    Args:
        engine: The training engine (``save(ckpt_dir, rank)``).
        session: The runtime; its ``report`` is a barrier over ranks.
        state: Progress to store as ``trainer_state.json`` (rank 0).
        metrics: Metrics reported with the checkpoint (``metrics["step"]`` names it).
        cfg: Training config (stamps the ZeRO stage).
        write_extra: Called on rank 0 with the checkpoint folder to add the loop's own files.
    """
    ckpt_dir = tempfile.mkdtemp(prefix=f"raycurate-ckpt-r{session.rank}-")
    try:
        engine.save(ckpt_dir, session.rank)
        if session.rank == 0:
            write_trainer_state(ckpt_dir, state, session, cfg)
            if write_extra is not None:
                write_extra(ckpt_dir)
        session.report(metrics, ckpt_dir if os.listdir(ckpt_dir) else None)
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
