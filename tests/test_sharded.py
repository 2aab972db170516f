"""The executor's shard-resumable map: planning and markers without Ray; retried UDF failures and kill-and-resume
with Ray."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from raycurate.stages.executor import PoolResources, ShardedInput, map_model_over_rows, sharded_stage
from raycurate.stages.sharded import (
    ROW_INDEX,
    InputFile,
    Shard,
    ShardCoverageError,
    ShardFailed,
    ShardWorker,
    apply_udf,
    list_input_files,
    marker_is_valid,
    marker_path,
    part_files,
    part_path,
    plan_key,
    plan_shards,
    prepare_shards_dir,
    read_row_range,
    verify_coverage,
)

TESTS_DIR = Path(__file__).resolve().parent


def map_shards(input_path, out_dir, udf_cls, ctor_kwargs, *, shard_rows, num_actors, num_cpus_per_actor,
               in_process=False, max_restarts=3, max_task_retries=3, progress=False):
    """The executor's sharded map, one UDF call per shard."""
    spec = ShardedInput(input_path, out_dir, shard_rows, in_process=in_process, max_restarts=max_restarts,
                        max_task_retries=max_task_retries)
    pool = PoolResources(num_actors=num_actors, num_cpus=num_cpus_per_actor, num_gpus=0, batch_size=shard_rows)
    return map_model_over_rows(spec, udf_cls, ctor_kwargs, pool, progress=progress)


class LengthScoreUDF:
    """Cheap deterministic scorer: ``score = scale * len(text)``; logs one file per call (first row id)."""

    def __init__(self, scale: int = 1, calls_dir: str | None = None, sleep_s: float = 0.0):
        self.scale = scale
        self.calls_dir = calls_dir
        self.sleep_s = sleep_s

    def __call__(self, table):
        import pyarrow as pa

        if self.calls_dir:
            Path(self.calls_dir, f"{table['id'][0].as_py()}.{uuid.uuid4().hex[:6]}").touch()
        time.sleep(self.sleep_s)
        return table.append_column("score", pa.array([self.scale * len(t) for t in table["text"].to_pylist()]))


class FailOnceUDF(LengthScoreUDF):
    """Fails the first time it sees each shard (a flag file per shard remembers it), then scores normally.

    ``mode="raise"`` raises a Python exception (task retry); ``mode="exit"`` kills the worker process (actor
    restart, then task retry).
    """

    def __init__(self, flags_dir: str, mode: str, **kwargs):
        super().__init__(**kwargs)
        self.flags_dir = flags_dir
        self.mode = mode

    def __call__(self, table):
        flag = Path(self.flags_dir, f"failed-{table['id'][0].as_py()}")
        if not flag.exists():
            flag.touch()
            if self.mode == "exit":
                os._exit(1)
            raise RuntimeError(f"injected failure for {flag.name}")
        return super().__call__(table)


class AlwaysFailsUDF:
    def __call__(self, table):
        raise ValueError("this UDF always fails")


