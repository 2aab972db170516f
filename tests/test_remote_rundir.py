"""Run directories on remote storage: a ``file://`` URI, an S3 emulator (moto) on loopback, and a pipeline end to end.

The S3 tests talk to ``moto.server.ThreadedMotoServer`` on 127.0.0.1 through pyarrow's S3 client.  What that
combination needs:

* ``endpoint_override=127.0.0.1:PORT`` and ``scheme=http`` in the URI (moto serves plain HTTP).  pyarrow then
  addresses buckets path-style (``http://127.0.0.1:PORT/bucket/key``) by default, as moto expects, so
  ``force_virtual_addressing`` stays at its default (False).
* ``allow_bucket_creation=True`` on the ``S3FileSystem`` that creates the bucket (pyarrow >= 15 refuses to
  create buckets otherwise: "Bucket 'x' not found. To create buckets, enable the allow_bucket_creation option").
* Any credentials (moto does not check them) in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, and
  AWS_EC2_METADATA_DISABLED=true so the AWS SDK does not probe the instance metadata endpoint; region us-east-1.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from raycurate import storage
from raycurate.rundir import RunDir, open_run_dir
from raycurate.stages.base import StageOutput, run_stage


def _stage(calls: list[str], name: str, files: dict[str, str]):
    """A stage body that counts its calls and writes ``files`` (relative path -> text)."""

    def body(out: Path) -> StageOutput:
        calls.append(name)
        for rel, text in files.items():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            (out / rel).write_text(text)
        return StageOutput(outputs={"out": next(iter(files))}, metrics={"files": len(files)})

    return body


def _two_stages(run: RunDir, calls: list[str]) -> None:
    run_stage(run, "a", _stage(calls, "a", {"out.txt": "A", "sub/deep.txt": "deep"}), config={"a": 1})
    run_stage(run, "b", _stage(calls, "b", {"out.txt": "B"}), config={"b": 1}, upstream=["a"])


def _remote_files(runs_uri: str, name: str) -> list[str]:
    return storage.list_files(storage.Location.parse(runs_uri).child(name))


def _remote_manifest(runs_uri: str, name: str) -> dict:
    return json.loads(storage.read_text(storage.Location.parse(runs_uri).child(name, "manifest.json")))


def _round_trip(runs_uri: str, tmp_path: Path) -> None:
    """Two stages persist to ``runs_uri``; a fresh mirror skips both and gets their outputs; failures and stale
    files of a re-run stage leave nothing behind remotely."""
    calls: list[str] = []
    run = open_run_dir(runs_uri, "r", local_dir=tmp_path / "mirror1")
    assert run.root == (tmp_path / "mirror1" / "r").resolve() and run.remote is not None
    _two_stages(run, calls)
    assert calls == ["a", "b"]
    assert _remote_files(runs_uri, "r") == ["a/out.txt", "a/sub/deep.txt", "b/out.txt", "manifest.json"]
    manifest = _remote_manifest(runs_uri, "r")
    assert {k: v["status"] for k, v in manifest["stages"].items()} == {"a": "done", "b": "done"}
    assert manifest["storage"] == storage.redact(runs_uri).rstrip("/") + "/r" and "?" not in manifest["storage"]

    fresh = open_run_dir(runs_uri, "r", local_dir=tmp_path / "mirror2")
    assert (fresh.root / "a/sub/deep.txt").read_text() == "deep" and (fresh.root / "b/out.txt").read_text() == "B"
    _two_stages(fresh, calls)
    assert calls == ["a", "b"], "a fresh mirror of a finished remote run must skip every stage"

    def boom(out: Path) -> StageOutput:
        (out / "half.txt").write_text("partial")
        raise RuntimeError("crash mid-stage")

    with pytest.raises(RuntimeError, match="crash mid-stage"):
        run_stage(fresh, "c", boom, config={})
    manifest = _remote_manifest(runs_uri, "r")
    assert manifest["stages"]["c"]["status"] == "failed"
    assert not [f for f in _remote_files(runs_uri, "r") if f.startswith("c/")], "no partial folder for c"

    (fresh.root / "a" / "stale.txt").write_text("old")
    run_stage(fresh, "a", _stage(calls, "a", {"out.txt": "A2", "stale.txt": "still here"}), config={"a": 1},
              force=True)
    assert "a/stale.txt" in _remote_files(runs_uri, "r")
    run_stage(fresh, "a", _stage(calls, "a", {"out.txt": "A3"}), config={"a": 1}, force=True)
    files = _remote_files(runs_uri, "r")
    assert [f for f in files if f.startswith("a/")] == ["a/out.txt"], "a re-run stage leaves no stale remote files"
    loc = storage.Location.parse(runs_uri).child("r", "a", "out.txt")
    assert storage.read_text(loc) == "A3"

    (fresh.root / "report.html").write_text("<html></html>")
    (fresh.root / "_scratch" / "a").mkdir(parents=True)
    (fresh.root / "_scratch" / "a" / "ckpt.bin").write_text("x")
    fresh.sync()
    files = _remote_files(runs_uri, "r")
    assert "report.html" in files and not [f for f in files if f.startswith("_scratch")]

    third = open_run_dir(runs_uri, "r", local_dir=tmp_path / "mirror1")  # the first mirror: a is out of date
    assert (third.root / "a/out.txt").read_text() == "A3" and not (third.root / "a/sub").exists()


def test_local_runs_dir_has_no_remote_and_no_mirror(tmp_path):
    run = open_run_dir(tmp_path / "runs", "r", local_dir=tmp_path / "unused")
    assert run.remote is None and run.root == (tmp_path / "runs" / "r").resolve()
    calls: list[str] = []
    _two_stages(run, calls)
    run.sync()
    assert "storage" not in run.load_manifest() and not (tmp_path / "unused").exists()


def test_file_uri_round_trip(tmp_path):
    _round_trip(f"file://{tmp_path / 'remote'}", tmp_path)


def test_default_mirror_is_keyed_by_the_uri(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = open_run_dir(f"file://{tmp_path / 'remote'}", "r")
    assert run.root.parent.parent == (tmp_path / ".cache/raycurate/run-mirrors").resolve()
    assert run.root.name == "r" and len(run.root.parent.name) == 16


def test_bad_uris_name_the_uri_and_the_config_key(tmp_path):
    with pytest.raises(storage.StorageError, match=r"run\.runs_dir='nosuch://x/y'.*local path"):
        open_run_dir("nosuch://x/y", "r", local_dir=tmp_path)


def test_ingest_command_writes_to_a_uri_and_inspect_reads_it(tmp_path, monkeypatch, capsys):
    from raycurate.cli.main import main

    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data.jsonl"
    data.write_text('{"id": "a", "prompt": "p", "response": "r"}\n{"id": "a", "prompt": "dup", "response": "d"}\n')
    out = f"file://{tmp_path / 'remote' / 'ing'}"
    assert main(["ingest", "--input", str(data), "--out", out]) == 0
    manifest = _remote_manifest(f"file://{tmp_path / 'remote'}", "ing")
    assert manifest["rows"]["input"] == 2 and manifest["stages"]["ingest"]["status"] == "done"
    assert (tmp_path / "remote/ing/ingest/rejected.jsonl").exists() and not (tmp_path / "file:").exists()
    capsys.readouterr()
    assert main(["inspect", out]) == 0
    assert f"storage: {out}" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------------------
# S3 through moto on loopback
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moto_endpoint():
    """``host:port`` of a moto S3 server on 127.0.0.1 (one per module)."""
    moto_server = pytest.importorskip("moto.server", reason="moto is not installed: pip install 'moto[server]'")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"{host}:{port}"
    server.stop()


@pytest.fixture
def s3_runs(moto_endpoint, monkeypatch):
    """``s3://<fresh bucket>/runs?endpoint_override=...&scheme=http`` on the moto server."""
    import pyarrow.fs as pafs

    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(key, value)
    bucket = f"raycurate-{uuid.uuid4().hex[:8]}"
    s3 = pafs.S3FileSystem(endpoint_override=moto_endpoint, scheme="http", access_key="testing",
                           secret_key="testing", region="us-east-1", allow_bucket_creation=True)
    s3.create_dir(bucket)
    return f"s3://{bucket}/runs?endpoint_override={moto_endpoint}&scheme=http"


