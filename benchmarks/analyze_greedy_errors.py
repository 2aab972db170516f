"""Where the greedy answers of a run's evaluated arms go wrong, per error kind (#25's corpus diagnosis).

For every evaluated arm of the run directories given (a proving-ground seed folder's ``eval_base``, ``eval_mixed``,
``eval_clean``, ...; an ``sft`` run's ``eval``), each wrong greedy answer is put in the first kind that fits:

- ``swapped_entity``: the final answer is the one the problem gives when the distractor person's count is used
  instead of the asked person's (the corpus's ``swapped_entity`` corruption, a wrong lookup);
- ``no_final``: no ``####`` line;
- ``arithmetic``: an equation in the answer is wrong (``a op b = r`` with the wrong ``r``);
- ``other``: anything else (a wrong operand or plan with correct arithmetic).

The questions are regenerated from the run's config (corpus seed, held-out / validation sizes, ``eval.split``), so
the swapped-entity answer of each question is known. Reads only; prints a table and a last line of figures.

    python benchmarks/analyze_greedy_errors.py runs/real_proving_ground/seed-0 runs/real_proving_ground/seed-1
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pyarrow.parquet as pq
import yaml

from raycurate.data.answers import answers_match, extract_final_answer
from raycurate.data.corpus.heldout import generate_heldout, heldout_tasks, validation_tasks
from raycurate.data.corpus.math_tasks import MathProblem, swapped_entity_response

ERROR_KINDS = ("swapped_entity", "no_final", "arithmetic", "other")


def swapped_answers(run_dir: Path) -> tuple[str, dict[str, str | None]]:
    """The evaluated split and each question id's swapped-entity final answer, from the run's saved config."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    data, split = cfg["data"], cfg["eval"].get("split", "heldout")
    if split == "validation":
        exclude = {row["prompt"] for row in generate_heldout(data["heldout_rows"], data["corpus_seed"])}
        tasks, prefix = validation_tasks(data["validation_questions"], data["corpus_seed"], exclude), "validation"
    else:
        tasks, prefix = heldout_tasks(data["heldout_rows"], data["corpus_seed"]), "heldout"
    answers: dict[str, str | None] = {}
    for i, task in enumerate(tasks):
        assert isinstance(task.math, MathProblem)
        answers[f"{prefix}-{i + 1:06d}"] = extract_final_answer(swapped_entity_response(task.math))
    return split, answers


def error_kind(row: dict, swapped: str | None) -> str:
    """The first error kind that fits one wrong greedy answer (a predictions.parquet row)."""
    if row["has_final_answer"] and answers_match(row["predicted_answer"], swapped):
        return "swapped_entity"
    if not row["has_final_answer"]:
        return "no_final"
    if row["equations_correct"] < row["equations_total"]:
        return "arithmetic"
    return "other"


def arm_errors(predictions: Path, swapped: dict[str, str | None]) -> dict[str, float]:
    """Greedy / sampled exact match and the share of questions per error kind for one arm."""
    rows = pq.read_table(predictions).to_pylist()
    counts = dict.fromkeys(ERROR_KINDS, 0)
    for row in rows:
        if not row["correct"]:
            counts[error_kind(row, swapped[row["id"]])] += 1
    n = len(rows)
    sampled = [row["sampled_accuracy"] for row in rows if row.get("sampled_accuracy") is not None]
    return {"n": n, "greedy": sum(row["correct"] for row in rows) / n,
            "sampled": sum(sampled) / len(sampled) if sampled else float("nan"),
            **{kind: counts[kind] / n for kind in ERROR_KINDS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, help="run folders (a proving ground's seed-<n> folders)")
    args = parser.parse_args()
    header = ["run", "arm", "split", "n", "greedy", "sampled", *ERROR_KINDS]
    print(" | ".join(header))
    pooled: dict[str, list[dict[str, float]]] = {}
    for run_dir in args.run_dirs:
        split, swapped = swapped_answers(run_dir)
        for predictions in sorted(run_dir.glob("eval*/predictions.parquet")):
            arm = predictions.parent.name.removeprefix("eval").lstrip("_") or "sft"
            result = arm_errors(predictions, swapped)
            pooled.setdefault(arm, []).append(result)
            print(" | ".join([run_dir.name, arm, split, str(result["n"])]
                             + [f"{result[k]:.3f}" for k in ("greedy", "sampled", *ERROR_KINDS)]))
    figures = []
    for arm, results in pooled.items():
        total = sum(r["n"] for r in results)
        for kind in ("greedy", *ERROR_KINDS):
            figures.append(f"{arm}_{kind}={sum(r[kind] * r['n'] for r in results) / total:.3f}")
    print(" ".join(figures))


if __name__ == "__main__":
    main()
