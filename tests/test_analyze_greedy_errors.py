"""benchmarks/analyze_greedy_errors.py: the regenerated questions match the evaluated ones; error kinds."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from benchmark_scripts import load_benchmark

from raycurate.data.corpus import generate_heldout, generate_validation_questions
from raycurate.data.corpus.heldout import heldout_tasks, validation_tasks
from raycurate.data.corpus.math_tasks import swapped_entity_response


def _script():
    return load_benchmark("analyze_greedy_errors")


def test_tasks_are_the_ones_behind_the_question_rows():
    assert [t.answer for t in heldout_tasks(30, 4)] == [r["label"]["answer"] for r in generate_heldout(30, 4)]
    exclude = {r["prompt"] for r in generate_heldout(30, 4)}
    rows = generate_validation_questions(20, 4, exclude)
    assert [t.response for t in validation_tasks(20, 4, exclude)] == [r["response"] for r in rows]


def test_error_kinds_and_shares(tmp_path):
    script = _script()
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(
        {"data": {"heldout_rows": 4, "corpus_seed": 0, "validation_questions": 0}, "eval": {"split": "heldout"}}))
    split, swapped = script.swapped_answers(tmp_path)
    first = heldout_tasks(1, 0)[0]
    assert split == "heldout"
    assert swapped["heldout-000001"] == swapped_entity_response(first.math).split("####")[-1].strip()
    rows = [  # right; the swapped answer; no #### line; an arithmetic slip; a wrong plan with right arithmetic
        {"id": "heldout-000001", "correct": True, "predicted_answer": "x", "has_final_answer": True,
         "equations_correct": 2, "equations_total": 2, "sampled_accuracy": 0.5},
        {"id": "heldout-000001", "correct": False, "predicted_answer": swapped["heldout-000001"],
         "has_final_answer": True, "equations_correct": 0, "equations_total": 2, "sampled_accuracy": 0.0},
        {"id": "heldout-000002", "correct": False, "predicted_answer": None, "has_final_answer": False,
         "equations_correct": 0, "equations_total": 1, "sampled_accuracy": 0.0},
        {"id": "heldout-000003", "correct": False, "predicted_answer": "-1", "has_final_answer": True,
         "equations_correct": 1, "equations_total": 2, "sampled_accuracy": 0.0},
        {"id": "heldout-000004", "correct": False, "predicted_answer": "-2", "has_final_answer": True,
         "equations_correct": 2, "equations_total": 2, "sampled_accuracy": 1.0},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    result = script.arm_errors(tmp_path / "p.parquet", swapped)
    assert result == {"n": 5, "greedy": 0.2, "sampled": 0.3, "swapped_entity": 0.2, "no_final": 0.2,
                      "arithmetic": 0.2, "other": 0.2}
