"""Config section ``model``: the base model, its tokenizer and the cached pre-training of tiny presets."""

from __future__ import annotations

from dataclasses import dataclass

from raycurate.config.base import option
from raycurate.models.tiny import TINY_PRESETS


@dataclass
class ModelConfig:
    """Base model: the committed embedded checkpoint, a tiny preset pre-trained on first use and cached, or a local HF
    checkpoint (docs/design.md, "Embedded base model")."""

    name_or_path: str = option(
        "embedded",
        "embedded (the committed pre-trained base model in raycurate/models/embedded, trained for in-context "
        f"learning; no pre-training on first use), a tiny preset ({', '.join(TINY_PRESETS)}; pre-trained on the "
        "clean corpus on first use and cached), a fetched model (smollm2-135m: SmolLM2-135M-Instruct, fetched once "
        "into the per-user model cache by `raycurate model fetch smollm2-135m`) or a local HF checkpoint directory "
        "with config.json, weights and tokenizer files.",
    )
    cache_dir: str = option(".cache/raycurate", "Folder for cached pre-trained tiny base models.")
    pretrain_steps: int = option(300, "Optimizer steps of the tiny preset's pre-training (16 x 128-token blocks each).",
                                 ge=0)
    pretrain_seed: int = option(0, "Seed of the tiny preset's weight init and pre-training block order.")
    pretrain_rows: int = option(4000, "Clean corpus texts used to train the tiny preset's tokenizer and weights.", ge=1)
    vocab_size: int = option(2048, "Byte-level BPE vocabulary size of the tiny preset's tokenizer (>= 263).", ge=263)
    chat_template: bool = option(
        True, "Give the tiny preset's tokenizer a system/user/assistant chat template (turns end with <|end|>)."
    )
    dtype: str = option(
        "auto", "Weight dtype when loading: auto keeps the checkpoint's dtype.", choices=("auto", "float32", "bfloat16")
    )
    attn_implementation: str = option(
        "sdpa", "Attention kernel; stages that need attention weights switch layers to eager themselves.",
        choices=("sdpa", "eager"),
    )
