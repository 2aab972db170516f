"""The ``pytest -n 2`` split (tests/xdist_units.py): whole modules as units, the tiny demo's two as one, long first."""

from __future__ import annotations

from types import SimpleNamespace

import xdist_units


def test_a_unit_is_a_module_and_the_tiny_demo_modules_share_one():
    assert xdist_units.unit_of("tests/test_sampling.py::test_a[1-2]") == "tests/test_sampling.py"
    assert xdist_units.unit_of("tests/test_sampling.py::test_b") == "tests/test_sampling.py"
    assert xdist_units.unit_of("tests/test_node_loss.py::test_c") != xdist_units.unit_of("tests/test_sampling.py::x")
    assert (xdist_units.unit_of("tests/test_demo_e2e.py::test_d")
            == xdist_units.unit_of("tests/test_bridge_score_select.py::test_e") == "tiny_demo")


def test_order_puts_the_listed_modules_first_in_list_order_and_keeps_the_rest_in_place():
    def item(module: str, name: str) -> SimpleNamespace:
        return SimpleNamespace(module=SimpleNamespace(__name__=module), name=name)

    items = [item("test_a", "1"), item("test_node_loss", "2"), item("test_b", "3"), item("test_train_stage", "4"),
             item("test_node_loss", "5"), SimpleNamespace(name="6")]  # a non-Python item has no module
    xdist_units.order(items)
    assert [i.name for i in items] == ["4", "2", "5", "1", "3", "6"]


def test_the_scheduler_keeps_the_workers_order(monkeypatch):
    config = SimpleNamespace(option=SimpleNamespace(loadscopereorder=True))
    made = {}

    class FakeLoadScope:
        def __init__(self, config, log):
            made["config"] = config

    import xdist.scheduler

    monkeypatch.setattr(xdist.scheduler, "LoadScopeScheduling", FakeLoadScope)
    scheduler = xdist_units.make_scheduler(config, log=None)
    assert config.option.loadscopereorder is False and made["config"] is config
    assert scheduler._split_scope("tests/test_demo_e2e.py::t") == "tiny_demo"
