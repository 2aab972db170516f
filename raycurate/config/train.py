"""Config section for supervised fine-tuning on Ray Train (``train:`` in a job YAML).

Batch arithmetic: every optimizer step consumes ``effective_batch_size`` examples = ``num_workers`` workers x
gradient-accumulation micro-steps x ``micro_batch_size`` examples, so ``effective_batch_size`` must be a multiple of
``micro_batch_size * num_workers``.  ``use_gpu`` and ``bf16`` are tri-state (``null``: decide from the hardware).
``launcher``: docs/design.md, "Training launcher".
"""

from __future__ import annotations

from dataclasses import dataclass

from raycurate.config.base import option

LAUNCHERS = ("ray_train", "task")
ADAPTERS = ("full", "lora")


@dataclass
class TrainConfig:
    """Supervised fine-tuning on Ray Train (DeepSpeed ZeRO or plain DDP)."""

    engine: str = option(
        "deepspeed", "Distributed engine: DeepSpeed ZeRO or plain torch DDP.", choices=("deepspeed", "ddp")
    )
    zero_stage: int = option(2, "DeepSpeed ZeRO stage (0 = plain data parallel, 3 = partitioned parameters).",
                             choices=(0, 1, 2, 3))
    num_workers: int = option(2, "Ray Train workers (data-parallel ranks).", ge=1)
    launcher: str = option(
        "ray_train", "How the workers start: ray_train (a TorchTrainer worker group, any num_workers) or task (one "
        "reused Ray task process; num_workers=1 only; skips the ~25 s worker-group start-up of laptop/CI runs).",
        choices=LAUNCHERS,
    )
    cpus_per_worker: float | None = option(
        None, "CPUs reserved per worker; null sizes it from the cluster so the pool fits beside the driver.", gt=0,
        runtime_only=True)
    threads_per_worker: int | None = option(
        None, "torch CPU threads per worker: null = its reserved CPUs (at least 1); 0 = the node's idle cores when the "
        "worker starts (cores minus the cores busy over a 0.5 s sample, at least 1), for jobs that train one stage "
        "at a time on one machine (the laptop demo: 1.8x faster steps on 2 idle cores than 1 thread; more threads "
        "than idle cores collapse on shared cores); Ray's reservation stays cpus_per_worker either way. Not in the "
        "stage hash: changing it neither re-trains a finished stage nor restarts a killed one from step 0.", ge=0,
        runtime_only=True)
    use_gpu: bool | None = option(None, "Train on GPUs (one per worker); null = yes iff the Ray cluster has GPUs.")
    adapter: str = option(
        "full", "What SFT trains: full (every parameter) or lora (PEFT LoRA on lora_targets, base weights frozen; "
        "resumable checkpoints then hold the adapter and its optimizer state only). Methods with their own adapter "
        "(P2D head deltas, bilevel's theta) keep theirs.", choices=ADAPTERS,
    )
    lora_r: int = option(16, "LoRA rank (train.adapter=lora).", ge=1)
    lora_alpha: float = option(32.0, "LoRA alpha (train.adapter=lora); the update is scaled by alpha / r.", gt=0)
    lora_targets: list[str] = option(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "Linear module names LoRA wraps (train.adapter=lora); the default is every linear layer of a Llama block.",
    )
    frozen_dtype: str = option(
        "float32", "dtype of the frozen base weights of a LoRA run (train.adapter=lora or a method's LoRA); the "
        "adapter trains in fp32 either way. bfloat16 halves their memory, makes activations bf16 and is fast only "
        "where bf16 matrix products are: a SmolLM2-135M LoRA step was 1.7x faster than fp32 on one Xeon VM, 1.7x "
        "slower on another without AMX (benchmarks/RESULTS.md). auto: bfloat16 on a GPU or on a CPU where a bf16 "
        "matmul measures at least 1.2x faster than fp32, else float32 (decided where the worker runs).",
        choices=("float32", "bfloat16", "auto"),
    )
    length_groups: int = option(
        1, "Forwards a micro-batch is split into, its rows sorted by length and each group cut to its longest row: "
        "the same loss and one backward, less padding computed (2 on the real proving ground's batches of 8: 43% "
        "-> 19% padding, a LoRA step 0.77-0.81x the time). Needs engine=deepspeed with zero_stage <= 2, or ddp on "
        "one worker. Not in the stage hash: the loss is the same up to floating-point summation order.",
        ge=1, runtime_only=True, hashed=False)
    export: str = option(
        "adapter", "What a LoRA run writes as its model folder: adapter (the PEFT adapter, tokenizer files and "
        "metrics: 19 MB for SmolLM2-135M at r=16 instead of 538 MB; it names its base, and every stage merges it on "
        "load in float32) or merged (a plain HF checkpoint in float32, the update folded in, plus the adapter "
        "under adapter/). Full fine-tuning and head deltas always write a full checkpoint. Not in the stage hash: "
        "both load as the same model, so changing it never re-trains a finished stage.",
        choices=("adapter", "merged"), runtime_only=True, hashed=False,
    )
    lr: float = option(2e-5, "Peak learning rate of AdamW.", gt=0)
    weight_decay: float = option(0.0, "AdamW decoupled weight decay.", ge=0)
    warmup_ratio: float = option(0.03, "Fraction of optimizer steps with linear warmup before the cosine decay.",
                                 ge=0, le=1)
    epochs: int = option(1, "Passes over the training table.", ge=1)
    max_steps: int | None = option(None, "Cap on optimizer steps (null = epochs x steps per epoch).", ge=1)
    micro_batch_size: int = option(4, "Examples per worker per forward/backward pass.", ge=1)
    effective_batch_size: int = option(
        8, "Examples per optimizer step over all workers; a multiple of micro_batch_size * num_workers.", ge=1
    )
    grad_clip: float = option(1.0, "Max global gradient norm; 0 disables clipping.", ge=0)
    loss_normalization: str = option(
        "token", "How a step's loss averages its supervised tokens: example (each row's tokens are averaged, then "
        "the rows, so every row counts the same) or token (every supervised token of the effective batch counts "
        "the same, as in HF Trainer, so a short row weighs less). On SmolLM2-135M, per-row averaging up-weights the "
        "one-line answers of short rows and LoRA SFT learns to skip the working (benchmarks/RESULTS.md). The BDS "
        "step ignores it: its lower level weighs each row's mean loss by the row's learned weight (the paper's).",
        choices=("example", "token"))
    bf16: bool | None = option(None, "bf16 mixed precision; null = on iff training runs on CUDA.")
    seed: int = option(0, "Seed of the data order (per epoch) and of dropout.")
    checkpoint_every_steps: int | None = option(
        None, "Save a resumable checkpoint every N optimizer steps (null = at the end of each epoch).", ge=1
    )
    checkpoint_every_minutes: float | None = option(
        10.0, "Also save a resumable checkpoint when this many minutes have passed since the last one (null = "
        "steps only), so a long epoch killed near its end does not restart from step 0; the ranks agree through "
        "the step's all-reduce. Not in the stage hash.", gt=0, runtime_only=True)
    keep_checkpoints: int = option(2, "Most recent checkpoints kept in Ray Train storage.", ge=1, runtime_only=True)
    offload_optimizer: bool = option(
        False, "ZeRO-Offload: optimizer states, fp32 master weights and the optimizer step live in CPU memory "
        "(DeepSpeed, ZeRO 1-3)."
    )
    offload_params: bool = option(False, "ZeRO-3 parameter offload to CPU memory (DeepSpeed, zero_stage=3 only).")
    max_failures: int = option(
        0, "Ray Train FailureConfig (launcher=task: the task's max_retries): restarts after a worker dies or "
        "raises; each restart resumes from the latest checkpoint (-1 = unlimited).", ge=-1, runtime_only=True)
    log_every_steps: int = option(10, "Rank 0 logs loss and learning rate every N optimizer steps.", ge=1,
                                  runtime_only=True)

    def adapter_spec(self) -> dict | None:
        """The :mod:`raycurate.models.adapters` spec of ``adapter`` (None = full fine-tuning)."""
        if self.adapter == "full":
            return None
        return {"kind": "lora", "r": self.lora_r, "alpha": self.lora_alpha, "targets": list(self.lora_targets)}

    def launcher_problems(self) -> list[str]:
        """``launcher=task`` runs one process, so it needs exactly one worker."""
        if self.launcher == "task" and self.num_workers != 1:
            return [f"train.launcher=task runs one worker process, but train.num_workers={self.num_workers}; set "
                    "train.num_workers=1, or use train.launcher=ray_train for data-parallel workers"]
        return []

    def config_problems(self) -> list[str]:
        """Batch arithmetic and engine options that only work together."""
        problems = self.launcher_problems()
        if self.adapter == "lora" and not self.lora_targets:
            problems.append("train.lora_targets: empty, so LoRA would wrap no layer; list module names, e.g. "
                            "[q_proj, k_proj, v_proj, o_proj]")
        per_pass = self.micro_batch_size * self.num_workers
        if self.effective_batch_size % per_pass:
            problems.append(
                f"train.effective_batch_size: {self.effective_batch_size} must be a multiple of micro_batch_size x "
                f"num_workers = {per_pass}; use {per_pass}, {2 * per_pass}, {4 * per_pass}, ...")
        if (self.offload_optimizer or self.offload_params) and self.engine != "deepspeed":
            problems.append("train.offload_optimizer / train.offload_params: need train.engine=deepspeed")
        elif (self.offload_optimizer or self.offload_params) and self.zero_stage == 0:
            problems.append("train.offload_optimizer / train.offload_params: need train.zero_stage 1-3 (got 0)")
        if self.length_groups > 1 and not (self.engine == "deepspeed" and self.zero_stage <= 2
                                           or self.engine == "ddp" and self.num_workers == 1):
            problems.append(f"train.length_groups={self.length_groups}: several forwards before one backward need "
                            "engine=deepspeed with zero_stage <= 2 or engine=ddp with num_workers=1 (DDP's and "
                            "ZeRO-3's hooks expect one forward per backward); set train.length_groups=1")
        if self.offload_params and self.zero_stage != 3:
            problems.append(f"train.offload_params: true needs train.zero_stage=3 (got {self.zero_stage}); use "
                            "train.offload_optimizer for ZeRO-1/2")
        return problems


def full_batch_train_config(train_cfg: TrainConfig, rows: int, steps: int, lr: float, *,
                            rows_key: str = "p2d.proxy_examples") -> TrainConfig:
    """``train_cfg`` turned into ``steps`` full-batch steps over ``rows`` examples (P2D's proxy recipe; BRIDGE's
    ``warmup_batch: full``): every step's gradient is the mean over all rows, so the result does not depend on a
    batch order.  ``rows_key`` names the setting behind ``rows`` in the error."""
    import dataclasses

    workers = train_cfg.num_workers
    micro = next((m for m in range(train_cfg.micro_batch_size, 0, -1) if rows % (m * workers) == 0), None)
    if micro is None:
        raise ValueError(f"{rows_key}={rows} is not divisible by train.num_workers={workers}; pick a "
                         "multiple so every optimizer step sees the full batch")
    # one step per epoch: checkpoint once at the end, not after every (one-step) epoch
    return dataclasses.replace(train_cfg, lr=lr, epochs=steps, max_steps=steps, micro_batch_size=micro,
                               effective_batch_size=rows, warmup_ratio=0.0, checkpoint_every_steps=steps)
