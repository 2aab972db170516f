"""Token-level rows: prompt/response boundary, loss mask, offsets and over-length rejection."""

from __future__ import annotations

import pytest

from raycurate.data.schema import DataValidationError
from raycurate.data.tokenize import TOKEN_COLUMNS, is_rejection, token_table, tokenize_batch, tokenize_record

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Emits BOS itself and closes assistant turns with the EOS token (Mistral/Llama-2 style).
INST = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
TRAIN_TEXT = [
    "What is 2 plus 3? The answer is 5.",
    "Tom has 4 apples and buys 3 more. How many apples does he have? He has 7 apples. #### 7",
    "Write code: def add(a, b): return a + b",
]


def _tokenizer(template: str | None = None, bos: str | None = "<s>"):
    """A byte-level BPE trained in milliseconds on a few sentences; decode() round-trips text exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAIN_TEXT * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", clean_up_tokenization_spaces=False)
    if bos is not None:
        fast.bos_token = bos
    if template is not None:
        fast.chat_template = template
    return fast


@pytest.fixture(scope="module")
def plain():
    return _tokenizer()


@pytest.fixture(scope="module")
def chat():
    return _tokenizer(CHATML)


RECORD = {
    "id": "a1",
    "prompt": "Tom has 4 apples and buys 3 more. How many apples does he have?",
    "response": "He has 7 apples. #### 7",
    "domain": "math",
    "split": "selection",
    "source": "in.jsonl",
    "line": 3,
    "label": {"corrupt": False},
}


def _check_offsets(tokenizer, ids: list[int], offsets: list[int], text: str) -> int:
    """Every mapped token decodes to exactly the text its offsets point at; returns how many were mapped."""
    assert len(offsets) == 2 * len(ids)
    mapped = 0
    for token, start, end in zip(ids, offsets[0::2], offsets[1::2]):
        if start == -1:
            assert end == -1
            continue
        assert tokenizer.decode([token]) == text[start:end]
        mapped += 1
    return mapped


def _check_layout(tokenizer, row: dict, prompt_side_text: str, response_side_text: str) -> None:
    ids, n_prompt = row["input_ids"], row["prompt_len"]
    assert tokenizer.decode(ids[:n_prompt]) == prompt_side_text
    assert tokenizer.decode(ids[n_prompt:]) == response_side_text
    assert row["loss_mask"] == [0] * n_prompt + [1] * (len(ids) - n_prompt)
    assert ids[-1] == tokenizer.eos_token_id
    assert len(row["prompt_offsets"]) == 2 * n_prompt
    assert len(row["response_offsets"]) == 2 * (len(ids) - n_prompt)


def test_plain_layout_is_bos_prompt_newline_response_eos(plain):
    row = tokenize_record(plain, RECORD, max_length=512)
    assert not is_rejection(row)
    _check_layout(plain, row, "<s>" + RECORD["prompt"] + "\n", RECORD["response"] + "</s>")
    assert row["input_ids"][0] == plain.bos_token_id
    # Response tokens are the response tokenized alone, so the boundary is exact.
    response_ids = plain(RECORD["response"], add_special_tokens=False)["input_ids"]
    assert row["input_ids"][row["prompt_len"] :] == response_ids + [plain.eos_token_id]
    assert row["weight"] == 1.0


def test_plain_offsets_point_at_the_right_substrings(plain):
    row = tokenize_record(plain, RECORD, max_length=512)
    n_prompt = row["prompt_len"]
    mapped = _check_offsets(plain, row["input_ids"][:n_prompt], row["prompt_offsets"], RECORD["prompt"])
    assert mapped == n_prompt - 2  # BOS and the newline separator are unmapped
    assert row["prompt_offsets"][:2] == [-1, -1] and row["prompt_offsets"][-2:] == [-1, -1]
    mapped = _check_offsets(plain, row["input_ids"][n_prompt:], row["response_offsets"], RECORD["response"])
    assert mapped == len(row["input_ids"]) - n_prompt - 1  # all but EOS
    # The mapped spans tile the text with no gaps.
    spans = [(s, e) for s, e in zip(row["response_offsets"][0::2], row["response_offsets"][1::2]) if s >= 0]
    assert spans[0][0] == 0 and spans[-1][1] == len(RECORD["response"])
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_chat_template_layout_and_end_marker(chat):
    row = tokenize_record(chat, RECORD, max_length=512)
    rendered = f"<|im_start|>user\n{RECORD['prompt']}<|im_end|>\n<|im_start|>assistant\n"
    _check_layout(chat, row, "<s>" + rendered, RECORD["response"] + "<|im_end|></s>")
    n_prompt = row["prompt_len"]
    mapped = _check_offsets(chat, row["input_ids"][:n_prompt], row["prompt_offsets"], RECORD["prompt"])
    assert mapped == len(chat(RECORD["prompt"], add_special_tokens=False)["input_ids"])
    end_marker = chat.convert_tokens_to_ids("<|im_end|>")
    assert row["input_ids"][-2:] == [end_marker, chat.eos_token_id]
    assert row["response_offsets"][-4:] == [-1, -1, -1, -1]


def test_multi_turn_messages_offsets_map_into_the_prompt_text(chat):
    messages = [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "assistant", "content": "5"},
    ]
    record = {"id": "m", "prompt": "Answer with a number.\n\nWhat is 2 plus 3?", "response": "5", "messages": messages}
    row = tokenize_record(chat, record, max_length=512)
    n_prompt = row["prompt_len"]
    assert chat.decode(row["input_ids"][n_prompt:]) == "5<|im_end|></s>"
    mapped = _check_offsets(chat, row["input_ids"][:n_prompt], row["prompt_offsets"], record["prompt"])
    expected = sum(len(chat(m["content"], add_special_tokens=False)["input_ids"]) for m in messages[:2])
    assert mapped == expected
    starts = [s for s in row["prompt_offsets"][0::2] if s >= 0]
    assert 0 in starts and record["prompt"].index("What") in starts
    assert row["messages"] == messages


def test_template_that_emits_bos_and_eos_is_not_doubled():
    tok = _tokenizer(INST)
    row = tokenize_record(tok, {"id": "i", "prompt": "What is 2 plus 3?", "response": "5"}, max_length=512)
    ids = row["input_ids"]
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert ids.count(tok.eos_token_id) == 1
    assert tok.decode(ids[row["prompt_len"] :]) == "5</s>"
    assert tok.decode(ids[: row["prompt_len"]]) == "<s>[INST] What is 2 plus 3? [/INST]"


def test_tokenizer_without_bos_starts_with_prompt():
    tok = _tokenizer(bos=None)
    row = tokenize_record(tok, {"id": "n", "prompt": "Hi", "response": "Yo"}, max_length=512)
    assert tok.decode(row["input_ids"]) == "Hi\nYo</s>"
    assert row["prompt_offsets"][:2] == [0, 1]


@pytest.mark.parametrize("fixture", ["plain", "chat"])
def test_over_length_is_rejected_not_truncated(request, fixture):
    tok = request.getfixturevalue(fixture)
    n = len(tokenize_record(tok, RECORD, max_length=10_000)["input_ids"])
    assert not is_rejection(tokenize_record(tok, RECORD, max_length=n))
    rej = tokenize_record(tok, RECORD, max_length=n - 1)
    assert is_rejection(rej)
    assert (rej["id"], rej["source"], rej["line"], rej["reason"]) == ("a1", "in.jsonl", 3, "over_length")
    assert rej["detail"].startswith(f"{n} tokens") and f"max_length {n - 1}" in rej["detail"]


def test_batch_keeps_order_and_accounts_for_every_row(plain):
    short = {"id": "s", "prompt": "Hi", "response": "Yo", "source": "f", "line": 1}
    long = {"id": "l", "prompt": "word " * 40, "response": "more " * 40, "source": "f", "line": 2}
    rows, rejected = tokenize_batch(plain, [short, long, dict(short, id="t")], max_length=20)
    assert [r["id"] for r in rows] == ["s", "t"]
    assert [r["id"] for r in rejected] == ["l"]
    with pytest.raises(DataValidationError, match=r"^f:2: .*max_length 20") as info:
        tokenize_batch(plain, [short, long], max_length=20, strict=True)
    assert info.value.reason == "over_length"


def test_pass_through_and_weight(plain):
    row = tokenize_record(plain, dict(RECORD, weight=0.25), max_length=512)
    assert row["weight"] == 0.25
    for key in ("prompt", "response", "domain", "split", "source", "line", "label"):
        assert row[key] == RECORD[key]


def test_token_table_has_contract_types(plain):
    import pyarrow as pa

    rows, _ = tokenize_batch(plain, [RECORD, dict(RECORD, id="a2")], max_length=512)
    table = token_table(rows)
    schema = table.schema
    assert schema.field("input_ids").type == pa.list_(pa.int32())
    assert schema.field("loss_mask").type == pa.list_(pa.int8())
    assert schema.field("prompt_len").type == pa.int32()
    assert schema.field("weight").type == pa.float32()
    assert schema.field("prompt_offsets").type == pa.list_(pa.int32())
    assert table.column_names[:7] == list(TOKEN_COLUMNS)
    offsets = ("prompt_offsets", "response_offsets")
    assert TOKEN_COLUMNS == ("id", "input_ids", "prompt_len", "loss_mask", "weight", *offsets)
    assert table.to_pylist()[1]["input_ids"] == rows[1]["input_ids"]


def test_slow_tokenizer_is_refused_with_a_fix():
    class Slow:
        is_fast = False
        eos_token_id = 1

    with pytest.raises(ValueError, match="use_fast=True"):
        tokenize_batch(Slow(), [RECORD], max_length=10)
