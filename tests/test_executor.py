"""The executor: every map of the stages goes through it; its task back-end (held-out evaluation: groups, order,
one UDF per task, warm or cold workers) and its dispatch by input kind."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pytest

from raycurate.stages.executor import PoolResources, ShardedInput, map_model_over_rows, row_groups

REPO = Path(__file__).resolve().parents[1]


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
    out = map_model_over_rows(rows, TagRows, {"offset": 1}, pool, progress=False).to_pylist()
    assert [r["id"] for r in out] == list(range(23))  # input order, whichever task mapped the group
    assert all(r["y"] == 2 * r["id"] + 1 for r in out)
    assert sorted(r["group_size"] for r in out) == [3] * 3 + [5] * 20  # groups of 5, the last of 3
    instances = {r["instance"] for r in out}
    assert len(instances) == 2  # one UDF per task, built once
    assert max(r["call"] for r in out) == 3  # groups 0, 2, 4 on one task; 1, 3 on the other


@pytest.mark.ray
def test_fewer_groups_than_tasks_start_only_the_tasks_needed(ray_local):
    _pickle_this_module_by_value()
    pool = PoolResources(num_actors=4, num_cpus=0.25, num_gpus=0.0, batch_size=10)
    out = map_model_over_rows([{"id": 0, "x": 5}], TagRows, {"offset": 0}, pool, progress=False)
    assert out["y"].to_pylist() == [10]
    assert map_model_over_rows([], TagRows, {"offset": 0}, pool, progress=False).num_rows == 0


@pytest.mark.ray
def test_a_task_process_exits_after_its_groups_instead_of_carrying_its_heap_to_the_next_task(ray_local):
    """max_calls=1: a warm process reused after an evaluation (or a training) kept its model-sized heap (#25)."""
    _pickle_this_module_by_value()
    pool = PoolResources(num_actors=1, num_cpus=0.5, num_gpus=0.0, batch_size=10)
    first = map_model_over_rows([{"id": 0, "x": 1}], TagRows, {"offset": 0}, pool, progress=False)
    second = map_model_over_rows([{"id": 0, "x": 1}], TagRows, {"offset": 0}, pool, progress=False)
    assert first["pid"][0] != second["pid"][0]


@pytest.mark.ray
def test_warm_workers_map_the_same_rows_as_cold_ones(ray_local):
    _pickle_this_module_by_value()
    rows = [{"id": i, "x": i} for i in range(7)]
    pool = PoolResources(num_actors=2, num_cpus=0.5, num_gpus=0.0, batch_size=3)
    strip = ("instance", "pid")
    cold, warm = (sorted(({k: v for k, v in r.items() if k not in strip}
                          for r in map_model_over_rows(rows, TagRows, {"offset": 2}, pool, progress=False,
                                                       warm=w).to_pylist()),
                         key=lambda r: r["id"]) for w in (False, True))
    assert cold == warm and [r["y"] for r in warm] == [2 * i + 2 for i in range(7)]


class TypedRows:
    """Test UDF: a float32 list column, and a column that is all null in batches without a note."""

    def __call__(self, batch):
        import pyarrow as pa

        rows = batch.to_pylist()
        notes = [f"row {r['id']}" if r["id"] == 4 else None for r in rows]
        return pa.table({"id": [r["id"] for r in rows],
                         "losses": pa.array([[0.5] * r["id"] for r in rows], pa.list_(pa.float32())),
                         "note": notes})


@pytest.mark.ray
def test_the_task_back_end_keeps_the_udf_arrow_types_across_batches(ray_local):
    _pickle_this_module_by_value()
    pool = PoolResources(num_actors=2, num_cpus=0.5, num_gpus=0.0, batch_size=2)
    out = map_model_over_rows([{"id": i} for i in range(6)], TypedRows, {}, pool, progress=False, warm=True)
    assert out.schema.field("losses").type == pa.list_(pa.float32())  # not the float64 of a round trip via dicts
    assert out["note"].to_pylist() == [None] * 4 + ["row 4", None]  # null-typed batches unify with the string one
    assert out["id"].to_pylist() == list(range(6))


def test_the_input_kind_picks_the_back_end_and_warm_is_only_for_in_memory_rows(tmp_path):
    pool = PoolResources(num_actors=1, num_cpus=1.0, num_gpus=0.0, batch_size=2)
    with pytest.raises(ValueError, match="warm=True needs in-memory rows"):
        map_model_over_rows(ShardedInput(tmp_path, tmp_path / "out", 4), TagRows, {}, pool, warm=True)
    with pytest.raises(ValueError, match="needs resources"):
        map_model_over_rows([{"id": 0, "x": 1}], TagRows, {}, None)
    with pytest.raises(TypeError, match="ray.data.Dataset, a ShardedInput or a list"):
        map_model_over_rows(str(tmp_path), TagRows, {}, pool)


# ----------------------------------------------------------------------------------------------------------
# Every map goes through the executor
# ----------------------------------------------------------------------------------------------------------

#: Ray scheduling primitives of a map: only the executor may use them.
MAP_PRIMITIVES = ("map_batches(", "ActorPoolStrategy", 'num_returns="streaming"', "from_items(", "(ShardWorker)")
#: The runners the executor replaced: no module, script or benchmark may name them again.
OLD_RUNNERS = ("sharded_map(", "map_rows_on_tasks", "map_with_actor_pool", "WarmPool(", "stages.ray_data",
               "stages.warm_tasks", "stages.warm_pool")
#: ``ray.remote`` outside the executor, each not a map over rows: one training task, one call of a function, and
#: the generation pool's actors (held across a BMO loop's adapter steps, one ``generate`` call per step).
RAY_REMOTE_ALLOWED = {"raycurate/stages/train.py", "raycurate/stages/runtime.py", "raycurate/stages/generation.py"}
#: The stage modules that map a model (or a function) over rows.
# the stage modules that map rows (and the executor's own sharded_stage)
CALLERS = ("reference", "p2d", "data_stages", "bridge_compact", "bridge", "model_stages", "dedup")


def _python_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (REPO / folder).rglob("*.py"))


def test_no_module_but_the_executor_schedules_a_map():
    offenders = []
    for path in _python_files("raycurate"):
        rel = path.relative_to(REPO).as_posix()
        if rel == "raycurate/stages/executor.py":
            continue
        text = path.read_text()
        offenders += [f"{rel}: {name}" for name in MAP_PRIMITIVES if name in text]
        if re.search(r"\bray\.remote\(", text) and rel not in RAY_REMOTE_ALLOWED:
            offenders.append(f"{rel}: ray.remote(")
    assert not offenders, f"maps scheduled outside raycurate/stages/executor.py: {offenders}"


def test_the_replaced_runners_are_gone_everywhere():
    offenders = [f"{p.relative_to(REPO)}: {name}" for p in _python_files("raycurate", "scripts", "benchmarks", "tests")
                 if p.name != "test_executor.py" for name in OLD_RUNNERS if name in p.read_text()]
    assert not offenders, offenders
    assert not (REPO / "raycurate/stages/warm_pool.py").exists()


def test_every_mapping_stage_calls_the_executor():
    missing = [name for name in CALLERS
               if "map_model_over_rows(" not in (REPO / "raycurate/stages" / f"{name}.py").read_text()]
    assert not missing, f"stage modules that map rows without the executor: {missing}"
