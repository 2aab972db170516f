#!/usr/bin/env python
"""Node loss on a multi-node Ray cluster on this machine: a worker node dies during BRIDGE scoring or SFT.

Usage::

    .venv/bin/python scripts/node_loss.py scoring    --out /tmp/node_loss_scoring
    .venv/bin/python scripts/node_loss.py warm_tasks --out /tmp/node_loss_warm_tasks
    .venv/bin/python scripts/node_loss.py ray_data   --out /tmp/node_loss_ray_data
    .venv/bin/python scripts/node_loss.py training   --out /tmp/node_loss_training
    .venv/bin/python scripts/node_loss.py scoring warm_tasks training:task:1 --out /tmp/node_loss_some

Each scenario starts a :class:`ray.cluster_utils.Cluster` on loopback: a head node with 0 CPUs (the driver, the
GCS and Ray Train's controller, which Ray pins to the driver's node) and two worker nodes with 1 CPU each, so every
actor and Ray Train worker runs on a worker node.  It runs the stage twice with the committed embedded model:

* ``baseline/``: uninterrupted;
* ``killed/``: the stage's code holds at a known point and writes ``hold.json`` (its node id and pid); a driver
  thread waits for that file and removes that worker node (SIGKILL of its raylet, object store and workers:
  ``Cluster.remove_node(node, allow_graceful=False)``).  Nothing else differs between the two runs.

``scoring``: ``bridge_score`` (:func:`raycurate.stages.bridge.score_stage`, the executor's sharded map: an actor
pool of 1 actor, 4 shards of 2 rows) holds in its 2nd UDF call (shard 1; shard 0 is written).
Ray restarts the actor on the other node (``max_restarts``) and retries its queued shard tasks
(``max_task_retries``); the stage finishes in the same call.

``warm_tasks``: :func:`~raycurate.stages.executor.map_model_over_rows` of in-memory rows (the held-out
evaluation's runtime, the executor's task back-end: one streaming Ray task over 4 groups of 2 rows, with a
model-free stand-in UDF) holds in group 2.  Ray retries the task on the other node (tasks' default
``max_retries``); the retried generator starts again at group 1 and Ray drops the outputs the driver already has,
so every row comes back once.

``ray_data``: :func:`~raycurate.stages.executor.map_model_over_rows` of a ``ray.data.Dataset`` (the runtime of
tokenize and the other Ray Data stages: 1 actor, 4 batches of 2 rows, order preserved, the same stand-in UDF)
holds in batch 2.  Ray Data's actor pools restart actors and retry their tasks by default; the map returns every
row once, in order.

``training``: ``run_sft`` (``train.launcher=ray_train``, 1 DDP worker, 4 steps, a checkpoint every 2 steps,
``train.max_failures=1``) holds after step 3, once the step-2 checkpoint is committed.  Ray Train's
``FailureConfig`` restarts the worker group on the other node, which resumes from the step-2 checkpoint.  With
``--max-failures 0`` (the default of ``train.max_failures``) the run fails instead, and a second ``run_sft`` on the
same storage folder (what re-running the stage does) resumes from the step-2 checkpoint.  ``--launcher task``
runs the same with ``train.launcher=task`` (one Ray task, ``max_retries = train.max_failures``).

Writes ``<out>/summary.json`` (timings, which node ran what, the killed node) and prints it;
``tests/test_node_loss.py`` runs this script and compares ``killed/`` with ``baseline/`` file by file.

Several scenarios in one call (``training:<launcher>:<max_failures>`` names a training variant) run one after
another on one cluster, each in ``<out>/<scenario>/`` with its own ``summary.json``: before each scenario the
driver adds worker nodes until two are alive again (the previous scenario removed one), so a scenario sees the same
two 1-CPU worker nodes as on a fresh cluster, without a cluster start per scenario (~2/3 of a small scenario's
wall time).  Training variants with the same launcher share one uninterrupted run (the first variant's
``baseline/``, copied): ``max_failures`` changes nothing until a worker dies.
Node death is detected by the GCS health check, shortened here to ~1 s (``HEALTH_CHECK``); Ray's defaults take
longer to declare a node dead, and the recovery waits for that.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from raycurate.stages.bridge import BridgeScoreUDF

HOLD_SECONDS = 300  # a held call sleeps this long; the node is removed long before (or the run fails loudly)
HEALTH_CHECK = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500, "health_check_timeout_ms": 500,
                "health_check_failure_threshold": 2}
SCORING_ROWS, SHARD_ROWS = 8, 2
TRAIN_STEPS, CHECKPOINT_EVERY, HOLD_AFTER_STEP = 4, 2, 3

log = logging.getLogger("node_loss")


# ------------------------------------------------------------------------------------------------ cluster


WORKER_NODES = 2


def start_cluster(worker_nodes: int = WORKER_NODES) -> Any:
    """Head (0 CPUs: only the driver's things run there) + ``worker_nodes`` 1-CPU nodes; the driver connected."""
    from ray.cluster_utils import Cluster

    from raycurate.stages.runtime import init_ray

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "_system_config": HEALTH_CHECK})
    for _ in range(worker_nodes):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    init_ray(address=cluster.address)
    return cluster


