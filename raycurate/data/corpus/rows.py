"""A clean task (prompt sentences and response lines, before any corruption) and the row dict it renders to.

Every domain builder returns a :class:`Task`; :func:`make_row` renders one into the corpus row schema of
:mod:`raycurate.data.corpus`, with the char spans of the relevant and distractor prompt sentences.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Task:
    """A clean task before corruption: prompt sentences (flagged distractor or not) and its response."""

    domain: str
    family: str
    sentences: list[tuple[str, bool]]  # (sentence, is_distractor)
    response_lines: list[str]
    answer: str = ""
    # A math_tasks.MathProblem / code_tasks.CodeTask: typed loosely so this module stays below the domain modules
    # (they build Tasks); corruptions narrow them with isinstance.
    math: object | None = None
    code: object | None = None

    @property
    def response(self) -> str:
        return "\n".join(self.response_lines)


def render_prompt(sentences: list[tuple[str, bool]], prefix: str = "") -> tuple[str, list[list[int]], list[list[int]]]:
    """Join sentences with single spaces; return the prompt and the relevant / distractor char spans."""
    parts: list[str] = [prefix] if prefix else []
    relevant: list[list[int]] = []
    distractor: list[list[int]] = []
    offset = len(prefix)
    for index, (sentence, is_distractor) in enumerate(sentences):
        if index:
            parts.append(" ")
            offset += 1
        (distractor if is_distractor else relevant).append([offset, offset + len(sentence)])
        parts.append(sentence)
        offset += len(sentence)
    return "".join(parts), relevant, distractor


def make_row(row_id: str, task: Task, corruption: str, response: str, prefix: str = "", suffix: str = "",
             source_id: str = "") -> dict:
    """The corpus row of ``task`` with ``response``; ``prefix`` / ``suffix`` edit the prompt (near duplicates)."""
    prompt, relevant, distractor = render_prompt(task.sentences, prefix)
    return {
        "id": row_id,
        "prompt": prompt + suffix,
        "response": response,
        "domain": task.domain,
        "label": {
            "clean": corruption == "none",
            "corruption": corruption,
            "answer": task.answer,
            "source_id": source_id,
            "relevant_spans": relevant,
            "distractor_spans": distractor,
        },
    }
