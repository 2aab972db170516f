"""The precision a held-out evaluation runs a model in (``eval.dtype``), and where bf16 pays (:func:`fast_bf16`).

:func:`load_eval_model` loads a checkpoint for evaluation: ``auto`` (the default) as stored, a LoRA adapter merged
onto its base in fp32; ``bfloat16`` the base in bf16 with the adapter unmerged in fp32 beside it
(:func:`raycurate.models.loading.load_model` with ``unmerged_adapter=True``), a full checkpoint cast to bf16;
``float32`` everything upcast.  :func:`eval_plan` says what a load will do without loading, so the evaluation
stage's hash names the plan only where it differs from :func:`legacy_eval_plan` and finished runs keep their
hashes.  Why ``auto`` stays the default (measured agreement and speed): docs/design.md, "Evaluation".
"""

from __future__ import annotations

import functools
import json
import os
from typing import TYPE_CHECKING

from raycurate.models.loading import DTYPES, adapter_base, load_model, resolve_model_path

if TYPE_CHECKING:
    from transformers import PreTrainedModel

FULL, MERGED, UNMERGED = "none", "merged", "unmerged"


def fast_bf16(device_type: str) -> bool:
    """Whether bf16 matrix products beat fp32 on a device of this type (``train.frozen_dtype=auto``): a CUDA GPU, or
    a CPU where :func:`cpu_bf16_speedup` is at least 1.2.  Measured rather than read from CPU flags: a VM of a Xeon
    that lists AVX512-BF16 but not AMX multiplied in bf16 at 0.44x its fp32 speed, and its SmolLM2-135M LoRA step
    with a bf16 frozen base took 1.72x the fp32 step's time (benchmarks/RESULTS.md, tenth session), while another
    Xeon VM ran that step 1.7x faster in bf16 (2026-12-05)."""
    if device_type == "cuda":
        return True
    return device_type == "cpu" and cpu_bf16_speedup() >= 1.2


@functools.lru_cache(maxsize=1)
def cpu_bf16_speedup(size: int = 384, repeats: int = 5) -> float:
    """fp32 time / bf16 time of a (size, size) x (size, size) matmul on this CPU, best of ``repeats`` each (~20 ms;
    once per process). The margins it decides between are ~2x either way, far above a loaded machine's noise."""
    import time

    import torch

    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.ones(size, size, dtype=dtype), torch.ones(size, size, dtype=dtype)
        a @ b  # warm-up: the first call picks the kernel
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - started)
        best[dtype] = min(times)
    return best[torch.float32] / best[torch.bfloat16]


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
