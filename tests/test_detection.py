"""Token-level ground truth: which response tokens overlap a corrupted span, and what a mask drops of them."""

import pytest

from raycurate.algorithms.detection import corrupted_tokens, dropped_counts


def test_tokens_overlapping_a_corrupted_span():
    # response "so 10 + 3" tokens: "so", " 10", " +", " 3", then an end-of-turn marker without offsets
    offsets = [0, 2, 2, 5, 5, 7, 7, 9, -1, -1]
    assert corrupted_tokens(offsets, [[3, 5]]).tolist() == [False, True, False, False, False]
    assert corrupted_tokens(offsets, [[0, 9]]).tolist() == [True, True, True, True, False]
    assert corrupted_tokens(offsets, []).tolist() == [False] * 5


def test_dropped_counts_by_hand():
    offsets = [0, 2, 2, 5, 5, 7, 7, 9, -1, -1]
    counts = dropped_counts([1, 1, 1, 0, 0, 1, 1], 2, offsets, [[3, 5], [8, 9]])
    assert counts == {"corrupted": 2, "corrupted_dropped": 1, "other": 3, "other_dropped": 1}
    with pytest.raises(ValueError, match="response offsets"):
        dropped_counts([1, 1, 1], 2, offsets, [])
