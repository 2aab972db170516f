"""Row validation for the corpus schema: one :class:`Verdict` with a reason per input record.

:func:`validate_record` / :func:`check_record` run the checks in a fixed order and report the first failure
(Unicode, ``id``, ``messages``, ``prompt``, ``response``, ``domain``, duplicates); :func:`content_id` is the
stable id of a row without one.  A ``messages`` list fills a missing prompt or response; length limits need the
tokenizer and are checked in :mod:`raycurate.data.tokenize`.  Reasons and rules: docs/data.md, "Rejections".
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

from raycurate.data.schema import (
    DOMAINS,
    DUPLICATE_ID,
    EMPTY_FIELD,
    MISSING_FIELD,
    NON_UTF8,
    UNKNOWN_DOMAIN,
    WRONG_TYPE,
)

PROMPT_TURN_SEPARATOR = "\n\n"


class Verdict(NamedTuple):
    """Outcome of validating one record: ``record`` when accepted, else ``reason``/``field``/``detail``."""

    record: dict[str, Any] | None
    reason: str | None
    field: str | None
    detail: str


class _Reject(Exception):
    def __init__(self, reason: str, field: str | None, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.field, self.detail = reason, field, detail


def content_id(prompt: str, response: str) -> str:
    """Stable id for a record without one: ``"h"`` + 16 hex digits of blake2b(prompt NUL response)."""
    digest = hashlib.blake2b(f"{prompt}\0{response}".encode(), digest_size=8).hexdigest()
    return f"h{digest}"


def _type_name(value: Any) -> str:
    return type(value).__name__


def _check_id(record: dict[str, Any]) -> str | None:
    value = record.get("id")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise _Reject(WRONG_TYPE, "id", f"expected str or int, got {_type_name(value)}")
    text = str(value)
    if not text.strip():
        raise _Reject(EMPTY_FIELD, "id", "empty string (drop the field to get a content-hash id)")
    return text


def _unencodable(value: Any, depth: int = 0) -> str | None:
    """The first string in ``value`` (keys included, nested up to 64 levels) that is not valid Unicode text (a
    lone surrogate such as ``"\\udcff"``, which JSON escapes can spell but UTF-8 cannot store), else None."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"lone surrogate {value[exc.start]!r} at character {exc.start}"
        return None
    if depth > 64:
        return None
    if isinstance(value, dict):
        items = [*value.keys(), *value.values()]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        return None
    for item in items:
        found = _unencodable(item, depth + 1)
        if found is not None:
            return found
    return None


def _check_unicode(record: dict[str, Any]) -> None:
    for key, value in record.items():
        found = _unencodable(key) or _unencodable(value)
        if found is not None:
            field = key if _unencodable(key) is None else None
            raise _Reject(NON_UTF8, field, f"{found} is not valid Unicode text; fix or drop it at the source")


def _check_messages(record: dict[str, Any]) -> list[dict[str, Any]] | None:
    messages = record.get("messages")
    if messages is None:
        return None
    if not isinstance(messages, list) or not messages:
        detail = f"expected a non-empty list of {{role, content}}, got {_type_name(messages)}"
        raise _Reject(WRONG_TYPE, "messages", detail)
    for i, turn in enumerate(messages):
        if not isinstance(turn, dict):
            raise _Reject(WRONG_TYPE, "messages", f"turn {i}: expected an object, got {_type_name(turn)}")
        for key in ("role", "content"):
            if not isinstance(turn.get(key), str):
                detail = f"turn {i}: '{key}' must be a string, got {_type_name(turn.get(key))}"
                raise _Reject(WRONG_TYPE, "messages", detail)
    return messages


def _from_messages(messages: list[dict[str, Any]] | None, field: str) -> str | None:
    if messages is None:
        return None
    if messages[-1]["role"] != "assistant":
        raise _Reject(MISSING_FIELD, field, "absent, and messages has no final assistant turn to take it from")
    if field == "response":
        return messages[-1]["content"]
    if len(messages) < 2:
        raise _Reject(MISSING_FIELD, field, "absent, and messages has no turn before the final assistant turn")
    return PROMPT_TURN_SEPARATOR.join(turn["content"] for turn in messages[:-1])


def _check_text(record: dict[str, Any], field: str, messages: list[dict[str, Any]] | None) -> str:
    value = record.get(field)
    if value is None:
        value = _from_messages(messages, field)
    if value is None:
        detail = "required field is absent (give it, or give messages ending with an assistant turn)"
        raise _Reject(MISSING_FIELD, field, detail)
    if not isinstance(value, str):
        raise _Reject(WRONG_TYPE, field, f"expected str, got {_type_name(value)}")
    if not value.strip():
        raise _Reject(EMPTY_FIELD, field, "empty string" if not value else "whitespace-only string")
    return value


def _check_domain(record: dict[str, Any], known_domains: tuple[str, ...] | list[str]) -> str | None:
    value = record.get("domain")
    if value is None:
        return None
    if not isinstance(value, str):
        raise _Reject(WRONG_TYPE, "domain", f"expected str, got {_type_name(value)}")
    domain = value.strip().lower()
    if not domain:
        return None
    if domain not in known_domains:
        raise _Reject(UNKNOWN_DOMAIN, "domain", f"'{value}' is not one of {', '.join(known_domains)}")
    return domain


def check_record(
    record: dict[str, Any], *, seen_ids: set[str], known_domains: tuple[str, ...] | list[str] = DOMAINS
) -> Verdict:
    """Validate one record and normalise it; record its id in ``seen_ids`` when accepted.

    Args:
        record: Parsed input row.
        seen_ids: Ids accepted so far (mutated: the accepted id is added).
        known_domains: Allowed values of ``domain``.

    Returns:
        A :class:`Verdict`.  An accepted record is a new dict with ``id`` (str), ``prompt``, ``response``,
        ``domain`` (str or ``None``) first, then every other input field unchanged (``messages`` included).
    """
    try:
        _check_unicode(record)
        example_id = _check_id(record)
        messages = _check_messages(record)
        prompt = _check_text(record, "prompt", messages)
        response = _check_text(record, "response", messages)
        domain = _check_domain(record, known_domains)
    except _Reject as rej:
        return Verdict(None, rej.reason, rej.field, rej.detail)
    if example_id is None:
        example_id = content_id(prompt, response)
    if example_id in seen_ids:
        return Verdict(None, DUPLICATE_ID, "id", f"id '{example_id}' already seen (first occurrence kept)")
    seen_ids.add(example_id)
    clean = {"id": example_id, "prompt": prompt, "response": response, "domain": domain}
    for key, value in record.items():
        if key not in clean:
            clean[key] = value
    return Verdict(clean, None, None, "")


def validate_record(
    record: dict[str, Any], *, seen_ids: set[str], known_domains: tuple[str, ...] | list[str] = DOMAINS
) -> tuple[dict[str, Any] | None, str | None, str | None]:
    """Validate one record: ``(clean_record, None, None)`` or ``(None, reason, field)``.

    Same as :func:`check_record` without the human-readable detail.
    """
    verdict = check_record(record, seen_ids=seen_ids, known_domains=known_domains)
    return verdict.record, verdict.reason, verdict.field
