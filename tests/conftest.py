"""Shared fixtures: a local Ray instance for the tests that need one (marked ``ray``)."""

from __future__ import annotations

import os

import pytest
import xdist_units

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests start their own local Ray; a RAY_ADDRESS in the caller's environment (a CI runner inside a Ray job, a
# shell after `ray start`) would make every init_ray(num_cpus=...) join that cluster instead.
os.environ.pop("RAY_ADDRESS", None)
# Under `pytest -n 2` two workers share the cores: one torch thread each (two threads per process on busy cores can
# run ten times slower).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ray Train's controller polls its worker group every 2 s by default: a 2-step training of a tiny model then
# waits up to 2 s to be seen finished, and its start-up polls too (~5 s a launch at 0.25 s: 31.8 -> 26.7 s a DDP
# launch, benchmarks/RESULTS.md, tenth session). Its
# preemption watcher (a node-drain poller, one more actor process a launch) watches drains no test makes.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - torch missing means no GPU either
        return False


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: pytest -n 2 splits the suite by xdist_units
def pytest_xdist_make_scheduler(config, log):
    return xdist_units.make_scheduler(config, log)


def pytest_collection_modifyitems(config, items):
    if getattr(config, "workerinput", None) is not None:  # a pytest-xdist worker
        xdist_units.order(items)
    if _has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def ray_local():
    """A 2-CPU local Ray instance shared by the whole session (started once: ``ray.init`` costs ~3-4 s)."""
    import ray

    from raycurate.stages.runtime import init_ray

    init_ray(num_cpus=2)
    yield ray
    ray.shutdown()



@pytest.fixture(scope="session")
def tiny_demo(ray_local, tmp_path_factory):
    """The shared tiny demo run (:mod:`tiny_demo`): ``(run_dir, cache_dir, stdout of the run)``.  Read it; re-run
    only a copy (:func:`tiny_demo.copy_tiny_demo`)."""
    import contextlib
    import io

    from tiny_demo import tiny_demo_args

    from raycurate.cli.main import main

    root = tmp_path_factory.mktemp("tiny_demo")
    run_dir, cache_dir = root / "demo", root / "cache"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(tiny_demo_args(run_dir, cache_dir)) == 0
    return run_dir, cache_dir, out.getvalue()
