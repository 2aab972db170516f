"""How ``pytest -n 2`` (pytest-xdist) splits the suite: work units and their order.

A unit runs whole on one worker. By default a unit is a test module (its module-scoped fixtures are built once);
the modules that read the shared tiny demo form one unit (it is built once per worker that needs it). The longest
modules are split: each of their tests is a unit, except the tests sharing one of :data:`SHARED_FIXTURES` (a whole
training or multi-node run), which stay together. Units are sent longest first, so the fast tests fill in at the
end and no worker is left with a long test after the other is done.

The workers know each test's fixtures and markers; the scheduler (in the controlling process) sees only test ids.
So each worker writes ``{test id: unit}`` to the file named by ``$RAYCURATE_TEST_UNITS`` and orders its collection;
the scheduler reads the file. (xdist's own ``xdist_group`` marks do nothing under pytest 9.2: xdist 3.8 rewrites
``item._nodeid``, which pytest 9.2 no longer reads.)
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

UNITS_ENV = "RAYCURATE_TEST_UNITS"
SHARED_MODULES = {"test_bridge_score_select": "tiny_demo", "test_demo_e2e": "tiny_demo"}
SPLIT_MODULES = ("test_train_stage", "test_node_loss")
SHARED_FIXTURES = ("zero2_resumed", "data_scenarios", "training_scenarios")
# Longest first (seconds per module in the 2026-12-07 idle runs); every other module keeps its place after them.
LONGEST_MODULES = ("test_train_stage", "test_node_loss", "test_bridge_score_select", "test_demo_e2e",
                   "test_curate_e2e", "test_api", "test_bilevel_e2e", "test_user_curate", "test_p2d_e2e",
                   "test_tune", "test_ray_jobs", "test_sharded", "test_bilevel_train")


def name_units_file() -> None:
    """In the controlling process: a fresh file name in ``$RAYCURATE_TEST_UNITS`` (the workers inherit it)."""
    if not os.environ.get(UNITS_ENV):
        os.environ[UNITS_ENV] = str(Path(tempfile.mkdtemp(prefix="raycurate-xdist-")) / "units.json")


def _module(item: Any) -> str:
    return getattr(getattr(item, "module", None), "__name__", "")


def unit_of(item: Any) -> str:
    """The unit of a collected test (see the module docstring)."""
    module = _module(item)
    if module in SPLIT_MODULES:
        fixtures = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        shared = sorted(name for name in SHARED_FIXTURES if name in fixtures)
        return f"{module}::{'+'.join(shared)}" if shared else item.nodeid
    return SHARED_MODULES.get(module, module)


def order_and_record(items: list[Any]) -> None:
    """In a worker: sort ``items`` longest units first (the split modules' slow tests first) and write the units."""
    rank = {name: i for i, name in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: (rank.get(_module(item), len(rank)), "slow" not in item.keywords))
    if not os.environ.get(UNITS_ENV):
        return
    units = {item.nodeid: unit_of(item) for item in items}
    path = Path(os.environ[UNITS_ENV])
    scratch = path.with_name(f"{path.name}.{os.getpid()}")
    scratch.write_text(json.dumps(units))
    os.replace(scratch, path)  # every worker writes the same content


def make_scheduler(config: Any, log: Any) -> Any:
    """A ``LoadScopeScheduling`` whose scopes are the units the workers recorded."""
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        units: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.units is None:  # read once, when the workers have collected
                self.units = json.loads(Path(os.environ[UNITS_ENV]).read_text())
            return self.units.get(nodeid, nodeid)

    config.option.loadscopereorder = False  # send the units in the workers' order, not by test count
    return UnitScheduling(config, log)
