"""BRIDGE structure-aware closure projection of the response mask (paper App. G.1, SPEC §4).

After the alternating token-level selection, the response mask ``S_r^(T)`` is projected onto whole structural
units of the response text under the same budget ``b_r``, using only the final conditional scores
``s_j = Delta_r(j | S_p^(T))`` (no model call).  Pure Python/numpy: no torch, no Ray, no I/O.

Pipeline of one example::

    check = verify_alignment(response, offsets)                    # token/text alignment
    units = structural_units(response, domain, offsets)            # task-specific units, split/merge rules
    result = closure_projection(scores, units, b_r, token_mask=m)  # mandatory units, DP / greedy, completion
    # or, all three with the documented fallback:  project_response(response, domain, offsets, scores, b_r, ...)

Positions are the example's *eligible* response positions ``0 .. r-1`` (the response side of the token row
without the fixed EOS; template markers such as ``<|end|>`` are eligible and carry ``(-1, -1)`` offsets).

Decisions (the paper leaves these open; App. G.1 gives the rules, not the constants):

* **Units** (G.1 "tokenizer-aligned, task-specific boundaries", D.2, D.3).  Boundaries are found on the text and
  mapped to tokens through each token's first non-whitespace character (a token ``" The"`` belongs to the sentence
  of ``T``; ``".\\n"`` to the sentence it ends); unaligned tokens join the unit of the token before them.
  math: lines, cut further into sentences; a unit holding ``=`` or display math is an ``equation``, else a
  ``step``.  The final-answer unit (``#### 42``, ``\\boxed{...}``, a line ``The answer is: 42``) is mandatory.
  code: statements = logical lines (a newline inside open ``()[]{}`` does not end a statement; quotes and ``#``
  comments are skipped on the line; prose outside ````` fences is cut into sentences).  instruction: list items
  (lines starting ``- ``, ``* ``, ``+ ``, ``• ``, ``1. ``, ``1) ``) and sentences.  Any other domain: sentences.
* **Tagged regions** (G.1 "overlapping tagged regions are merged before selection"): final-answer tags and display
  math (``$$..$$``, ``\\[..\\]``) absorb every base unit they overlap; such *protected* units are never split,
  so they may exceed ``max_unit_tokens``, and are never merged away when short.
* **Merge, then split.**  A non-protected unit shorter than ``min_unit_tokens`` (4) merges into a neighbour:
  non-mandatory neighbours first, then the smaller one, then the left one; it takes the neighbour's kind.  Repeat
  left to right until no such unit remains.  Then every non-protected unit longer than ``max_unit_tokens`` (96) is
  cut into ``ceil(n / 96)`` contiguous chunks of near-equal size (earlier chunks one longer), which are at least
  ``48 >= 4`` tokens, so both limits hold afterwards for the defaults.
* **Core** of a unit (the ``u_core`` of eq. 11): its aligned tokens that contain at least one alphanumeric
  character; whitespace, punctuation, bracket and template tokens are supervised with their unit but do not
  count in ``q(u)``.  A unit with an empty core has ``q = 0``.
* **Quality** ``q(u) = sum_{j in core} max(s_j, -tau) / (|core| + eps)^alpha``.  The paper states no defaults.
  ``alpha = 0.5`` (between total utility, alpha = 0, which favours long units, and mean utility, alpha = 1, which
  favours many tiny units); ``eps = 1.0`` (smoothing: a one-token core does not count as a full unit; also guards
  empty cores); ``tau = None`` = scale-free default ``tau = mean |s_j|`` over the example's eligible positions
  (token utilities are gradient dot products with no fixed scale), so one strongly negative token costs its unit
  at most one average token's worth.  All three are arguments.
* **Structural priority** (the first DP tie-break, summed over the chosen units): answer 3, equation 2, every
  other kind 1.
* **Mandatory units first** (G.1): whole mandatory units are taken last-first while they fit; a mandatory unit
  that does not fit keeps its highest-priority positions as capacity permits: answer-payload tokens (the ``42``
  of ``#### 42``) first, then other core tokens, then the rest, each by score (descending) then position.
* **Unit selection**: exact 0/1 knapsack by DP over capacity (vectorised over capacities) when the residual
  capacity is at most ``dp_capacity_limit`` (2048), greedy by density ``q / |u|`` above (G.1).  Objective ties
  (relative tolerance 1e-9, via a perturbation below it, see :func:`knapsack_dp`) break by structural priority,
  then retained positive utility ``sum max(s_j, 0)`` over the unit's positions, then position (the DP keeps the
  incumbent on a full tie, so earlier units win).  Units
  with ``q < 0`` are left out (they never improve the objective); when all remaining units fit, all are taken
  (the exact optimum, no search).
* **Budget completion** (G.1 "repacks whole units or adds individual positions"): both solvers already leave no
  unchosen unit with ``q > 0`` that fits the residual (DP is exact; the greedy scan skips what does not fit and
  continues), so the residual is filled with single positions by score (descending), then position, until the
  mask holds exactly ``b_r`` positions, like the token-level Top-b it replaces.  ``complete_budget=False``
  turns this off.  The mask never holds more than ``b_r`` positions.
* **Fallback**: when :func:`verify_alignment` fails (offsets out of the text, not monotone, or not covering every
  non-whitespace character), :func:`project_response` returns the token mask unchanged with ``fallback=True``
  and the reason.

Cost: units depend only on the text and offsets, so a caller that re-projects with other scores or budgets can
build them once per example.  Measured on one (shared, loaded) CPU core: about 0.2 ms for the whole
:func:`project_response` of a ~60-token corpus response, 0.25-0.7 ms at r ~ 300 (the DP itself ~35 us there).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from raycurate.algorithms.selection import top_b

MAX_UNIT_TOKENS = 96
MIN_UNIT_TOKENS = 4
DP_CAPACITY_LIMIT = 2048
ALPHA = 0.5
EPS = 1.0
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


@dataclass(frozen=True)
class AlignmentCheck:
    """Outcome of :func:`verify_alignment`; ``reason`` is empty when ``ok``."""

    ok: bool
    reason: str = ""


@dataclass
class ClosureResult:
    """Projected response mask and diagnostics for one example.

    Attributes:
        mask: (r,) bool, the projected response supervision set ``S_r^cl``.
        chosen_units: Indices into ``units`` of the whole units kept (sorted).
        used_budget: ``mask.sum()``, never above ``b_r``.
        fallback: True when the token mask was returned unchanged (alignment could not be verified or no units).
        final_answer_kept: True when there is a mandatory unit and every mandatory position is in ``mask``.
        utility_retained: ``sum(s[mask]) / sum(s[token_mask])`` (diagnostic; NaN when the denominator <= 0).
        units: The units the projection worked on (empty on an alignment fallback).
        has_final_answer: Whether any unit is mandatory (the denominator of final-answer coverage).
        solver: ``"dp"``, ``"greedy"``, ``"all"`` (every unit with ``q >= 0`` fits: the exact optimum without a
            search), ``"none"`` (no residual capacity or no optional unit) or ``"fallback"``.
        fallback_reason: Why the fallback happened; empty otherwise.
        completed_positions: Single positions added by budget completion.
        partial_mandatory: A mandatory unit did not fit and was cut to its highest-priority positions.
    """

    mask: np.ndarray
    chosen_units: list[int]
    used_budget: int
    fallback: bool
    final_answer_kept: bool
    utility_retained: float
    units: list[Unit] = field(default_factory=list)
    has_final_answer: bool = False
    solver: str = "none"
    fallback_reason: str = ""
    completed_positions: int = 0
    partial_mandatory: bool = False


# ----------------------------------------------------------------------------------------------------------------
# Alignment


def pairs_from_flat(flat: Sequence[int]) -> list[tuple[int, int]]:
    """``[s0, e0, s1, e1, ...]`` (the token row's ``response_offsets``) -> ``[(s0, e0), (s1, e1), ...]``."""
    if len(flat) % 2:
        raise ValueError(f"flat offsets need an even length (start, end per token); got {len(flat)} values")
    return [(int(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2)]


_ASCII_SPACE = np.array([chr(c).isspace() for c in range(128)])
_ASCII_ALNUM = np.array([chr(c).isalnum() for c in range(128)])


def _char_classes(text: str) -> tuple[np.ndarray, np.ndarray]:
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


def _span_array(offsets: Sequence[tuple[int, int]] | np.ndarray) -> np.ndarray:
    """(r, 2) int64 spans from a list of pairs or an array."""
    if isinstance(offsets, np.ndarray):
        return offsets.astype(np.int64, copy=False).reshape(-1, 2)
    flat = itertools.chain.from_iterable(offsets)
    return np.fromiter(flat, dtype=np.int64, count=2 * len(offsets)).reshape(-1, 2)


def _alignment(response: str, spans: np.ndarray, nonws: np.ndarray) -> AlignmentCheck:
    n = len(response)
    aligned = ~((spans[:, 0] == -1) & (spans[:, 1] == -1))  # (r,)
    index = np.flatnonzero(aligned)
    start, end = spans[index, 0], spans[index, 1]
    bad = (start < 0) | (start >= end) | (end > n)
    if bad.any():
        k = int(index[np.argmax(bad)])
        return AlignmentCheck(False, f"token {k} span {tuple(spans[k].tolist())} is outside the text of length {n}")
    back = (np.diff(start) < 0) | (np.diff(end) < 0)
    if back.any():
        j = int(np.argmax(back))
        return AlignmentCheck(False, f"token {int(index[j + 1])} span {tuple(spans[index[j + 1]].tolist())} "
                                     f"goes back before {tuple(spans[index[j]].tolist())}")
    depth = np.cumsum(np.bincount(start, minlength=n + 1) - np.bincount(end, minlength=n + 1))[:n]  # (n,)
    uncovered = nonws & (depth <= 0)
    if uncovered.any():
        i = int(np.argmax(uncovered))
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
    return _alignment(response, _span_array(offsets), _char_classes(response)[0])


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
    segs = []
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
        for m in _DISPLAY_MATH.finditer(text):
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


def _owners(segs: list[_Seg], spans: np.ndarray, nonws: np.ndarray) -> np.ndarray:
    """(r,) segment index per token, placed by its first non-whitespace character; monotone.

    Unaligned tokens join the segment of the token before them (leading ones the first aligned token's).
    """
    n, r = nonws.shape[0], spans.shape[0]
    aligned = ~((spans[:, 0] == -1) & (spans[:, 1] == -1))  # (r,)
    owner = np.full(r, -1, dtype=np.int64)
    if n and aligned.any():
        nonws_at = np.append(np.flatnonzero(nonws), n)  # non-whitespace character positions + sentinel
        start, end = spans[aligned, 0], spans[aligned, 1]
        first = nonws_at[np.searchsorted(nonws_at, start)]  # first non-whitespace character >= start
        anchor = np.where(first < end, first, start)  # whitespace-only tokens sit at their start
        owner[aligned] = np.searchsorted([g.start for g in segs], anchor, side="right") - 1
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
            ``(-1, -1)`` for template/special tokens.  Must pass :func:`verify_alignment`.
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
    spans = _span_array(offsets)
    nonws, alnum = _char_classes(response)
    check = _alignment(response, spans, nonws)
    if not check.ok:
        raise ValueError(f"offsets do not align with the response ({check.reason}); "
                         "call project_response to fall back to the token mask")
    return _build_units(response, domain, spans, nonws, alnum, max_unit_tokens, min_unit_tokens)


def _build_units(
    response: str, domain: str | None, spans: np.ndarray, nonws: np.ndarray, alnum: np.ndarray,
    max_unit_tokens: int, min_unit_tokens: int,
) -> list[Unit]:
    """:func:`structural_units` on verified offsets (``spans`` (r, 2), character classes (n,))."""
    if spans.shape[0] == 0:
        return []
    segs = _segments(response, domain) or [_Seg(0, len(response), "sentence")]
    drafts = _drafts(segs, _owners(segs, spans, nonws), spans)
    drafts = _split_long(_merge_short(drafts, min_unit_tokens), max_unit_tokens)
    alnum_before = np.concatenate([[0], np.cumsum(alnum)])  # (n+1,)
    aligned = spans[:, 0] >= 0
    safe = np.where(aligned[:, None], spans, 0)
    has_alnum = alnum_before[safe[:, 1]] > alnum_before[safe[:, 0]]  # (r,) the token has a letter or digit
    content = np.flatnonzero(aligned & has_alnum)  # core candidates, ascending
    bounds = np.searchsorted(content, [d.start for d in drafts] + [drafts[-1].end]).tolist()
    content_list = content.tolist()
    return [
        Unit(
            token_start=d.start,
            token_end=d.end,
            kind=d.kind,
            mandatory=d.mandatory,
            priority=PRIORITY.get(d.kind, 1),
            core=tuple(content_list[bounds[i] : bounds[i + 1]]),
            key=tuple(sorted(d.key)),
        )
        for i, d in enumerate(drafts)
    ]


# ----------------------------------------------------------------------------------------------------------------
# Unit quality and solvers


def default_tau(scores: np.ndarray) -> float:
    """Scale-free clipping threshold: ``mean |s_j|`` over the eligible positions (0 for an empty example)."""
    return float(np.mean(np.abs(scores))) if scores.size else 0.0


def _unit_index(units: Sequence[Unit], r: int, partition: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(r,) unit id per position (-1 outside every unit) and (r,) core flags.

    ``partition=True`` promises that the units partition ``[0, r)`` in order (checked by the caller).
    """
    m = len(units)
    if partition:
        unit_id = np.repeat(np.arange(m), [u.size for u in units])
    else:
        unit_id = np.full(r, -1, dtype=np.int64)
        for i, u in enumerate(units):
            unit_id[u.token_start : u.token_end] = i
    core_positions = itertools.chain.from_iterable(
        range(u.token_start, u.token_end) if u.core is None else u.core for u in units
    )
    core = np.zeros(r, dtype=bool)
    core[np.fromiter(core_positions, dtype=np.int64)] = True
    return unit_id, core


def unit_quality(
    scores: np.ndarray, units: Sequence[Unit], *, tau: float | None = None, alpha: float = ALPHA, eps: float = EPS
) -> np.ndarray:
    """Eq. (11): ``q(u) = sum_{j in core(u)} max(s_j, -tau) / (|core(u)| + eps)^alpha``.

    Args:
        scores: (r,) final conditional response scores ``s_j``.
        units: M non-overlapping units inside ``[0, r)``.
        tau: Clipping threshold (>= 0); None uses :func:`default_tau`.
        alpha: Size exponent (>= 0).
        eps: Size smoothing (> 0 when alpha > 0).

    Returns:
        (M,) float64 qualities; 0 for a unit with an empty core.
    """
    scores = np.asarray(scores, dtype=np.float64)
    unit_id, core = _unit_index(units, scores.shape[0])
    return _quality(scores, unit_id, core, len(units), tau, alpha, eps)


def _quality(
    scores: np.ndarray, unit_id: np.ndarray, core: np.ndarray, m: int, tau: float | None, alpha: float, eps: float
) -> np.ndarray:
    tau = default_tau(scores) if tau is None else float(tau)
    counted = core & (unit_id >= 0)
    ids = unit_id[counted]
    sums = np.bincount(ids, weights=np.maximum(scores[counted], -tau), minlength=m)  # (M,)
    sizes = np.bincount(ids, minlength=m)  # (M,)
    return np.where(sizes > 0, sums / np.power(sizes + eps, alpha), 0.0)


def knapsack_dp(
    weights: Sequence[int],
    values: Sequence[float],
    capacity: int,
    *,
    priority: Sequence[int] | None = None,
    positive: Sequence[float] | None = None,
) -> list[int]:
    """Exact 0/1 knapsack: maximise ``sum values`` s.t. ``sum weights <= capacity``; O(M * capacity).

    One vectorised update over all capacities per item.  Tie-breaks are folded into the objective as a
    perturbation below the tie tolerance ``tol = 1e-9 * (1 + sum |values|)``: each value gets
    ``+ delta * (priority * (1 + sum |positive|) + positive)`` with the total perturbation of any subset under
    ``tol / 2``.  So the optimum is within ``tol`` of the exact one, and among solutions tied on ``sum values``
    the higher ``sum priority`` (integers) wins, then the higher ``sum positive``; on an exact tie the incumbent
    is kept (items are processed in the given order, so earlier items win).

    Args:
        weights: (M,) positive integer sizes.
        values: (M,) item values (``q(u)``).
        capacity: Non-negative integer capacity.
        priority: (M,) integer first tie-break key (default zeros).
        positive: (M,) non-negative second tie-break key (default zeros).

    Returns:
        Sorted indices of the chosen items.
    """
    m = len(weights)
    w = [int(x) for x in weights]
    q = np.asarray(values, dtype=np.float64)  # (M,)
    pri = np.zeros(m) if priority is None else np.asarray(priority, dtype=np.float64)
    pos = np.zeros(m) if positive is None else np.asarray(positive, dtype=np.float64)
    secondary = pri * (1.0 + float(np.abs(pos).sum())) + pos  # (M,) priority first, then positive utility
    tol = 1e-9 * (1.0 + float(np.abs(q).sum()))
    delta = 0.5 * tol / (1.0 + float(np.abs(secondary).sum()))
    gains = (q + delta * secondary).tolist()
    value = np.zeros(capacity + 1)  # best perturbed value within capacity c, (C+1,)
    take = np.zeros((m, capacity + 1), dtype=bool)  # (M, C+1)
    for i in range(m):
        wi = w[i]
        if wi > capacity:
            continue
        cand = value[: capacity + 1 - wi] + gains[i]  # item i on top of the best within c - wi
        better = cand > value[wi:]  # strict: the incumbent stays on an exact tie
        take[i, wi:] = better
        np.maximum(value[wi:], cand, out=value[wi:])
    chosen, c = [], capacity
    for i in range(m - 1, -1, -1):
        if take[i, c]:
            chosen.append(i)
            c -= w[i]
    return sorted(chosen)


def greedy_density(
    weights: Sequence[int],
    values: Sequence[float],
    capacity: int,
    *,
    priority: Sequence[float] | None = None,
    positive: Sequence[float] | None = None,
) -> list[int]:
    """Greedy by density ``value / weight`` (then priority, positive utility, index); skips what does not fit.

    Only items with a positive value are taken.  Args and return as :func:`knapsack_dp`.
    """
    m = len(weights)
    pri = np.zeros(m) if priority is None else np.asarray(priority, dtype=np.float64)
    pos = np.zeros(m) if positive is None else np.asarray(positive, dtype=np.float64)
    order = sorted(range(m), key=lambda i: (-values[i] / weights[i], -pri[i], -pos[i], i))
    chosen, left = [], capacity
    for i in order:
        if values[i] > 0 and weights[i] <= left:
            chosen.append(i)
            left -= int(weights[i])
    return sorted(chosen)


# ----------------------------------------------------------------------------------------------------------------
# Projection


def _check_inputs(scores: np.ndarray, units: Sequence[Unit], b_r: int) -> None:
    r = scores.shape[0]
    if scores.ndim != 1 or not np.all(np.isfinite(scores)):
        raise ValueError(f"scores must be a finite (r,) vector; got shape {scores.shape}")
    if not 0 <= b_r <= r:
        raise ValueError(f"b_r={b_r} must lie in [0, r={r}]; compute it over the eligible response positions")
    cursor = 0
    for i, u in enumerate(units):
        if u.token_start != cursor or u.size < 1:
            raise ValueError(f"unit {i} [{u.token_start}, {u.token_end}) does not continue a partition of [0, {r}) "
                             f"at {cursor}; build units with structural_units")
        cursor = u.token_end
    if units and cursor != r:
        raise ValueError(f"units cover [0, {cursor}) but scores have r={r} positions; use the same offsets")


def top_b_mask(scores: np.ndarray, b: int) -> np.ndarray:
    """(r,) bool mask of the ``b`` highest scores, ties by position (lower first): :func:`selection.top_b`."""
    return top_b(np.asarray(scores, dtype=np.float64), b)


def _ranked(positions: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """``positions`` (ascending) by score, descending; the stable sort keeps ties in position order."""
    return positions[np.argsort(-scores[positions], kind="stable")]


def _mandatory_order(u: Unit, scores: np.ndarray) -> np.ndarray:
    """Positions of a mandatory unit by priority: answer payload, other core, rest; each by score then position."""
    everything = np.arange(u.token_start, u.token_end, dtype=np.int64)
    key = np.asarray(u.key, dtype=np.int64)
    core = np.setdiff1d(u.core_positions(), key)
    rest = np.setdiff1d(everything, np.concatenate([key, core]))
    return np.concatenate([_ranked(key, scores), _ranked(core, scores), _ranked(rest, scores)])


def _take_mandatory(
    units: Sequence[Unit], scores: np.ndarray, mask: np.ndarray, capacity: int
) -> tuple[list[int], int, bool]:
    """Mandatory units into ``mask``: whole ones last-first while they fit, then cut ones; (whole, left, cut)."""
    mandatory = [i for i in range(len(units) - 1, -1, -1) if units[i].mandatory]  # last first
    whole = []
    for i in mandatory:
        if units[i].size <= capacity:
            mask[units[i].token_start : units[i].token_end] = True
            whole.append(i)
            capacity -= units[i].size
    partial = False
    for i in mandatory:
        if i not in whole and capacity > 0:
            keep = _mandatory_order(units[i], scores)[:capacity]
            mask[keep] = True
            capacity -= keep.size
            partial = True
    return whole, capacity, partial


def _complete(mask: np.ndarray, scores: np.ndarray, b_r: int) -> int:
    """Add single positions by score (then position) until ``mask`` holds ``b_r`` positions."""
    missing = b_r - int(mask.sum())
    if missing <= 0:
        return 0
    free = np.flatnonzero(~mask)
    mask[_ranked(free, scores)[:missing]] = True
    return missing


def _retained(scores: np.ndarray, mask: np.ndarray, token_mask: np.ndarray) -> float:
    denom = float(scores[token_mask].sum())
    return float(scores[mask].sum()) / denom if denom > 0 else float("nan")


def final_answer_covered(mask: np.ndarray, units: Sequence[Unit]) -> bool | None:
    """Complete final-answer supervision: every mandatory position in ``mask``; None when no unit is mandatory.

    Use it on any response mask (score-only, random, closure) to compute the final-answer coverage of Table 20.
    """
    mandatory = [u for u in units if u.mandatory]
    if not mandatory:
        return None
    return all(bool(np.all(mask[u.token_start : u.token_end])) for u in mandatory)


def _fallback(scores: np.ndarray, token_mask: np.ndarray, units: list[Unit], reason: str) -> ClosureResult:
    covered = final_answer_covered(token_mask, units)
    return ClosureResult(
        mask=token_mask.copy(),
        chosen_units=[],
        used_budget=int(token_mask.sum()),
        fallback=True,
        final_answer_kept=bool(covered),
        utility_retained=_retained(scores, token_mask, token_mask),
        units=units,
        has_final_answer=covered is not None,
        solver="fallback",
        fallback_reason=reason,
    )


def _token_mask(scores: np.ndarray, token_mask: np.ndarray | None, b_r: int) -> np.ndarray:
    if token_mask is None:
        return top_b_mask(scores, b_r)
    token_mask = np.asarray(token_mask).astype(bool)
    if token_mask.shape != scores.shape or int(token_mask.sum()) > b_r:
        raise ValueError(f"token_mask must be (r,)={scores.shape} with at most b_r={b_r} positions; "
                         f"got shape {token_mask.shape} with {int(token_mask.sum())}")
    return token_mask


def _select_optional(
    units: list[Unit], optional: list[int], q: np.ndarray, positive: np.ndarray, capacity: int, dp_limit: int
) -> tuple[list[int], str]:
    """Whole non-mandatory units for the residual ``capacity``: (indices into ``units``, solver name).

    Units with ``q < 0`` never improve the objective and are left out; when every remaining unit fits, taking all
    of them is the exact optimum (solver ``all``); otherwise DP (``capacity <= dp_limit``) or greedy.
    """
    if not optional or capacity <= 0:
        return [], "none"
    tol = 1e-9 * (1.0 + float(np.abs(q).sum()))
    pool = [i for i in optional if q[i] >= -tol]
    weights = [units[i].size for i in pool]
    if sum(weights) <= capacity:
        return pool, "all"
    solve, name = (knapsack_dp, "dp") if capacity <= dp_limit else (greedy_density, "greedy")
    picked = solve(weights, q[pool], capacity, priority=[units[i].priority for i in pool], positive=positive[pool])
    return [pool[j] for j in picked], name


def closure_projection(
    scores: np.ndarray,
    units: Sequence[Unit] | None,
    b_r: int,
    *,
    token_mask: np.ndarray | None = None,
    tau: float | None = None,
    alpha: float = ALPHA,
    eps: float = EPS,
    dp_capacity_limit: int = DP_CAPACITY_LIMIT,
    complete_budget: bool = True,
) -> ClosureResult:
    """Project the response selection onto structural units under the budget ``b_r`` (paper eq. 11, App. G.1).

    Args:
        scores: (r,) final conditional response scores ``s_j = Delta_r(j | S_p^(T))``.
        units: Units partitioning ``[0, r)`` (from :func:`structural_units`); None or empty -> fallback.
        b_r: Response budget over the eligible positions, ``0 <= b_r <= r``.
        token_mask: (r,) pre-projection selection ``S_r^(T)`` (at most ``b_r`` positions); None = Top-``b_r``.
            Returned on fallback; the denominator of ``utility_retained``.
        tau: Clipping threshold of ``q``; None = ``mean |s|`` (module docstring).
        alpha: Size exponent of ``q`` (default 0.5).
        eps: Size smoothing of ``q`` (default 1.0).
        dp_capacity_limit: Exact DP when the residual capacity is at most this, greedy by density above.
        complete_budget: Fill the residual with single positions so the mask holds exactly ``b_r``.

    Returns:
        :class:`ClosureResult`; ``mask.sum() <= b_r`` always (``== b_r`` with ``complete_budget``).

    Raises:
        ValueError: Non-finite scores, ``b_r`` out of range, a token mask over budget, or units that do not
            partition ``[0, r)``.
    """
    scores = np.asarray(scores, dtype=np.float64)
    units = list(units or [])
    _check_inputs(scores, units, b_r)
    token_mask = _token_mask(scores, token_mask, b_r)
    if not units:
        return _fallback(scores, token_mask, units, "no structural units")
    mask = np.zeros(scores.shape[0], dtype=bool)
    whole, capacity, partial = _take_mandatory(units, scores, mask, b_r)
    optional = [i for i, u in enumerate(units) if not u.mandatory]
    unit_id, core = _unit_index(units, scores.shape[0], partition=True)
    q = _quality(scores, unit_id, core, len(units), tau, alpha, eps)  # (M,)
    positive = np.bincount(unit_id, weights=np.maximum(scores, 0.0), minlength=len(units))  # (M,)
    picked, solver = _select_optional(units, optional, q, positive, capacity, dp_capacity_limit)
    chosen = np.zeros(len(units), dtype=bool)
    chosen[picked] = True
    mask |= chosen[unit_id]
    completed = _complete(mask, scores, b_r) if complete_budget else 0
    covered = final_answer_covered(mask, units)
    return ClosureResult(
        mask=mask,
        chosen_units=sorted(whole + picked),
        used_budget=int(mask.sum()),
        fallback=False,
        final_answer_kept=bool(covered),
        utility_retained=_retained(scores, mask, token_mask),
        units=units,
        has_final_answer=covered is not None,
        solver=solver,
        completed_positions=completed,
        partial_mandatory=partial,
    )


def project_response(
    response: str,
    domain: str | None,
    offsets: Sequence[tuple[int, int]],
    scores: np.ndarray,
    b_r: int,
    *,
    token_mask: np.ndarray | None = None,
    max_unit_tokens: int = MAX_UNIT_TOKENS,
    min_unit_tokens: int = MIN_UNIT_TOKENS,
    **projection_kwargs,
) -> ClosureResult:
    """Alignment check + :func:`structural_units` + :func:`closure_projection`, with the token-mask fallback.

    Args:
        response: Response text.
        domain: Record domain (``math`` / ``code`` / ``instruction`` / other -> sentences).
        offsets: (r,) character spans of the eligible response tokens (use :func:`pairs_from_flat` on the token
            row's ``response_offsets`` and drop the EOS).
        scores: (r,) final conditional response scores.
        b_r: Response budget.
        token_mask: (r,) pre-projection selection (None = Top-``b_r`` of ``scores``).
        max_unit_tokens: See :func:`structural_units`.
        min_unit_tokens: See :func:`structural_units`.
        **projection_kwargs: ``tau``, ``alpha``, ``eps``, ``dp_capacity_limit``, ``complete_budget``.

    Returns:
        The :class:`ClosureResult`; ``fallback=True`` with ``fallback_reason`` when the offsets do not align with
        the text (the token mask is returned unchanged).
    """
    scores = np.asarray(scores, dtype=np.float64)
    if len(offsets) != scores.shape[0]:
        raise ValueError(f"{len(offsets)} offsets for {scores.shape[0]} scores; pass the eligible positions only "
                         "(response side without the EOS)")
    spans = _span_array(offsets)
    nonws, alnum = _char_classes(response)
    check = _alignment(response, spans, nonws)
    if not check.ok:
        _check_inputs(scores, [], b_r)
        return _fallback(scores, _token_mask(scores, token_mask, b_r), [], f"alignment: {check.reason}")
    units = _build_units(response, domain, spans, nonws, alnum, max_unit_tokens, min_unit_tokens)
    return closure_projection(scores, units, b_r, token_mask=token_mask, **projection_kwargs)
