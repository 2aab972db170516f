"""Mapping a UDF over in-memory rows on Ray tasks (held-out evaluation): groups, order, one UDF per task."""

from __future__ import annotations

import pytest

from raycurate.stages.ray_data import PoolResources
from raycurate.stages.warm_tasks import map_rows_on_tasks, row_groups


class TagRows:
    """Test UDF: doubles ``x`` and records which UDF instance (one per construction) saw each group."""

    def __init__(self, offset: int) -> None:
        import uuid

        # uuid, not the pid: Ray may run the two (short) tasks one after the other in one worker process
        self.offset, self.instance = offset, uuid.uuid4().hex
        self.calls = 0

    def __call__(self, batch):
        import os

        import pyarrow as pa

        self.calls += 1
        rows = batch.to_pylist()
        return pa.Table.from_pylist([{"id": r["id"], "y": 2 * r["x"] + self.offset, "group_size": len(rows),
                                      "instance": self.instance, "call": self.calls, "pid": os.getpid()}
                                     for r in rows])


def _pickle_this_module_by_value() -> None:
    import sys

    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import the tests folder


def test_row_groups_are_consecutive_and_only_the_last_is_short():
    rows = [{"id": i} for i in range(7)]
    assert [[r["id"] for r in g] for g in row_groups(rows, 3)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert row_groups([], 3) == []
    with pytest.raises(ValueError, match="group_rows"):
        row_groups(rows, 0)


@pytest.mark.ray
def test_every_row_is_mapped_once_in_batch_sized_groups_by_one_udf_per_task(ray_local):
    _pickle_this_module_by_value()
    rows = [{"id": i, "x": i} for i in range(23)]
    pool = PoolResources(num_actors=2, num_cpus=0.5, num_gpus=0.0, batch_size=5)
    out = map_rows_on_tasks(rows, TagRows, {"offset": 1}, pool, progress=False)
    assert sorted(r["id"] for r in out) == list(range(23))
    assert all(r["y"] == 2 * r["id"] + 1 for r in out)
    assert sorted(r["group_size"] for r in out) == [3] * 3 + [5] * 20  # groups of 5, the last of 3
    instances = {r["instance"] for r in out}
    assert len(instances) == 2  # one UDF per task, built once
    assert max(r["call"] for r in out) == 3  # groups 0, 2, 4 on one task; 1, 3 on the other


@pytest.mark.ray
def test_fewer_groups_than_tasks_start_only_the_tasks_needed(ray_local):
    _pickle_this_module_by_value()
    pool = PoolResources(num_actors=4, num_cpus=0.25, num_gpus=0.0, batch_size=10)
    out = map_rows_on_tasks([{"id": 0, "x": 5}], TagRows, {"offset": 0}, pool, progress=False)
    assert [r["y"] for r in out] == [10]
    assert map_rows_on_tasks([], TagRows, {"offset": 0}, pool, progress=False) == []


@pytest.mark.ray
def test_a_task_process_exits_after_its_groups_instead_of_carrying_its_heap_to_the_next_task(ray_local):
    """max_calls=1: a warm process reused after an evaluation (or a training) kept its model-sized heap (#25)."""
    _pickle_this_module_by_value()
    pool = PoolResources(num_actors=1, num_cpus=0.5, num_gpus=0.0, batch_size=10)
    first = map_rows_on_tasks([{"id": 0, "x": 1}], TagRows, {"offset": 0}, pool, progress=False)
    second = map_rows_on_tasks([{"id": 0, "x": 1}], TagRows, {"offset": 0}, pool, progress=False)
    assert first[0]["pid"] != second[0]["pid"]
