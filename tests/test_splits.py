"""Deterministic (id, seed) -> split assignment."""

from __future__ import annotations

import pytest

from raycurate.data.splits import (
    BRIDGE_SPLIT_RATIOS,
    SplitAssigner,
    assign_split,
    assign_splits,
    check_ratios,
    split_uniform,
    without_split,
)

IDS = [f"ex-{i}" for i in range(20_000)]


def test_same_id_and_seed_give_same_split():
    first = assign_splits(IDS[:500], 7, BRIDGE_SPLIT_RATIOS)
    again = [assign_split(i, 7, BRIDGE_SPLIT_RATIOS) for i in IDS[:500]]
    assert first == again
    assert first == [SplitAssigner(7, BRIDGE_SPLIT_RATIOS)(i) for i in IDS[:500]]


def test_split_does_not_depend_on_row_order():
    forward = dict(zip(IDS[:1000], assign_splits(IDS[:1000], 0, BRIDGE_SPLIT_RATIOS)))
    backward = dict(zip(IDS[999::-1], assign_splits(IDS[999::-1], 0, BRIDGE_SPLIT_RATIOS)))
    assert forward == backward


def test_uniform_is_hash_of_seed_and_id():
    import hashlib

    digest = hashlib.blake2b(b"3:abc", digest_size=8).digest()
    assert split_uniform("abc", 3) == int.from_bytes(digest, "big") / 2**64


def test_proportions_on_20k_ids():
    splits = assign_splits(IDS, 0, BRIDGE_SPLIT_RATIOS)
    n = len(IDS)
    for name, ratio in BRIDGE_SPLIT_RATIOS.items():
        share = splits.count(name) / n
        # Binomial std for p=0.05 on 20k is 0.0015; 0.01 is > 6 sigma.
        assert abs(share - ratio) < 0.01, (name, share)
    assert set(splits) == set(BRIDGE_SPLIT_RATIOS)


def test_different_seed_moves_some_ids():
    a = assign_splits(IDS[:2000], 0, BRIDGE_SPLIT_RATIOS)
    b = assign_splits(IDS[:2000], 1, BRIDGE_SPLIT_RATIOS)
    moved = sum(x != y for x, y in zip(a, b))
    # Two independent draws disagree with probability 1 - (0.05^2 + 0.05^2 + 0.9^2) = 0.185.
    assert 0.12 * 2000 < moved < 0.25 * 2000


def test_zero_ratio_split_is_never_assigned():
    splits = assign_splits(IDS[:3000], 0, {"a": 0.5, "never": 0.0, "b": 0.5})
    assert "never" not in splits
    assert set(splits) == {"a", "b"}


def test_dict_order_fixes_intervals():
    u = split_uniform("x", 0)
    expected = "first" if u < 0.3 else "second"
    assert assign_split("x", 0, {"first": 0.3, "second": 0.7}) == expected


@pytest.mark.parametrize(
    "ratios, message",
    [
        ({"a": 0.5, "b": 0.4}, "sum to 1"),
        ({}, "empty"),
        ({"a": 1.2, "b": -0.2}, ">= 0"),
    ],
)
def test_bad_ratios_raise_clear_error(ratios, message):
    with pytest.raises(ValueError, match=message):
        check_ratios(ratios)
    with pytest.raises(ValueError, match=message):
        assign_split("x", 0, ratios)


def test_without_split_rescales_the_rest():
    rest = without_split(BRIDGE_SPLIT_RATIOS, "validation")
    assert list(rest) == ["warmup", "selection"]
    assert rest["warmup"] == pytest.approx(0.05 / 0.95)
    assert rest["selection"] == pytest.approx(0.90 / 0.95)
    with pytest.raises(ValueError, match="nothing besides"):
        without_split({"validation": 1.0}, "validation")