def write_input(folder: Path, sizes: list[int], row_group_size: int = 7) -> int:
    """Parquet files ``in-{k}.parquet`` of ``sizes[k]`` rows with ``id`` (global, ``r000000``) and ``text``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    start = 0
    for k, n in enumerate(sizes):
        ids = [f"r{i:06d}" for i in range(start, start + n)]
        texts = ["x" * (i % 13) + f"-{i}" for i in range(start, start + n)]
        pq.write_table(pa.table({"id": ids, "text": texts}), folder / f"in-{k}.parquet", row_group_size=row_group_size)
        start += n
    return start


def read_parts(shards_dir: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pa.concat_tables([pq.read_table(p) for p in part_files(shards_dir)])


def expected_scores(n: int, scale: int = 1) -> list[int]:
    return [scale * len("x" * (i % 13) + f"-{i}") for i in range(n)]


# ----------------------------------------------------------------------------------------------------------
# Without Ray
# ----------------------------------------------------------------------------------------------------------


def test_plan_cuts_consecutive_shards_with_a_short_last_one():
    shards = plan_shards(25, 10)
    assert [(s.index, s.start, s.stop) for s in shards] == [(0, 0, 10), (1, 10, 20), (2, 20, 25)]
    assert shards[2].name == "part-00002" and shards[2].rows == 5
    assert plan_shards(0, 10) == []
    with pytest.raises(ValueError, match="shard_rows"):
        plan_shards(10, 0)


def test_row_ranges_cross_file_and_row_group_boundaries(tmp_path):
    total = write_input(tmp_path / "in", [10, 3, 12])
    files = list_input_files(tmp_path / "in")
    assert [f.rows for f in files] == [10, 3, 12] and total == 25
    for start, stop in [(0, 25), (5, 9), (6, 14), (9, 11), (13, 14), (24, 25)]:
        ids = read_row_range(files, start, stop)["id"].to_pylist()
        assert ids == [f"r{i:06d}" for i in range(start, stop)], (start, stop)
    with pytest.raises(ValueError, match="outside the input"):
        read_row_range(files, 25, 30)


def test_input_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list_input_files(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no parquet files"):
        list_input_files(tmp_path / "empty")


def test_plan_key_changes_with_the_udf_arguments_and_the_input(tmp_path):
    write_input(tmp_path / "in", [10])
    files = list_input_files(tmp_path / "in")
    key = plan_key(files, 5, LengthScoreUDF, {"scale": 1})
    assert key == plan_key(files, 5, LengthScoreUDF, {"scale": 1})
    assert key != plan_key(files, 5, LengthScoreUDF, {"scale": 2})
    assert key != plan_key(files, 4, LengthScoreUDF, {"scale": 1})
    grown = [InputFile(f.path, f.rows + 1, f.size, f.mtime_ns) for f in files]
    assert key != plan_key(grown, 5, LengthScoreUDF, {"scale": 1})


def test_worker_writes_part_and_marker_that_validate_until_tampered(tmp_path):
    write_input(tmp_path / "in", [10, 10])
    files = list_input_files(tmp_path / "in")
    shards_dir = tmp_path / "shards"
    shards_dir.mkdir()
    worker = ShardWorker(LengthScoreUDF, {"scale": 3}, files, str(shards_dir), "k1", batch_rows=4)
    shard = Shard(1, 8, 16)
    marker = worker.process(shard)
    assert marker["rows"] == 8 and marker["input_rows"] == [8, 16] and marker["plan"] == "k1"
    assert json.loads(marker_path(shards_dir, shard).read_text())["sha256"] == marker["sha256"]
    table = read_parts(shards_dir)
    assert table[ROW_INDEX].to_pylist() == list(range(8, 16))
    assert table["score"].to_pylist() == expected_scores(16, 3)[8:16]
    assert marker_is_valid(shards_dir, shard, "k1")
    assert not marker_is_valid(shards_dir, shard, "other-plan")
    assert not marker_is_valid(shards_dir, Shard(1, 8, 15), "k1")
    with open(part_path(shards_dir, shard), "ab") as fh:
        fh.write(b"x")
    assert not marker_is_valid(shards_dir, shard, "k1"), "a part that changed after its marker must be recomputed"


def test_prepare_keeps_valid_shards_and_removes_temp_stale_and_invalid(tmp_path):
    write_input(tmp_path / "in", [20])
    files = list_input_files(tmp_path / "in")
    shards_dir = tmp_path / "shards"
    shards_dir.mkdir()
    worker = ShardWorker(LengthScoreUDF, {}, files, str(shards_dir), "k")
    shards = plan_shards(20, 5)
    for shard in shards[:3]:
        worker.process(shard)
    marker_path(shards_dir, shards[2]).write_text("{not json")  # a torn marker counts as absent
    (shards_dir / ".part-00003.parquet.123-abc.tmp").write_bytes(b"partial")
    worker.process(Shard(9, 15, 20))  # a part from an older plan with more shards
    done = prepare_shards_dir(shards_dir, shards, "k")
    assert done == {0, 1}
    names = sorted(p.name for p in shards_dir.iterdir())
    assert names == ["part-00000.done", "part-00000.parquet", "part-00001.done", "part-00001.parquet",
                     "part-00002.parquet"]


def test_coverage_check_catches_missing_and_misplaced_rows(tmp_path):
    write_input(tmp_path / "in", [12])
    files = list_input_files(tmp_path / "in")
    shards_dir = tmp_path / "shards"
    shards_dir.mkdir()
    shards = plan_shards(12, 4)
    worker = ShardWorker(LengthScoreUDF, {}, files, str(shards_dir), "k")
    for shard in shards:
        worker.process(shard)
    verify_coverage(shards_dir, shards, 12)
    with pytest.raises(ShardCoverageError, match=r"cover rows \[0, 12\) of 13"):
        verify_coverage(shards_dir, shards, 13)
    # Shard 2's file now holds shard 1's rows: rows 4-7 twice, rows 8-11 never.
    part_path(shards_dir, shards[2]).write_bytes(part_path(shards_dir, shards[1]).read_bytes())
    with pytest.raises(ShardCoverageError, match=r"part-00002.parquet does not hold exactly input rows \[8, 12\)"):
        verify_coverage(shards_dir, shards, 12)
    marker_path(shards_dir, shards[0]).unlink()
    with pytest.raises(ShardCoverageError, match="part-00000.parquet or its .done marker is missing"):
        verify_coverage(shards_dir, shards, 12)


def test_udf_must_return_one_row_per_input_row():
    import pyarrow as pa

    table = pa.table({"id": ["a", "b", "c"], "text": ["x", "yy", "zzz"]})
    assert apply_udf(LengthScoreUDF(), table, 2)["score"].to_pylist() == [1, 2, 3]
    with pytest.raises(ValueError, match="exactly one row per input row"):
        apply_udf(lambda t: t.slice(0, 1), table, None)


# ----------------------------------------------------------------------------------------------------------
# With Ray
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture()
def pickled_tests(ray_local):
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import the tests folder
    return ray_local


@pytest.mark.ray
@pytest.mark.parametrize("mode", ["raise", "exit"])
def test_injected_udf_failures_are_retried_without_losing_or_duplicating_rows(pickled_tests, tmp_path, mode):
    total = write_input(tmp_path / "in", [23, 17])
    flags = tmp_path / "flags"
    flags.mkdir()
    common = dict(shard_rows=20, num_actors=2, num_cpus_per_actor=0.5, progress=False)
    clean = map_shards(tmp_path / "in", tmp_path / "clean", LengthScoreUDF, {"scale": 2}, **common)
    flaky = map_shards(tmp_path / "in", tmp_path / "flaky", FailOnceUDF,
                       {"flags_dir": str(flags), "mode": mode, "scale": 2},
                       max_restarts=2, max_task_retries=2, **common)
    assert len(list(flags.iterdir())) == 2, "every shard failed once"
    assert clean["shards_computed"] == flaky["shards_computed"] == 2 and flaky["rows"] == total
    out = read_parts(tmp_path / "flaky" / "shards")
    assert out[ROW_INDEX].to_pylist() == list(range(total))
    assert out["score"].to_pylist() == expected_scores(total, 2)
    assert out.equals(read_parts(tmp_path / "clean" / "shards"))


@pytest.mark.ray
def test_sharded_stage_publishes_shards_into_the_stage_folder_and_is_skipped_when_current(pickled_tests, tmp_path):
    from raycurate.rundir import RunDir

    total = write_input(tmp_path / "in", [12])
    run = RunDir(tmp_path / "run")
    pool = PoolResources(num_actors=2, num_cpus=0.5, num_gpus=0, batch_size=5)
    kwargs = dict(config={"v": 1}, upstream=[], shard_rows=5, progress=False)
    record = sharded_stage(run, "score", tmp_path / "in", LengthScoreUDF, {}, pool, **kwargs)
    assert record["status"] == "done" and record["outputs"] == {"shards": "score/shards"}
    assert record["metrics"]["shards"] == 3 and record["metrics"]["rows"] == total
    assert read_parts(run.root / "score" / "shards")["score"].to_pylist() == expected_scores(total)
    assert not (run.root / "_scratch" / "score").exists(), "scratch shards are moved, not copied"
    again = sharded_stage(run, "score", tmp_path / "in", LengthScoreUDF, {}, pool, **kwargs)
    assert again["finished"] == record["finished"], "a current stage is skipped"


def test_a_sharded_map_needs_ray_started_by_init_ray(tmp_path, monkeypatch):
    import ray

    write_input(tmp_path / "in", [4])
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="init_ray"):
        map_shards(tmp_path / "in", tmp_path / "out", LengthScoreUDF, {}, shard_rows=2, num_actors=1,
                   num_cpus_per_actor=1)


@pytest.mark.ray
def test_a_shard_that_keeps_failing_raises_naming_it_and_keeps_finished_shards(pickled_tests, tmp_path):
    write_input(tmp_path / "in", [10])
    message = r"part-0000\d \(input rows \[\d+, \d+\)\) failed after all retries; .* re-run to resume"
    with pytest.raises(ShardFailed, match=message):
        map_shards(tmp_path / "in", tmp_path / "out", AlwaysFailsUDF, {}, shard_rows=5, num_actors=1,
                   num_cpus_per_actor=0.5, max_restarts=0, max_task_retries=1, progress=False)
    assert not list((tmp_path / "out" / "shards").glob("*.done"))


CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests_dir!r})
    import ray.cloudpickle
    import test_sharded
    from raycurate.stages.runtime import init_ray

    ray.cloudpickle.register_pickle_by_value(test_sharded)
    init_ray(num_cpus=2, temp_dir={ray_dir!r})
    metrics = test_sharded.map_shards({input!r}, {out!r}, test_sharded.LengthScoreUDF,
                                      {{"calls_dir": {calls!r}, "sleep_s": 0.3}}, shard_rows=8, num_actors=2,
                                      num_cpus_per_actor=0.5)
    print("METRICS " + json.dumps(metrics))
""")