def refill_cluster(cluster: Any, worker_nodes: int = WORKER_NODES) -> int:
    """Add 1-CPU worker nodes until ``worker_nodes`` are alive (a scenario removed one); returns how many were
    added."""
    import ray

    alive = sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0)
    for _ in range(worker_nodes - alive):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    deadline = time.time() + 60
    while sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0) < worker_nodes:
        if time.time() > deadline:
            raise RuntimeError(f"fewer than {worker_nodes} worker nodes alive 60 s after adding nodes")
        time.sleep(0.2)
    return max(worker_nodes - alive, 0)


def stop_cluster(cluster: Any) -> None:
    """Disconnect the driver, then stop every node left."""
    import ray

    ray.shutdown()
    cluster.shutdown()


def node_id() -> str:
    """This process's Ray node id (hex)."""
    import ray

    return ray.get_runtime_context().get_node_id()


def hold(marker: str) -> None:
    """Write ``marker`` (this node id, pid) atomically, then sleep: the driver removes this node meanwhile."""
    tmp = f"{marker}.tmp"
    with open(tmp, "w") as fh:
        json.dump({"node_id": node_id(), "pid": os.getpid(), "time": time.time()}, fh)
    os.replace(tmp, marker)
    time.sleep(HOLD_SECONDS)
    raise RuntimeError(f"held {HOLD_SECONDS} s after writing {marker} and the node was not removed")


class NodeKiller(threading.Thread):
    """Waits for the hold marker, then removes the worker node it names (no graceful shutdown)."""

    def __init__(self, cluster: Any, marker: Path, timeout_s: float = 600):
        super().__init__(daemon=True)
        self.cluster, self.marker, self.timeout_s = cluster, marker, timeout_s
        self.result: dict[str, Any] = {}

    def run(self) -> None:
        deadline = time.time() + self.timeout_s
        while not self.marker.exists():
            if time.time() > deadline:
                self.result = {"error": f"{self.marker} never appeared"}
                return
            time.sleep(0.1)
        held = json.loads(self.marker.read_text())
        nodes = [n for n in self.cluster.worker_nodes if n.node_id == held["node_id"]]
        if len(nodes) != 1:
            self.result = {"error": f"held on node {held['node_id']}, not one worker node", "held": held}
            return
        started = time.time()
        self.cluster.remove_node(nodes[0], allow_graceful=False)
        self.result = {"killed_node": held["node_id"], "held_pid": held["pid"], "held_at": held["time"],
                       "removed_at": started, "remove_seconds": round(time.time() - started, 3)}


def run_with_node_loss(cluster: Any, marker: Path, fn: Any) -> tuple[Any, dict]:
    """``fn()`` while a :class:`NodeKiller` removes the node that writes ``marker``; (fn's value, kill record)."""
    killer = NodeKiller(cluster, marker)
    killer.start()
    value = fn()
    killer.join(timeout=5)
    return value, killer.result


# ------------------------------------------------------------------------------------------------ scoring


class HoldingScoreUDF(BridgeScoreUDF):
    """``BridgeScoreUDF`` that logs each call (node, pid, first row id) and holds in its 2nd call when
    ``hold_marker`` is set and does not exist yet (the restarted actor does not hold again).

    Class attributes are set by the driver before the run; the class lives in ``__main__``, so Ray pickles it by
    value, attributes included.
    """

    hold_marker: str | None = None
    calls_log: str | None = None

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.calls = 0

    def __call__(self, batch: Any) -> Any:
        self.calls += 1
        with open(self.calls_log, "a") as fh:
            fh.write(json.dumps({"node_id": node_id(), "pid": os.getpid(), "call": self.calls,
                                 "first_id": batch["id"][0].as_py(), "rows": batch.num_rows}) + "\n")
        if self.hold_marker and self.calls == 2 and not os.path.exists(self.hold_marker):
            hold(self.hold_marker)
        return super().__call__(batch)


