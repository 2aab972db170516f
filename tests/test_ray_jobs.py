"""cluster.yaml and docs/cluster.md checks, and the demo job submitted through the Ray Jobs API to a local head.

The Jobs test starts its own head with ``ray start --head --block`` in a new session, on loopback with free
ports, a private temp dir and a private auth token, and tears it down by killing exactly the processes of that
session (never ``ray stop``, which would stop every Ray instance on the machine).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CLUSTER_YAML = REPO / "cluster.yaml"
CLUSTER_DOC = REPO / "docs" / "cluster.md"


# ----------------------------------------------------------------------------------------------------------
# cluster.yaml and the documented commands (fast)
# ----------------------------------------------------------------------------------------------------------


def load_cluster_yaml() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def test_cluster_yaml_matches_rays_launcher_schema():
    import ray

    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    config = load_cluster_yaml()
    jsonschema.validate(config, schema)
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(config))  # the launcher's own defaults-filling and checks (no cloud calls)


def test_cluster_yaml_keeps_work_off_the_head_and_offers_gpu_workers():
    config = load_cluster_yaml()
    for key in ("cluster_name", "provider", "auth", "available_node_types", "head_node_type", "docker",
                "file_mounts", "setup_commands", "head_start_ray_commands", "worker_start_ray_commands"):
        assert key in config, key
    types = config["available_node_types"]
    assert types[config["head_node_type"]]["resources"] == {"CPU": 0}
    workers = {name: spec for name, spec in types.items() if name != config["head_node_type"]}
    assert workers and all(spec["resources"].get("GPU", 0) >= 1 for spec in workers.values())
    assert all(0 <= spec["min_workers"] <= spec["max_workers"] for spec in workers.values())
    assert config["idle_timeout_minutes"] > 0
    assert any("raycurate[gpu,eval]" in cmd for cmd in config["setup_commands"])
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert any("--object-spilling-directory" in cmd for cmd in config[key]), key
    assert any("--dashboard-host=127.0.0.1" in cmd for cmd in config["head_start_ray_commands"])


def test_cluster_image_runs_the_ray_version_raycurate_is_tested_with():
    import ray

    image = load_cluster_yaml()["docker"]["image"]
    assert re.fullmatch(r"rayproject/ray:[\d.]+-py3\d+-(gpu|cu\d+)", image), image
    assert image.split(":")[1].split("-")[0] == ray.__version__, "driver and cluster Ray versions must match"


def documented_run_commands() -> list[list[str]]:
    """Every ``raycurate run <job> key=value ...`` in docs/cluster.md's shell blocks, as argument lists."""
    commands = []
    for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", CLUSTER_DOC.read_text(), flags=re.S):
        text = block.replace("\\\n", " ")
        for line in text.splitlines():
            line = line.split(" #", 1)[0]
            if "raycurate run " in line:
                args = shlex.split(line[line.index("raycurate run ") + len("raycurate run "):])
                commands.append([a for a in args if not a.startswith("--")])
    return commands


def test_every_documented_run_command_loads_its_job_and_overrides():
    from raycurate.config.loader import apply_overrides, from_dict, read_yaml
    from raycurate.config.schema import JobConfig

    commands = documented_run_commands()
    assert any("jobs/bridge_metamath_llama3b.yaml" in c for c in commands), "the paper-scale job is documented"
    for args in commands:
        job, overrides = args[0], args[1:]
        assert (REPO / job).exists(), job
        cfg = from_dict(JobConfig, apply_overrides(read_yaml(REPO / job), overrides), source=job)
        assert cfg.pipeline


def test_documented_cli_subcommands_exist():
    from raycurate.cli.main import build_parser

    text = CLUSTER_DOC.read_text()
    code = re.findall(r"```\w*\n(.*?)```", text, flags=re.S) + re.findall(r"`([^`\n]+)`", text)
    used = {m for snippet in code for m in re.findall(r"(?:^|[\s'\"])raycurate (\w+)", snippet)}
    choices = build_parser()._subparsers._group_actions[0].choices  # the COMMAND sub-parsers
    assert {"run", "inspect"} <= used <= set(choices), sorted(used - set(choices))


# ----------------------------------------------------------------------------------------------------------
# Ray Jobs API (slow: a real head with the dashboard)
# ----------------------------------------------------------------------------------------------------------

# The demo job made tiny: 200-row corpus, a 5-step tiny model, no training; ~1-2 min on 2 CPUs.  DEMO_STAGES are
# the stages it must at least run.
TINY_DEMO = ["demo.methods=[base]", "data.corpus_rows=200", "data.heldout_rows=8", "data.corpus_bad_lines=2",
             "model.pretrain_steps=5", "model.pretrain_rows=200", "model.vocab_size=512", "eval.max_new_tokens=8",
             "eval.batch_size=8", "run.progress=false", "tokenize.num_actors=1", "eval.pool.num_actors=1",
             "eval.lm_eval_tasks=[]", "ray.address=auto"]
DEMO_STAGES = {"corpus", "base_model", "ingest", "tokenize", "eval_base"}


