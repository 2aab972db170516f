"""Tokenization into the token-level table (shared data contract).

:func:`tokenize_record` turns one record into a row: ``input_ids`` = prompt side (BOS as
:func:`raycurate.data.chat_layout.sequence_lead` says + the chat-template render up to the assistant turn, or
``prompt + "\n"`` without a template) + response side (response, end-of-turn marker, EOS), tokenized separately
so ``prompt_len`` is exact, with ``loss_mask`` on the response side and per-token character offsets (``-1`` for
markup); a row over ``max_length`` is an ``over_length`` rejection, never truncated.  :func:`tokenize_batch` /
:func:`token_table` do it for a batch, :func:`render_conversation` renders a prompt, :func:`kept_spans` maps a
loss mask back to character spans.  The full contract: docs/data.md, "Token-level table".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raycurate.data.chat_layout import sequence_lead
from raycurate.data.schema import OVER_LENGTH, DataValidationError

PLAIN_SEPARATOR = "\n"
SYSTEM_DEFAULT, SYSTEM_NONE = "default", "none"
_SYSTEM_PLACEHOLDER = "raycurate-system-placeholder-7f3a"
TOKEN_COLUMNS = ("id", "input_ids", "prompt_len", "loss_mask", "weight", "prompt_offsets", "response_offsets")


@dataclass
class _PromptPlan:
    text: str  # what is tokenized on the prompt side
    segments: list[tuple[int, int, int]]  # (start in text, end in text, start in record prompt)
    marker: str  # end-of-turn text appended after the response


def _conversation(record: dict[str, Any]) -> list[dict[str, str]]:
    messages = record.get("messages")
    if messages:
        turns = messages[:-1] if messages[-1]["role"] == "assistant" else messages
        return [{"role": t["role"], "content": t["content"]} for t in turns]
    return [{"role": "user", "content": record["prompt"]}]


def _locate_turns(rendered: str, prompt: str, turns: list[dict[str, str]]) -> list[tuple[int, int, int]]:
    segments, r_cursor, p_cursor = [], 0, 0
    for turn in turns:
        content = turn["content"]
        r_at, p_at = rendered.find(content, r_cursor), prompt.find(content, p_cursor)
        if content and r_at >= 0 and p_at >= 0:
            segments.append((r_at, r_at + len(content), p_at))
            r_cursor, p_cursor = r_at + len(content), p_at + len(content)
    return segments


def render_conversation(tokenizer: Any, turns: list[dict[str, str]], *, generation: bool,
                        system_prompt: str = SYSTEM_DEFAULT) -> str:
    """The chat template's render of ``turns`` with ``system_prompt`` applied (module docstring).

    Args:
        tokenizer: A tokenizer with ``chat_template``.
        turns: ``[{"role", "content"}, ...]``; a leading system turn is always kept as it is.
        generation: Append the assistant header (``add_generation_prompt``).
        system_prompt: ``"default"``, ``"none"`` or the system prompt text.

    Returns:
        The rendered text.
    """
    def render(messages: list[dict[str, str]], gen: bool) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)

    if system_prompt == SYSTEM_DEFAULT or (turns and turns[0]["role"] == "system"):
        return render(turns, generation)
    if system_prompt != SYSTEM_NONE:
        return render([{"role": "system", "content": system_prompt}] + turns, generation)
    placeholder = [{"role": "system", "content": _SYSTEM_PLACEHOLDER}]
    try:
        head, full = render(placeholder, False), render(placeholder + turns, generation)
    except Exception as exc:  # noqa: BLE001 - jinja raises its own errors (e.g. "system role not supported")
        raise ValueError(f"tokenize.system_prompt=none needs a chat template that renders a system turn, and this "
                         f"one failed on it ({exc}); use tokenize.system_prompt=default") from exc
    if not full.startswith(head) or _SYSTEM_PLACEHOLDER not in head:
        raise ValueError("tokenize.system_prompt=none: the chat template does not render a system turn in front of "
                         "the conversation, so it cannot be left out; use tokenize.system_prompt=default")
    return full[len(head):]


def _end_marker(tokenizer: Any, turns: list[dict[str, str]], rendered: str, response: str,
                system_prompt: str) -> str:
    full = render_conversation(tokenizer, turns + [{"role": "assistant", "content": response}], generation=False,
                               system_prompt=system_prompt)
    if not full.startswith(rendered):
        return ""
    suffix = full[len(rendered) :]
    at = suffix.find(response)
    return suffix[at + len(response) :].rstrip() if at >= 0 else ""


def _plan_prompt(tokenizer: Any, record: dict[str, Any], system_prompt: str) -> _PromptPlan:
    prompt = record["prompt"]
    if not getattr(tokenizer, "chat_template", None):
        return _PromptPlan(prompt + PLAIN_SEPARATOR, [(0, len(prompt), 0)], "")
    turns = _conversation(record)
    rendered = render_conversation(tokenizer, turns, generation=True, system_prompt=system_prompt)
    segments = _locate_turns(rendered, prompt, turns)
    return _PromptPlan(rendered, segments, _end_marker(tokenizer, turns, rendered, record["response"], system_prompt))


def _map_offsets(offsets: list[tuple[int, int]], segments: list[tuple[int, int, int]]) -> list[int]:
    """Flattened (start, end) per token in record-prompt coordinates; -1, -1 outside every segment."""
    flat: list[int] = []
    for start, end in offsets:
        mapped = (-1, -1)
        for seg_start, seg_end, target in segments:
            lo, hi = max(start, seg_start), min(end, seg_end)
            if lo < hi:
                mapped = (target + lo - seg_start, target + hi - seg_start)
                break
        flat.extend(mapped)
    return flat


def _special_ids(tokenizer: Any) -> tuple[list[int], int]:
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("tokenization needs a fast tokenizer (character offsets); load it with use_fast=True")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token; set tokenizer.eos_token before tokenizing")
    return sequence_lead(tokenizer), tokenizer.eos_token_id


def _encode(tokenizer: Any, texts: list[str]) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    if not texts:
        return [], []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        return enc["input_ids"], enc["offset_mapping"]
    # The Rust tokenizer directly: same ids/offsets, without transformers' per-row Python conversion.
    encodings = backend.encode_batch(texts, add_special_tokens=False)
    return [e.ids for e in encodings], [e.offsets for e in encodings]


def _weight(record: dict[str, Any]) -> float:
    value = record.get("weight")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 1.0


def _rejection(record: dict[str, Any], n_prompt: int, n_response: int, max_length: int) -> dict[str, Any]:
    total = n_prompt + n_response
    detail = f"{total} tokens (prompt {n_prompt} + response {n_response}) > max_length {max_length}"
    return {
        "id": record.get("id"),
        "source": record.get("source"),
        "line": record.get("line"),
        "reason": OVER_LENGTH,
        "field": None,
        "detail": detail,
    }


def tokenize_batch(
    tokenizer: Any, rows: list[dict[str, Any]], max_length: int, *, strict: bool = False,
    system_prompt: str = SYSTEM_DEFAULT,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Tokenize validated records into token-level rows (one batched tokenizer call per side).

    Args:
        tokenizer: A fast HF tokenizer (``PreTrainedTokenizerFast``), optionally with ``chat_template``.
        rows: Accepted records (``id``, ``prompt``, ``response``, optional ``messages``, pass-through fields).
        max_length: Longest allowed ``len(input_ids)``; longer rows are rejected, not truncated.
        strict: Raise :class:`DataValidationError` on the first over-length row instead of rejecting it.
        system_prompt: ``"default"`` (the template's own), ``"none"`` or a system prompt (module docstring).

    Returns:
        ``(token_rows, rejected_rows)`` in input order.  A token row has ``id``, ``input_ids`` (L,),
        ``prompt_len``, ``loss_mask`` (L,), ``weight``, ``prompt_offsets`` (2 * prompt_len,),
        ``response_offsets`` (2 * (L - prompt_len),) and the pass-through fields.
    """
    lead, eos_id = _special_ids(tokenizer)
    plans = [_plan_prompt(tokenizer, r, system_prompt) for r in rows]
    prompt_ids, prompt_offs = _encode(tokenizer, [p.text for p in plans])
    response_ids, response_offs = _encode(tokenizer, [r["response"] for r in rows])
    marker_cache: dict[str, list[int]] = {"": []}
    token_rows, rejected = [], []
    for i, (record, plan) in enumerate(zip(rows, plans)):
        p_ids, p_offs = list(prompt_ids[i]), _map_offsets(prompt_offs[i], plan.segments)
        if lead and p_ids[: len(lead)] != lead:
            p_ids, p_offs = lead + p_ids, [-1, -1] * len(lead) + p_offs
        if plan.marker not in marker_cache:
            marker_cache[plan.marker] = list(_encode(tokenizer, [plan.marker])[0][0])
        r_ids = list(response_ids[i]) + marker_cache[plan.marker]
        r_offs = [x for span in response_offs[i] for x in span] + [-1, -1] * len(marker_cache[plan.marker])
        if not r_ids or r_ids[-1] != eos_id:
            r_ids.append(eos_id)
            r_offs += [-1, -1]
        if len(p_ids) + len(r_ids) > max_length:
            rejection = _rejection(record, len(p_ids), len(r_ids), max_length)
            if strict:
                source, line = str(record.get("source")), int(record.get("line") or 0)
                raise DataValidationError(source, line, None, OVER_LENGTH, rejection["detail"])
            rejected.append(rejection)
            continue
        row = {
            "id": record["id"],
            "input_ids": p_ids + r_ids,
            "prompt_len": len(p_ids),
            "loss_mask": [0] * len(p_ids) + [1] * len(r_ids),
            "weight": _weight(record),
            "prompt_offsets": p_offs,
            "response_offsets": r_offs,
        }
        row.update((k, v) for k, v in record.items() if k not in row)
        token_rows.append(row)
    return token_rows, rejected


