"""Load local HF checkpoints (tiny, embedded or real) and expose attention weights and head geometry.

:func:`load_model` / :func:`load_tokenizer` never reach a hub (``local_files_only=True``, no remote code); an
adapter-only folder loads as its base with the adapter merged in float32 (:func:`adapter_base`,
:func:`config_dir`), or unmerged with ``unmerged_adapter=True`` (:mod:`raycurate.models.precision`).
:func:`check_model_source` rejects an unusable ``--model`` before any stage runs.  :func:`enable_attention_outputs`
makes chosen layers return attention weights (SDPA returns none) and :func:`check_attentions` verifies them;
:func:`key_log_scales` is BRIDGE's knock-out hook; :func:`head_geometry` and :func:`attention_layer_types` describe
the heads.  Decisions: docs/design.md, "Run directory and resume" and "Attention weights"; docs/bridge.md.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raycurate.errors import UserError
from raycurate.models.fetch import REGISTRY, fetch_command, fetched_model_dir, is_fetched
from raycurate.models.tiny import TINY_PRESETS, build_tiny_model, is_preset

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger("raycurate")

DTYPES = ("auto", "float32", "bfloat16")
ADAPTER_CONFIG = "adapter_config.json"
SELECTIVE_EAGER = "raycurate_selective_eager"
_RECORD_FLAG = "_raycurate_record_attention"


def _torch_dtype(dtype: str) -> Any:
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {list(DTYPES)}")
    return "auto" if dtype == "auto" else getattr(torch, dtype)


EMBEDDED_MODEL = "embedded"


def embedded_model_dir() -> str:
    """Folder of the committed pre-trained base model (package data, see ``raycurate/models/embedded/README.md``)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), EMBEDDED_MODEL)


def resolve_model_path(path_or_name: str) -> str:
    """Map a model name to its folder; a local folder of the same name always wins.

    ``"embedded"`` -> :func:`embedded_model_dir`; a fetchable model (a key of
    :data:`raycurate.models.fetch.REGISTRY`, e.g. ``"smollm2-135m"``) -> its absolute folder in the model cache,
    or :class:`ModelSourceError` naming the fetch command when it was not fetched yet; anything else as is.
    """
    if os.path.isdir(path_or_name):
        return path_or_name
    if path_or_name == EMBEDDED_MODEL:
        return embedded_model_dir()
    if path_or_name in REGISTRY:
        folder = fetched_model_dir(path_or_name)
        if not is_fetched(folder, REGISTRY[path_or_name]):
            raise ModelSourceError(f"model {path_or_name!r} is not in the model cache ({folder}); fetch it once "
                                   f"with: {fetch_command(path_or_name)}")
        return str(folder)
    return path_or_name


def adapter_base(path: str | os.PathLike) -> str | None:
    """The checkpoint an adapter-only folder was trained on, or None when ``path`` is not one.

    An adapter-only folder has ``adapter_config.json`` (PEFT) and no ``config.json``; its base is the config's
    ``base_model_name_or_path`` (absolute, or relative to the folder).

    Raises:
        ModelSourceError: The folder names no base, or the base folder is gone (e.g. a run directory moved without
            the model it was trained from).
    """
    folder = Path(path)
    adapter_config = folder / ADAPTER_CONFIG
    if (folder / "config.json").is_file() or not adapter_config.is_file():
        return None
    base = json.loads(adapter_config.read_text(encoding="utf-8")).get("base_model_name_or_path")
    if not base:
        raise ModelSourceError(f"{adapter_config} names no base_model_name_or_path; set it to the folder of the "
                               "checkpoint the adapter was trained on")
    base_dir = folder / base
    if not base_dir.is_dir():
        raise ModelSourceError(f"{folder} is a LoRA adapter of {base}, which is not a folder on this machine; put the "
                               f"base checkpoint there (or edit base_model_name_or_path in {ADAPTER_CONFIG})")
    return os.path.normpath(base_dir)


