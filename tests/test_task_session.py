"""``train.launcher=task`` without Ray: the TaskSession's checkpoint folder, the 1-rank process group and the
launcher validation (the Ray launches are in tests/test_train_stage.py and tests/test_bilevel_train.py)."""

from __future__ import annotations

import os
import shutil

import pytest

from raycurate.config.loader import ConfigError, from_dict
from raycurate.config.schema import JobConfig
from raycurate.config.train import TrainConfig
from raycurate.training.session import TaskSession, scoped_env, single_rank_process_group, worker_threads


def _report(session: TaskSession, tmp_path, step: int, text: str | None = None) -> None:
    """Report a checkpoint of ``step`` holding one file (``text``, default the step), as ``save_checkpoint`` does."""
    src = tmp_path / f"src_{step}_{len(os.listdir(tmp_path))}"
    src.mkdir()
    (src / "state.txt").write_text(text or str(step))
    session.report({"step": step}, str(src))


def _steps(run_dir) -> list[str]:
    return sorted(os.listdir(run_dir))


def test_task_session_is_rank_0_of_1_on_cpu(tmp_path):
    session = TaskSession(str(tmp_path / "run"), keep_checkpoints=2)
    assert (session.rank, session.local_rank, session.world_size, session.device.type) == (0, 0, 1, "cpu")
    assert os.path.isdir(tmp_path / "run")
    with session.restore_dir() as path:
        assert path is None


def test_checkpoints_use_ray_train_names_and_the_newest_is_restored(tmp_path):
    run_dir = tmp_path / "storage" / "sft"
    session = TaskSession(str(run_dir), keep_checkpoints=5)
    for step in (2, 4, 10):
        _report(session, tmp_path, step)
    session.report({"step": 11}, None)  # metrics only: no folder
    assert _steps(run_dir) == ["checkpoint_step_00000002", "checkpoint_step_00000004", "checkpoint_step_00000010"]
    resumed = TaskSession(str(run_dir), keep_checkpoints=5)  # a re-run of the stage
    with resumed.restore_dir() as restored, resumed.latest_checkpoint_dir() as latest:
        assert restored == latest == str(run_dir / "checkpoint_step_00000010")
        assert open(os.path.join(restored, "state.txt")).read() == "10"


def test_keep_checkpoints_prunes_the_oldest(tmp_path):
    session = TaskSession(str(tmp_path / "run"), keep_checkpoints=2)
    for step in (1, 2, 3, 4):
        _report(session, tmp_path, step)
    assert _steps(tmp_path / "run") == ["checkpoint_step_00000003", "checkpoint_step_00000004"]


def test_a_failed_copy_leaves_no_checkpoint_and_the_previous_one_is_restored(tmp_path, monkeypatch):
    session = TaskSession(str(tmp_path / "run"), keep_checkpoints=2)
    _report(session, tmp_path, 2)

    def copy_half_then_die(src, dst):
        os.makedirs(dst)
        shutil.copy2(os.path.join(src, "state.txt"), dst)
        raise OSError("disk full")

    monkeypatch.setattr(shutil, "copytree", copy_half_then_die)
    with pytest.raises(OSError, match="disk full"):
        _report(session, tmp_path, 4)
    assert _steps(tmp_path / "run") == ["checkpoint_step_00000002"]  # the partial copy is deleted with the error
    with session.restore_dir() as path:
        assert path.endswith("checkpoint_step_00000002")


def test_partial_copies_of_a_killed_save_are_removed_when_the_next_session_starts(tmp_path):
    run_dir = tmp_path / "run"
    _report(TaskSession(str(run_dir), keep_checkpoints=2), tmp_path, 2)
    partial = run_dir / ".checkpoint_step_00000004.tmp-0a1b2c3d"  # what a kill during copytree leaves
    partial.mkdir()
    (partial / "state.txt").write_text("half")
    (run_dir / ".keep-me").mkdir()  # not a checkpoint copy: left alone
    resumed = TaskSession(str(run_dir), keep_checkpoints=2)
    assert _steps(run_dir) == [".keep-me", "checkpoint_step_00000002"]
    with resumed.restore_dir() as path:
        assert path.endswith("checkpoint_step_00000002")


def test_the_same_step_reported_again_replaces_its_folder(tmp_path):
    session = TaskSession(str(tmp_path / "run"), keep_checkpoints=2)
    _report(session, tmp_path, 3, "first")
    _report(session, tmp_path, 3, "second")
    assert _steps(tmp_path / "run") == ["checkpoint_step_00000003"]
    assert (tmp_path / "run" / "checkpoint_step_00000003" / "state.txt").read_text() == "second"


def test_scoped_env_restores_set_and_unset_variables(monkeypatch):
    monkeypatch.setenv("RAYCURATE_TEST_A", "old")
    monkeypatch.delenv("RAYCURATE_TEST_B", raising=False)
    with scoped_env({"RAYCURATE_TEST_A": "new", "RAYCURATE_TEST_B": "set"}):
        assert os.environ["RAYCURATE_TEST_A"] == "new" and os.environ["RAYCURATE_TEST_B"] == "set"
    assert os.environ["RAYCURATE_TEST_A"] == "old" and "RAYCURATE_TEST_B" not in os.environ