def test_s3_round_trip(s3_runs, tmp_path):
    _round_trip(s3_runs, tmp_path)


def test_s3_missing_bucket_is_a_clear_error(moto_endpoint, s3_runs, tmp_path):
    with pytest.raises(storage.StorageError, match=r"bucket 'no-such-bucket' of run\.runs_dir=.*does not exist"):
        open_run_dir(f"s3://no-such-bucket/runs?endpoint_override={moto_endpoint}&scheme=http", "r",
                     local_dir=tmp_path)


# ----------------------------------------------------------------------------------------------------------
# A pipeline end to end (slow: Ray, a tiny base model, ingest and tokenize)
# ----------------------------------------------------------------------------------------------------------

# The demo job without training methods: corpus -> base_model -> ingest -> tokenize -> eval_base on 120 rows.
TINY = ["demo.methods=[base]", "data.corpus_rows=120", "data.heldout_rows=6", "data.corpus_bad_lines=2",
        "model.pretrain_steps=3", "model.pretrain_rows=120", "model.vocab_size=512", "eval.max_new_tokens=4",
        "eval.batch_size=8", "run.progress=false", "tokenize.num_actors=1", "eval.pool.num_actors=1",
        "eval.lm_eval_tasks=[]", "ray.num_cpus=2"]


@pytest.mark.slow
@pytest.mark.ray
def test_demo_pipeline_persists_to_s3_and_a_fresh_mirror_skips_every_stage(s3_runs, tmp_path, capsys):
    from raycurate.cli.main import main

    args = ["demo", *TINY, f"run.runs_dir={s3_runs}", "run.name=e2e", f"model.cache_dir={tmp_path / 'cache'}"]
    assert main([*args, f"run.local_dir={tmp_path / 'mirror1'}"]) == 0
    assert "run directory: s3://" in capsys.readouterr().out
    manifest = _remote_manifest(s3_runs, "e2e")
    stages = manifest["stages"]
    assert {"corpus", "base_model", "ingest", "tokenize", "eval_base"} <= set(stages)
    assert all(rec["status"] == "done" for rec in stages.values())
    rows = manifest["rows"]
    assert rows["input"] == rows["accepted"] + rows["rejected"] and rows["rejected"] > 0
    files = _remote_files(s3_runs, "e2e")
    assert {"manifest.json", "config.yaml", "report.html"} <= set(files)
    assert all(any(f.startswith(f"{stage}/") for f in files) for stage in stages)

    assert main([*args, f"run.local_dir={tmp_path / 'mirror2'}"]) == 0
    again = _remote_manifest(s3_runs, "e2e")["stages"]
    assert {k: v["finished"] for k, v in again.items()} == {k: v["finished"] for k, v in stages.items()}, \
        "a re-run from an empty mirror must skip every finished stage"
    assert main(["inspect", s3_runs.replace("/runs?", "/runs/e2e?")]) == 0
    assert "storage: s3://" in capsys.readouterr().out
