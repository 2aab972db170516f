"""Compact SFT rows: kept prompt physically compacted, full response as history, loss at selected positions + EOS."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raycurate.algorithms.bridge.compaction import compact_example, compact_table_rows
from raycurate.algorithms.bridge.selection import eligible_positions, to_row_masks
from raycurate.algorithms.losses import example_losses, token_losses

BOS, EOS = 1, 2
# [BOS] p1 p2 p3 p4 | r1 r2 r3 r4 [EOS]
IDS = [BOS, 10, 11, 12, 13, 20, 21, 22, 23, EOS]
PROMPT_LEN = 5
OFFSETS = [-1, -1, 0, 2, 3, 5, 6, 8, 9, 11]  # BOS is special; p1..p4 cover "ab cd ef gh"
KEEP = np.array([True, False, True, True, False])  # BOS kept by the caller, p1 and p4 dropped
LOSS = np.array([0, 0, 0, 0, 0, 0, 1, 0, 1, 1], dtype=bool)  # r2, r4 selected, EOS supervised


def test_hand_built_example():
    out = compact_example(IDS, PROMPT_LEN, KEEP, LOSS, OFFSETS)
    assert out["input_ids"] == [BOS, 11, 12, 20, 21, 22, 23, EOS]
    assert out["prompt_len"] == 3
    assert out["loss_mask"] == [0, 0, 0, 0, 1, 0, 1, 1]
    assert out["prompt_offsets"] == [-1, -1, 3, 5, 6, 8]
    # Targets the loss sees: r2, r4 and EOS; r1 and r3 stay in the sequence as unsupervised history.
    targets = [t for t, m in zip(out["input_ids"], out["loss_mask"]) if m]
    assert targets == [21, 23, EOS]


def test_eos_is_supervised_even_when_the_mask_omits_it():
    loss = LOSS.copy()
    loss[-1] = False
    out = compact_example(IDS, PROMPT_LEN, KEEP, loss)
    assert out["loss_mask"] == [0, 0, 0, 0, 1, 0, 1, 1]
    assert out["prompt_offsets"] is None


def test_first_response_token_is_predicted_from_the_last_kept_prompt_token():
    loss = np.zeros(len(IDS), dtype=bool)
    loss[PROMPT_LEN] = True  # r1
    out = compact_example(IDS, PROMPT_LEN, KEEP, loss)
    t = out["loss_mask"].index(1)
    assert (out["input_ids"][t - 1], out["input_ids"][t]) == (12, 20)


def test_keep_everything_is_the_identity():
    out = compact_example(IDS, PROMPT_LEN, np.ones(PROMPT_LEN, bool), LOSS, OFFSETS)
    assert out["input_ids"] == IDS and out["prompt_len"] == PROMPT_LEN and out["prompt_offsets"] == OFFSETS
    assert out["loss_mask"] == LOSS.astype(int).tolist()


def test_sft_loss_is_normalised_by_the_number_of_selected_positions():
    out = compact_example(IDS, PROMPT_LEN, KEEP, LOSS)
    ids = torch.tensor([out["input_ids"]])  # (1, 8)
    mask = torch.tensor([out["loss_mask"]])  # (1, 8)
    logits = torch.randn(1, ids.shape[1], 32, generator=torch.Generator().manual_seed(0))  # (1, 8, V)
    per_pos = token_losses(logits, ids, torch.ones_like(ids))[0]  # (8,)
    expected = per_pos[[4, 6, 7]].mean()  # r2, r4, EOS
    assert example_losses(logits, ids, mask)[0] == pytest.approx(float(expected), rel=1e-6)
    # ... not by the response length (5) nor the row length.
    assert float(per_pos[[4, 6, 7]].sum() / 5) != pytest.approx(float(expected), rel=1e-3)


@pytest.mark.parametrize(
    "keep, loss, match",
    [
        (np.ones(4, bool), LOSS, "prompt_keep has shape"),
        (KEEP, LOSS[:-1], "response_loss has shape"),
        (np.zeros(PROMPT_LEN, bool), LOSS, "drops every prompt token"),
        (KEEP, np.ones(len(IDS), bool), "prompt side"),
    ],
)
def test_bad_masks_are_rejected_with_a_fix(keep, loss, match):
    with pytest.raises(ValueError, match=match):
        compact_example(IDS, PROMPT_LEN, keep, loss)


def test_bad_prompt_len_and_offsets():
    with pytest.raises(ValueError, match="prompt_len"):
        compact_example(IDS, len(IDS), np.ones(len(IDS), bool), np.zeros(len(IDS), bool))
    with pytest.raises(ValueError, match="two"):
        compact_example(IDS, PROMPT_LEN, KEEP, LOSS, OFFSETS[:-2])


def test_table_rows_pass_fields_through_and_match_by_id():
    rows = [
        {"id": "a", "input_ids": IDS, "prompt_len": PROMPT_LEN, "loss_mask": [0] * 5 + [1] * 5, "weight": 0.5,
         "prompt_offsets": OFFSETS, "response_offsets": list(range(10)), "domain": "math"},
        {"id": "b", "input_ids": [BOS, 7, 8, EOS], "prompt_len": 2, "loss_mask": [0, 0, 1, 1], "weight": 1.0},
    ]
    masks = {"b": (np.array([True, True]), np.array([0, 0, 0, 1], bool)), "a": (KEEP, LOSS)}
    a, b = compact_table_rows(rows, masks)
    assert a["input_ids"] == [BOS, 11, 12, 20, 21, 22, 23, EOS] and a["loss_mask"] == [0, 0, 0, 0, 1, 0, 1, 1]
    assert (a["id"], a["weight"], a["domain"], a["response_offsets"]) == ("a", 0.5, "math", list(range(10)))
    assert a["prompt_offsets"] == [-1, -1, 3, 5, 6, 8] and a["n_tokens_full"] == 10
    assert b["input_ids"] == [BOS, 7, 8, EOS] and b["loss_mask"] == [0, 0, 0, 1] and "prompt_offsets" not in b
    with pytest.raises(ValueError, match="no selection masks for 1 of 2 rows"):
        compact_table_rows(rows, {"a": (KEEP, LOSS)})


def test_tokenized_chat_row_keeps_template_tokens_and_text_alignment():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from raycurate.data.tokenize import tokenize_record

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["Tom has 4 apples and buys 3 more. He has 7 apples. #### 7"] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="<s>",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    prompt = "Tom has 4 apples and buys 3 more. How many?"
    row = tokenize_record(fast, {"id": "x", "prompt": prompt, "response": "He has 7 apples. #### 7"}, 512)
    n, plen = len(row["input_ids"]), row["prompt_len"]
    p_offs = np.asarray(row["prompt_offsets"]).reshape(plen, 2)
    r_offs = np.asarray(row["response_offsets"]).reshape(n - plen, 2)
    prompt_idx, response_idx = eligible_positions(n, plen, True, p_offs[:, 0] < 0, r_offs[:, 0] < 0)
    prompt_mask = np.arange(prompt_idx.size) % 2 == 0  # keep every other content token
    response_mask = np.arange(response_idx.size) % 3 == 0
    keep, loss = to_row_masks(n, plen, prompt_idx, response_idx, prompt_mask, response_mask)

    out = compact_example(row["input_ids"], plen, keep, loss, row["prompt_offsets"])
    k = out["prompt_len"]
    assert k == plen - prompt_idx.size + int(prompt_mask.sum())
    assert out["input_ids"][k:] == row["input_ids"][plen:]  # the complete response, in order
    kept_ids = [row["input_ids"][i] for i in np.flatnonzero(keep)]
    assert out["input_ids"][:k] == kept_ids
    assert out["input_ids"][0] == fast.bos_token_id
    # Every template/special token (offset -1) of the prompt survives; kept content tokens still point at their text.
    assert sum(1 for i in range(plen) if p_offs[i, 0] < 0) == sum(1 for s in out["prompt_offsets"][::2] if s < 0)
    for t, (s, e) in enumerate(np.asarray(out["prompt_offsets"]).reshape(k, 2)):
        if s >= 0:
            assert fast.decode([out["input_ids"][t]]) == prompt[s:e]
    assert sum(out["loss_mask"]) == int(response_mask.sum()) + (n - plen - response_idx.size)
