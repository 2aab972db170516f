"""Time a tiny SFT stage launched with ``train.launcher=task`` against ``train.launcher=ray_train``.

Setup: a local Ray instance (``--cpus`` CPUs), the 2-layer test Llama (vocab 64) and 16 random rows; each launch is
a full :func:`raycurate.stages.train.run_sft` of ``--steps`` DDP steps on one worker (micro-batch 2, effective 4)
into a fresh storage folder, so the difference is the launch: a TorchTrainer worker group (controller, worker
actor, process group, imports) versus one Ray task in a process Ray keeps for later tasks.  Runs alternate between
the two launchers (the machine is shared); the reported time is the median of ``--repeats`` runs each.  The first
task run pays its process's torch/transformers imports, the later ones reuse the process.  Usage::

    python benchmarks/bench_launch.py [--repeats 2] [--steps 2] [--cpus 2]

The last line is ``task_launch_seconds=... ray_train_launch_seconds=... ratio=...`` (ratio = task / ray_train).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def write_token_table(path: str, rows: int = 16) -> str:
    """``rows`` random examples (8-12 tokens, a 3-token prompt) in the token-table format."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from train_helpers import VOCAB

    rng = np.random.default_rng(0)
    tokens = [[1, *rng.integers(3, VOCAB, size=int(rng.integers(6, 11))).tolist(), 2] for _ in range(rows)]
    pq.write_table(pa.table({
        "id": [f"ex{i:03d}" for i in range(rows)],
        "input_ids": pa.array(tokens, type=pa.list_(pa.int32())),
        "loss_mask": pa.array([[0] * 3 + [1] * (len(t) - 3) for t in tokens], type=pa.list_(pa.int8())),
    }), path)
    return path


def timed_launch(launcher: str, table: str, model: str, root: str, run: int, steps: int) -> float:
    """Seconds of one ``run_sft`` with ``launcher`` (fresh output and storage folders)."""
    from raycurate.config.train import TrainConfig
    from raycurate.stages.train import run_sft

    cfg = TrainConfig(launcher=launcher, engine="ddp", num_workers=1, micro_batch_size=2, effective_batch_size=4,
                      max_steps=steps, lr=1e-2)
    out = os.path.join(root, f"{launcher}_{run}")
    started = time.perf_counter()
    metrics = run_sft(table, model, os.path.join(out, "model"), cfg, storage_dir=os.path.join(out, "storage"),
                      name="sft")
    seconds = time.perf_counter() - started
    assert metrics["steps"] == steps
    print(f"{launcher} run {run}: {seconds:.1f} s (train loop {metrics['seconds']:.2f} s)", flush=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--cpus", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from train_helpers import write_tiny_llama

    from raycurate.stages.runtime import init_ray

    init_ray(num_cpus=args.cpus)
    times: dict[str, list[float]] = {"task": [], "ray_train": []}
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as root:
        model = write_tiny_llama(os.path.join(root, "tiny_llama"))
        table = write_token_table(os.path.join(root, "train.parquet"))
        for run in range(args.repeats):
            for launcher in times:
                times[launcher].append(timed_launch(launcher, table, model, root, run, args.steps))
    task, ray_train = statistics.median(times["task"]), statistics.median(times["ray_train"])
    print(f"task_launch_seconds={task:.1f} ray_train_launch_seconds={ray_train:.1f} ratio={task / ray_train:.2f}")


if __name__ == "__main__":
    main()
