"""Where a tokenizer's special tokens sit: the sequence's, a turn's, or none (BOS handling in one place).

:func:`bos_kind` reads off the chat template whether the BOS belongs to the sequence (``separate``: the embedded
``<|bos|>``, Llama-3), opens every turn (``turn``: ChatML as SmolLM2 ships it) or is absent (``none``: Qwen2);
:func:`chat_layout` bundles it with :func:`separator_text` (what the template renders between rows) and
:func:`assistant_header_text`.  Code that adds, strips or joins rows goes through :func:`sequence_lead`,
:func:`split_row`, :func:`instruction_ids` (the P2D probe instruction) and :func:`response_alone` (IFD's
response-only row).  The rules: docs/data.md, "Token-level table"; the probe layout: docs/p2d.md, "Prompt layout".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SEPARATE, TURN, NONE = "separate", "turn", "none"
_PROBE_USER, _PROBE_ASSISTANT = "a1b2c3", "d4e5f6"  # contents that no template adds itself


@dataclass(frozen=True)
class ChatLayout:
    """How rows of one tokenizer are opened and joined.

    Attributes:
        kind: ``"separate"``, ``"turn"`` or ``"none"`` (see the module docstring).
        lead: Token ids that open a sequence and belong to no turn (``[bos]`` for ``separate``, else ``[]``).
        separator: Token ids rendered between consecutive rows (``[]`` when the template renders nothing).
        assistant_header: Token ids that open an assistant turn (``[]`` without a chat template).
    """

    kind: str
    lead: list[int]
    separator: list[int]
    assistant_header: list[int]


def _render(tokenizer: Any, messages: list[dict[str, str]], generation: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


def _has_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def bos_kind(tokenizer: Any) -> str:
    """``"separate"``, ``"turn"`` or ``"none"``: whether the BOS belongs to the sequence, opens turns, or is absent."""
    if tokenizer.bos_token_id is None:
        return NONE
    if not _has_template(tokenizer):
        return SEPARATE
    chat = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}] * 2
    return TURN if _render(tokenizer, chat, False).count(tokenizer.bos_token) > 1 else SEPARATE


def sequence_lead(tokenizer: Any) -> list[int]:
    """Leading special tokens that belong to the sequence, not to its first turn: ``[bos_token_id]`` for a
    ``separate`` BOS, ``[]`` when the BOS opens turns (ChatML as SmolLM2) or there is none (Qwen2)."""
    return [int(tokenizer.bos_token_id)] if bos_kind(tokenizer) == SEPARATE else []


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def separator_text(tokenizer: Any) -> str:
    """What the chat template renders after an assistant turn's end-of-turn marker (``""`` without a template)."""
    if not _has_template(tokenizer):
        return ""
    user = [{"role": "user", "content": _PROBE_USER}]
    full = _render(tokenizer, user + [{"role": "assistant", "content": _PROBE_ASSISTANT}], False)
    suffix = full[full.rfind(_PROBE_ASSISTANT) + len(_PROBE_ASSISTANT):]
    return suffix[len(suffix.rstrip()):]


def assistant_header_text(tokenizer: Any) -> str:
    """The text that opens an assistant turn (what ``add_generation_prompt`` appends; ``""`` without a template)."""
    if not _has_template(tokenizer):
        return ""
    user = [{"role": "user", "content": _PROBE_USER}]
    prompt, closed = _render(tokenizer, user, True), _render(tokenizer, user, False)
    if not prompt.startswith(closed):
        raise ValueError("the chat template's generation prompt does not extend the rendered conversation; "
                         "raycurate needs a template whose add_generation_prompt appends the assistant header")
    return prompt[len(closed):]


def chat_layout(tokenizer: Any) -> ChatLayout:
    """The :class:`ChatLayout` of ``tokenizer`` (renders a few tiny conversations; compute once per tokenizer)."""
    return ChatLayout(kind=bos_kind(tokenizer), lead=sequence_lead(tokenizer),
                      separator=_encode(tokenizer, separator_text(tokenizer)),
                      assistant_header=_encode(tokenizer, assistant_header_text(tokenizer)))


def split_row(row: dict[str, Any], layout: ChatLayout) -> tuple[list[int], list[int]]:
    """(prompt part, response part) of a token row without its sequence lead, ready to join with other rows.

    Args:
        row: A token row (``input_ids`` (L,), ``prompt_len``).
        layout: The tokenizer's layout; only ``lead`` is dropped (a turn-opening BOS stays).

    Returns:
        ``(input_ids[s:prompt_len], input_ids[prompt_len:])`` with ``s = len(lead)`` when the row starts with it.
    """
    ids, p = [int(t) for t in row["input_ids"]], int(row["prompt_len"])
    lead = layout.lead
    start = len(lead) if lead and ids[: len(lead)] == lead else 0
    return ids[start:p], ids[p:]


def instruction_ids(tokenizer: Any, layout: ChatLayout, instruction: str) -> list[int]:
    """The opening segment of a P2D probe prompt: the sequence lead and the instruction (module docstring).

    Args:
        tokenizer: The tokenizer of the rows.
        layout: Its :func:`chat_layout`.
        instruction: Task instruction text (``""``: for chat tokenizers of kind ``turn`` / ``none`` no system
            turn at all; otherwise the lead and a blank line, as before).

    Returns:
        Token ids: ``lead + tokens(instruction + "\\n\\n")`` or ``tokens(render(system turn)) + separator``.
    """
    if layout.kind == SEPARATE or not _has_template(tokenizer):
        return layout.lead + _encode(tokenizer, instruction + "\n\n")
    if not instruction:
        return []
    turn = _render(tokenizer, [{"role": "system", "content": instruction}], False).rstrip()
    return _encode(tokenizer, turn) + layout.separator


def response_alone(layout: ChatLayout, response: list[int]) -> tuple[list[int], list[int]]:
    """IFD's "response alone" row: ``lead + assistant header + response`` and its loss mask (1 on the response).

    Args:
        layout: The tokenizer's layout.
        response: The response side of a token row (R,), end-of-turn marker and EOS included.

    Returns:
        ``(input_ids, loss_mask)``, both of length ``len(lead) + len(header) + R``.
    """
    head = layout.lead + layout.assistant_header
    return head + list(response), [0] * len(head) + [1] * len(response)