#: Checkpoints whose weights (an adapter's base included) are at most this many bytes count as small: their
#: evaluation tasks reuse warm worker processes (``warm=True`` in
#: :func:`raycurate.stages.executor.map_model_over_rows`).  SmolLM2-135M's bf16 weights are 270 MB; the embedded and
#: tiny models are a few MB.
SMALL_CHECKPOINT_BYTES = 64 * 2**20


def is_small_checkpoint(path: str | os.PathLike, limit: int = SMALL_CHECKPOINT_BYTES) -> bool:
    """Whether the weight files of ``path`` (and of its base, for an adapter-only folder) total at most ``limit``
    bytes."""
    folders = [Path(path)] + ([Path(base)] if (base := adapter_base(path)) else [])
    total = sum(f.stat().st_size for folder in folders for pattern in _WEIGHT_GLOBS for f in folder.glob(pattern))
    return total <= limit


def config_dir(path: str) -> str:
    """The folder whose ``config.json`` / ``generation_config.json`` describe ``path``'s model: ``path`` itself, or
    for an adapter-only folder its base's (following chains of adapters)."""
    base = adapter_base(path)
    return path if base is None else config_dir(base)


def _load_adapter_merged(adapter_dir: str, base_dir: str, *, dtype: str, attn_implementation: str,
                         device: str) -> PreTrainedModel:
    """The base model with the adapter of ``adapter_dir`` merged in float32, then cast to ``dtype`` (``"auto"``:
    float32, as the merged exports are: a bf16 merge rounds most of a small update away)."""
    from peft import PeftModel

    base = load_model(base_dir, dtype="float32", attn_implementation=attn_implementation)
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=False).merge_and_unload()
    if dtype != "auto":
        model = model.to(_torch_dtype(dtype))
    return model.to(device).eval()


def _load_adapter_unmerged(adapter_dir: str, base_dir: str, *, dtype: str, attn_implementation: str,
                           device: str) -> PreTrainedModel:
    """The base in ``dtype`` (``"auto"``: as stored) with the adapter of ``adapter_dir`` beside it, unmerged, its
    weights in float32 (a ``peft.PeftModel``).

    Each LoRA layer computes ``base(x)`` in the base's dtype and ``B(A(x)) * scale`` in float32 on ``x`` cast to
    float32, and returns their sum in the base's dtype: on a bf16 base the activations are bf16, as in training with
    ``train.frozen_dtype=bfloat16``, while the update's weights keep every bit (merged into bf16 weights, most of it
    would round away). A chain (the base is itself an adapter folder) is merged in float32 instead, since one PEFT
    model holds one base: no stage trains an adapter on an adapter today.
    """
    import torch
    from peft import PeftModel

    if adapter_base(base_dir) is not None:
        log.warning("%s is an adapter of the adapter %s: loading it merged in float32 (an unmerged chain is not "
                    "supported)", adapter_dir, base_dir)
        return _load_adapter_merged(adapter_dir, base_dir, dtype="float32", attn_implementation=attn_implementation,
                                    device=device)
    base = load_model(base_dir, dtype=dtype, attn_implementation=attn_implementation)
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=False, autocast_adapter_dtype=True)
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(torch.float32)  # PEFT upcasts bf16/fp16 adapters only; keep every one fp32
    return model.to(device).eval()


