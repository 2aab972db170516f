"""AUROC against hand counts and scikit-style edge cases."""

from __future__ import annotations

import numpy as np
import pytest

from raycurate.algorithms.ranking import auroc


def test_auroc_by_hand():
    # pairs (pos, neg): (0.9,0.1) (0.9,0.5) (0.4,0.1) (0.4,0.5) -> 1 + 1 + 1 + 0 = 3 of 4
    assert auroc(np.array([0.9, 0.4, 0.1, 0.5]), np.array([True, True, False, False])) == pytest.approx(0.75)
    assert auroc(np.array([1.0, 1.0]), np.array([True, False])) == pytest.approx(0.5)  # a tie counts 1/2
    assert auroc(np.array([0.0, 1.0]), np.array([True, False])) == 0.0


def test_auroc_needs_both_classes():
    with pytest.raises(ValueError, match="both classes"):
        auroc(np.array([0.1, 0.2]), np.array([True, True]))
