"""Token-to-character alignment of a response: are a row's per-token character offsets inside the text, monotone,
and covering every non-space character (:func:`verify_alignment`, :func:`alignment_check`)?  The structural units
(:mod:`.units`) and the closure projection (:mod:`.closure`) trust token ownership only when this check passes
(docs/bridge.md, "Closure").  Split out of :mod:`.units` to keep that module about segmentation.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


@dataclass(frozen=True)
class AlignmentCheck:
    """Outcome of :func:`verify_alignment`; ``reason`` is empty when ``ok``."""

    ok: bool
    reason: str = ""


# ----------------------------------------------------------------------------------------------------------------
# Alignment


def pairs_from_flat(flat: Sequence[int]) -> list[tuple[int, int]]:
    """``[s0, e0, s1, e1, ...]`` (the token row's ``response_offsets``) -> ``[(s0, e0), (s1, e1), ...]``."""
    if len(flat) % 2:
        raise ValueError(f"flat offsets need an even length (start, end per token); got {len(flat)} values")
    return [(int(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2)]


def spans_from_flat(flat: Sequence[int] | np.ndarray) -> np.ndarray:
    """``[s0, e0, s1, e1, ...]`` -> (r, 2) int64 spans, the form :func:`aligned_units` takes without conversion."""
    spans = np.asarray(flat, dtype=np.int64)
    if spans.ndim != 1 or spans.shape[0] % 2:
        raise ValueError(f"flat offsets need an even length (start, end per token); got shape {spans.shape}")
    return spans.reshape(-1, 2)


_ASCII_SPACE = np.array([chr(c).isspace() for c in range(128)])
_ASCII_ALNUM = np.array([chr(c).isalnum() for c in range(128)])


def char_classes(text: str) -> tuple[np.ndarray, np.ndarray]:
    """(n,) bool non-whitespace and (n,) bool alphanumeric flags per character (vectorised over code points)."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)  # (n,)
    if text.isascii():
        return ~_ASCII_SPACE[codes], _ASCII_ALNUM[codes]
    space, alnum = np.zeros(codes.shape, dtype=bool), np.zeros(codes.shape, dtype=bool)
    small = codes < 128
    space[small], alnum[small] = _ASCII_SPACE[codes[small]], _ASCII_ALNUM[codes[small]]
    uniq, inverse = np.unique(codes[~small], return_inverse=True)
    space[~small] = np.array([chr(c).isspace() for c in uniq], dtype=bool)[inverse]
    alnum[~small] = np.array([chr(c).isalnum() for c in uniq], dtype=bool)[inverse]
    return ~space, alnum


def span_array(offsets: Sequence[tuple[int, int]] | np.ndarray) -> np.ndarray:
    """(r, 2) int64 spans from a list of pairs or an array."""
    if isinstance(offsets, np.ndarray):
        return offsets.astype(np.int64, copy=False).reshape(-1, 2)
    flat = itertools.chain.from_iterable(offsets)
    return np.fromiter(flat, dtype=np.int64, count=2 * len(offsets)).reshape(-1, 2)


class Spans(NamedTuple):
    """Token spans and the facts about them that alignment and ownership both use."""

    spans: np.ndarray  # (r, 2) int64 (start, end); (-1, -1) for template/special tokens
    aligned: np.ndarray  # (r,) bool, the token has a span in the text
    start: np.ndarray  # (a,) int64 starts of the aligned tokens, in token order
    end: np.ndarray  # (a,) int64 ends of the aligned tokens
    nonws_at: np.ndarray  # (k,) int64 positions of the text's non-whitespace characters, ascending


def span_facts(spans: np.ndarray, nonws: np.ndarray) -> Spans:
    aligned = (spans[:, 0] != -1) | (spans[:, 1] != -1)  # (r,)
    return Spans(spans, aligned, spans[aligned, 0], spans[aligned, 1], np.flatnonzero(nonws))


def alignment_check(response: str, facts: Spans) -> AlignmentCheck:
    n, spans, start, end = len(response), facts.spans, facts.start, facts.end
    bad = (start < 0) | (start >= end) | (end > n)
    if bad.any():
        k = int(np.flatnonzero(facts.aligned)[np.argmax(bad)])
        return AlignmentCheck(False, f"token {k} span {tuple(spans[k].tolist())} is outside the text of length {n}")
    back = (start[1:] < start[:-1]) | (end[1:] < end[:-1])
    if back.any():
        index = np.flatnonzero(facts.aligned)
        j = int(np.argmax(back))
        return AlignmentCheck(False, f"token {int(index[j + 1])} span {tuple(spans[index[j + 1]].tolist())} "
                                     f"goes back before {tuple(spans[index[j]].tolist())}")
    # Starts and ends are monotone now, so the last span starting at or before a character reaches furthest right:
    # the character is covered exactly when that span ends after it.
    chars = facts.nonws_at
    last = np.searchsorted(start, chars, side="right") - 1  # (k,)
    covered = (last >= 0) & (end[np.maximum(last, 0)] > chars) if start.size else np.zeros(chars.shape, bool)
    if not covered.all():
        i = int(chars[np.argmin(covered)])
        return AlignmentCheck(False, f"character {i} ({response[i]!r}) is not covered by any token")
    return AlignmentCheck(True)


def verify_alignment(response: str, offsets: Sequence[tuple[int, int]]) -> AlignmentCheck:
    """Check that token offsets describe ``response`` faithfully.

    Conditions: every span is ``(-1, -1)`` (special/template token) or ``0 <= start < end <= len(response)``;
    aligned spans are monotone (starts and ends non-decreasing; byte-level tokens of one multi-byte character may
    share a span); every non-whitespace character of ``response`` lies in some span.

    Args:
        response: The response text the offsets index into.
        offsets: (r,) ``(start, end)`` character spans of the eligible response tokens.

    Returns:
        ``AlignmentCheck(ok, reason)``; the reason names the first failing token or character.
    """
    return alignment_check(response, span_facts(span_array(offsets), char_classes(response)[0]))