def _record(run: Any, stage: str, files: dict[str, Path]) -> None:
    """A finished upstream stage whose outputs are copies of ``files`` ({output name: path})."""
    import shutil

    from raycurate.stages.base import StageOutput, run_stage

    def body(out: Path) -> StageOutput:
        for src in files.values():
            (shutil.copytree if src.is_dir() else shutil.copy)(src, out / src.name)
        return StageOutput(outputs={name: src.name for name, src in files.items()})

    run_stage(run, stage, body, config={"stage": stage})


def scoring_inputs(work: Path) -> dict[str, Path]:
    """Tokens (``SCORING_ROWS`` corpus rows), the embedded model and a fixed random direction on its last layer."""
    import pyarrow.parquet as pq
    import torch
    from safetensors.torch import save_file

    from raycurate.algorithms.bridge.token_utility import scoring_parameters
    from raycurate.data.corpus import generate_corpus
    from raycurate.data.tokenize import token_table, tokenize_record
    from raycurate.models.loading import embedded_model_dir, load_model, load_tokenizer

    model_dir = embedded_model_dir()
    tokenizer = load_tokenizer(model_dir)
    rows = [tokenize_record(tokenizer, r, 384) for r in generate_corpus(3 * SCORING_ROWS, seed=0)]
    rows = [r for r in rows if "input_ids" in r][:SCORING_ROWS]
    tokens = work / "tokens"
    tokens.mkdir(parents=True)
    pq.write_table(token_table(rows), tokens / "part-0.parquet")
    model = load_model(model_dir, dtype="float32", device="cpu")
    gen = torch.Generator().manual_seed(0)
    direction = {k: torch.randn(v.shape, generator=gen) * 1e-2 for k, v in scoring_parameters(model, 1).items()}
    save_file(direction, str(work / "direction.safetensors"))
    return {"tokens": tokens, "model": Path(model_dir), "direction": work / "direction.safetensors"}


def score_once(root: Path, inputs: dict[str, Path]) -> dict:
    """``bridge_score`` in a fresh run folder ``root/run`` (1 actor, shards of ``SHARD_ROWS`` rows)."""
    from raycurate.config.bridge import BridgeConfig
    from raycurate.config.pool import ActorPoolConfig
    from raycurate.rundir import RunDir
    from raycurate.stages.bridge import score_stage

    run = RunDir(root / "run", lock=True)
    _record(run, "rows", {"tokens": inputs["tokens"]})
    _record(run, "warmup", {"model": inputs["model"]})
    _record(run, "direction", {"direction": inputs["direction"]})
    pool = ActorPoolConfig(num_actors=1, batch_size=SHARD_ROWS, shard_rows=SHARD_ROWS)
    return score_stage(run, tokens_stage="rows", warmup_stage="warmup", direction_stage_name="direction",
                       bridge_cfg=BridgeConfig(micro_batch=SHARD_ROWS), pool_cfg=pool, progress=False)


def scoring(out: Path, cluster: Any) -> dict:
    """Scenario A: a worker node dies while it scores shard 1 of 4."""
    import raycurate.stages.bridge as bridge

    summary: dict[str, Any] = {"scenario": "scoring"}
    inputs = scoring_inputs(out / "inputs")
    bridge.BridgeScoreUDF = HoldingScoreUDF  # score_stage builds its actors from this name
    for label in ("baseline", "killed"):
        root = out / label
        root.mkdir(parents=True)
        HoldingScoreUDF.calls_log = str(root / "calls.jsonl")
        HoldingScoreUDF.hold_marker = str(root / "hold.json") if label == "killed" else None
        t0 = time.perf_counter()
        if label == "killed":
            record, summary["kill"] = run_with_node_loss(cluster, root / "hold.json",
                                                         lambda root=root: score_once(root, inputs))
        else:
            record = score_once(root, inputs)
        summary[label] = {"seconds": round(time.perf_counter() - t0, 1), "executions": record["executions"],
                          "metrics": record["metrics"],
                          "calls": [json.loads(x) for x in (root / "calls.jsonl").read_text().splitlines()]}
    summary["nodes_alive_after"] = _alive_nodes()
    return summary


