"""Collectives of the training loops over the worker process group (each an identity without one)."""

from __future__ import annotations

from typing import Any

import numpy as np

from raycurate.training.bds_state import omega_digest


def all_reduce_sum(values: list[float], device: Any) -> list[float]:
    """Sum ``values`` over ranks (float64; identity without a process group)."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor.tolist()


def all_gather_pairs(idx: np.ndarray, losses: np.ndarray, device: Any) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate every rank's (index, loss) pairs in rank order; identity without a process group.

    Args:
        idx: (b,) this rank's candidate indices (the same b on every rank).
        losses: (b,) their losses.
        device: Tensor device of the process group's backend.

    Returns:
        (world * b,) int64 indices and (world * b,) float64 losses, identical on every rank.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return np.asarray(idx, dtype=np.int64), np.asarray(losses, dtype=np.float64)
    # float64 holds both exactly: indices < 2**53 and float32 losses.
    mine = torch.tensor(np.stack([np.asarray(idx, np.float64), np.asarray(losses, np.float64)]), device=device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    both = torch.cat(parts, dim=1).cpu().numpy()  # (2, world * b)
    return both[0].astype(np.int64), both[1]


def broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (for a generation hook that generates on rank 0 only); identity alone."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gathered_omega_digests(omega: np.ndarray, device: Any) -> list[str]:
    """Every rank's :func:`omega_digest`, in rank order (collective)."""
    import torch
    import torch.distributed as dist

    mine = omega_digest(omega)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    tensor = torch.tensor([float(int(mine, 16))], dtype=torch.float64, device=device)
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    return [f"{int(p.item()):013x}" for p in parts]
