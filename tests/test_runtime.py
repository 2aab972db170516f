"""init_ray: what it asks Ray for, without starting Ray (``ray.init`` is replaced by a recorder)."""

from __future__ import annotations

import logging

import pytest

from raycurate.stages import runtime


@pytest.fixture
def ray_init_calls(monkeypatch):
    """The keyword arguments of every ``ray.init`` call ``init_ray`` makes (Ray itself is never started)."""
    import ray

    calls: list[dict] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return calls


def test_no_address_starts_a_local_instance_whatever_ray_current_cluster_says(ray_init_calls, tmp_path):
    """Ray's own address=None joins the cluster a (possibly stale) ray_current_cluster file names and then rejects
    num_cpus with a ValueError; "local" always starts a fresh instance with the local options."""
    (tmp_path / "ray_current_cluster").write_text("127.0.0.1:1")
    runtime.init_ray(num_cpus=2, temp_dir=str(tmp_path))
    (kwargs,) = ray_init_calls
    assert kwargs["address"] == "local" and kwargs["num_cpus"] == 2 and kwargs["_temp_dir"] == str(tmp_path)


def test_ray_address_in_the_environment_is_joined_and_local_options_are_named_as_ignored(
        ray_init_calls, monkeypatch, caplog):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    with caplog.at_level(logging.WARNING, logger=runtime.__name__):
        runtime.init_ray(num_cpus=2, spill_dir="/tmp/spill")
    (kwargs,) = ray_init_calls
    assert kwargs["address"] == "10.0.0.5:6379" and "num_cpus" not in kwargs and "_system_config" not in kwargs
    assert "num_cpus, spill_dir" in caplog.text and "unset RAY_ADDRESS" in caplog.text


def test_an_explicit_address_is_passed_through(ray_init_calls):
    runtime.init_ray(address="auto", num_cpus=2)
    (kwargs,) = ray_init_calls
    assert kwargs["address"] == "auto" and "num_cpus" not in kwargs
