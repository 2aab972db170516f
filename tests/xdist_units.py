"""How ``pytest -n 2`` (pytest-xdist) splits the suite: whole test modules, the longest first.

A module runs whole on one worker, so its module-scoped fixtures (``test_node_loss``'s multi-node runs,
``test_train_stage``'s ZeRO-2 resume) are built once; the two modules that read the shared tiny demo run on one
worker, so it is built once. The longest modules are sent first and the short ones fill in at the end, so neither
worker is left with a long module after the other is done. (Sending ``test_train_stage``'s and ``test_node_loss``'s
tests one by one measured no faster: 1,134 s against 1,080 s, benchmarks/RESULTS.md.) xdist's own ``xdist_group``
marks do nothing under pytest 9.2 (xdist 3.8 rewrites ``item._nodeid``, which pytest 9.2 no longer reads), so the
grouping is this scheduler's.
"""

from __future__ import annotations

from typing import Any

SHARED_MODULES = {"tests/test_bridge_score_select.py": "tiny_demo", "tests/test_demo_e2e.py": "tiny_demo"}
# Long modules first, roughly by the per-file seconds of the sixth session's `--durations` run (benchmarks/RESULTS.md,
# "Where the test suite's time goes"), the tiny demo's two together: the order of the measured 1,081 s run. Every
# other module keeps its collection place after them.
LONGEST_MODULES = ("test_train_stage", "test_bridge_score_select", "test_demo_e2e", "test_node_loss",
                   "test_curate_e2e", "test_api", "test_bilevel_e2e", "test_user_curate", "test_p2d_e2e",
                   "test_tune", "test_ray_jobs", "test_sharded", "test_bilevel_train")


def unit_of(nodeid: str) -> str:
    """The unit a test id belongs to: its module's path, or the shared name of the tiny demo's two modules."""
    path = nodeid.split("::", 1)[0]
    return SHARED_MODULES.get(path, path)


def order(items: list[Any]) -> None:
    """In a worker: sort the collected ``items`` so the longest modules come first (stable otherwise)."""
    rank = {name: i for i, name in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: rank.get(getattr(getattr(item, "module", None), "__name__", ""), len(rank)))


def make_scheduler(config: Any, log: Any) -> Any:
    """A ``LoadScopeScheduling`` whose scopes are modules (the tiny demo's two as one), sent in collection order."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False  # keep the workers' order, not xdist's by test count
    return ModuleScheduling(config, log)
