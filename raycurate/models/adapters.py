"""Parameter-efficient adapters on a causal LM: which parameters train, and how the result becomes a checkpoint.

An adapter is a small JSON-able spec, so it travels to Ray Train workers and into stage hashes unchanged: ``None`` /
``{"kind": "full"}`` (every parameter), ``{"kind": "lora", "r", "alpha", "dropout", "targets"}`` (PEFT LoRA,
:func:`lora_config`) or ``{"kind": "head_delta", "heads": [[layer, head], ...], "train_o"}`` (P2D's sparse head
adaptation, :mod:`raycurate.models.head_adapter`).  :func:`apply_adapter` attaches one, :func:`trainable_parameters`
counts it, :func:`export_model` writes a plain HF model (LoRA merged, head deltas added into the weights) and
:func:`save_adapter` the adapter alone where a format exists (PEFT LoRA, for vLLM and the generation actor).
Adapter-only exports and their loading: docs/design.md, "Run directory and resume".
"""

from __future__ import annotations

from typing import Any

KINDS = ("full", "lora", "head_delta")
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def adapter_kind(spec: dict | None) -> str:
    """The adapter kind of a spec (``"full"`` for ``None``), validated."""
    kind = "full" if spec is None else spec.get("kind", "full")
    if kind not in KINDS:
        raise ValueError(f"adapter kind {kind!r} is unknown; use one of {', '.join(KINDS)}")
    return kind


def lora_config(spec: dict) -> Any:
    """The ``peft.LoraConfig`` of a ``{"kind": "lora", ...}`` spec."""
    from peft import LoraConfig

    unknown = set(spec) - {"kind", "r", "alpha", "dropout", "targets"}
    if unknown:
        raise ValueError(f"LoRA adapter spec has unknown keys {sorted(unknown)}; allowed: r, alpha, dropout, targets")
    return LoraConfig(
        r=int(spec.get("r", 16)),
        lora_alpha=float(spec.get("alpha", 16)),
        lora_dropout=float(spec.get("dropout", 0.0)),
        target_modules=list(spec.get("targets", DEFAULT_LORA_TARGETS)),
        task_type="CAUSAL_LM",
        bias="none",
    )


def apply_adapter(model: Any, spec: dict | None) -> Any:
    """Attach the adapter of ``spec`` to ``model``; returns the model to train (a ``PeftModel`` for LoRA).

    Args:
        model: A HF causal LM (parameters on any device, any dtype).
        spec: Adapter spec (module docstring); ``None`` trains everything.

    Returns:
        The model whose ``requires_grad`` parameters are exactly the adapter's.
    """
    kind = adapter_kind(spec)
    if kind == "full" or spec is None:  # adapter_kind(None) == "full"
        return model
    if kind == "lora":
        from peft import get_peft_model

        return get_peft_model(model, lora_config(spec))
    from raycurate.models.head_adapter import attach_head_delta

    heads = [(int(layer), int(head)) for layer, head in spec.get("heads", [])]
    if not heads:
        raise ValueError("head_delta adapter spec has no heads; run head scoring first (heads.json) or pass "
                         "heads=[[layer, head], ...]")
    attach_head_delta(model, heads, train_o=bool(spec.get("train_o", False)))
    return model


def export_model(model: Any, spec: dict | None) -> Any:
    """A plain HF model with the adapter folded into the base weights (in place where possible).

    Args:
        model: The model returned by :func:`apply_adapter` (full parameters present, e.g. on rank 0 after a
            ZeRO-3 gather into a CPU copy).
        spec: The same spec.

    Returns:
        A ``PreTrainedModel`` without adapter modules; ``save_pretrained`` writes a standard checkpoint.
    """
    kind = adapter_kind(spec)
    if kind == "lora":
        return model.merge_and_unload()
    if kind == "head_delta":
        from raycurate.models.head_adapter import merge_head_delta

        merge_head_delta(model)
    return model


def save_adapter(model: Any, spec: dict | None, path: str) -> bool:
    """Write the adapter alone (PEFT format for LoRA) to ``path``; returns False for kinds without such a format."""
    if adapter_kind(spec) != "lora":
        return False
    model.save_pretrained(path)
    return True


def trainable_parameters(model: Any) -> int:
    """Number of scalar parameters that receive gradients."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