# ------------------------------------------------------------------------------------------------ warm tasks


class HoldingSquareUDF:
    """A stand-in for ``EvaluateUDF`` on the executor's task back-end (no model: the
    retry of the streaming task is what is under test): appends ``square = i * i``; logs each call and holds in its
    2nd call like :class:`HoldingScoreUDF`."""

    hold_marker: str | None = None
    calls_log: str | None = None

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, batch: Any) -> Any:
        import pyarrow.compute as pc

        self.calls += 1
        with open(self.calls_log, "a") as fh:
            fh.write(json.dumps({"node_id": node_id(), "pid": os.getpid(), "call": self.calls,
                                 "first_i": batch["i"][0].as_py(), "rows": batch.num_rows}) + "\n")
        if self.hold_marker and self.calls == 2 and not os.path.exists(self.hold_marker):
            hold(self.hold_marker)
        return batch.append_column("square", pc.multiply(batch["i"], batch["i"]))


def warm_tasks(out: Path, cluster: Any) -> dict:
    """Scenario C: a worker node dies during a warm-task map (the held-out evaluation's runtime), in group 2 of 4."""
    from raycurate.stages.executor import PoolResources, map_model_over_rows

    summary: dict[str, Any] = {"scenario": "warm_tasks"}
    rows = [{"i": k} for k in range(8)]
    pool = PoolResources(num_actors=1, num_cpus=0.95, num_gpus=0, batch_size=2)
    for label in ("baseline", "killed"):
        root = out / label
        root.mkdir(parents=True)
        HoldingSquareUDF.calls_log = str(root / "calls.jsonl")
        HoldingSquareUDF.hold_marker = str(root / "hold.json") if label == "killed" else None
        t0 = time.perf_counter()
        if label == "killed":
            result, summary["kill"] = run_with_node_loss(
                cluster, root / "hold.json", lambda: map_model_over_rows(rows, HoldingSquareUDF, {}, pool,
                                                                         progress=False))
        else:
            result = map_model_over_rows(rows, HoldingSquareUDF, {}, pool, progress=False)
        (root / "rows.json").write_text(json.dumps(result.to_pylist()))  # the map's table, in input order
        summary[label] = {"seconds": round(time.perf_counter() - t0, 1),
                          "calls": [json.loads(x) for x in (root / "calls.jsonl").read_text().splitlines()]}
    summary["nodes_alive_after"] = _alive_nodes()
    return summary


def ray_data(out: Path, cluster: Any) -> dict:
    """Scenario D: a worker node dies inside a Ray Data actor-pool map (the tokenize / Ray Data stages' runtime:
    :func:`~raycurate.stages.executor.map_model_over_rows` of a Dataset, order preserved as the stages set it), in
    batch 2 of 4."""
    import ray.data

    from raycurate.stages.executor import PoolResources, dataset_from_rows, map_model_over_rows

    summary: dict[str, Any] = {"scenario": "ray_data"}
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    ray.data.DataContext.get_current().enable_progress_bars = False
    rows = [{"i": k} for k in range(8)]
    pool = PoolResources(num_actors=1, num_cpus=0.5, num_gpus=0, batch_size=2)

    def map_rows() -> list[dict]:
        return map_model_over_rows(dataset_from_rows(rows, 2), HoldingSquareUDF, {}, pool).take_all()

    for label in ("baseline", "killed"):
        root = out / label
        root.mkdir(parents=True)
        HoldingSquareUDF.calls_log = str(root / "calls.jsonl")
        HoldingSquareUDF.hold_marker = str(root / "hold.json") if label == "killed" else None
        t0 = time.perf_counter()
        if label == "killed":
            result, summary["kill"] = run_with_node_loss(cluster, root / "hold.json", map_rows)
        else:
            result = map_rows()
        (root / "rows.json").write_text(json.dumps(result))
        summary[label] = {"seconds": round(time.perf_counter() - t0, 1),
                          "calls": [json.loads(x) for x in (root / "calls.jsonl").read_text().splitlines()]}
    summary["nodes_alive_after"] = _alive_nodes()
    return summary


# ------------------------------------------------------------------------------------------------ training


