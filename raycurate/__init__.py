"""raycurate: Ray-distributed curation of LLM fine-tuning data.

Layers (imports point down only): ``cli``/``config`` -> ``pipelines`` -> ``stages`` (the only Ray code)
-> ``algorithms`` (pure torch/numpy) -> ``models``/``data``.  Importing the package is cheap: heavy
dependencies (ray, torch, transformers, deepspeed, vllm) are imported by the modules that need them.
"""

__version__ = "0.1.0"
