"""One small `raycurate demo` (sft + BRIDGE with the random and token_cleaning baselines: six trainings, each one
reused Ray task with ``train.launcher=task``; the Ray Train worker-group path is tested in test_train_stage.py),
run once per session by the ``tiny_demo`` fixture (conftest.py) and shared by the slow tests that read it or re-run
it with a changed setting; those re-run a copy."""

from __future__ import annotations

import shutil
from pathlib import Path

TINY_DEMO_OVERRIDES = [
    "data.corpus_rows=160", "data.heldout_rows=10", "model.pretrain_steps=10", "model.pretrain_rows=300",
    "train.max_steps=2", "eval.max_new_tokens=8", "run.progress=false", "train.micro_batch_size=2",
    "train.effective_batch_size=4", "bridge.diagnostics_rows=4", "bridge.baselines=[random,token_cleaning]",
    "demo.methods=[sft,bridge]", "train.num_workers=1", "train.launcher=task",
]


def tiny_demo_args(run_dir: Path, cache_dir: Path, *extra: str) -> list[str]:
    """``raycurate demo`` arguments of the shared tiny demo, writing to ``run_dir``."""
    return ["demo", "--out", str(run_dir), *TINY_DEMO_OVERRIDES, f"model.cache_dir={cache_dir}", *extra]


def copy_tiny_demo(tiny_demo: tuple, dest: Path) -> list[str]:
    """Copy the shared tiny demo's run directory to ``dest``; returns the arguments that re-run the copy."""
    run_dir, cache_dir, _ = tiny_demo
    shutil.copytree(run_dir, dest)
    return tiny_demo_args(dest, cache_dir)
