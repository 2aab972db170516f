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


def changed_spans(clean: str, corrupted: str) -> list[list[int]]:
    """Char ``[start, end)`` spans of ``corrupted`` that differ from ``clean`` (replaced or inserted text; text
    that was only deleted, such as a truncated ending, leaves no span)."""
    import difflib

    matcher = difflib.SequenceMatcher(None, clean, corrupted, autojunk=False)
    return [[j1, j2] for tag, _, _, j1, j2 in matcher.get_opcodes() if tag in ("replace", "insert") and j2 > j1]


def make_row(row_id: str, task: Task, corruption: str, response: str, prefix: str = "", suffix: str = "",
             source_id: str = "") -> dict:
    """The corpus row of ``task`` with ``response``; ``prefix`` / ``suffix`` edit the prompt (near duplicates).

    ``label.corrupted_spans`` marks where ``response`` departs from the task's clean response (empty for clean rows
    and near duplicates, the whole response for off-topic ones): the tokens a token-level selector should drop.
    """
    prompt, relevant, distractor = render_prompt(task.sentences, prefix)
    if corruption in ("none", "near_duplicate"):
        spans: list[list[int]] = []
    elif corruption == "off_topic":  # an unrelated text: every character is wrong, whatever it shares by chance
        spans = [[0, len(response)]]
    else:
        spans = changed_spans(task.response, response)
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
            "corrupted_spans": spans,
        },
    }
