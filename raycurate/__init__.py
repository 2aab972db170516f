"""raycurate: Ray-distributed curation of LLM fine-tuning data.

Layers (imports point down only): ``cli``/``config`` -> ``pipelines`` -> ``stages`` (the only Ray code)
-> ``algorithms`` (pure torch/numpy) -> ``models``/``data``.  Importing the package is cheap: heavy
dependencies (ray, torch, transformers, deepspeed, vllm) are imported by the modules that need them.

The Python API (``raycurate.ingest``, ``bridge_select``, ``identify_heads``, ``p2d_select``, ``bds_weights``,
``curate``, ``train``, ``evaluate``; see :mod:`raycurate.api`) is imported on first attribute access.
"""

__version__ = "0.1.0"

# The Python API (raycurate/api.py), imported on first use so ``import raycurate`` stays cheap.
_API = ("Result", "ingest", "bridge_select", "identify_heads", "p2d_select", "bds_weights", "curate", "train",
        "evaluate")
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        from raycurate import api

        return getattr(api, name)
    raise AttributeError(f"module 'raycurate' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
