"""Tiny tokenizer, presets, loading, attention outputs and cached pre-training (raycurate.models)."""

from __future__ import annotations

import json
import math
import os
import random
import threading

import pytest

torch = pytest.importorskip("torch")

from raycurate.models import loading, pretrain, tiny  # noqa: E402
from raycurate.models import tokenizer as tok_mod  # noqa: E402

WORDS = "the a cat dog sat ran on to mat park with ball add two three numbers sum is then multiply result by".split()


def make_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) + "." for _ in range(n)]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return make_texts(300)


@pytest.fixture(scope="module")
def tokenizer(texts):
    return tok_mod.train_tokenizer(texts, vocab_size=400)


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "add two and three"},
    {"role": "assistant", "content": "the sum is five"},
]


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded)


# --- tokenizer -------------------------------------------------------------------------------------------------


def test_tokenizer_training_is_deterministic(texts, tokenizer):
    again = tok_mod.train_tokenizer(texts, vocab_size=400)
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    assert 263 < len(tokenizer) <= 400


def test_special_tokens_have_fixed_ids_and_are_not_auto_added(tokenizer):
    assert tokenizer.convert_tokens_to_ids(tok_mod.SPECIAL_TOKENS) == list(range(7))
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    ids = tokenizer("the cat sat").input_ids
    assert ids and all(i >= len(tok_mod.SPECIAL_TOKENS) for i in ids)
    assert tokenizer.decode(ids) == "the cat sat"


def test_tokenizer_round_trips_offline(tmp_path, monkeypatch, tokenizer):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer.save_pretrained(tmp_path)
    loaded = loading.load_tokenizer(str(tmp_path))
    text = "add two numbers then multiply the result by three"
    assert loaded(text).input_ids == tokenizer(text).input_ids
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (0, 1, 2)
    assert _ids(loaded.apply_chat_template(CONVERSATION)) == _ids(tokenizer.apply_chat_template(CONVERSATION))


def test_vocab_size_below_byte_alphabet_is_rejected(texts):
    with pytest.raises(ValueError, match="at least 263"):
        tok_mod.train_tokenizer(texts, vocab_size=100)


