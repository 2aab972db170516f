"""Resume, per-worker set-up and fault injection of a training loop, against the session protocol.

:class:`~raycurate.training.protocol.TrainSession` is the small runtime interface of a worker (rank, world size,
device, restore, report); ``raycurate.stages.train.RaySession`` implements it on Ray Train, tests with a double.
A resumed run recomputes the data order and starts at the next step (docs/design.md, "Layers").
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from typing import Any, Iterator

from raycurate.config.train import TrainConfig
from raycurate.training.checkpoint import TrainState, read_trainer_state
from raycurate.training.engines import build_model_engine
from raycurate.training.protocol import TrainSession

logger = logging.getLogger(__name__)

FAULT_ENV = "RAYCURATE_FAULT_KILL"
CHECKPOINT_PATTERN = re.compile(r"^checkpoint_step_(\d{8})$")  # Ray Train's folder names (checkpoint_dir_name)
PARTIAL_CHECKPOINT_PATTERN = re.compile(r"^\.checkpoint_step_\d{8}\.tmp-[0-9a-f]{8}$")  # a copy not renamed yet


def needs_universal_resume(saved: TrainState | None, cfg: TrainConfig, world_size: int) -> bool:
    """Whether resuming ``saved`` needs a universal checkpoint: DeepSpeed ZeRO-1/2/3 shards written by another
    worker count (DDP and ZeRO-0 checkpoints hold full, unpartitioned state that any worker count loads).

    Raises:
        ValueError: The checkpoint was written with another ZeRO stage (DeepSpeed 0.19's universal loader fails
            on that; the upgrade path is docs/design.md, "DeepSpeed version").
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
    if universal and saved is not None and session.rank == 0:
        logger.info("resuming a checkpoint written by %d workers on %d workers (ZeRO-%d universal checkpoint)",
                    saved.world_size, session.world_size, job.cfg.zero_stage)
    engine, trainable, pad_id = build_model_engine(job, run_steps, session.device, load_universal=universal)
    if ckpt_dir is None or saved is None:  # read_trainer_state: None exactly for a fresh run
        return engine, trainable, pad_id, TrainState()
    engine.load(ckpt_dir, session)
    return engine, trainable, pad_id, saved


def prepare_worker(job: Any) -> None:
    """Per-worker set-up of every training loop: logging and (on CPU) the worker's thread count."""
    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not job.use_gpu:
        torch.set_num_threads(worker_threads(job.cfg.threads_per_worker, job.cpus_per_worker))


def worker_threads(threads_per_worker: int | None, cpus_per_worker: float) -> int:
    """torch threads of a CPU worker: ``threads_per_worker``, with None = its reserved CPUs (at least 1) and 0 =
    the cores this process may run on that are idle when it starts (:func:`idle_cores`)."""
    if threads_per_worker is None:
        return max(1, int(cpus_per_worker))
    if threads_per_worker == 0:
        return idle_cores()
    return threads_per_worker


def idle_cores(sample_seconds: float = 0.5) -> int:
    """Usable cores minus the cores busy right now (rounded), at least 1.

    Busy cores are sampled from ``/proc/stat`` over ``sample_seconds`` (:func:`busy_cores`); where that file is
    missing, the 1-minute load average stands in.  Not the load average first: it trails by about a minute, so a
    training that starts right after the previous stage of the same job (an evaluation on both cores) saw that
    stage's load and took 1 thread on an idle machine (SmolLM2 LoRA, 4.2 s per step instead of 2.9 with 2).

    Why not every core: torch's intra-op threads spin and wait for each other, so on shared cores a step with more
    threads than idle cores collapses (a LoRA step on 2 cores at load ~8: 2 threads 21x slower than 1,
    ``benchmarks/bench_cpu_precision.py``), while on idle cores 2 threads are ~1.8x faster than 1.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    busy = busy_cores(sample_seconds)
    if busy is None:
        try:
            busy = os.getloadavg()[0]
        except (AttributeError, OSError):  # no load average on this platform either: assume idle
            busy = 0.0
    return max(1, min(cores, int(round(cores - busy))))


def busy_cores(sample_seconds: float) -> float | None:
    """Cores of the machine in use over the next ``sample_seconds`` (``/proc/stat``); None where it cannot be read."""
    first = cpu_times()
    if first is None:
        return None
    time.sleep(sample_seconds)
    second = cpu_times()
    return None if second is None else busy_from_cpu_times(first, second, os.cpu_count() or 1)


def cpu_times(path: str = "/proc/stat") -> tuple[int, int] | None:
    """(idle, total) CPU time of all cores since boot, in clock ticks (idle includes I/O wait); None if unreadable."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 5 or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal (guest is within user)
    return ticks[3] + ticks[4], sum(ticks)


