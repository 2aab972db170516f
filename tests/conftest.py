"""Shared fixtures: a local Ray instance for the tests that need one (marked ``ray``)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - torch missing means no GPU either
        return False


def pytest_collection_modifyitems(config, items):
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
