"""What a configured base model looks like, without loading its weights: its ``config.json`` settings (layer count)
and its module names, so settings that depend on them are checked before any stage runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from raycurate.models.loading import config_dir, resolve_model_path
from raycurate.models.tiny import TINY_PRESETS


def model_settings(name: str) -> dict[str, Any]:
    """The model's config settings (``num_hidden_layers``, ``layer_types``, ...): a tiny preset's, or the
    ``config.json`` of its folder (an adapter folder's base; a multimodal config's ``text_config``).

    Args:
        name: ``model.name_or_path`` (a preset, ``embedded``, a fetched name or a checkpoint folder), already
            checked by :func:`raycurate.models.loading.check_model_source`.
    """
    if name in TINY_PRESETS:
        return dict(TINY_PRESETS[name][1])
    settings = json.loads((Path(config_dir(resolve_model_path(name))) / "config.json").read_text(encoding="utf-8"))
    return settings.get("text_config") or settings


def module_names(name: str) -> dict[str, str]:
    """``{qualified module name: its class name}`` of every module (``model.layers.0.self_attn.q_proj: Linear``), from
    the model built on the meta device (no memory, no weights read).

    Raises:
        Exception: Whatever transformers raises for a config it cannot build.
    """
    import torch
    import transformers

    if name in TINY_PRESETS:
        class_name, overrides = TINY_PRESETS[name]
        config = getattr(transformers, class_name)(**overrides)
    else:
        config = transformers.AutoConfig.from_pretrained(config_dir(resolve_model_path(name)))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return {module: type(obj).__name__ for module, obj in model.named_modules() if module}


def matches_module(target: str, names: Iterable[str]) -> bool:
    """Whether a LoRA target (``q_proj``, or a dotted suffix such as ``self_attn.q_proj``) names a module, as PEFT
    matches ``target_modules``."""
    return any(module == target or module.endswith("." + target) for module in names)