def busy_from_cpu_times(first: tuple[int, int], second: tuple[int, int], cpus: int) -> float:
    """Busy cores between two :func:`cpu_times` readings: ``cpus x (1 - idle share of the elapsed ticks)``."""
    elapsed = second[1] - first[1]
    if elapsed <= 0:
        return 0.0
    return cpus * (1.0 - (second[0] - first[0]) / elapsed)


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


def checkpoint_dir_name(step: int) -> str:
    """``checkpoint_step_<8 digits>``: the checkpoint folder of optimizer step ``step`` (as reported to Ray Train)."""
    return f"checkpoint_step_{step:08d}"


def remove_partial_checkpoints(run_dir: str) -> list[str]:
    """Delete the hidden ``.checkpoint_step_<8 digits>.tmp-<8 hex>`` copies of a killed save; returns their names."""
    partial = sorted(name for name in os.listdir(run_dir) if PARTIAL_CHECKPOINT_PATTERN.match(name))
    for name in partial:
        shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)
    if partial:
        logger.info("removed %d partial checkpoint copies of a killed save in %s: %s", len(partial), run_dir, partial)
    return partial


class TaskSession:
    """:class:`TrainSession` of a single process (rank 0 of 1) that keeps its checkpoints in ``run_dir``.

    Checkpoints are ``run_dir/checkpoint_step_<8 digits>`` (Ray Train's folder naming), each copied to a hidden
    temp folder and renamed into place, so a folder with that name is always complete; the newest
    ``keep_checkpoints`` are kept.  A killed and re-run task resumes from the newest one; the hidden copies a killed
    task left behind are removed when the next session on ``run_dir`` starts (one training writes a run_dir).

    Args:
        run_dir: The run's checkpoint folder (``storage_dir/name``); created when missing.
        keep_checkpoints: Most recent checkpoints kept.
        use_gpu: Train on ``cuda`` (the task's one GPU) instead of the CPU.
    """

    rank, local_rank, world_size = 0, 0, 1

    def __init__(self, run_dir: str, keep_checkpoints: int, use_gpu: bool = False) -> None:
        import torch

        self.run_dir, self.keep = os.path.abspath(run_dir), keep_checkpoints
        self.device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")
        os.makedirs(self.run_dir, exist_ok=True)
        remove_partial_checkpoints(self.run_dir)

    def checkpoints(self) -> list[str]:
        """The complete checkpoint folders, oldest first (by step)."""
        steps = sorted(int(m.group(1)) for m in map(CHECKPOINT_PATTERN.match, os.listdir(self.run_dir)) if m)
        return [os.path.join(self.run_dir, checkpoint_dir_name(step)) for step in steps]

    @contextlib.contextmanager
    def restore_dir(self) -> Iterator[str | None]:
        saved = self.checkpoints()
        yield saved[-1] if saved else None

    latest_checkpoint_dir = restore_dir  # reports are synchronous: the newest folder is the last reported one

    def report(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
        """Copy ``checkpoint_dir`` to ``checkpoint_step_<metrics["step"]>`` atomically and prune old ones."""
        if checkpoint_dir is None:
            return
        final = os.path.join(self.run_dir, checkpoint_dir_name(metrics["step"]))
        tmp = os.path.join(self.run_dir, f".{os.path.basename(final)}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            shutil.copytree(checkpoint_dir, tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if os.path.exists(final):  # the same step written again (a re-run that re-trains it): the new one wins
            shutil.rmtree(final)
        os.rename(tmp, final)
        for old in self.checkpoints()[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def scoped_env(env: dict[str, str]) -> Iterator[None]:
    """Set ``env`` in ``os.environ`` and restore the previous values on exit (for a process that runs many tasks)."""
    previous = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def single_rank_process_group(use_gpu: bool) -> Iterator[None]:
    """A 1-rank torch.distributed group (gloo, or nccl on GPU) for the engines, destroyed on exit.

    Nothing is done when a group already exists.  The group rendezvouses through a private file, so concurrent
    tasks on one node never race for a port; the launcher variables DeepSpeed reads (``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) are set for the duration.  Teardown goes through DeepSpeed's
    ``destroy_process_group`` when DeepSpeed used the group, which also drops the groups DeepSpeed cached, so the
    next task in the same process starts clean.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    launcher_env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": "29500"}  # read, never bound: the group is initialised through the file
    with tempfile.TemporaryDirectory(prefix="raycurate-pg-") as tmp, scoped_env(launcher_env):
        dist.init_process_group("nccl" if use_gpu else "gloo", init_method=f"file://{tmp}/rendezvous", rank=0,
                                world_size=1)
        try:
            yield
        finally:
            _destroy_process_group()


def _destroy_process_group() -> None:
    import torch.distributed as dist

    ds_comm = sys.modules.get("deepspeed.comm")
    if ds_comm is not None and ds_comm.is_initialized():
        ds_comm.destroy_process_group()
    elif dist.is_initialized():
        dist.destroy_process_group()
