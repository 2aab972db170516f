"""The corpus schema (docs/data.md): required fields, domains, reject reasons and the strict-mode error.

Every keep/drop decision on an input row carries one of the reason codes below; rejected rows are written to
``rejected.jsonl`` with that code (default mode) or raised as :class:`DataValidationError` (strict mode).

Reserved columns: ingest adds ``split``, ``source`` (input file) and ``line`` (1-based row/line number in that
file).  An input field with one of those names is kept under ``input_<name>`` instead of being overwritten.
"""

from __future__ import annotations

from typing import Any

from raycurate.errors import UserError

REQUIRED_FIELDS: tuple[str, ...] = ("prompt", "response")
DOMAINS: tuple[str, ...] = ("math", "code", "instruction")
RESERVED_COLUMNS: tuple[str, ...] = ("split", "source", "line")

# Reason codes: one per way an input row can be rejected.
MALFORMED_JSON = "malformed_json"
NON_UTF8 = "non_utf8"
WRONG_TYPE = "wrong_type"
MISSING_FIELD = "missing_field"
EMPTY_FIELD = "empty_field"
DUPLICATE_ID = "duplicate_id"
UNKNOWN_DOMAIN = "unknown_domain"
OVER_LENGTH = "over_length"
UNREADABLE_FILE = "unreadable_file"  # the part of a file that broke while being read (truncated .gz, bad page)
OVERLAPS_TRUSTED = "overlaps_trusted"  # a pool row with a trusted row's prompt or id: the target is not curated
OVERLAPS_EVALUATION = "overlaps_evaluation"  # a trusted row with a held-out / validation question's prompt
REASONS: tuple[str, ...] = (
    MALFORMED_JSON,
    NON_UTF8,
    WRONG_TYPE,
    MISSING_FIELD,
    EMPTY_FIELD,
    DUPLICATE_ID,
    UNKNOWN_DOMAIN,
    OVER_LENGTH,
    UNREADABLE_FILE,
    OVERLAPS_TRUSTED,
    OVERLAPS_EVALUATION,
)
# File-level condition (no rows): an error in strict mode, a warning otherwise.
EMPTY_FILE = "empty_file"

MAX_RAW_CHARS = 2000


class DataValidationError(UserError, ValueError):
    """A bad input row (or empty file) in strict mode, located by file, line and field.

    Attributes:
        file: Input file the row came from.
        line: 1-based line (jsonl) or row (parquet / HF dataset) number; 0 for file-level problems.
        field: Offending field, or ``None`` when the whole row/file is at fault.
        reason: One of :data:`REASONS` or :data:`EMPTY_FILE`.
        detail: Human-readable specifics ("empty string", "expected str, got int", ...).
    """

    def __init__(self, file: str, line: int, field: str | None, reason: str, detail: str) -> None:
        self.file = file
        self.line = line
        self.field = field
        self.reason = reason
        self.detail = detail
        where = f"{file}:{line}" if line else file
        what = f"field '{field}': {detail}" if field else detail
        fix = (
            "fix the row or run without strict mode to reject it (rejected rows go to rejected.jsonl)"
            if line
            else "fix or remove the file, or run without strict mode to skip it with a warning"
        )
        super().__init__(f"{where}: {what} [{reason}] — {fix}")


def rejected_row(
    source: str,
    line: int,
    reason: str,
    field: str | None,
    detail: str,
    raw: str,
    example_id: str | None = None,
) -> dict[str, Any]:
    """One ``rejected.jsonl`` entry; ``raw`` is truncated to :data:`MAX_RAW_CHARS` characters."""
    row: dict[str, Any] = {"source": source, "line": line, "reason": reason, "field": field, "detail": detail}
    if example_id is not None:
        row["id"] = example_id
    row["raw"] = raw if len(raw) <= MAX_RAW_CHARS else raw[:MAX_RAW_CHARS] + "…[truncated]"
    return row


def prompt_key(prompt: str) -> str:
    """A prompt compared for overlap: whitespace runs collapsed and case folded."""
    return " ".join(prompt.split()).casefold()


class Exclusions:
    """Rows ingest rejects because they overlap another set: by prompt (:func:`prompt_key`) and by id.

    Attributes:
        reason: The reject reason (:data:`OVERLAPS_TRUSTED`, :data:`OVERLAPS_EVALUATION`).
        prompts: ``prompt_key`` -> the id of the row it overlaps.
        ids: Ids that may not be reused.
        what: What the other set is, for the detail line (e.g. "trusted row", "held-out question").
    """

    def __init__(self, reason: str, what: str, rows: list[tuple[str, str]]) -> None:
        self.reason, self.what = reason, what
        self.prompts = {prompt_key(prompt): row_id for row_id, prompt in rows}
        self.ids = {row_id for row_id, _ in rows}

    def match(self, record: dict[str, Any]) -> tuple[str, str] | None:
        """``(field, detail)`` when ``record`` overlaps the set, else None."""
        other = self.prompts.get(prompt_key(record["prompt"]))
        if other is not None:
            return "prompt", f"same prompt as {self.what} {other!r}"
        if record["id"] in self.ids:
            return "id", f"same id as {self.what} {record['id']!r}"
        return None
