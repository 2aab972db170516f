"""Deterministic, disjoint splits from (id, seed) (docs/data.md, "Splits").

Each id maps to ``u = blake2b(f"{seed}:{id}") / 2**64`` in [0, 1); the split is the first name whose cumulative
ratio (in the dict's order) exceeds ``u``.  The mapping depends on nothing but the id, the seed and the ratios,
so it is the same on every worker, every run and any row order, and the pools are disjoint by construction.
"""

from __future__ import annotations

import hashlib
import math
from typing import Iterable

BRIDGE_SPLIT_RATIOS: dict[str, float] = {"warmup": 0.05, "validation": 0.05, "selection": 0.90}
_TOLERANCE = 1e-6
_SCALE = float(2**64)


def check_ratios(ratios: dict[str, float]) -> None:
    """Raise ``ValueError`` unless ``ratios`` is a non-empty name -> fraction map summing to 1."""
    if not ratios:
        raise ValueError("split_ratios is empty; give e.g. {warmup: 0.05, validation: 0.05, selection: 0.90}")
    bad = {name: r for name, r in ratios.items() if not isinstance(r, (int, float)) or not math.isfinite(r) or r < 0}
    if bad:
        raise ValueError(f"split_ratios must be finite numbers >= 0; fix {bad}")
    total = sum(ratios.values())
    if abs(total - 1.0) > _TOLERANCE:
        raise ValueError(f"split_ratios must sum to 1, got {total:.6g} for {ratios}; rescale them")


def split_uniform(example_id: str, seed: int) -> float:
    """The id's stable position in [0, 1) for ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{example_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / _SCALE


def _bounds(ratios: dict[str, float]) -> list[tuple[float, str]]:
    check_ratios(ratios)
    bounds, acc = [], 0.0
    for name, ratio in ratios.items():
        acc += ratio
        bounds.append((acc, name))
    # The last non-empty split absorbs float rounding, so u close to 1 never falls off the end.
    last = max(i for i, (_, name) in enumerate(bounds) if ratios[name] > 0)
    bounds[last] = (math.inf, bounds[last][1])
    return bounds


def _pick(u: float, bounds: list[tuple[float, str]]) -> str:
    for upper, name in bounds:
        if u < upper:
            return name
    raise AssertionError("unreachable: the last split's bound is infinite")


def assign_split(example_id: str, seed: int, ratios: dict[str, float]) -> str:
    """Split name for one id.

    Args:
        example_id: Unique example id.
        seed: Split seed; a different seed reshuffles ids across splits.
        ratios: Split name -> fraction, summing to 1; the dict's order fixes the interval order.

    Returns:
        One of ``ratios``' names (never one with ratio 0).
    """
    return _pick(split_uniform(example_id, seed), _bounds(ratios))


def assign_splits(example_ids: Iterable[str], seed: int, ratios: dict[str, float]) -> list[str]:
    """Split names for many ids (ratios checked once), in input order."""
    bounds = _bounds(ratios)
    return [_pick(split_uniform(i, seed), bounds) for i in example_ids]


class SplitAssigner:
    """Callable ``id -> split`` with the ratios checked once (for per-row use in streaming code)."""

    def __init__(self, seed: int, ratios: dict[str, float]) -> None:
        self.seed = seed
        self.ratios = dict(ratios)
        self._bounds = _bounds(self.ratios)

    def __call__(self, example_id: str) -> str:
        return _pick(split_uniform(example_id, self.seed), self._bounds)


def without_split(ratios: dict[str, float], name: str) -> dict[str, float]:
    """``ratios`` with ``name`` removed and the rest rescaled to sum to 1 (used when a split comes from a file)."""
    rest = {k: v for k, v in ratios.items() if k != name}
    total = sum(rest.values())
    if total <= 0:
        raise ValueError(f"split_ratios has nothing besides '{name}'; add a split for the main input")
    return {k: v / total for k, v in rest.items()}
