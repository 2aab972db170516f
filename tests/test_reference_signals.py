"""Row signals and token masks of the trusted reference (pure numpy): hand-computable values."""

import math

import numpy as np
import pytest

from raycurate.algorithms.reference_signals import ROW_SIGNALS, high_loss_mask, row_signals, signal_scores


def test_row_signals_by_hand():
    s = row_signals(np.array([0.5, 4.0, 1.0, 2.0]), np.array([1.0, 1.0, 1.0, 0.0]))
    assert s == {"mean": 1.875, "max": 4.0, "top3": pytest.approx(7.0 / 3), "eos": 2.0, "excess_max": 3.0}
    assert set(s) == set(ROW_SIGNALS)


def test_row_signals_without_base_or_tokens():
    assert math.isnan(row_signals(np.array([1.0]))["excess_max"])
    assert all(math.isnan(v) for v in row_signals(np.array([])).values())
    with pytest.raises(ValueError, match="same positions"):
        row_signals(np.array([1.0, 2.0]), np.array([1.0]))


def test_signal_scores_negate_and_rank_missing_rows_last():
    assert signal_scores([1.0, float("nan"), 3.0]).tolist() == [-1.0, -math.inf, -3.0]


def test_high_loss_mask_keeps_the_end_of_turn_token():
    losses = np.array([0.1, 7.5, 0.2, 9.0])
    assert high_loss_mask(losses, 6.0).tolist() == [True, False, True, True]
    assert high_loss_mask(losses, 6.0, keep_last=False).tolist() == [True, False, True, False]
    assert high_loss_mask(np.array([6.0]), 6.0).tolist() == [True]  # "above" the threshold, not at it
    with pytest.raises(ValueError, match="positive"):
        high_loss_mask(losses, 0.0)


def test_calibrated_percentiles_by_hand():
    from raycurate.algorithms.reference_signals import calibrated_percentiles

    calibration = np.array([1.0, 2.0, 3.0, 4.0])
    assert calibrated_percentiles(np.array([0.5, 2.0, 2.5, 9.0, np.nan]), calibration).tolist() == [
        0.0, 0.5, 0.5, 1.0, 1.0]
    with pytest.raises(ValueError, match="at least one"):
        calibrated_percentiles(np.array([1.0]), np.array([np.nan]))


def test_badness_is_the_worst_standing_over_the_signals():
    from raycurate.algorithms.reference_signals import badness, pool_percentiles

    signals = {"max": np.array([1.0, 5.0, 2.0]), "excess_max": np.array([0.0, 0.1, 3.0])}
    calibration = {"max": np.array([1.0, 2.0]), "excess_max": np.array([0.5, 1.0])}
    assert badness(signals, calibration).tolist() == [0.5, 1.0, 1.0]
    assert pool_percentiles(np.array([3.0, 1.0, 1.0, np.nan])).tolist() == [0.75, 0.375, 0.375, 1.0]
    assert badness(signals, None).tolist() == [pytest.approx(1 / 3), 1.0, 1.0]
