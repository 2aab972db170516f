"""ZeRO checkpoints beyond DeepSpeed's own save/load: consolidation to a full state dict, conversion to a universal
checkpoint (resume on another worker count), and the repairs DeepSpeed 0.19's universal loader needs.

The resume procedure, the version pin and the upgrade path (which repair to drop after an upgrade, what to re-test)
are docs/design.md, "DeepSpeed version".
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from typing import Any, Iterator

from raycurate.training.protocol import TrainSession

logger = logging.getLogger(__name__)

DS_TAG = "deepspeed"
"""The DeepSpeed checkpoint tag (sub-folder) of every checkpoint this package writes."""


def repair_zero3_universal_load(zero_optimizer: Any, weight_decays: list[float]) -> None:
    """Undo two defects of DeepSpeed 0.19's ZeRO-3 universal-checkpoint loader (``load_hp_checkpoint_state_from_
    checkpoint_dir_stage3``), so a resume on another worker count continues the exact trajectory.

    * It stores *one* ``step`` tensor object in the optimizer state of every fp32 sub-group; torch's AdamW
      increments ``step`` in place once per sub-group, so the shared counter advanced several times per optimizer
      step and every later bias correction was wrong (measured: weights off by ~5% of a step after 2 steps).
    * It copies the first parameter group's hyper-parameters into every group, so the no-decay group (norms,
      biases) would get the decay group's ``weight_decay``.

    Args:
        zero_optimizer: ``DeepSpeedEngine.optimizer`` (``DeepSpeedZeroOptimizer_Stage3``) after the load.
        weight_decays: Per parameter group, the weight decay the run was built with.
    """
    import torch

    base = zero_optimizer.optimizer
    for flat in getattr(zero_optimizer, "fp32_partitioned_groups_flat", []):
        state = base.state.get(flat, {})
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    for group, weight_decay in zip(base.param_groups, weight_decays):
        group["weight_decay"] = weight_decay


def consolidate_zero_checkpoint(ckpt_dir: str, dtype: Any = None) -> dict[str, Any]:
    """Full model state dict from a checkpoint folder holding every rank's ZeRO shards (``zero_to_fp32``).

    Args:
        ckpt_dir: A checkpoint folder a training stage reported (``<ckpt_dir>/deepspeed/*_optim_states.pt``).
        dtype: Cast every tensor to this dtype (None keeps fp32).

    Returns:
        Parameter name -> tensor (frozen parameters included), on CPU.
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, tag=DS_TAG)
    return {k: v if dtype is None else v.to(dtype) for k, v in state.items()}


def node_private_dir(session: TrainSession) -> str:
    """Collective: a fresh private folder (``mkdtemp``: unpredictable name, mode 0700, never an existing one) made
    by local rank 0 of each node; every rank gets its own node's folder."""
    import socket

    import torch.distributed as dist

    mine = tempfile.mkdtemp(prefix="raycurate-universal-") if session.local_rank == 0 else None
    if not dist.is_initialized():
        assert mine is not None
        return mine
    host = socket.gethostname()
    entries: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(entries, (host, mine))
    return next(path for node, path in entries if node == host and path is not None)


def convert_to_universal(ckpt_dir: str, dest_parent: str) -> str:
    """Convert ``<ckpt_dir>/deepspeed`` with DeepSpeed's ``ds_to_universal`` into ``<dest_parent>/deepspeed``.

    The conversion runs in a subprocess (the CLI is DeepSpeed's stable interface) into a temp folder that is
    renamed into place, so a crash never leaves a half-converted checkpoint.

    Returns:
        ``dest_parent`` (load it with ``tag="deepspeed"`` and ``checkpoint.load_universal``).

    Raises:
        RuntimeError: When ``ds_to_universal`` fails (its stderr tail is in the message).
    """
    import subprocess
    import sys

    final = os.path.join(dest_parent, DS_TAG)
    if os.path.isdir(final):
        return dest_parent
    os.makedirs(dest_parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".universal-", dir=dest_parent)
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
               os.path.join(ckpt_dir, DS_TAG), "--output_folder", os.path.join(tmp, DS_TAG),
               "--num_extract_workers", "1", "--num_merge_workers", "1", "--no_strict"]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR":
                          os.environ.get("DS_ACCELERATOR", "cpu")})
    if done.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"ds_to_universal failed on {ckpt_dir} (exit {done.returncode}); resume with the worker "
                           f"count and ZeRO stage that wrote it instead.\n{done.stderr[-4000:]}")
    os.replace(os.path.join(tmp, DS_TAG), final)
    shutil.rmtree(tmp, ignore_errors=True)
    return dest_parent


@contextlib.contextmanager
def universal_checkpoint(ckpt_dir: str, session: TrainSession) -> Iterator[str]:
    """Collective: local rank 0 of each node converts ``ckpt_dir`` to a universal checkpoint; yields its folder."""
    import torch.distributed as dist

    dest = node_private_dir(session)
    if session.local_rank == 0:
        logger.info("converting %s to a universal checkpoint in %s", ckpt_dir, dest)
        convert_to_universal(ckpt_dir, dest)
    if dist.is_initialized():
        dist.barrier()
    try:
        yield dest
    finally:
        if dist.is_initialized():
            dist.barrier()
        if session.local_rank == 0:
            shutil.rmtree(dest, ignore_errors=True)
