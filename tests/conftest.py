"""Shared fixtures: a local Ray instance for the tests that need one (marked ``ray``)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests start their own local Ray; a RAY_ADDRESS in the caller's environment (a CI runner inside a Ray job, a
# shell after `ray start`) would make every init_ray(num_cpus=...) join that cluster instead.
os.environ.pop("RAY_ADDRESS", None)
# Under `pytest -n 2` two workers share the cores: one torch thread each (two threads per process on busy cores can
# run ten times slower).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - torch missing means no GPU either
        return False


# Under `pytest -n 2` (pytest-xdist) each module runs whole on one worker (its module-scoped fixtures are built once;
# test_node_loss's are whole multi-node runs) and the modules that read the shared tiny demo run on the same worker
# (it is built once). xdist's own `xdist_group` marks do nothing under pytest 9.2 (xdist 3.8 renames `item._nodeid`,
# which pytest 9.2 no longer reads), so the grouping is this scheduler's.
_SHARED_SCOPES = {"tests/test_bridge_score_select.py": "tiny_demo", "tests/test_demo_e2e.py": "tiny_demo"}
# Sent first, longest first (the idle CI run of 2026-12-07: seconds per module), so no worker is left with a long
# module after the other is done; every other module keeps its place after them.
_LONGEST_MODULES = ("test_train_stage", "test_bridge_score_select", "test_demo_e2e", "test_node_loss",
                    "test_curate_e2e", "test_api", "test_bilevel_e2e", "test_user_curate", "test_p2d_e2e",
                    "test_tune", "test_ray_jobs", "test_sharded", "test_bilevel_train")


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        """Whole modules as units, in collection order (see :func:`pytest_collection_modifyitems`)."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return _SHARED_SCOPES.get(path, path)

    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if getattr(config, "workerinput", None) is not None:  # a pytest-xdist worker: the longest modules first
        rank = {name: i for i, name in enumerate(_LONGEST_MODULES)}
        items.sort(key=lambda item: rank.get(getattr(getattr(item, "module", None), "__name__", ""), len(rank)))
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