def free_ports(n: int) -> list[int]:
    sockets = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (the head we started; Ray gives workers their own groups)."""
    import psutil

    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getsid(proc.info["pid"]) == sid:
                os.kill(proc.info["pid"], signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue


@pytest.fixture()
def local_head(tmp_path):
    """A Ray head with the dashboard (Jobs API) on loopback; yields a ``JobSubmissionClient`` for it."""
    try:
        import ray.dashboard.optional_deps  # noqa: F401
    except ImportError as err:
        pytest.skip(f"the Ray Jobs API needs the dashboard packages: pip install 'ray[default]' ({err})")
    temp_dir = tempfile.mkdtemp(prefix="rcjob", dir="/tmp")  # short: Ray's socket paths are length-limited
    token = secrets.token_hex(32)
    (tmp_path / "auth_token").write_text(token)
    # The head, and the job drivers it starts, use a private token; the client sends it as a bearer header.
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "auth_token")}
    env.pop("RAY_ADDRESS", None)
    gcs, dashboard, client, agent, agent_grpc, metrics, env_agent = free_ports(7)
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--node-ip-address=127.0.0.1",
           f"--port={gcs}", "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
           f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
           f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
           f"--runtime-env-agent-port={env_agent}", "--num-cpus=2", f"--temp-dir={temp_dir}",
           f"--object-spilling-directory={temp_dir}/spill"]
    log = open(tmp_path / "ray_start.log", "w")
    head = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path,
                            env=env)
    try:
        yield wait_for_jobs_api(f"http://127.0.0.1:{dashboard}", {"Authorization": f"Bearer {token}"}, head,
                                tmp_path / "ray_start.log")
    finally:
        kill_session(head.pid)
        head.wait(timeout=30)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def wait_for_jobs_api(url: str, headers: dict, head: subprocess.Popen, log_path: Path, timeout_s: float = 180):
    """A ``JobSubmissionClient`` once the head's Jobs API answers."""
    from ray.job_submission import JobSubmissionClient

    deadline = time.monotonic() + timeout_s
    while True:
        if head.poll() is not None:
            raise RuntimeError(f"ray start exited with {head.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            client = JobSubmissionClient(url, headers=headers)
            client.list_jobs()
            return client
        except Exception as err:  # noqa: BLE001 - any failure means "not up yet" until the deadline
            if time.monotonic() > deadline:
                raise RuntimeError(f"Jobs API at {url} not up after {timeout_s} s: {err}") from err
            time.sleep(1)


def submit_and_wait(client, entrypoint: str, runtime_env: dict, timeout_s: float = 900):
    from ray.job_submission import JobStatus

    job_id = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env)
    deadline = time.monotonic() + timeout_s
    while not client.get_job_status(job_id).is_terminal():
        assert time.monotonic() < deadline, f"job {job_id} still running after {timeout_s} s"
        time.sleep(2)
    status, logs = client.get_job_status(job_id), client.get_job_logs(job_id)
    assert status == JobStatus.SUCCEEDED, f"job {job_id} ended {status}:\n{logs[-5000:]}"
    return logs


@pytest.mark.slow
@pytest.mark.ray
def test_demo_job_submitted_through_the_jobs_api_completes_and_resumes(local_head, tmp_path):
    runs, cache = tmp_path / "runs", tmp_path / "model_cache"
    overrides = [*TINY_DEMO, f"run.runs_dir={runs}", "run.name=jobs_demo", f"model.cache_dir={cache}"]
    entrypoint = shlex.join([sys.executable, "-m", "raycurate.cli.main", "run", "jobs/demo.yaml", *overrides])
    # The job runs in an uploaded copy of the repository, as with `ray job submit --working-dir .`; uploading a
    # snapshot keeps both submissions on the same code even if the checkout changes meanwhile.
    snapshot = tmp_path / "repo"
    shutil.copytree(REPO, snapshot, ignore=shutil.ignore_patterns(".venv", ".git", "runs", ".cache", "__pycache__",
                                                                  "*.egg-info", ".ruff_cache"))
    runtime_env = {"working_dir": str(snapshot)}
    client = local_head

    logs = submit_and_wait(client, entrypoint, runtime_env)
    manifest = json.loads((runs / "jobs_demo" / "manifest.json").read_text())
    assert set(manifest["stages"]) >= DEMO_STAGES
    assert all(record["status"] == "done" for record in manifest["stages"].values())
    assert manifest["rows"]["input"] == 202 and manifest["rows"]["accepted"] + manifest["rows"]["rejected"] == 202
    assert (runs / "jobs_demo" / "report.html").exists()
    assert "run directory:" in logs
    first = {name: record["finished"] for name, record in manifest["stages"].items()}

    logs = submit_and_wait(client, entrypoint, runtime_env)  # the same job again: every stage is current
    manifest = json.loads((runs / "jobs_demo" / "manifest.json").read_text())
    assert {name: record["finished"] for name, record in manifest["stages"].items()} == first
    assert logs.count("skipped (outputs current") == len(first)
