"""The precision a held-out evaluation runs a model in (``eval.dtype``).

Decisions:

* A LoRA adapter folder (``train.export: adapter``) is merged onto its base in float32 on load, so on SmolLM2-135M,
  whose weights are stored in bf16, a fine-tuned arm is evaluated in fp32 while the base model itself runs in bf16.
  Merging into bf16 weights is no way out: an update ~1e-3 of a weight is below bf16's 8 significant bits and
  mostly rounds away. ``eval.dtype=bfloat16`` keeps the adapter unmerged in fp32 beside the frozen base in bf16 (a
  PEFT model, :func:`raycurate.models.loading.load_model` with ``unmerged_adapter=True``); a full checkpoint is
  cast to bf16 (which rounds a fine-tuned fp32 checkpoint's small update). ``float32`` upcasts every weight.
* **The default, ``auto``, stays the evaluation from before the option** (each checkpoint as stored, an adapter
  merged in fp32). Measured on a SmolLM2 LoRA arm (300 held-out questions, benchmarks/RESULTS.md): the bf16
  path changed 6.7% of the greedy answer texts (near-ties in the answer's arithmetic, as often right as wrong:
  exact match +0.003 [-0.017, +0.023] greedy, -0.002 [-0.018, +0.015] sampled) for 1.2-1.3x less time on a
  loaded 2-core CPU, against the 98% agreement asked of a default. The base's weights are stored in bf16 and the
  adapter stays exact, so the rounding that moves them is the bf16 activations'.
* :func:`eval_plan` says what a load will do without loading anything, so the evaluation stage's hash can cover
  exactly that: it names the plan only when it differs from :func:`legacy_eval_plan`, and a finished run whose
  models would load the same keeps its stage hashes whatever the setting (``float32`` on an adapter arm, say).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from raycurate.models.loading import DTYPES, adapter_base, load_model, resolve_model_path

if TYPE_CHECKING:
    from transformers import PreTrainedModel

FULL, MERGED, UNMERGED = "none", "merged", "unmerged"


def stored_dtype(path: str) -> str:
    """The dtype a checkpoint folder's weights are stored in (its ``config.json``'s ``dtype`` / ``torch_dtype``;
    float32 when it names none, or for a tiny preset, which has no folder)."""
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return "float32"
    with open(config, encoding="utf-8") as f:
        data = json.load(f)
    return str(data.get("dtype") or data.get("torch_dtype") or "float32")


def eval_plan(path: str, dtype: str = "auto") -> dict[str, str]:
    """How :func:`load_eval_model` loads ``path`` at ``eval.dtype=dtype``.

    Returns:
        ``{"weights": dtype the full checkpoint or the adapter's base runs in, "adapter": "none" | "merged" |
        "unmerged"}``; a merged adapter always runs in float32.
    """
    if dtype not in DTYPES:
        raise ValueError(f"eval.dtype={dtype!r} is not supported; use one of {list(DTYPES)}")
    if dtype == "auto":
        return legacy_eval_plan(path)
    path = resolve_model_path(path)
    base = adapter_base(path) if os.path.isdir(path) else None
    if base is None:
        return {"weights": dtype, "adapter": FULL}
    if dtype == "float32" or adapter_base(base) is not None:  # a chain: merged in fp32 (one PEFT model, one base)
        return {"weights": "float32", "adapter": MERGED}
    return {"weights": dtype, "adapter": UNMERGED}


def legacy_eval_plan(path: str) -> dict[str, str]:
    """How evaluation loaded ``path`` before ``eval.dtype``: as stored, an adapter merged in float32."""
    path = resolve_model_path(path)
    if os.path.isdir(path) and adapter_base(path) is not None:
        return {"weights": "float32", "adapter": MERGED}
    return {"weights": stored_dtype(path), "adapter": FULL}


def load_eval_model(path: str, dtype: str = "auto", *, device: str = "cpu") -> PreTrainedModel:
    """The model held-out evaluation runs (:func:`eval_plan`), in eval mode on ``device``.

    Args:
        path: As :func:`raycurate.models.loading.load_model`'s ``path_or_preset``.
        dtype: ``eval.dtype``: ``"auto"``, ``"float32"`` or ``"bfloat16"`` (module docstring).
    """
    plan = eval_plan(path, dtype)
    # "auto" lets load_model keep a full checkpoint's stored dtype (which DTYPES may not name, e.g. float16)
    return load_model(path, dtype=dtype, device=device, unmerged_adapter=plan["adapter"] == UNMERGED).eval()
