"""Run directory: atomic outputs, manifest records, skip-on-rerun and downstream-only re-runs."""

from __future__ import annotations

import json

import pytest

from raycurate.rundir import RunDir, atomic_dir, atomic_file, atomic_write_json
from raycurate.stages.base import StageOutput, output_path, run_stage


def test_atomic_write_json_leaves_no_temp_files(tmp_path):
    atomic_write_json(tmp_path / "a.json", {"x": 1})
    atomic_write_json(tmp_path / "a.json", {"x": 2})
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_atomic_file_renames_on_success_and_cleans_up_on_error(tmp_path):
    target = tmp_path / "sub" / "out.txt"
    with atomic_file(target, fsync=True) as tmp:
        assert tmp.parent == target.parent and tmp.name.startswith(".out.txt.") and tmp.name.endswith(".tmp")
        tmp.write_text("good")
    with pytest.raises(RuntimeError):
        with atomic_file(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash")
    assert target.read_text() == "good"
    assert [p.name for p in target.parent.iterdir()] == ["out.txt"]
    with atomic_file(target) as first, atomic_file(target) as second:
        assert first != second  # racing writers never share a temp name
        first.write_text("first")
        second.write_text("second")
    assert target.read_text() == "first"  # the outer one renames last


def test_atomic_dir_keeps_old_contents_on_error(tmp_path):
    target = tmp_path / "stage"
    with atomic_dir(target) as tmp:
        (tmp / "f.txt").write_text("good")
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as tmp:
            (tmp / "f.txt").write_text("half")
            raise RuntimeError("crash")
    assert (target / "f.txt").read_text() == "good"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stage"]


def _pipeline(run: RunDir, calls: list[str], cfg: dict) -> None:
    """A three-stage chain a -> b -> c where each stage appends its name to ``calls``."""

    def make(name: str, upstream: list[str]):
        def body(out):
            calls.append(name)
            text = "".join((run.root / f"{u}/out.txt").read_text() for u in upstream) + f"{name}{cfg[name]}"
            (out / "out.txt").write_text(text)
            return StageOutput(outputs={"out": "out.txt"}, metrics={"len": len(text)})

        return body

    run_stage(run, "a", make("a", []), config=cfg["a"])
    run_stage(run, "b", make("b", ["a"]), config=cfg["b"], upstream=["a"])
    run_stage(run, "c", make("c", ["b"]), config=cfg["c"], upstream=["b"])


def test_rerun_skips_and_changed_stage_reruns_with_downstream_only(tmp_path):
    run = RunDir(tmp_path / "run")
    calls: list[str] = []
    cfg = {"a": 1, "b": 1, "c": 1}
    _pipeline(run, calls, cfg)
    assert calls == ["a", "b", "c"]
    _pipeline(run, calls, cfg)
    assert calls == ["a", "b", "c"], "a second run with the same config must skip every stage"
    _pipeline(run, calls, {"a": 1, "b": 2, "c": 1})
    assert calls == ["a", "b", "c", "b", "c"], "changing b re-runs b and its downstream c, not a"
    assert (run.root / "c/out.txt").read_text() == "a1b2c1"
    manifest = run.load_manifest()
    for name in "abc":
        record = manifest["stages"][name]
        assert record["status"] == "done" and record["seconds"] >= 0 and len(record["config_hash"]) == 16
        assert record["outputs"] == {"out": f"{name}/out.txt"}
    assert output_path(run, "c", "out") == run.root / "c/out.txt"


def test_missing_output_makes_stage_stale(tmp_path):
    run = RunDir(tmp_path / "run")
    calls: list[str] = []
    cfg = {"a": 1, "b": 1, "c": 1}
    _pipeline(run, calls, cfg)
    (run.root / "b/out.txt").unlink()
    _pipeline(run, calls, cfg)
    assert calls[3:] == ["b", "c"]


def test_failed_stage_is_recorded_and_rerun(tmp_path):
    run = RunDir(tmp_path / "run")

    def boom(out):
        raise ValueError("bad input")

    with pytest.raises(ValueError):
        run_stage(run, "x", boom, config={})
    record = run.stage_record("x")
    assert record["status"] == "failed" and "bad input" in record["error"]
    assert not (run.root / "x").exists()
    run_stage(run, "x", lambda out: (out / "f").write_text("ok") and StageOutput({"f": "f"}), config={})
    assert run.stage_record("x")["status"] == "done"


def test_declared_output_must_exist(tmp_path):
    run = RunDir(tmp_path / "run")
    with pytest.raises(RuntimeError, match="did not write"):
        run_stage(run, "x", lambda out: StageOutput({"f": "missing.txt"}), config={})


def test_recorded_links_may_point_outside_but_recorded_paths_may_not_escape(tmp_path):
    """base_model/model is a link to the model cache outside the run: allowed; a '..' path in a manifest: refused."""
    from raycurate.rundir import RunDir, RunDirError

    run = RunDir(tmp_path / "run")
    target = tmp_path / "cache" / "model"
    target.mkdir(parents=True)
    (run.root / "base_model").mkdir(parents=True)
    (run.root / "base_model" / "model").symlink_to(target, target_is_directory=True)
    assert run.relative(run.root / "base_model" / "model") == "base_model/model"
    assert run.path_of("base_model/model") == run.root / "base_model" / "model"
    with pytest.raises(RunDirError, match="outside the run directory"):
        run.path_of("../cache/model")


def test_forced_stages_rerun_with_their_downstream(tmp_path):
    """``run.force`` (the job's ``run.force``) re-runs a current stage and what reads it; ``all`` re-runs all."""
    run = RunDir(tmp_path / "run")
    calls: list[str] = []
    cfg = {"a": 1, "b": 1, "c": 1}
    _pipeline(run, calls, cfg)
    run.force(["b"])
    assert run.is_forced("b") and not run.is_forced("a")
    _pipeline(run, calls, cfg)
    assert calls == ["a", "b", "c", "b", "c"]
    run.force(["all"])
    _pipeline(run, calls, cfg)
    assert calls[5:] == ["a", "b", "c"]


def test_forced_stage_starts_over_instead_of_resuming_its_scratch(tmp_path):
    """A forced stage deletes ``_scratch/<stage>`` first: a finished training's last checkpoint there carries the
    same config hash and would otherwise be resumed as "done" (0 steps trained); an unforced re-run keeps it."""
    from raycurate.stages.base import scratch_dir

    run = RunDir(tmp_path / "run")
    seen: list[bool] = []

    def body(out):
        state = scratch_dir(run, "train") / "checkpoint_step_00000084"
        seen.append(state.exists())
        state.mkdir(exist_ok=True)
        (out / "model").write_text("weights")
        return StageOutput({"model": "model"})

    run_stage(run, "train", body, config={"lr": 1})
    run_stage(run, "train", body, config={"lr": 2})  # re-run, not forced: the scratch is left to the stage
    run_stage(run, "train", body, config={"lr": 2}, force=True)
    run.force(["train"])
    run_stage(run, "train", body, config={"lr": 2})
    assert seen == [False, True, False, False]
    assert (run.root / "_scratch/train/checkpoint_step_00000084").is_dir(), "the forced run's own state is kept"
