"""A single-process stand-in for Ray Train's session, shared by the in-process training-loop tests."""

from __future__ import annotations

import contextlib
import os
import shutil

import torch


class Crash(RuntimeError):
    """The simulated worker failure raised by :class:`LocalSession`."""


class LocalSession:
    """Keeps reported checkpoints in ``store`` (one folder per step); can crash after the n-th one."""

    rank, world_size, device = 0, 1, torch.device("cpu")

    def __init__(self, store: str, crash_after_checkpoints: int | None = None) -> None:
        self.store, self.crash_after = store, crash_after_checkpoints
        self.reports: list[dict] = []
        os.makedirs(store, exist_ok=True)

    @contextlib.contextmanager
    def restore_dir(self):
        saved = sorted(os.listdir(self.store))
        yield os.path.join(self.store, saved[-1]) if saved else None

    def report(self, metrics, checkpoint_dir):
        self.reports.append(metrics)
        if checkpoint_dir is not None:
            shutil.copytree(checkpoint_dir, os.path.join(self.store, f"step_{metrics['step']:05d}"))
            if self.crash_after is not None and len(os.listdir(self.store)) == self.crash_after:
                raise Crash("simulated worker failure")
