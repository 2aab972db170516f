"""Structural units of a response text (paper App. G.1, D.2, D.3): the first half of BRIDGE's closure projection.

A unit is a contiguous run of a row's *eligible* response positions ``0 .. r-1``: math lines and sentences (the
final-answer unit mandatory), code logical lines, instruction list items and sentences, merged below 4 and split
above 96 tokens (:func:`structural_units`, :func:`aligned_units`, :func:`units_and_core`, which also returns each
unit's core, the tokens that count in ``q(u)``).  Token-to-text checks come from :mod:`.alignment`; scoring and
selecting the units is :mod:`.closure`.  Pure Python/numpy.  The rules and constants (the paper gives none):
docs/bridge.md, "Closure".
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from raycurate.algorithms.bridge import kernels
from raycurate.algorithms.bridge.alignment import (
    AlignmentCheck,
    Spans,
    alignment_check,
    char_classes,
    span_array,
    span_facts,
)

MAX_UNIT_TOKENS = 96
MIN_UNIT_TOKENS = 4
PRIORITY = {"answer": 3, "equation": 2}

_NO_SPAN = (-1, -1)
_LIST_ITEM = re.compile(r"[ \t]*(?:[-*+\u2022]|\d{1,3}[.)])[ \t]+\S")
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*[ \t]+(?=\S)")
_LINE_OR_SENTENCE_END = re.compile(r"\n|[.!?][\"')\]]*[ \t]+(?=\S)")
_ENUMERATOR = re.compile(r"\s*(?:\d{1,3}|[A-Za-z])[.)]\s*")
_FINAL_HASH = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER_LINE = re.compile(r"(?im)^[ \t]*(?:the[ \t]+)?(?:final[ \t]+)?answer[ \t]+is[ \t]*:?[ \t]*(\S[^\n]*)")
_DISPLAY_MATH = re.compile(r"\$\$.+?\$\$|\\\[.+?\\\]", re.S)
_FENCE = re.compile(r"(?m)^[ \t]*```[^\n]*(?:\n|$)")


class Unit(NamedTuple):
    """One structural unit: the contiguous eligible response positions ``[token_start, token_end)``.

    Attributes:
        token_start: First position (inclusive).
        token_end: Last position + 1 (exclusive).
        kind: ``answer``, ``equation``, ``step``, ``statement``, ``sentence``, ``list_item`` or ``fence``.
        mandatory: Final-answer unit, taken before the knapsack whenever it fits.
        priority: Structural priority for tie-breaks (higher wins).
        core: Absolute positions counted in ``q(u)``; ``None`` means every position of the unit.
        key: Absolute positions kept first when a mandatory unit must be cut (the answer payload).
    """

    token_start: int
    token_end: int
    kind: str
    mandatory: bool = False
    priority: int = 1
    core: tuple[int, ...] | None = None
    key: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        """Number of positions ``|u|`` (what the unit costs in the budget)."""
        return self.token_end - self.token_start

    def core_positions(self) -> np.ndarray:
        """(|core|,) int64 absolute positions of the core."""
        if self.core is None:
            return np.arange(self.token_start, self.token_end, dtype=np.int64)
        return np.asarray(self.core, dtype=np.int64)


# ----------------------------------------------------------------------------------------------------------------
# Character-level segmentation


@dataclass
class _Seg:
    start: int
    end: int
    kind: str
    mandatory: bool = False
    protected: bool = False
    keys: list[tuple[int, int]] = field(default_factory=list)


def _cut(start: int, end: int, cuts: list[int]) -> list[tuple[int, int]]:
    points = [start] + [c for c in cuts if start < c < end] + [end]
    return [(a, b) for a, b in zip(points, points[1:]) if b > a]


def _line_spans(text: str, start: int, end: int) -> list[tuple[int, int]]:
    cuts = [m.end() for m in re.finditer("\n", text[start:end])]
    return _cut(start, end, [start + c for c in cuts])


def _sentence_cuts(text: str, start: int, end: int) -> list[int]:
    cuts, piece_start = [], start
    for m in _SENTENCE_END.finditer(text, start, end):
        if _ENUMERATOR.fullmatch(text, piece_start, m.end()):
            continue  # "1. " or "a) " opens a sentence, it does not end one
        cuts.append(m.end())
        piece_start = m.end()
    return cuts


def _sentence_spans(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """Lines cut into sentences, in one regex pass."""
    cuts, piece_start = [], start
    for m in _LINE_OR_SENTENCE_END.finditer(text, start, end):
        if m.group() != "\n" and _ENUMERATOR.fullmatch(text, piece_start, m.end()):
            continue  # "1. " or "a) " opens a sentence, it does not end one
        cuts.append(m.end())
        piece_start = m.end()
    return _cut(start, end, cuts)


def _statement_spans(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """Logical lines: a newline ends a statement only outside open brackets (quotes and comments skipped)."""
    cuts, depth, quote, comment = [], 0, "", False
    for i in range(start, end):
        ch = text[i]
        if ch == "\n":
            quote, comment = "", False
            if depth == 0:
                cuts.append(i + 1)
        elif comment:
            continue
        elif quote:
            if ch == quote and text[i - 1] != "\\":
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            comment = True
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(depth - 1, 0)
    return _cut(start, end, cuts)


def _fenced_blocks(text: str) -> list[tuple[int, int, str]]:
    """Partition into ``prose`` / ``fence`` / ``code`` blocks by markdown fences (no fences: one code block)."""
    fences = list(_FENCE.finditer(text))
    if not fences:
        return [(0, len(text), "code")]
    blocks, pos, inside = [], 0, False
    for m in fences:
        if m.start() > pos:
            blocks.append((pos, m.start(), "code" if inside else "prose"))
        blocks.append((m.start(), m.end(), "fence"))
        pos, inside = m.end(), not inside
    if pos < len(text):
        blocks.append((pos, len(text), "code" if inside else "prose"))
    return blocks


def _math_segments(text: str) -> list[_Seg]:
    segs = []
    for a, b in _sentence_spans(text, 0, len(text)):
        segs.append(_Seg(a, b, "equation" if "=" in text[a:b] else "step"))
    return segs


def _code_segments(text: str) -> list[_Seg]:
    segs: list[_Seg] = []
    for a, b, block in _fenced_blocks(text):
        if block == "code":
            segs.extend(_Seg(s, e, "statement") for s, e in _statement_spans(text, a, b))
        elif block == "prose":
            segs.extend(_Seg(s, e, "sentence") for s, e in _sentence_spans(text, a, b))
        else:
            segs.append(_Seg(a, b, "fence"))
    return segs


def _instruction_segments(text: str) -> list[_Seg]:
    segs = []
    for a, b in _line_spans(text, 0, len(text)):
        if _LIST_ITEM.match(text, a, b):
            segs.append(_Seg(a, b, "list_item"))
        else:
            segs.extend(_Seg(s, e, "sentence") for s, e in _cut(a, b, _sentence_cuts(text, a, b)))
    return segs


def _boxed_tags(text: str) -> list[tuple[int, int, int, int]]:
    tags, at = [], text.find("\\boxed{")
    while at >= 0:
        depth, i = 0, at + len("\\boxed")
        while i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
            if depth == 0:
                break
        tags.append((at, i, at + len("\\boxed{"), i - 1 if depth == 0 else i))
        at = text.find("\\boxed{", i)
    return tags


def _answer_tags(text: str) -> list[tuple[int, int, int, int]]:
    """Final-answer tags ``(start, end, payload_start, payload_end)`` in the text."""
    tags = [(m.start(), m.end(), m.start(1), m.end(1)) for m in _FINAL_HASH.finditer(text)]
    if "answer" in text.casefold():  # the regex scan costs ~4x this substring test
        tags += [(m.start(), m.end(), m.start(1), m.end(1)) for m in _ANSWER_LINE.finditer(text)]
    return tags + _boxed_tags(text)


def _absorb(segs: list[_Seg], start: int, end: int, mandatory: bool, key: tuple[int, int] | None) -> list[_Seg]:
    """Merge every segment overlapping the tagged region ``[start, end)`` into one protected segment."""
    hit = [i for i, s in enumerate(segs) if s.start < end and start < s.end]
    if not hit:
        return segs
    group = segs[hit[0] : hit[-1] + 1]
    is_answer = mandatory or any(s.mandatory for s in group)
    merged = _Seg(group[0].start, group[-1].end, "answer" if is_answer else "equation", is_answer, True)
    merged.keys = [k for s in group for k in s.keys] + ([key] if key else [])
    return segs[: hit[0]] + [merged] + segs[hit[-1] + 1 :]


def _segments(text: str, domain: str | None) -> list[_Seg]:
    name = (domain or "").strip().lower()
    if name == "math":
        segs = _math_segments(text)
        for m in _DISPLAY_MATH.finditer(text) if "$$" in text or "\\[" in text else ():
            segs = _absorb(segs, m.start(), m.end(), False, None)
        for start, end, key_start, key_end in sorted(_answer_tags(text)):
            key = (key_start, key_end) if key_end > key_start else None
            segs = _absorb(segs, start, end, True, key)
        return segs
    if name == "code":
        return _code_segments(text)
    if name == "instruction":
        return _instruction_segments(text)
    return [_Seg(a, b, "sentence") for a, b in _sentence_spans(text, 0, len(text))]


# ----------------------------------------------------------------------------------------------------------------
# Token-level units


def _owners(segs: list[_Seg], facts: Spans, n: int) -> np.ndarray:
    """(r,) segment index per token, placed by its first non-whitespace character; monotone.

    Unaligned tokens join the segment of the token before them (leading ones the first aligned token's).
    """
    owner = np.full(facts.spans.shape[0], -1, dtype=np.int64)
    if n and facts.start.size:
        nonws_at = np.append(facts.nonws_at, n)  # non-whitespace character positions + sentinel
        first = nonws_at[np.searchsorted(nonws_at, facts.start)]  # first non-whitespace character >= start
        anchor = np.where(first < facts.end, first, facts.start)  # whitespace-only tokens sit at their start
        owner[facts.aligned] = np.searchsorted([g.start for g in segs], anchor, side="right") - 1
    owner = np.maximum.accumulate(owner)
    lead = owner < 0
    owner[lead] = owner[~lead][0] if (~lead).any() else 0
    return owner


@dataclass
class _Draft:
    start: int
    end: int
    kind: str
    mandatory: bool
    protected: bool
    key: set[int]

    @property
    def size(self) -> int:
        return self.end - self.start


def _drafts(segs: list[_Seg], owner: np.ndarray, spans: np.ndarray) -> list[_Draft]:
    """One draft unit per run of tokens owned by the same segment; answer-payload tokens marked as keys."""
    r = owner.shape[0]
    cuts = (np.flatnonzero(np.diff(owner)) + 1).tolist()
    drafts = []
    for a, b in zip([0] + cuts, cuts + [r]):
        seg = segs[int(owner[a])]
        key: set[int] = set()
        for lo, hi in seg.keys:
            hit = (spans[a:b, 0] < hi) & (spans[a:b, 1] > lo) & (spans[a:b, 0] >= 0)
            key.update((np.flatnonzero(hit) + a).tolist())
        drafts.append(_Draft(a, b, seg.kind, seg.mandatory, seg.protected, key))
    return drafts


def _merge_target(drafts: list[_Draft], i: int) -> int:
    neighbours = [j for j in (i - 1, i + 1) if 0 <= j < len(drafts)]
    return min(neighbours, key=lambda j: (drafts[j].mandatory, drafts[j].size, j))


def _merge_short(drafts: list[_Draft], min_tokens: int) -> list[_Draft]:
    """Merge non-protected units shorter than ``min_tokens`` into a neighbour, left to right, until none remain."""
    while len(drafts) > 1:
        short = next((i for i, d in enumerate(drafts) if d.size < min_tokens and not d.protected), None)
        if short is None:
            break
        j = _merge_target(drafts, short)
        host, guest = drafts[j], drafts[short]
        host.start, host.end = min(host.start, guest.start), max(host.end, guest.end)
        host.key |= guest.key
        del drafts[short]
    return drafts


def _split_long(drafts: list[_Draft], max_tokens: int) -> list[_Draft]:
    """Cut non-protected units longer than ``max_tokens`` into near-equal contiguous chunks."""
    out = []
    for d in drafts:
        if d.protected or d.size <= max_tokens:
            out.append(d)
            continue
        pieces = math.ceil(d.size / max_tokens)
        base, extra = divmod(d.size, pieces)
        start = d.start
        for p in range(pieces):
            end = start + base + (1 if p < extra else 0)
            out.append(_Draft(start, end, d.kind, False, False, {k for k in d.key if start <= k < end}))
            start = end
    return out


def structural_units(
    response: str,
    domain: str | None,
    offsets: Sequence[tuple[int, int]],
    *,
    max_unit_tokens: int = MAX_UNIT_TOKENS,
    min_unit_tokens: int = MIN_UNIT_TOKENS,
) -> list[Unit]:
    """Task-specific structural units over the eligible response positions (paper App. G.1, D.2, D.3).

    Args:
        response: The response text.
        domain: ``math``, ``code`` or ``instruction``; anything else (or None) cuts sentences.
        offsets: (r,) ``(start, end)`` character spans of the eligible response tokens (EOS excluded);
            ``(-1, -1)`` for template/special tokens.  Must pass :func:`~.alignment.verify_alignment`.
        max_unit_tokens: Non-protected units longer than this are split (paper: 96).
        min_unit_tokens: Non-protected units shorter than this merge into a neighbour (paper: 4).

    Returns:
        Units partitioning ``[0, r)`` in order (empty when ``r == 0``).  See the module docstring for the rules.

    Raises:
        ValueError: The offsets do not align with the text (use :func:`project_response` to fall back), or the
            limits are not positive.
    """
    if min_unit_tokens < 1 or max_unit_tokens < 1:
        raise ValueError(f"unit limits must be >= 1; got min={min_unit_tokens}, max={max_unit_tokens}")
    units, check = aligned_units(response, domain, offsets, max_unit_tokens=max_unit_tokens,
                                 min_unit_tokens=min_unit_tokens)
    if units is None:
        raise ValueError(f"offsets do not align with the response ({check.reason}); "
                         "call project_response to fall back to the token mask")
    return units


def aligned_units(
    response: str,
    domain: str | None,
    offsets: Sequence[tuple[int, int]],
    *,
    max_unit_tokens: int = MAX_UNIT_TOKENS,
    min_unit_tokens: int = MIN_UNIT_TOKENS,
) -> tuple[list[Unit] | None, AlignmentCheck]:
    """:func:`~.alignment.verify_alignment`, then :func:`structural_units` when it passes, sharing the character scan.

    Args:
        response: The response text.
        domain: See :func:`structural_units`.
        offsets: See :func:`structural_units`.
        max_unit_tokens: See :func:`structural_units` (not range-checked here).
        min_unit_tokens: See :func:`structural_units` (not range-checked here).

    Returns:
        ``(units, check)``; ``units`` is None when ``check.ok`` is False (the reason says why).
    """
    units, _, check = units_and_core(response, domain, offsets, max_unit_tokens=max_unit_tokens,
                                     min_unit_tokens=min_unit_tokens)
    return units, check


def units_and_core(
    response: str,
    domain: str | None,
    offsets: Sequence[tuple[int, int]] | np.ndarray,
    *,
    max_unit_tokens: int = MAX_UNIT_TOKENS,
    min_unit_tokens: int = MIN_UNIT_TOKENS,
) -> tuple[list[Unit] | None, np.ndarray | None, AlignmentCheck]:
    """:func:`aligned_units` plus the (r,) bool core mask, the union of the units' cores.

    The closure projection counts core positions per unit; taking the mask from here saves rebuilding it from
    the units' ``core`` tuples.

    Args:
        response: The response text.
        domain: See :func:`structural_units`.
        offsets: (r,) ``(start, end)`` pairs, or an (r, 2) integer array (no conversion).
        max_unit_tokens: See :func:`structural_units` (not range-checked here).
        min_unit_tokens: See :func:`structural_units` (not range-checked here).

    Returns:
        ``(units, core_mask, check)``; both None when ``check.ok`` is False.
    """
    nonws, alnum = char_classes(response)
    if kernels.active():
        spans = span_array(offsets)
        if kernels.aligned_ok(spans, nonws):
            return (*_compiled_units(response, domain, spans, nonws, alnum, max_unit_tokens, min_unit_tokens),
                    AlignmentCheck(True))
        facts = span_facts(spans, nonws)
        check = alignment_check(response, facts)  # words the reason
        return None, None, check
    facts = span_facts(span_array(offsets), nonws)
    check = alignment_check(response, facts)
    if not check.ok:
        return None, None, check
    units, core = _build_units(response, domain, facts, alnum, max_unit_tokens, min_unit_tokens)
    return units, core, check


def _build_units(
    response: str, domain: str | None, facts: Spans, alnum: np.ndarray, max_unit_tokens: int, min_unit_tokens: int,
) -> tuple[list[Unit], np.ndarray]:
    """:func:`structural_units` on verified offsets, and the (r,) core mask (character classes (n,))."""
    spans = facts.spans
    if spans.shape[0] == 0:
        return [], np.zeros(0, dtype=bool)
    segs = _segments(response, domain) or [_Seg(0, len(response), "sentence")]
    drafts = _drafts(segs, _owners(segs, facts, len(response)), spans)
    drafts = _split_long(_merge_short(drafts, min_unit_tokens), max_unit_tokens)
    alnum_before = np.zeros(alnum.shape[0] + 1, dtype=np.int64)
    np.cumsum(alnum, out=alnum_before[1:])
    safe = np.where(facts.aligned[:, None], spans, 0)
    core = facts.aligned & (alnum_before[safe[:, 1]] > alnum_before[safe[:, 0]])  # (r,) aligned, letter or digit
    content = np.flatnonzero(core)  # core positions, ascending
    bounds = np.searchsorted(content, [d.start for d in drafts] + [drafts[-1].end]).tolist()
    content_list = content.tolist()
    units = [
        Unit(d.start, d.end, d.kind, d.mandatory, PRIORITY.get(d.kind, 1),
             tuple(content_list[bounds[i] : bounds[i + 1]]), tuple(sorted(d.key)) if d.key else ())
        for i, d in enumerate(drafts)
    ]
    return units, core


def _compiled_units(
    response: str, domain: str | None, spans: np.ndarray, nonws: np.ndarray, alnum: np.ndarray,
    max_unit_tokens: int, min_unit_tokens: int,
) -> tuple[list[Unit], np.ndarray]:
    """:func:`_build_units` with the token-level work in one compiled kernel (:func:`kernels.build_units`)."""
    if spans.shape[0] == 0:
        return [], np.zeros(0, dtype=bool)
    segs = _segments(response, domain) or [_Seg(0, len(response), "sentence")]
    kinds = list(dict.fromkeys(s.kind for s in segs))
    starts, ends, kind_ids, mandatory, core, key = kernels.build_units(
        np.ascontiguousarray(spans, dtype=np.int64), nonws, alnum, segs, kinds, min_unit_tokens, max_unit_tokens)
    content, keys = np.flatnonzero(core), np.flatnonzero(key)
    edges = np.append(starts, ends[-1])
    bounds, key_bounds = np.searchsorted(content, edges).tolist(), np.searchsorted(keys, edges).tolist()
    content_list, key_list = content.tolist(), keys.tolist()
    names = [kinds[k] for k in kind_ids.tolist()]
    units = [
        Unit(s, e, names[i], m, PRIORITY.get(names[i], 1), tuple(content_list[bounds[i] : bounds[i + 1]]),
             tuple(key_list[key_bounds[i] : key_bounds[i + 1]]))
        for i, (s, e, m) in enumerate(zip(starts.tolist(), ends.tolist(), mandatory.tolist()))
    ]
    return units, core
