"""Tiny causal LMs of real architectures (Llama, Qwen2), built from config with a seeded init.

Both presets share one geometry: hidden 128, 4 layers, 4 query heads and 2 key/value heads (GQA, 2 query heads per
KV head), head_dim 32, MLP width 344, RoPE up to 2048 positions, tied input/output embeddings (~1M parameters
with a 2k vocabulary).  Vocabulary size and bos/eos/pad ids come from the tokenizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

_SHARED_GEOMETRY: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 344,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "tie_word_embeddings": True,
    "use_cache": True,
}

# preset name -> (transformers config class name, architecture-specific overrides)
TINY_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-llama": ("LlamaConfig", {**_SHARED_GEOMETRY, "rope_theta": 10000.0, "attention_bias": False}),
    "tiny-qwen2": ("Qwen2Config", {**_SHARED_GEOMETRY, "rope_theta": 10000.0, "use_sliding_window": False}),
    # two layers (induction heads need two; half the compute of tiny-llama), used by the embedded model's recipe
    "tiny-llama-2l": ("LlamaConfig", {**_SHARED_GEOMETRY, "num_hidden_layers": 2, "rope_theta": 10000.0,
                                      "attention_bias": False}),
}


def is_preset(name: str) -> bool:
    """Whether ``name`` is one of :data:`TINY_PRESETS`."""
    return name in TINY_PRESETS


def tiny_config(preset: str, tokenizer: PreTrainedTokenizerBase) -> Any:
    """The transformers config of a preset, with vocabulary and special ids taken from ``tokenizer``.

    Args:
        preset: A key of :data:`TINY_PRESETS`.
        tokenizer: Tokenizer whose vocabulary the model will use; must define bos/eos/pad tokens.

    Returns:
        A ``LlamaConfig`` or ``Qwen2Config``.
    """
    import transformers

    if preset not in TINY_PRESETS:
        raise ValueError(f"unknown tiny preset {preset!r}; valid presets: {sorted(TINY_PRESETS)}")
    missing = [name for name in ("bos_token_id", "eos_token_id", "pad_token_id") if getattr(tokenizer, name) is None]
    if missing:
        raise ValueError(
            f"tokenizer has no {', '.join(missing)}; use raycurate.models.tokenizer.train_tokenizer or set "
            "bos/eos/pad tokens on it before building a tiny model"
        )
    class_name, overrides = TINY_PRESETS[preset]
    config_class = getattr(transformers, class_name)
    return config_class(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **overrides,
    )


def _stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """EOS plus the chat end-of-turn token when the tokenizer has one: generation stops at either."""
    stops = [tokenizer.eos_token_id]
    end_id = tokenizer.convert_tokens_to_ids("<|end|>")
    if isinstance(end_id, int) and end_id != tokenizer.unk_token_id and end_id not in stops:
        stops.append(end_id)
    return stops


def build_tiny_model(
    preset: str, tokenizer: PreTrainedTokenizerBase, seed: int, attn_implementation: str = "sdpa"
) -> PreTrainedModel:
    """Build a randomly initialised tiny model; the same seed gives identical weights.

    The global torch RNG state is saved and restored, so building a model does not perturb other random streams.

    Args:
        preset: A key of :data:`TINY_PRESETS`.
        tokenizer: Tokenizer supplying the vocabulary size and bos/eos/pad ids.
        seed: Seed of the weight initialisation.
        attn_implementation: ``"sdpa"`` or ``"eager"`` (eager returns attention weights).

    Returns:
        A float32 ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` in eval mode on CPU.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(preset, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = _stop_token_ids(tokenizer)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()