def test_chat_template_renders_turns_and_generation_prompt_is_a_prefix(tokenizer):
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert rendered == (
        "<|system|>Be brief.<|end|><|user|>add two and three<|end|><|assistant|>the sum is five<|end|>"
    )
    prompt = _ids(tokenizer.apply_chat_template(CONVERSATION[:-1], add_generation_prompt=True))
    full = _ids(tokenizer.apply_chat_template(CONVERSATION))
    assert prompt[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    assert full[: len(prompt)] == prompt
    response = tokenizer("the sum is five", add_special_tokens=False).input_ids
    assert full[len(prompt):] == response + [tokenizer.convert_tokens_to_ids("<|end|>")]


def test_chat_template_can_be_disabled(texts):
    plain = tok_mod.train_tokenizer(texts[:50], vocab_size=300, chat_template=False)
    assert plain.chat_template is None


# --- presets ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_presets_build_gqa_models_and_forward(preset, tokenizer):
    model = tiny.build_tiny_model(preset, tokenizer, seed=0)
    geometry = loading.head_geometry(model.config)
    assert geometry == {"n_heads": 4, "n_kv_heads": 2, "head_dim": 32, "n_layers": 4, "hidden": 128}
    assert model.config.vocab_size == len(tokenizer)
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (0, 1, 2)
    input_ids = torch.tensor([[0, 10, 11, 12, 13], [0, 14, 15, 16, 17]])
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    assert logits.shape == (2, 5, len(tokenizer))
    assert torch.isfinite(logits).all()
    assert loading.attention_layer_types(model) == ["full_attention"] * 4


def test_seeded_init_is_reproducible_and_seed_sensitive(tokenizer):
    first = tiny.build_tiny_model("tiny-llama", tokenizer, seed=3)
    same = tiny.build_tiny_model("tiny-llama", tokenizer, seed=3)
    other = tiny.build_tiny_model("tiny-llama", tokenizer, seed=4)
    weights = [p for _, p in sorted(first.state_dict().items())]
    assert all(torch.equal(a, b) for a, b in zip(weights, [p for _, p in sorted(same.state_dict().items())]))
    assert not torch.equal(first.model.layers[0].self_attn.q_proj.weight, other.model.layers[0].self_attn.q_proj.weight)


def test_building_a_model_leaves_global_rng_untouched(tokenizer):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    tiny.build_tiny_model("tiny-qwen2", tokenizer, seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_unknown_preset_lists_valid_names(tokenizer):
    with pytest.raises(ValueError, match="tiny-llama.*tiny-qwen2"):
        tiny.build_tiny_model("tiny-gpt", tokenizer, seed=0)


def test_layer_types_come_from_config(tokenizer):
    model = tiny.build_tiny_model("tiny-qwen2", tokenizer, seed=0)
    model.config.layer_types = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    assert loading.attention_layer_types(model)[1] == "sliding_attention"


# --- attention outputs -----------------------------------------------------------------------------------------


def _attention_batch():
    input_ids = torch.tensor([[0, 10, 11, 12, 13, 14], [0, 15, 16, 17, 2, 2]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    return input_ids, attention_mask


def test_sdpa_returns_no_attentions_and_check_raises(tokenizer):
    model = tiny.build_tiny_model("tiny-llama", tokenizer, seed=0)
    input_ids, attention_mask = _attention_batch()
    with torch.no_grad():
        outputs = model(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True)
    assert not outputs.attentions
    with pytest.raises(RuntimeError, match="enable_attention_outputs"):
        loading.check_attentions(outputs, [0])


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_enable_attention_outputs_all_layers(preset, tokenizer):
    model = tiny.build_tiny_model(preset, tokenizer, seed=0)
    input_ids, attention_mask = _attention_batch()
    with torch.no_grad():
        reference = model(input_ids=input_ids, attention_mask=attention_mask).logits
        loading.enable_attention_outputs(model)
        outputs = model(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True)
    attentions = loading.check_attentions(outputs)
    assert len(attentions) == 4
    for weights in attentions:
        assert weights.shape == (2, 4, 6, 6)  # (B, n_heads, T, T)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 6))
        assert torch.all(weights.triu(diagonal=1) == 0)  # causal
        assert torch.all(weights[1, :, :, 4:] == 0)  # padded keys get no attention
    torch.testing.assert_close(outputs.logits, reference, atol=1e-5, rtol=1e-5)


def test_enable_attention_outputs_layer_subset(tokenizer):
    model = tiny.build_tiny_model("tiny-qwen2", tokenizer, seed=0)
    input_ids, attention_mask = _attention_batch()
    with torch.no_grad():
        reference = model(input_ids=input_ids, attention_mask=attention_mask).logits
        loading.enable_attention_outputs(model, [1, 3])
        outputs = model(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True)
    attentions = loading.check_attentions(outputs, [1, 3])
    assert [tuple(a.shape) for a in attentions] == [(2, 4, 0, 0), (2, 4, 6, 6), (2, 4, 0, 0), (2, 4, 6, 6)]
    torch.testing.assert_close(attentions[3].sum(-1), torch.ones(2, 4, 6))
    torch.testing.assert_close(outputs.logits, reference, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match=r"layers \[0\]"):
        loading.check_attentions(outputs, [0, 1])
    with pytest.raises(ValueError, match="out of range"):
        loading.enable_attention_outputs(model, [4])


# --- loading ---------------------------------------------------------------------------------------------------


def test_load_model_errors_say_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="ensure_base_model"):
        loading.load_model("tiny-llama")
    with pytest.raises(FileNotFoundError, match="config.json"):
        loading.load_model(str(tmp_path))
    with pytest.raises(ValueError, match="float16"):
        loading.load_model(str(tmp_path), dtype="float16")


def test_load_model_builds_untrained_preset_with_tokenizer(tokenizer):
    model = loading.load_model("tiny-qwen2", tokenizer=tokenizer, seed=0, dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert not model.training


# --- pre-training ----------------------------------------------------------------------------------------------


def test_cosine_with_warmup_schedule_values_with_a_floor():
    from raycurate.models.optim import cosine_with_warmup

    assert cosine_with_warmup(0, 10, 100, floor=0.1) == pytest.approx(1 / 11)  # (step + 1) / (warmup + 1)
    assert cosine_with_warmup(9, 10, 100, floor=0.1) == pytest.approx(10 / 11)
    assert cosine_with_warmup(10, 10, 100, floor=0.1) == pytest.approx(1.0)
    assert cosine_with_warmup(55, 10, 100, floor=0.1) == pytest.approx(0.55)  # halfway: (1 + 0.1) / 2
    assert cosine_with_warmup(100, 10, 100, floor=0.1) == pytest.approx(0.1)
    assert cosine_with_warmup(55, 10, 100) == pytest.approx(0.5)  # no floor: the training stage's schedule


def test_decay_param_groups_decay_matrices_only_and_drop_empty_groups():
    from raycurate.models.optim import decay_param_groups

    layer = torch.nn.Linear(3, 2)
    groups = decay_param_groups(layer, 0.1)
    assert [(len(g["params"]), g["weight_decay"]) for g in groups] == [(1, 0.1), (1, 0.0)]
    assert groups[0]["params"][0] is layer.weight
    layer.bias.requires_grad_(False)
    assert [(len(g["params"]), g["weight_decay"]) for g in decay_param_groups(layer, 0.1)] == [(1, 0.1)]


def test_pack_token_blocks_frames_each_text_with_bos_and_eos(tokenizer):
    texts = ["the cat sat", "a dog ran"]
    lengths = [len(tokenizer(t).input_ids) + 2 for t in texts]
    blocks = pretrain.pack_token_blocks(tokenizer, texts, max_len=3)
    assert blocks.shape == (sum(lengths) // 3, 3)
    stream = blocks.flatten().tolist()
    assert stream[0] == tokenizer.bos_token_id
    assert stream[lengths[0] - 1] == tokenizer.eos_token_id
    assert stream[lengths[0]] == tokenizer.bos_token_id
    with pytest.raises(ValueError, match="smaller max_len"):
        pretrain.pack_token_blocks(tokenizer, texts, max_len=1000)


def test_causal_lm_loss_of_uniform_logits_is_log_vocab():
    logits = torch.zeros(2, 5, 7)
    input_ids = torch.randint(0, 7, (2, 5), generator=torch.Generator().manual_seed(0))
    assert pretrain.causal_lm_loss(logits, input_ids).item() == pytest.approx(math.log(7))


def test_pretraining_lowers_the_loss(texts, tokenizer):
    model = tiny.build_tiny_model("tiny-llama", tokenizer, seed=0)
    losses = pretrain.pretrain_causal_lm(
        model, tokenizer, texts, steps=30, batch_size=8, max_len=32, lr=3e-3, seed=0, num_threads=1, progress=False
    )
    assert len(losses) == 30
    assert losses[0] == pytest.approx(math.log(len(tokenizer)), abs=0.5)  # near-uniform at init
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5
    assert not model.training


# One torch thread: on a shared 2-core machine two OpenMP threads stall on each other (measured 4-6x slower).
SMALL_RUN = {
    "steps": 3, "seed": 0, "vocab_size": 300, "batch_size": 4, "max_len": 16, "num_threads": 1, "progress": False
}


def test_ensure_base_model_caches_and_reloads_identically(tmp_path, texts):
    calls = []

    def texts_fn():
        calls.append(1)
        return texts

    path = pretrain.ensure_base_model("tiny-llama", str(tmp_path), texts_fn, data_key="unit-v1", **SMALL_RUN)
    assert calls == [1]
    for name in ("config.json", "model.safetensors", "tokenizer.json", pretrain.METADATA_FILE):
        assert os.path.isfile(os.path.join(path, name)), name
    metadata_path = os.path.join(path, pretrain.METADATA_FILE)
    metadata = json.load(open(metadata_path))
    assert len(metadata["losses"]) == 3 and metadata["seconds"] > 0
    mtime = os.path.getmtime(metadata_path)

    again = pretrain.ensure_base_model("tiny-llama", str(tmp_path), texts_fn, data_key="unit-v1", **SMALL_RUN)
    assert again == path and calls == [1] and os.path.getmtime(metadata_path) == mtime
    assert [p for p in os.listdir(os.path.dirname(path)) if p.startswith(".tmp")] == []

    # Rebuilding in memory with the same settings gives bit-identical logits to the reloaded checkpoint.
    tokenizer = tok_mod.train_tokenizer(texts, vocab_size=300)
    model = tiny.build_tiny_model("tiny-llama", tokenizer, seed=0)
    pretrain.pretrain_causal_lm(
        model, tokenizer, texts, steps=3, batch_size=4, max_len=16, seed=0, num_threads=1, progress=False
    )
    loaded = loading.load_model(path, dtype="float32")
    loaded_tokenizer = loading.load_tokenizer(path)
    input_ids = torch.tensor([[0] + loaded_tokenizer("the cat sat on the mat").input_ids])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=input_ids).logits, model(input_ids=input_ids).logits)


def test_ensure_base_model_key_tracks_settings(tmp_path, texts):
    base = pretrain.ensure_base_model("tiny-qwen2", str(tmp_path), lambda: texts, data_key="a", **SMALL_RUN)
    other_data = pretrain.ensure_base_model("tiny-qwen2", str(tmp_path), lambda: texts, data_key="b", **SMALL_RUN)
    hashed = pretrain.ensure_base_model("tiny-qwen2", str(tmp_path), lambda: texts, **SMALL_RUN)
    assert len({base, other_data, hashed}) == 3
    with pytest.raises(ValueError, match="valid presets"):
        pretrain.ensure_base_model("tiny-gpt", str(tmp_path), lambda: texts, **SMALL_RUN)


def test_racing_callers_build_once(tmp_path, texts):
    calls = []
    results: list[str] = []

    def texts_fn():
        calls.append(1)
        return texts

    def build():
        results.append(pretrain.ensure_base_model("tiny-llama", str(tmp_path), texts_fn, data_key="race", **SMALL_RUN))

    threads = [threading.Thread(target=build) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 2 and results[0] == results[1]
    assert calls == [1]


def test_small_checkpoints_count_an_adapters_base_weights(tmp_path):
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    base.mkdir()
    adapter.mkdir()
    (base / "config.json").write_text("{}")
    (base / "model.safetensors").write_bytes(b"\0" * 3000)
    (base / "tokenizer.json").write_bytes(b"\0" * 5000)  # not a weight file
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "../base"}))
    (adapter / "adapter_model.safetensors").write_bytes(b"\0" * 1000)
    assert loading.is_small_checkpoint(base, limit=3000) and not loading.is_small_checkpoint(base, limit=2999)
    assert loading.is_small_checkpoint(adapter, limit=4000) and not loading.is_small_checkpoint(adapter, limit=3999)
