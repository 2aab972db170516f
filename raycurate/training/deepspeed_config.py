"""DeepSpeed config dict and the batch arithmetic shared by both training engines (pure, no Ray/DeepSpeed import).

Why the config looks as it does (client AdamW and schedule, offload without DeepSpeed's CPU Adam, universal
checkpoint info in every checkpoint): docs/design.md, "DeepSpeed version".  The engines are
:mod:`raycurate.training.engines`.
"""

from __future__ import annotations

from typing import Any

from raycurate.config.train import TrainConfig

_NEVER_PRINT = 10**9

UNIVERSAL_CLIENT_STATE = {"universal_checkpoint_info": {"universal_checkpoint_version": 0.2}}
"""``client_state`` of every ``save_checkpoint``: what ``ds_to_universal`` requires to convert a checkpoint."""


def grad_accum_steps(cfg: TrainConfig, world_size: int) -> int:
    """Gradient-accumulation micro-steps per optimizer step.

    Args:
        cfg: Training config (``micro_batch_size``, ``effective_batch_size``).
        world_size: Data-parallel workers.

    Returns:
        ``effective_batch_size / (micro_batch_size * world_size)``.

    Raises:
        ValueError: When the effective batch is not a positive multiple of ``micro_batch_size * world_size``.
    """
    if cfg.micro_batch_size < 1 or world_size < 1:
        raise ValueError(
            f"micro_batch_size={cfg.micro_batch_size} and num_workers={world_size} must both be >= 1."
        )
    per_pass = cfg.micro_batch_size * world_size
    if cfg.effective_batch_size < per_pass or cfg.effective_batch_size % per_pass != 0:
        raise ValueError(
            f"train.effective_batch_size={cfg.effective_batch_size} must be a positive multiple of "
            f"micro_batch_size * num_workers = {cfg.micro_batch_size} * {world_size} = {per_pass}; "
            f"set effective_batch_size to {per_pass}, {2 * per_pass}, {4 * per_pass}, ... "
            "or change micro_batch_size / num_workers."
        )
    return cfg.effective_batch_size // per_pass


def check_offload(cfg: TrainConfig) -> None:
    """Fail early (on the driver) on offload settings DeepSpeed would reject or silently ignore.

    Raises:
        ValueError: Offload with the DDP engine or ZeRO-0, or parameter offload below ZeRO-3.
    """
    if not (cfg.offload_optimizer or cfg.offload_params):
        return
    if cfg.engine != "deepspeed" or cfg.zero_stage == 0:
        raise ValueError(f"train.offload_optimizer / train.offload_params need train.engine=deepspeed with "
                         f"zero_stage 1-3 (got engine={cfg.engine}, zero_stage={cfg.zero_stage}).")
    if cfg.offload_params and cfg.zero_stage != 3:
        raise ValueError(f"train.offload_params=true needs train.zero_stage=3 (got {cfg.zero_stage}): only ZeRO-3 "
                         "partitions parameters; use train.offload_optimizer=true for ZeRO-1/2.")


def _offload_block(device: str, pin_memory: bool) -> dict[str, Any]:
    return {"device": device, "pin_memory": pin_memory}


def _zero_block(stage: int, cfg: TrainConfig, pin_memory: bool) -> dict[str, Any]:
    block: dict[str, Any] = {"stage": stage, "overlap_comm": False, "contiguous_gradients": True}
    if cfg.offload_optimizer:
        block["offload_optimizer"] = _offload_block("cpu", pin_memory)
    if cfg.offload_params:
        block["offload_param"] = _offload_block("cpu", pin_memory)
    if stage in (1, 2):
        block.update({"allgather_partitions": True, "reduce_scatter": True,
                      "allgather_bucket_size": 200_000_000, "reduce_bucket_size": 200_000_000})
    if stage == 3:
        block.update({
            "reduce_bucket_size": 50_000_000,
            "stage3_prefetch_bucket_size": 50_000_000,
            "stage3_param_persistence_threshold": 100_000,
            "stage3_max_live_parameters": 1_000_000_000,
            "stage3_max_reuse_distance": 1_000_000_000,
            "stage3_gather_16bit_weights_on_model_save": True,
        })
    return block


def deepspeed_config(cfg: TrainConfig, world_size: int, bf16: bool, *, on_gpu: bool = False,
                     load_universal: bool = False) -> dict[str, Any]:
    """The DeepSpeed config for one training run.

    Args:
        cfg: Training config.
        world_size: Data-parallel workers.
        bf16: Whether to train in bf16 mixed precision (fp32 master weights in the optimizer).
        on_gpu: Training runs on CUDA devices (pins the host buffers of offloaded state).
        load_universal: The run resumes from a universal checkpoint (a different worker count or ZeRO stage).

    Returns:
        A config dict for ``deepspeed.initialize(config=...)``; ``train_batch_size`` equals
        ``train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size``.
    """
    if cfg.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"train.zero_stage={cfg.zero_stage} is not a ZeRO stage; use 0, 1, 2 or 3.")
    check_offload(cfg)
    accum = grad_accum_steps(cfg, world_size)
    config = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": accum,
        "train_batch_size": cfg.micro_batch_size * accum * world_size,
        "gradient_clipping": float(cfg.grad_clip),
        "zero_optimization": _zero_block(cfg.zero_stage, cfg, pin_memory=on_gpu),
        "bf16": {"enabled": bool(bf16)},
        "fp16": {"enabled": False},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": _NEVER_PRINT,
        "wall_clock_breakdown": False,
    }
    if cfg.offload_optimizer or cfg.offload_params:
        config["zero_force_ds_cpu_optimizer"] = False
    if load_universal:
        config["checkpoint"] = {"load_universal": True}
    return config