def test_single_rank_process_group_is_torn_down_and_can_be_made_again():
    import torch
    import torch.distributed as dist

    assert not dist.is_initialized()
    for _ in range(2):  # Ray reuses a task's process: the second task must get a fresh group
        with single_rank_process_group(use_gpu=False):
            assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
            assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]) == ("0", "0", "1")
            total = torch.tensor([2.0])
            dist.all_reduce(total)
            assert total.item() == 2.0
        assert not dist.is_initialized() and "LOCAL_RANK" not in os.environ


# ------------------------------------------------------------------------------------------ launcher validation


def test_task_launcher_needs_one_worker_and_says_what_to_change(monkeypatch):
    from raycurate.stages import train as train_stage

    cfg = TrainConfig(launcher="task", num_workers=2, micro_batch_size=1, effective_batch_size=4)
    message = r"train.launcher=task runs one worker process, but train.num_workers=2; set train.num_workers=1, or " \
              r"use train.launcher=ray_train"
    with pytest.raises(ValueError, match=message):
        train_stage.check_launcher(cfg)

    def no_ray(cfg):
        raise AssertionError("Ray was started before the launcher was checked")

    monkeypatch.setattr(train_stage, "worker_resources", no_ray)
    with pytest.raises(ValueError, match=message):  # before the init_model check and before Ray starts
        train_stage.run_sft("t.parquet", "/no/such/model", "out", cfg, storage_dir="s", name="sft")
    train_stage.check_launcher(TrainConfig(launcher="task", num_workers=1))
    train_stage.check_launcher(TrainConfig(launcher="ray_train", num_workers=2))


def test_bds_checks_the_launcher_on_the_driver(monkeypatch):
    from raycurate.config.bilevel import BilevelConfig
    from raycurate.stages import bilevel_train as bt

    monkeypatch.setattr(bt, "worker_resources", lambda cfg: pytest.fail("Ray started"))
    cfg = TrainConfig(launcher="task", num_workers=2, micro_batch_size=1, effective_batch_size=4)
    with pytest.raises(ValueError, match="train.num_workers=2; set train.num_workers=1"):
        bt.run_bds("c", "v", "/no/such/model", "out", cfg, BilevelConfig(val_batch=2),
                   storage_dir="s", name="bds")


def test_job_config_rejects_the_task_launcher_with_two_workers():
    with pytest.raises(ConfigError, match="train.launcher=task runs one worker process"):
        from_dict(JobConfig, {"train": {"launcher": "task", "num_workers": 2}})
    with pytest.raises(ConfigError, match=r"train.launcher: 'torchrun' is not one of \['ray_train', 'task'\]"):
        from_dict(JobConfig, {"train": {"launcher": "torchrun"}})
    cfg = from_dict(JobConfig, {"train": {"launcher": "task", "num_workers": 1, "micro_batch_size": 2,
                                          "effective_batch_size": 4}})
    assert cfg.train.launcher == "task" and JobConfig().train.launcher == "ray_train"


def test_worker_threads_follow_the_reserved_cpus_unless_set():
    assert worker_threads(None, 0.95) == 1  # a fractional reservation still gets one thread
    assert worker_threads(None, 4.0) == 4
    assert worker_threads(3, 0.95) == 3


@pytest.mark.parametrize("busy, expected", [(0.0, 4), (0.4, 4), (1.6, 2), (3.5, 1), (9.0, 1)])
def test_threads_zero_take_the_idle_cores_when_the_worker_starts(monkeypatch, busy, expected):
    from raycurate.training import session

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(session, "busy_cores", lambda seconds: busy)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # the trailing load average is not read
    assert worker_threads(0, 0.95) == expected
    monkeypatch.setattr(session, "busy_cores", lambda seconds: None)  # no /proc/stat: the load average instead
    monkeypatch.setattr(os, "getloadavg", lambda: (busy, 0.0, 0.0))
    assert worker_threads(0, 0.95) == expected


def test_busy_cores_come_from_the_idle_share_of_elapsed_cpu_ticks(tmp_path):
    from raycurate.training.session import busy_from_cpu_times, cpu_times

    stat = tmp_path / "stat"
    stat.write_text("cpu  100 5 45 800 50 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    assert cpu_times(str(stat)) == (850, 1000)  # idle + iowait, user..steal
    assert cpu_times(str(tmp_path / "missing")) is None
    # 200 ticks elapsed on 4 cpus, 50 of them idle: 3 cores busy
    assert busy_from_cpu_times((100, 1000), (150, 1200), cpus=4) == pytest.approx(3.0)
    assert busy_from_cpu_times((100, 1000), (100, 1000), cpus=4) == 0.0
