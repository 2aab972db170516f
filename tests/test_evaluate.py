"""Held-out evaluation: equation checking and metric aggregation (hand-computed)."""

from __future__ import annotations

import pytest

from raycurate.data.answers import equation_counts
from raycurate.stages.model_stages import summarize_predictions


def test_equation_counts():
    assert equation_counts("3 * 4 = 12 apples, then 12 - 5 = 8.\n#### 8") == (1, 2)
    assert equation_counts("10 / 4 = 2.5 and 7 x 2 = 14 and 1 / 0 = 3") == (2, 3)
    assert equation_counts("no arithmetic here") == (0, 0)


def test_summarize_predictions():
    rows = [
        {"correct": True, "gold_loss": 1.0, "has_final_answer": True, "unsafe_marker": False,
         "equations_correct": 2, "equations_total": 2},
        {"correct": False, "gold_loss": 3.0, "has_final_answer": False, "unsafe_marker": True,
         "equations_correct": 0, "equations_total": 2},
    ]
    m = summarize_predictions(rows)
    assert m == pytest.approx({"rows": 2, "exact_match": 0.5, "gold_loss": 2.0, "answer_format_rate": 0.5,
                               "unsafe_rate": 0.5, "equation_accuracy": 0.5})
    assert summarize_predictions([]) == {"rows": 0}