def run_child(tmp_path: Path, out: Path, calls: Path, kill_after_shards: int | None = None) -> dict | None:
    """Run a sharded map in a fresh process (own Ray); optionally SIGKILL its process group after k markers."""
    calls.mkdir(parents=True, exist_ok=True)
    ray_dir = tempfile.mkdtemp(prefix="rcsh", dir="/tmp")  # short: Ray's socket paths are length-limited
    script = tmp_path / f"child-{uuid.uuid4().hex[:6]}.py"
    script.write_text(CHILD.format(tests_dir=str(TESTS_DIR), ray_dir=ray_dir, input=str(tmp_path / "in"),
                                   out=str(out), calls=str(calls)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        if kill_after_shards is None:
            stdout, _ = proc.communicate(timeout=180)
            assert proc.returncode == 0, stdout[-3000:]
            line = next(x for x in stdout.splitlines() if x.startswith("METRICS "))
            return json.loads(line[len("METRICS "):])
        deadline = time.monotonic() + 120
        while len(list((out / "shards").glob("*.done"))) < kill_after_shards:
            if proc.poll() is not None:
                output = proc.communicate()[0][-3000:]
                assert proc.returncode != 0, "the child finished before it could be killed; make its shards slower"
                raise AssertionError(f"the child failed (exit {proc.returncode}) before it could be killed:\n{output}")
            assert time.monotonic() < deadline, "no progress in the child"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        return None
    finally:
        _kill_session(proc.pid)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(ray_dir, ignore_errors=True)


def _kill_session(sid: int) -> None:
    """SIGKILL what is left of the child's session (Ray's workers get their own process groups in it)."""
    import psutil

    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.info["pid"]) == sid:
                os.kill(p.info["pid"], signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue


@pytest.mark.slow  # ~40 s: two fresh processes each start their own Ray
@pytest.mark.ray
def test_killed_run_resumes_recomputing_only_unfinished_shards(pickled_tests, tmp_path):
    total = write_input(tmp_path / "in", [30, 26])  # 7 shards of 8 rows
    shard_of = {f"r{shard * 8:06d}": f"part-{shard:05d}" for shard in range(7)}  # first row id -> shard
    out, calls = tmp_path / "out", tmp_path / "calls"
    run_child(tmp_path, out, calls, kill_after_shards=2)
    done_before = {p.stem for p in (out / "shards").glob("*.done")}
    mtimes = {name: (out / "shards" / f"{name}.done").stat().st_mtime_ns for name in done_before}
    assert 2 <= len(done_before) < 7
    calls_before = set(calls.iterdir())

    resumed = run_child(tmp_path, out, calls)  # same UDF arguments, so the same plan
    assert resumed["shards_skipped"] == len(done_before)
    assert resumed["shards_computed"] == 7 - len(done_before)
    recomputed = {shard_of[p.name.split(".")[0]] for p in set(calls.iterdir()) - calls_before}
    assert recomputed == set(shard_of.values()) - done_before, "only the unfinished shards are recomputed"
    assert all((out / "shards" / f"{n}.done").stat().st_mtime_ns == t for n, t in mtimes.items())

    map_shards(tmp_path / "in", tmp_path / "reference", LengthScoreUDF, {}, shard_rows=8, num_actors=2,
               num_cpus_per_actor=0.5, progress=False)
    resumed_rows = read_parts(out / "shards")
    assert resumed_rows[ROW_INDEX].to_pylist() == list(range(total))
    assert resumed_rows.to_pylist() == read_parts(tmp_path / "reference" / "shards").to_pylist()


def test_in_process_map_writes_the_same_parts_and_resumes_without_ray(tmp_path):
    """in_process=True (bridge_select on small inputs): same plan, parts and markers as the actor pool, no Ray."""
    total = write_input(tmp_path / "in", [23, 17])
    first = map_shards(tmp_path / "in", tmp_path / "out", LengthScoreUDF, {"scale": 3}, shard_rows=10,
                       num_actors=0, num_cpus_per_actor=1, progress=False, in_process=True)
    assert first["shards_computed"] == 4 and first["rows"] == total
    out = read_parts(tmp_path / "out" / "shards")
    assert out[ROW_INDEX].to_pylist() == list(range(total))
    assert out["score"].to_pylist() == expected_scores(total, 3)
    (tmp_path / "out" / "shards" / "part-00001.done").unlink()
    again = map_shards(tmp_path / "in", tmp_path / "out", LengthScoreUDF, {"scale": 3}, shard_rows=10,
                       num_actors=0, num_cpus_per_actor=1, progress=False, in_process=True)
    assert (again["shards_skipped"], again["shards_computed"]) == (3, 1)
    assert read_parts(tmp_path / "out" / "shards").equals(out)
    with pytest.raises(ValueError, match="num_actors"):
        map_shards(tmp_path / "in", tmp_path / "x", LengthScoreUDF, {}, shard_rows=10, num_actors=0,
                   num_cpus_per_actor=1)