def tokenize_record(tokenizer: Any, record: dict[str, Any], max_length: int, *,
                    system_prompt: str = SYSTEM_DEFAULT) -> dict[str, Any]:
    """Tokenize one validated record; see :func:`tokenize_batch` for the layout and ``system_prompt``.

    Returns:
        The token-level row, or, when the sequence is longer than ``max_length``, the rejection
        ``{id, source, line, reason: "over_length", field, detail}`` (no ``input_ids``; test with
        :func:`is_rejection`).
    """
    rows, rejected = tokenize_batch(tokenizer, [record], max_length, system_prompt=system_prompt)
    return rows[0] if rows else rejected[0]


def is_rejection(result: dict[str, Any]) -> bool:
    """True when a :func:`tokenize_record` result is a rejection rather than a token row."""
    return "input_ids" not in result


def token_table(rows: list[dict[str, Any]]) -> Any:
    """A ``pyarrow.Table`` of token rows with the contract's types (int32 ids/offsets, int8 mask, float32 weight).

    Pass-through columns are typed by pyarrow's inference.
    """
    import pyarrow as pa

    types = {
        "id": pa.string(),
        "input_ids": pa.list_(pa.int32()),
        "prompt_len": pa.int32(),
        "loss_mask": pa.list_(pa.int8()),
        "weight": pa.float32(),
        "prompt_offsets": pa.list_(pa.int32()),
        "response_offsets": pa.list_(pa.int32()),
    }
    names = list(TOKEN_COLUMNS) + [k for k in (rows[0] if rows else {}) if k not in types]
    arrays = [pa.array([r.get(n) for r in rows], type=types.get(n)) for n in names]
    return pa.Table.from_arrays(arrays, names=names)


def kept_spans(offsets: list[int], marks: list[int]) -> list[list[int]]:
    """Character spans of the marked tokens of one text, adjacent tokens merged.

    Args:
        offsets: (2 * n,) flattened ``start, end`` per token into the text (``-1, -1`` for template markup and
            special tokens, which have no characters and are skipped), e.g. a row's ``response_offsets``.
        marks: (n,) 1 for a kept token (e.g. ``loss_mask[prompt_len:]``), 0 otherwise.

    Returns:
        ``[[start, end], ...]`` in text order; a span ends where a token that is not kept (or a gap) begins.
    """
    if len(offsets) != 2 * len(marks):
        raise ValueError(f"{len(offsets)} offsets for {len(marks)} tokens; expected two per token")
    spans: list[list[int]] = []
    for k, mark in enumerate(marks):
        start, end = int(offsets[2 * k]), int(offsets[2 * k + 1])
        if start < 0:
            continue
        if not mark:
            spans.append([])  # a break: the next kept token starts a new span
        elif spans and spans[-1] and spans[-1][1] >= start:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    return [s for s in spans if s]
