"""The runtime interface a training worker runs against: :class:`TrainSession`.

It sits below every other training module (engines, checkpoints, ZeRO conversion, export and the session helpers
all take a session), so none of them has to import :mod:`raycurate.training.session` for the type.
``raycurate.stages.train.RaySession`` implements it on Ray Train; tests use in-process doubles.
"""

from __future__ import annotations

from typing import Any, ContextManager, Protocol


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