def load_model(
    path_or_preset: str,
    *,
    dtype: str = "auto",
    attn_implementation: str = "sdpa",
    device: str = "cpu",
    tokenizer: PreTrainedTokenizerBase | None = None,
    seed: int = 0,
    unmerged_adapter: bool = False,
) -> PreTrainedModel:
    """Load a causal LM from a local HF checkpoint directory, or build an untrained tiny preset.

    Args:
        path_or_preset: A local checkpoint directory (``config.json`` + weights, or an adapter-only folder: see
            :func:`adapter_base`), ``"embedded"`` (the committed
            pre-trained base model, :func:`embedded_model_dir`), a fetched registry model (``"smollm2-135m"``,
            see :func:`resolve_model_path`), or a key of ``TINY_PRESETS``
            (then ``tokenizer`` is required and the weights are a fresh seeded init; use
            :func:`raycurate.models.pretrain.ensure_base_model` for the pre-trained base model).
        dtype: ``"auto"`` (the checkpoint's dtype), ``"float32"`` or ``"bfloat16"``.
        attn_implementation: ``"sdpa"``, ``"eager"`` or any implementation transformers accepts.
        device: Device to move the model to.
        tokenizer: Only for presets: supplies the vocabulary.
        seed: Only for presets: initialisation seed.
        unmerged_adapter: Only for adapter-only folders: keep the adapter unmerged in float32 beside its base loaded
            in ``dtype`` (:func:`_load_adapter_unmerged`; a ``peft.PeftModel``) instead of merging it in float32.

    Returns:
        The model in eval mode on ``device``.
    """
    from transformers import AutoModelForCausalLM

    torch_dtype = _torch_dtype(dtype)
    path_or_preset = resolve_model_path(path_or_preset)
    if is_preset(path_or_preset) and not os.path.isdir(path_or_preset):
        if tokenizer is None:
            raise ValueError(
                f"{path_or_preset!r} is a tiny preset, which has no weights on disk: call "
                "raycurate.models.pretrain.ensure_base_model(...) to get a pre-trained checkpoint directory, or "
                "pass tokenizer= to build an untrained model"
            )
        model = build_tiny_model(path_or_preset, tokenizer, seed, attn_implementation=attn_implementation)
        if torch_dtype != "auto":
            model = model.to(torch_dtype)
        return model.to(device)
    base = adapter_base(path_or_preset) if os.path.isdir(path_or_preset) else None
    if base is not None:
        load = _load_adapter_unmerged if unmerged_adapter else _load_adapter_merged
        return load(path_or_preset, base, dtype=dtype, attn_implementation=attn_implementation, device=device)
    if not os.path.isfile(os.path.join(path_or_preset, "config.json")):
        raise FileNotFoundError(
            f"{path_or_preset!r} is not a local HF checkpoint directory (no config.json there); pass a directory "
            f"written by save_pretrained or one of the tiny presets {sorted(TINY_PRESETS)}"
        )
    model = AutoModelForCausalLM.from_pretrained(
        path_or_preset,
        dtype=torch_dtype,
        attn_implementation=attn_implementation,
        local_files_only=True,
        trust_remote_code=False,
    )
    return model.to(device).eval()


class ModelSourceError(UserError, FileNotFoundError):
    """A model path that is neither a tiny preset nor a usable local Hugging Face checkpoint folder."""


_WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_model_source(name: str, key: str = "model.name_or_path") -> None:
    """Raise :class:`ModelSourceError` unless ``name`` is a tiny preset or a checkpoint folder with
    ``config.json`` (valid JSON), weights and tokenizer files.

    Args:
        name: The configured model (preset name or folder path).
        key: The config key it came from (named in the error).
    """
    if is_preset(name):
        return
    path = Path(name)
    if not path.is_dir() and name in REGISTRY and not is_fetched(fetched_model_dir(name), REGISTRY[name]):
        raise ModelSourceError(f"{key}={name!r} is not in the model cache ({fetched_model_dir(name)}); fetch it "
                               f"once with: {fetch_command(name)}")
    if not path.is_dir() and (name == EMBEDDED_MODEL or name in REGISTRY):
        path = Path(resolve_model_path(name))
    if not path.is_dir():
        raise ModelSourceError(
            f"{key}={name!r} is neither {EMBEDDED_MODEL!r}, a tiny preset ({', '.join(TINY_PRESETS)}), a fetchable "
            f"model ({', '.join(sorted(REGISTRY))}; `raycurate model fetch NAME`) nor a local checkpoint folder; "
            "download the checkpoint first (this machine never reaches the hub) and pass its folder")
    base = adapter_base(path)
    if base is not None:  # an adapter-only folder: its tokenizer here, config and weights in the base
        check_model_source(base, key=f"the base of {key}={name!r}")
        if not any((path / f).is_file() for f in _TOKENIZER_FILES):
            raise ModelSourceError(f"{key}={name!r} is a LoRA adapter folder without tokenizer files (one of "
                                   f"{', '.join(_TOKENIZER_FILES)}); copy them from its base {base}")
        return
    missing = []
    config = path / "config.json"
    if not config.is_file():
        missing.append("config.json")
    else:
        try:
            json.loads(config.read_text(encoding="utf-8"))
        except (ValueError, OSError) as exc:
            missing.append(f"a readable config.json ({type(exc).__name__})")
    if not any(next(path.glob(pattern), None) for pattern in _WEIGHT_GLOBS):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        missing.append(f"tokenizer files (one of {', '.join(_TOKENIZER_FILES)})")
    if missing:
        raise ModelSourceError(
            f"{key}={name!r} is not a Hugging Face checkpoint folder: it has no {'; no '.join(missing)}; pass the "
            "folder written by model.save_pretrained + tokenizer.save_pretrained, or a tiny preset "
            f"({', '.join(TINY_PRESETS)})")


