"""The two training engines (plain torch DDP and DeepSpeed ZeRO), their optimizer and LR schedule, model loading.

An engine wraps a model for one worker of an already-initialised process group and exposes
``train_micro_batch(batch, loss_fn, is_boundary)``, ``lr()``, ``save(ckpt_dir, rank)``, ``load(ckpt_dir, session)``,
``full_state_dict(session)`` and ``module`` (the unwrapped model).  Precision and loss averaging: docs/design.md
("Layers", "DeepSpeed version").
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from raycurate.config.train import TrainConfig
from raycurate.models.optim import cosine_with_warmup, decay_param_groups
from raycurate.training.batches import LossFn, batch_token_losses
from raycurate.training.deepspeed_config import UNIVERSAL_CLIENT_STATE, deepspeed_config, grad_accum_steps
from raycurate.training.protocol import TrainSession
from raycurate.training.zero_checkpoint import (
    DS_TAG,
    consolidate_zero_checkpoint,
    repair_zero3_universal_load,
    universal_checkpoint,
)

DDP_STATE_FILE = "ddp_state.pt"


def load_model(init_model: str, dtype: Any) -> Any:
    """Load a causal LM from a local HF checkpoint directory (or an adapter-only folder, merged on load), ready for
    training (no KV cache)."""
    from transformers import AutoModelForCausalLM

    from raycurate.models import loading

    if loading.adapter_base(init_model) is not None:
        model = loading.load_model(init_model, dtype="float32").to(dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(init_model, dtype=dtype, local_files_only=True,
                                                     trust_remote_code=False)
    model.config.use_cache = False
    model.train()
    return model


def optimizer_and_schedule(model: Any, cfg: TrainConfig, run_steps: int) -> tuple[Any, Any]:
    """AdamW over :func:`~raycurate.models.optim.decay_param_groups` and a ``LambdaLR`` on
    :func:`~raycurate.models.optim.cosine_with_warmup`
    over ``run_steps`` steps (warmup = ``round(cfg.warmup_ratio * run_steps)``)."""
    import torch

    optimizer = torch.optim.AdamW(decay_param_groups(model, cfg.weight_decay), lr=cfg.lr)
    warmup = int(round(cfg.warmup_ratio * run_steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: cosine_with_warmup(step, warmup, run_steps)
    )
    return optimizer, scheduler


def resync_schedule(scheduler: Any, lr: float) -> None:
    """After a restore, put every param group on the *current* run's schedule at the restored step.

    A restored optimizer carries the learning rate the previous run computed for its next step (with that run's
    total steps and peak lr); without this, the first step after extending a run would use that stale value.
    """
    step = scheduler.last_epoch
    groups = scheduler.optimizer.param_groups
    scheduler.base_lrs = [lr] * len(groups)
    for group, factor in zip(groups, scheduler.lr_lambdas):
        group["lr"] = lr * factor(step)
    scheduler._last_lr = [group["lr"] for group in groups]


def use_bf16(cfg: TrainConfig, device: Any) -> bool:
    """``cfg.bf16``, or (when unset) whether ``device`` is a GPU."""
    return cfg.bf16 if cfg.bf16 is not None else device.type == "cuda"


class DDPEngine:
    """Plain torch data parallel: DDP wrapper (when a process group with >1 rank exists), AdamW, LambdaLR.

    Gradient sync is skipped (``no_sync``) on non-boundary micro-steps; at a boundary the engine clips, steps
    the optimizer and the scheduler once, and zeroes the gradients.
    """

    def __init__(self, model: Any, cfg: TrainConfig, run_steps: int, device: Any, bf16: bool) -> None:
        import torch
        import torch.distributed as dist

        self.cfg = cfg
        self.device = device
        self.bf16 = bf16
        self.accum = grad_accum_steps(cfg, dist.get_world_size() if dist.is_initialized() else 1)
        self.module = model.to(device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            ids = [device] if device.type == "cuda" else None
            self.wrapped = torch.nn.parallel.DistributedDataParallel(self.module, device_ids=ids)
        else:
            self.wrapped = self.module
        self.optimizer, self.scheduler = optimizer_and_schedule(self.module, cfg, run_steps)

    def train_micro_batch(self, batch: dict[str, Any], loss_fn: LossFn, is_boundary: bool) -> Any:
        """Forward + backward of one micro-batch; optimizer step when ``is_boundary``. Returns the loss (detached)."""
        import torch

        sync = contextlib.nullcontext()
        if not is_boundary and hasattr(self.wrapped, "no_sync"):
            sync = self.wrapped.no_sync()
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)
        with sync:
            with autocast:
                per_token = batch_token_losses(self.wrapped, batch, self.cfg.length_groups)  # (B, T)
            loss = loss_fn(per_token, batch)
            (loss / self.accum).backward()
        if is_boundary:
            if self.cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def lr(self) -> float:
        """The learning rate of the next optimizer step."""
        return float(self.scheduler.get_last_lr()[0])

    def save(self, ckpt_dir: str, rank: int) -> None:
        """Rank 0 writes model, optimizer and scheduler state (replicated on every rank)."""
        import torch

        if rank == 0:
            state = {
                "model": trainable_state_dict(self.module),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
            }
            torch.save(state, os.path.join(ckpt_dir, DDP_STATE_FILE))

    def load(self, ckpt_dir: str, session: TrainSession | None = None) -> None:
        """Restore model, optimizer and scheduler (full state: any world size can load it)."""
        import torch

        state = torch.load(os.path.join(ckpt_dir, DDP_STATE_FILE), map_location=self.device, weights_only=True)
        load_trainable_state_dict(self.module, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        resync_schedule(self.scheduler, self.cfg.lr)

    def full_state_dict(self, session: TrainSession | None = None) -> dict[str, Any] | None:
        """The full model state dict (every rank holds it)."""
        return self.module.state_dict()


def frozen_parameter_names(module: Any) -> set[str]:
    """Names of the parameters that receive no gradient (a LoRA or head-delta run's base weights), every alias
    included: a tied ``lm_head.weight`` is the frozen embedding under a second name, also in ``state_dict()``."""
    return {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


def trainable_state_dict(module: Any) -> dict[str, Any]:
    """``module.state_dict()`` without the frozen parameters: a LoRA run's checkpoint holds the adapter only, since
    the base weights are the ``init_model`` it restarts from."""
    frozen = frozen_parameter_names(module)
    return {k: v for k, v in module.state_dict().items() if k not in frozen}


def load_trainable_state_dict(module: Any, state: dict[str, Any]) -> None:
    """Load a (possibly :func:`trainable_state_dict`) state; only frozen parameters may be missing from it.

    Raises:
        RuntimeError: A key the module does not have, or a trainable parameter or buffer the state lacks.
    """
    missing, unexpected = module.load_state_dict(state, strict=False)
    bad = sorted(set(missing) - frozen_parameter_names(module))
    if unexpected or bad:
        raise RuntimeError(f"checkpoint does not match the model: unexpected keys {sorted(unexpected)[:5]}, missing "
                           f"trainable keys {bad[:5]}; delete the stage's _scratch folder to train from scratch")


def skip_shared_memory_comm_op(deepspeed: Any) -> None:
    """Stop DeepSpeed's CPU backend from JIT-building its shared-memory all-reduce op (``deepspeed_shm_comm``).

    Only ``inference_all_reduce`` uses that op; training reduces through torch.distributed. Building it costs a
    C++ compile on each fresh machine, and a process killed while compiling (a timed-out test, a killed worker)
    leaves torch's build lock behind, so every later DeepSpeed start on that machine waits on the lock forever.
    DeepSpeed caches its op-compatibility table in ``deepspeed.ops``; marking the op incompatible makes
    ``build_shm_op`` return None.
    """
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class DeepSpeedEngine:
    """DeepSpeed ZeRO engine around a client AdamW + LambdaLR, inside an already-initialised process group.

    DeepSpeed counts micro-steps itself: ``engine.step()`` after every micro-batch only updates the weights (and
    steps the client scheduler, once) at accumulation boundaries; the loop's ``is_boundary`` is checked against
    DeepSpeed's own count so both can never drift apart.
    """

    def __init__(self, model: Any, cfg: TrainConfig, run_steps: int, device: Any, bf16: bool,
                 load_universal: bool = False) -> None:
        import deepspeed
        import torch
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        optimizer, scheduler = optimizer_and_schedule(model, cfg, run_steps)
        self.zero_stage, self.peak_lr, self.load_universal = cfg.zero_stage, cfg.lr, load_universal
        self.length_groups = cfg.length_groups
        self.export_dtype = torch.bfloat16 if bf16 else torch.float32
        config = deepspeed_config(cfg, world, bf16, on_gpu=device.type == "cuda", load_universal=load_universal)
        skip_shared_memory_comm_op(deepspeed)
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=config,
            dist_init_required=False,  # Ray Train already created the process group
        )
        self.module = self.engine.module
        # LoRA / head-delta runs: checkpoints skip the frozen base weights (restored from init_model instead).
        self.has_frozen = bool(frozen_parameter_names(self.module))
        if self.has_frozen:
            # DeepSpeed drops frozen weights by their de-duplicated names, so a tied lm_head.weight (the frozen
            # embedding's second name) stayed in every checkpoint: 57 MB of a SmolLM2 LoRA checkpoint's 76 MB.
            self.engine.module_state_dict = self._module_state_dict

    def _module_state_dict(self, *args: Any, exclude_frozen_parameters: bool = False, **kwargs: Any) -> Any:
        """DeepSpeed's ``module_state_dict``, with every alias of a frozen weight dropped when it drops frozen ones."""
        import deepspeed

        state = deepspeed.DeepSpeedEngine.module_state_dict(
            self.engine, *args, exclude_frozen_parameters=exclude_frozen_parameters, **kwargs)
        if exclude_frozen_parameters:
            for name in frozen_parameter_names(self.module):
                state.pop(name, None)
        return state

    def train_micro_batch(self, batch: dict[str, Any], loss_fn: LossFn, is_boundary: bool) -> Any:
        """Forward + backward of one micro-batch; DeepSpeed steps at its accumulation boundary."""
        if self.engine.is_gradient_accumulation_boundary() != is_boundary:
            raise RuntimeError(
                "DeepSpeed's micro-step count disagrees with the training loop's accumulation boundary; "
                "gradient_accumulation_steps in the DeepSpeed config must equal the loop's."
            )
        loss = loss_fn(batch_token_losses(self.engine, batch, self.length_groups), batch)
        self.engine.backward(loss)  # scales by 1 / gradient_accumulation_steps
        self.engine.step()
        return loss.detach()

    def lr(self) -> float:
        """The learning rate of the next optimizer step."""
        return float(self.scheduler.get_last_lr()[0])

    def save(self, ckpt_dir: str, rank: int) -> None:
        """Collective: every rank writes its own ZeRO shard files into ``ckpt_dir`` (convertible to universal)."""
        self.engine.save_checkpoint(ckpt_dir, tag=DS_TAG, client_state=dict(UNIVERSAL_CLIENT_STATE),
                                    exclude_frozen_parameters=self.has_frozen)

    def load(self, ckpt_dir: str, session: TrainSession | None = None) -> None:
        """Collective: restore weights, optimizer and scheduler; via a universal checkpoint when built for one."""
        if not self.load_universal:
            self._load_tag(ckpt_dir, DS_TAG)
            return
        if session is None:
            raise ValueError("a universal-checkpoint resume needs the session (to convert once per node)")
        with universal_checkpoint(ckpt_dir, session) as universal_dir:
            self._load_tag(universal_dir, DS_TAG)

    def _load_tag(self, ckpt_dir: str, tag: str) -> None:
        weight_decays = [group["weight_decay"] for group in self.scheduler.optimizer.param_groups]
        load_path, _ = self.engine.load_checkpoint(
            ckpt_dir, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True,
            load_module_strict=not self.has_frozen,
        )
        if load_path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint under {ckpt_dir}/{tag}; delete the run's storage "
                               "directory to start from scratch.")
        if self.load_universal and self.zero_stage == 3:
            repair_zero3_universal_load(self.engine.optimizer, weight_decays)
        resync_schedule(self.scheduler, self.peak_lr)

    def full_state_dict(self, session: TrainSession) -> dict[str, Any] | None:
        """The full model state dict on rank 0 (None on other ranks under ZeRO-1/2/3).

        ZeRO-1/2/3: consolidated by ``zero_to_fp32`` from the latest persisted checkpoint (every rank's shards),
        cast to the training dtype.  ZeRO-0 holds the full weights on every rank.
        """
        if self.zero_stage == 0:
            return self.module.state_dict()
        if session.rank != 0:
            return None
        with session.latest_checkpoint_dir() as path:
            if path is None:
                raise RuntimeError("no checkpoint was reported, so there are no ZeRO shards to consolidate")
            return consolidate_zero_checkpoint(path, self.export_dtype)