def hold_entry(entry: Any, marker: str, config: dict, session: Any) -> None:
    """Ray Train worker entry: ``entry`` with rank 0 holding after step ``HOLD_AFTER_STEP`` (once the checkpoints
    reported so far are committed), unless ``marker`` exists (the restarted worker trains on).  Each start appends
    its node id, pid and rank to ``workers.jsonl`` beside ``marker``."""
    import raycurate.stages.train as train

    with open(os.path.join(os.path.dirname(marker), "workers.jsonl"), "a") as fh:  # which node each start ran on
        fh.write(json.dumps({"node_id": node_id(), "pid": os.getpid(), "rank": session.rank}) + "\n")

    def hold_after(session: Any, step: int) -> None:
        if session.rank == 0 and step == HOLD_AFTER_STEP and not os.path.exists(marker):
            with session.latest_checkpoint_dir():  # wait until Ray Train has registered every reported checkpoint
                pass
            hold(marker)

    train.maybe_inject_fault = hold_after  # train_loop calls it after every step (this worker process only)
    entry(config, session)


def training_inputs(work: Path) -> dict[str, Path]:
    """A 16-row token table of the embedded corpus and the embedded model."""
    import pyarrow.parquet as pq

    from raycurate.data.corpus import generate_corpus
    from raycurate.data.tokenize import token_table, tokenize_record
    from raycurate.models.loading import embedded_model_dir, load_tokenizer

    model_dir = embedded_model_dir()
    tokenizer = load_tokenizer(model_dir)
    rows = [tokenize_record(tokenizer, r, 384) for r in generate_corpus(48, seed=1)]
    rows = [r for r in rows if "input_ids" in r][:16]
    work.mkdir(parents=True)
    pq.write_table(token_table(rows), work / "train.parquet")
    return {"table": work / "train.parquet", "model": Path(model_dir)}


def train_config(max_failures: int, launcher: str) -> Any:
    from raycurate.config.train import TrainConfig

    return TrainConfig(engine="ddp", launcher=launcher, num_workers=1, micro_batch_size=2, effective_batch_size=4,
                       max_steps=TRAIN_STEPS, checkpoint_every_steps=CHECKPOINT_EVERY, lr=1e-3, warmup_ratio=0.0,
                       log_every_steps=1, max_failures=max_failures)


def training(out: Path, cluster: Any, max_failures: int = 1, launcher: str = "ray_train",
             baseline: tuple[dict, Path] | None = None) -> dict:
    """Scenario B: a worker node dies after step 3 of 4 (checkpoint at step 2).

    With ``max_failures >= 1`` Ray Train restarts the worker group inside the same ``fit()``; with 0 the run fails
    and a second ``run_sft`` on the same storage (what re-running the stage does) resumes from the checkpoint.
    ``launcher="task"``: one Ray task, retried ``max_failures`` times (``train.launcher=task``).

    ``baseline``: ``(summary, folder)`` of an uninterrupted run of another variant with the same launcher (the same
    run: ``max_failures`` matters only once a worker dies), copied instead of training it again.
    """
    import shutil

    import raycurate.stages.train as train

    summary: dict[str, Any] = {"scenario": "training", "max_failures": max_failures, "launcher": launcher}
    inputs = training_inputs(out / "inputs")
    real_launch = train.launch_trainer
    for label in ("baseline", "killed"):
        root = out / label
        if label == "baseline" and baseline is not None:
            shutil.copytree(baseline[1] / "model", root / "model")
            summary[label] = {**baseline[0], "copied_from": str(baseline[1])}
            continue
        root.mkdir(parents=True)
        marker = root / "hold.json"
        if label == "killed":
            train.launch_trainer = lambda entry, *a, marker=str(marker), **k: real_launch(
                functools.partial(hold_entry, entry, marker), *a, **k)

        def fit(root: Path = root) -> dict:
            return train.run_sft(str(inputs["table"]), str(inputs["model"]), str(root / "model"),
                                 train_config(max_failures, launcher), storage_dir=str(root / "ray_train"), name="sft")

        def fit_or_error(fit: Any = fit) -> dict | Exception:
            try:
                return fit()
            except Exception as exc:  # noqa: BLE001 - recorded: with max_failures=0 the lost node fails the run
                return exc

        t0 = time.perf_counter()
        if label == "killed":
            metrics, summary["kill"] = run_with_node_loss(cluster, marker, fit_or_error)
            train.launch_trainer = real_launch
            summary["killed"] = {}
            if isinstance(metrics, Exception):  # the stage failed: run it again, as a user re-runs the command
                summary["killed"]["failed_with"] = f"{type(metrics).__name__}: {str(metrics)[:300]}"
                summary["killed"]["failed_after_seconds"] = round(time.perf_counter() - t0, 1)
                metrics = fit()
        else:
            metrics = fit()
        summary[label] = {**summary.get(label, {}), "seconds": round(time.perf_counter() - t0, 1),
                          **{k: metrics[k] for k in ("start_step", "steps", "loss_per_step")}}
        if label == "killed":
            summary[label]["workers"] = [json.loads(x) for x in (root / "workers.jsonl").read_text().splitlines()]
    summary["nodes_alive_after"] = _alive_nodes()
    return summary