def best_device() -> str:
    """``"cuda"`` when a GPU is visible to this process (e.g. a Ray actor given ``num_gpus``), else ``"cpu"``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved in a local checkpoint directory (never downloads).

    Args:
        path: Directory containing ``tokenizer.json`` / ``tokenizer_config.json``, or ``"embedded"``.

    Returns:
        The tokenizer; its pad token falls back to EOS when the checkpoint defines none.
    """
    from transformers import AutoTokenizer

    path = resolve_model_path(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer directory {path!r} does not exist; pass a local checkpoint directory")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def attention_modules(model: PreTrainedModel) -> list[Any]:
    """Self-attention modules in layer order (those with a ``layer_idx`` whose class name ends in 'Attention')."""
    modules = [
        module
        for module in model.modules()
        if type(module).__name__.endswith("Attention") and isinstance(getattr(module, "layer_idx", None), int)
    ]
    return sorted(modules, key=lambda module: module.layer_idx)


def _repeat_kv(states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, n_kv, T, D) -> (B, n_kv * n_rep, T, D)."""
    if n_rep == 1:
        return states
    batch, n_kv, length, dim = states.shape
    return states[:, :, None].expand(batch, n_kv, n_rep, length, dim).reshape(batch, n_kv * n_rep, length, dim)


def _generic_eager_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                             softmax_dtype=None, **kwargs):
    """Eager attention for architectures whose modeling file has no ``eager_attention_forward``.

    Shapes: query (B, H, Tq, D); key/value (B, H_kv, Tk, D); additive mask (B, 1, Tq, Tk).
    Returns output (B, Tq, H, D) and weights (B, H, Tq, Tk). The softmax runs in ``softmax_dtype`` (default
    float32, like Llama/Qwen2's own eager attention).
    """
    import torch

    n_rep = query.shape[1] // key.shape[1]
    key, value = _repeat_kv(key, n_rep), _repeat_kv(value, n_rep)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, Tq, Tk)
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    weights = torch.softmax(scores, dim=-1, dtype=softmax_dtype or torch.float32).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return output, weights


def _selective_eager_attention(module, query, key, value, attention_mask, **kwargs):
    """Eager attention (with weights) on flagged layers, SDPA elsewhere with an empty weight placeholder."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if getattr(module, _RECORD_FLAG, False):
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", _generic_eager_attention)
        return eager(module, query, key, value, attention_mask, **kwargs)
    output, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    batch, n_heads = query.shape[:2]
    return output, query.new_empty((batch, n_heads, 0, 0))


def _register_selective_eager() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, eager_mask

    if SELECTIVE_EAGER not in AttentionInterface._global_mapping:
        AttentionInterface.register(SELECTIVE_EAGER, _selective_eager_attention)
    if SELECTIVE_EAGER not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        # Additive float masks work for both the eager and the SDPA path.
        AttentionMaskInterface.register(SELECTIVE_EAGER, eager_mask)


def enable_attention_outputs(model: PreTrainedModel, layers: list[int] | None = None) -> PreTrainedModel:
    """Make ``model(..., output_attentions=True)`` return real attention weights.

    Args:
        model: A transformers causal LM (modified in place).
        layers: Layer indices whose weights are needed; ``None`` means all layers (plain eager attention).

    Returns:
        The same model.  ``outputs.attentions[l]`` has shape (B, n_heads, T, T) for every requested layer ``l``;
        with a layer subset, the other entries are empty (B, n_heads, 0, 0) placeholders.  Logits are unchanged
        (up to float rounding).  ``model.set_attn_implementation("sdpa")`` switches back.
    """
    modules = attention_modules(model)
    n_layers = len(modules)
    if layers is None:
        model.set_attn_implementation("eager")
        return model
    bad = [layer for layer in layers if not 0 <= layer < n_layers]
    if bad:
        raise ValueError(f"attention layers {bad} are out of range; the model has layers 0..{n_layers - 1}")
    wanted = set(layers)
    for module in modules:
        setattr(module, _RECORD_FLAG, module.layer_idx in wanted)
    _register_selective_eager()
    model.set_attn_implementation(SELECTIVE_EAGER)
    return model


def _is_attention_tensor(attentions: tuple[Any, ...], layer: int) -> bool:
    weights = attentions[layer] if 0 <= layer < len(attentions) else None
    return weights is not None and weights.dim() == 4 and weights.numel() > 0


def check_attentions(outputs: Any, layers: list[int] | None = None) -> tuple[Any, ...]:
    """Raise if attention weights were requested but did not come back.

    Args:
        outputs: Model output of a forward pass with ``output_attentions=True``.
        layers: Layers whose weights must be present; ``None`` means every entry of ``outputs.attentions``.

    Returns:
        ``outputs.attentions`` (a tuple of (B, n_heads, T, T) tensors, placeholders for unrequested layers).
    """
    attentions = getattr(outputs, "attentions", None)
    fix = "call raycurate.models.loading.enable_attention_outputs(model, layers) before the forward pass"
    if not attentions:
        raise RuntimeError(
            f"the forward pass returned no attention weights (sdpa/flash attention does not materialise them); {fix}"
        )
    wanted = range(len(attentions)) if layers is None else layers
    missing = [layer for layer in wanted if not _is_attention_tensor(attentions, layer)]
    if missing:
        raise RuntimeError(f"attention weights of layers {missing} are missing ({len(attentions)} entries); {fix}")
    return attentions


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def attention_layer_types(model: PreTrainedModel) -> list[str]:
    """Per-layer attention kind, ``"full_attention"`` or ``"sliding_attention"``.

    Taken from the config's ``layer_types`` when it has one, else every layer is full attention.
    """
    config = _text_config(model.config)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return list(layer_types)
    return ["full_attention"] * config.num_hidden_layers


def head_geometry(config: Any) -> dict[str, int]:
    """Attention geometry of a config (or a model), GQA-aware.

    Returns:
        ``{"n_heads", "n_kv_heads", "head_dim", "n_layers", "hidden"}``; ``n_heads // n_kv_heads`` query heads share
        each key/value head.
    """
    config = _text_config(getattr(config, "config", config))
    n_heads = config.num_attention_heads
    n_kv_heads = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    return {
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "head_dim": head_dim,
        "n_layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
    }


# ------------------------------------------------------------------------------ per-key attention scales

KEY_SCALED_EAGER = "raycurate_key_scaled_eager"
_KEY_LOG_SCALES: Any = None  # contextvars.ContextVar holding a (B, T) tensor or None; created on first use


def _key_log_scales_var() -> Any:
    global _KEY_LOG_SCALES
    if _KEY_LOG_SCALES is None:
        import contextvars

        _KEY_LOG_SCALES = contextvars.ContextVar("raycurate_key_log_scales", default=None)
    return _KEY_LOG_SCALES


def _key_scaled_eager_attention(module, query, key, value, attention_mask, **kwargs):
    """The model's eager attention with ``log s_k`` added to the score of every key ``k`` (all heads, all queries).

    Adding ``log s_k`` before the softmax multiplies key ``k``'s unnormalised weight by ``s_k`` (the row is then
    renormalised); ``s_k = 1`` is the unmodified model and ``s_k = 0`` removes key ``k`` from every query's softmax.
    """
    import torch

    log_scales = _key_log_scales_var().get()
    if log_scales is not None:
        k_len = key.shape[-2]
        bias = log_scales[:, None, None, :k_len].to(query.dtype)  # (B, 1, 1, Tk)
        if attention_mask is None:  # eager masks are always materialised; keep causality if one is not
            q_len = query.shape[-2]
            causal = torch.ones((q_len, k_len), dtype=torch.bool, device=query.device).tril(k_len - q_len)
            attention_mask = torch.zeros((q_len, k_len), dtype=query.dtype, device=query.device).masked_fill(
                ~causal, float("-inf"))[None, None]
        attention_mask = attention_mask[:, :, :, :k_len] + bias
    return _precise_eager_attention(module, query, key, value, attention_mask, **kwargs)


def _precise_eager_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention (GQA-aware) whose softmax runs in the query's precision when that is wider than float32.

    Llama/Qwen2's own eager attention casts the softmax to float32, which makes float64 finite-difference checks
    of the knock-out derivative noisy; otherwise identical to :func:`_generic_eager_attention` (no soft-capping,
    no attention sinks: Llama/Qwen2/Mistral-style attention only).
    """
    import torch

    return _generic_eager_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                    softmax_dtype=torch.promote_types(query.dtype, torch.float32))


def _register_key_scaled_eager() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, eager_mask

    if KEY_SCALED_EAGER not in AttentionInterface._global_mapping:
        AttentionInterface.register(KEY_SCALED_EAGER, _key_scaled_eager_attention)
    if KEY_SCALED_EAGER not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionMaskInterface.register(KEY_SCALED_EAGER, eager_mask)


class key_log_scales:  # noqa: N801 -- used as a context manager, reads like one
    """Context manager: every attention layer of ``model`` adds ``log_scales[b, k]`` to the scores of key ``k``.

    ``log_scales`` is ``log s`` for per-token key scales ``s`` (B, T): 0 everywhere is the unmodified model,
    ``-inf`` at ``k`` knocks token ``k`` out of attention in every layer (its own hidden state is still computed,
    and the positions of later tokens do not shift, unlike a physical removal).  The tensor may require grad: the
    derivative of any output w.r.t. ``log s_k`` at ``s = 1`` equals the derivative w.r.t. ``s_k``.  The model runs
    eager attention (registered as ``"raycurate_key_scaled_eager"``) inside the block and gets its previous
    attention implementation back afterwards.

    Args:
        model: A transformers causal LM whose attention modules use the ``AttentionInterface`` (Llama, Qwen2, ...).
        log_scales: (B, T) additive log-space key scales, T >= the sequence length of the forward passes.
    """

    def __init__(self, model: PreTrainedModel, log_scales: torch.Tensor):
        if log_scales.dim() != 2:
            raise ValueError(f"log_scales must be (B, T) per-token key scales, got {tuple(log_scales.shape)}")
        self.model, self.log_scales = model, log_scales
        self._token = None
        self._previous = None

    def __enter__(self) -> PreTrainedModel:
        _register_key_scaled_eager()
        self._previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(KEY_SCALED_EAGER)
        self._token = _key_log_scales_var().set(self.log_scales)
        return self.model

    def __exit__(self, *exc: Any) -> None:
        _key_log_scales_var().reset(self._token)
        self.model.set_attn_implementation(self._previous)
