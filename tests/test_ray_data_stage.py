"""The executor's Ray Data back-end: resource arithmetic (pure) and a real local run with 2 actors."""

from __future__ import annotations

import os

import pytest

from raycurate.config.pool import ActorPoolConfig
from raycurate.stages.executor import dataset_from_rows, map_model_over_rows, resolve_pool
from raycurate.stages.runtime import actor_cpus


def test_whole_cpu_actors_are_shrunk_on_a_two_cpu_node():
    # 2 actors x 1 CPU on 2 CPUs would leave nothing for the read task: the pool would deadlock.
    # one whole CPU stays free for the read task, plus 0.05 for small standing reservations (a Tune trial's 0.01)
    assert actor_cpus(1.0, 2, 2.0) == 0.475
    assert actor_cpus(None, 2, 2.0) == 0.475
    assert actor_cpus(1.0, 2, 8.0) == 1.0
    assert actor_cpus(None, 4, 8.0) == 1.737


def test_pool_uses_gpus_when_the_cluster_has_them():
    pool = resolve_pool(ActorPoolConfig(num_actors=8), total_cpus=32, total_gpus=4)
    assert pool.num_gpus == 1.0 and pool.num_actors == 4
    cpu_pool = resolve_pool(ActorPoolConfig(num_actors=2), total_cpus=2, total_gpus=0)
    assert cpu_pool.num_gpus == 0.0 and cpu_pool.num_actors == 2 and cpu_pool.num_cpus * 2 + 1.0 <= 2


class AddOffsetUDF:
    """Built once per actor; records which process handled each row."""

    def __init__(self, offset: int):
        self.offset = offset
        self.pid = os.getpid()

    def __call__(self, batch):
        import time

        import pyarrow as pa

        time.sleep(0.1)  # long enough that the pool spreads the 16 batches over both actors

        values = [v + self.offset for v in batch["x"].to_pylist()]
        return batch.append_column("y", pa.array(values)).append_column("pid", pa.array([self.pid] * len(values)))


@pytest.mark.ray
def test_actor_pool_stage_runs_on_two_cpus_without_deadlock(ray_local):
    import sys

    import ray.cloudpickle
    import ray.data

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import the tests folder
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    ds = ray.data.range(400, override_num_blocks=8).map_batches(
        lambda b: {"x": b["id"]}, batch_format="numpy")
    pool = resolve_pool(ActorPoolConfig(num_actors=2, cpus_per_actor=1.0, batch_size=25))
    rows = map_model_over_rows(ds, AddOffsetUDF, {"offset": 10}, pool).take_all()
    assert [r["y"] for r in rows] == [x + 10 for x in range(400)]
    assert len({r["pid"] for r in rows}) == 2, "both actors should have taken batches"


@pytest.mark.ray
def test_in_memory_rows_come_in_batch_sized_blocks(ray_local):
    # ray.data.from_items would cut 120 rows into ~120 one-row blocks, one read task each
    ds = dataset_from_rows([{"x": i} for i in range(120)], 50).materialize()
    assert ds.num_blocks() == 3
    assert [r["x"] for r in ds.take_all()] == list(range(120))
    assert dataset_from_rows([{"x": 0}], 50).materialize().num_blocks() == 1


@pytest.mark.parametrize("progress", [False, True])
def test_ray_data_progress_bars_follow_run_progress(tmp_path, monkeypatch, progress):
    """open_run sets DataContext.enable_progress_bars from run.progress (Ray Data's default is on)."""
    import ray.data

    import raycurate.stages.runtime as runtime
    from raycurate.config.loader import from_dict
    from raycurate.config.schema import JobConfig
    from raycurate.pipelines.common import open_run
    from raycurate.rundir import release_locks

    monkeypatch.setattr(runtime, "init_ray", lambda **kwargs: None)  # the setting is driver-side: no cluster needed
    ctx = ray.data.DataContext.get_current()
    monkeypatch.setattr(ctx, "enable_progress_bars", not progress)
    cfg = from_dict(JobConfig, {"pipeline": "sft", "run": {"name": "p", "runs_dir": str(tmp_path),
                                                          "progress": progress}})
    try:
        open_run(cfg)
    finally:
        release_locks()
    assert ray.data.DataContext.get_current().enable_progress_bars is progress


@pytest.mark.ray
def test_tokenize_in_the_driver_writes_what_the_actor_pool_writes(ray_local, tmp_path):
    import pyarrow.parquet as pq

    from raycurate.config.loader import from_dict
    from raycurate.config.schema import JobConfig
    from raycurate.pipelines.common import open_run, prepare_data
    from raycurate.rundir import release_locks
    from raycurate.stages.base import output_path
    from raycurate.stages.data_stages import tokenize_stage

    # max_length 160 rejects the longest corpus rows, so both paths must also agree on rejected.jsonl
    cfg = from_dict(JobConfig, {"run": {"name": "tok", "runs_dir": str(tmp_path), "progress": False},
                                "data": {"corpus_rows": 80, "heldout_rows": 10, "max_length": 160},
                                "tokenize": {"batch_size": 16}, "demo": {"methods": ["sft"]}})
    try:
        run = open_run(cfg)
        local = prepare_data(run, cfg)["tokenize"]
        tokens, rejected = (output_path(run, "tokenize", name) for name in ("tokens", "rejected"))
        local_rows, local_rejected = pq.read_table(tokens).to_pylist(), rejected.read_text()
        pooled = tokenize_stage(run, accepted_stage="ingest", tokenizer_stage="base_model", max_length=160,
                                pool_cfg=cfg.tokenize, in_process=False, force=True)
        assert local["metrics"]["in_process"] and not pooled["metrics"]["in_process"]
        assert 0 < local["metrics"]["rejected"] < 80
        assert pq.read_table(tokens).to_pylist() == local_rows
        assert rejected.read_text() == local_rejected
    finally:
        release_locks()