def build_engine(model: Any, cfg: TrainConfig, run_steps: int, device: Any, bf16: bool, *,
                 load_universal: bool = False) -> Any:
    """The engine named by ``cfg.engine`` (``deepspeed`` or ``ddp``)."""
    if cfg.engine == "deepspeed":
        return DeepSpeedEngine(model, cfg, run_steps, device, bf16, load_universal=load_universal)
    if cfg.engine == "ddp":
        return DDPEngine(model, cfg, run_steps, device, bf16)
    raise ValueError(f"train.engine={cfg.engine!r} is unknown; use one of ['ddp', 'deepspeed'].")


def load_dtype(cfg: TrainConfig, adapter: dict | None, device: Any, bf16: bool) -> Any:
    """The dtype the base weights are loaded in: bf16 for DeepSpeed bf16 on GPU, and for the frozen base of a LoRA
    run with ``train.frozen_dtype=bfloat16`` (or ``auto`` where :func:`~raycurate.models.precision.fast_bf16`; its
    adapter stays fp32); else fp32."""
    import torch

    from raycurate.models.adapters import adapter_kind
    from raycurate.models.precision import fast_bf16

    if bf16 and cfg.engine == "deepspeed" and device.type == "cuda":
        return torch.bfloat16
    if adapter_kind(adapter) == "lora" and (
            cfg.frozen_dtype == "bfloat16" or cfg.frozen_dtype == "auto" and fast_bf16(device.type)):
        return torch.bfloat16
    return torch.float32


def build_model_engine(job: Any, run_steps: int, device: Any, *, load_universal: bool = False) -> tuple[Any, int, int]:
    """Load ``job.init_model``, attach ``job.adapter`` and wrap it in the configured engine.

    Args:
        job: An ``SFTJob``-like object (``init_model``, ``adapter``, ``cfg``).
        run_steps: Optimizer steps of the whole run (the LR schedule's length).
        device: The worker's torch device.
        load_universal: Build DeepSpeed for a universal-checkpoint resume.

    Returns:
        (engine, trainable parameter count, pad token id).
    """

    from raycurate.models.adapters import apply_adapter, trainable_parameters

    cfg = job.cfg
    bf16 = use_bf16(cfg, device)
    # A bf16 frozen base: PEFT creates the LoRA weights in fp32 (autocast_adapter_dtype), so they train in fp32.
    model = apply_adapter(load_model(job.init_model, load_dtype(cfg, job.adapter, device, bf16)), job.adapter)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    engine = build_engine(model, cfg, run_steps, device, bf16, load_universal=load_universal)
    return engine, trainable_parameters(model), pad_id
