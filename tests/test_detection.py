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


def test_corrupted_token_ranks_put_the_most_suspect_token_at_0_and_skip_ineligible_ones():
    from raycurate.algorithms.detection import corrupted_token_ranks

    suspicion = [5.0, 1.0, 3.0, 9.0, 2.0]
    eligible = [True, True, True, False, True]  # the 9.0 token is not ranked
    # eligible scores 5, 1, 3, 2: token 0 is the most suspect (rank 0), token 2 has one above it (1/3)
    assert corrupted_token_ranks(suspicion, eligible, [True, False, True, True, False]).tolist() == [0.0, 1 / 3]
    assert corrupted_token_ranks([1.0, 1.0, 0.0], [True] * 3, [True, False, False]).tolist() == [0.25]  # a tie: half
    assert corrupted_token_ranks(suspicion, eligible, [False, False, False, True, False]) is None  # only ineligible
    assert corrupted_token_ranks([1.0], [True], [True]) is None