def _alive_nodes() -> int:
    import ray

    return sum(1 for n in ray.nodes() if n["Alive"])


SCENARIOS = {"scoring": scoring, "warm_tasks": warm_tasks, "ray_data": ray_data, "training": training}
LAUNCHERS = ("ray_train", "task")


def scenario_options(name: str, max_failures: int, launcher: str) -> tuple[str, dict]:
    """``(scenario function name, its keyword options)`` of a scenario argument: a name of ``SCENARIOS``, or
    ``training:<launcher>:<max_failures>`` (plain ``training`` takes ``--launcher`` / ``--max-failures``)."""
    base, _, variant = name.partition(":")
    if base not in SCENARIOS or (variant and base != "training"):
        raise ValueError(f"unknown scenario {name!r}: one of {', '.join(sorted(SCENARIOS))} or "
                         "training:<launcher>:<max_failures>")
    if base != "training":
        return base, {}
    if variant:
        launcher, _, failures = variant.partition(":")
        if launcher not in LAUNCHERS or not failures.isdigit():
            raise ValueError(f"bad training variant {name!r}: training:<{'|'.join(LAUNCHERS)}>:<max_failures>")
        max_failures = int(failures)
    return base, {"max_failures": max_failures, "launcher": launcher}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", nargs="+", help=f"one or more of {', '.join(sorted(SCENARIOS))}, or "
                        "training:<launcher>:<max_failures>; several run one after another on one cluster, each in "
                        "<out>/<scenario>/")
    parser.add_argument("--out", required=True, type=Path, help="an empty or new folder for the runs and summary")
    parser.add_argument("--max-failures", type=int, default=1,
                        help="training: train.max_failures (0: the run fails and a second run_sft resumes)")
    parser.add_argument("--launcher", choices=LAUNCHERS, default="ray_train", help="training: train.launcher")
    args = parser.parse_args(argv)
    try:
        plan = [(name, *scenario_options(name, args.max_failures, args.launcher)) for name in args.scenario]
    except ValueError as exc:
        parser.error(str(exc))
    if len({name for name, _, _ in plan}) != len(plan):
        parser.error("a scenario is named twice")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    if any(args.out.iterdir()):
        parser.error(f"--out {args.out} is not empty")
    out = args.out.resolve()
    started = time.perf_counter()
    cluster = start_cluster()
    start_seconds = time.perf_counter() - started
    summaries: dict[str, dict] = {}
    baselines: dict[str, tuple[dict, Path]] = {}  # launcher -> its uninterrupted training run (summary, folder)
    try:
        for index, (name, base, options) in enumerate(plan):
            scenario_started = time.perf_counter()
            if index:
                refill_cluster(cluster)
            setup_seconds = time.perf_counter() - scenario_started if index else start_seconds
            folder = out if len(plan) == 1 else out / name.replace(":", "_")
            folder.mkdir(exist_ok=True)
            if base == "training" and options["launcher"] in baselines:
                options = {**options, "baseline": baselines[options["launcher"]]}
            summary = SCENARIOS[base](folder, cluster, **options)
            if base == "training":
                baselines.setdefault(options["launcher"], (summary["baseline"], folder / "baseline"))
            summary["cluster_seconds"] = round(setup_seconds, 1)  # the cluster's start, or the nodes added back
            summary["total_seconds"] = round(time.perf_counter() - scenario_started + (0 if index else start_seconds),
                                             1)
            (folder / "summary.json").write_text(json.dumps(summary, indent=1))
            summaries[name] = summary
    finally:
        stop_cluster(cluster)
    if len(plan) > 1:
        (out / "summary.json").write_text(json.dumps(
            {"scenarios": list(summaries), "total_seconds": round(time.perf_counter() - started, 1)}, indent=1))
    print(json.dumps(summaries if len(plan) > 1 else summaries[plan[0][0]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
