"""Supervised fine-tuning stage: Ray Train ``TorchTrainer`` with DeepSpeed ZeRO (default) or plain torch DDP.

Run it::

    from raycurate.config.train import TrainConfig
    from raycurate.stages.train import run_sft
    metrics = run_sft("runs/x/tokenize/train.parquet", "models/base", "runs/x/sft/model", TrainConfig(),
                      storage_dir="runs/x/ray_train", name="sft")

The worker loop is a chain of small, replaceable pieces so later methods (compact SFT, sparse-head adapters,
LoRA, bilevel data weights) swap one piece, not the loop:
``load_model`` -> ``build_engine`` (``DeepSpeedEngine`` | ``DDPEngine``) -> ``micro_batch_rows`` + ``collate``
-> ``engine.train_micro_batch(batch, loss_fn, is_boundary)`` -> ``engine.save`` / ``engine.load`` ->
``export_hf``.  :func:`train_loop` runs against a small :class:`TrainSession` interface (rank, world size,
device, restore, report); :class:`RaySession` implements it on Ray Train, and a test double runs the same loop
in-process without Ray.

Decisions:

* Data order: rows are sorted by ``id`` (file layout does not matter), then epoch ``e`` uses the permutation
  ``np.random.default_rng([seed, e])``.  Optimizer step ``s`` of the epoch takes the permuted rows
  ``[s*E, (s+1)*E)`` (``E`` = effective batch); micro-step ``k`` of rank ``r`` takes the ``micro_batch_size``
  rows at ``[s, k, r]`` of that block reshaped to (steps, accum, world, micro).  Every rank therefore has the
  same number of micro-batches.  The remainder ``num_rows mod E`` of each epoch's permutation is not trained on
  in that epoch; because the permutation changes per epoch, no row is left out systematically.
* Resume: a checkpoint is taken after an optimizer step (always at an accumulation boundary) and stores the
  step; a resumed run recomputes the same epoch permutation and starts at the next step, so it sees exactly the
  data an uninterrupted run would.  Checkpoints are taken every ``checkpoint_every_steps`` steps (or at the end
  of each epoch) and always after the last step, so a later run with a larger ``max_steps`` can extend it.
  The LR schedule is a function of the *current* run's total steps: extending a run changes the remaining
  schedule (as if it had been configured that way from the start).
* Precision: DeepSpeed loads the model in bf16 on GPU when bf16 is on (its ZeRO optimizer keeps fp32 master
  weights); DDP keeps fp32 weights and runs the forward under ``torch.autocast(bf16)``.  CPU training is fp32.
* Loss: ``weighted_batch_loss(example_losses(...), weight)`` per micro-batch; gradients are averaged over
  accumulation micro-steps and ranks, so an optimizer step minimises the mean of ``w_i * l_i`` over its
  effective batch.  The logged step loss is that mean (all-reduced over ranks).
* Checkpoints: every rank writes its own ZeRO shard files and reports them through ``ray.train.report``; Ray
  Train puts all ranks' files into one checkpoint folder in its storage.  The final HF checkpoint of a ZeRO-1/2/3
  run is *consolidated from those persisted shards* with DeepSpeed's ``zero_to_fp32`` on rank 0 (the fp32 master
  weights, cast to the training dtype), not gathered from live parameters; DDP and ZeRO-0 hold full weights on
  every rank and export them directly.  Consolidation holds the full fp32 state dict in rank 0's host memory
  (4 bytes per parameter).
* Resume on a different worker count: ``trainer_state.json`` records the world size and ZeRO stage that wrote
  the checkpoint.  When the world size differs, the local rank 0 of every node converts the checkpoint with
  DeepSpeed's ``ds_to_universal`` into a temp folder and every rank loads that universal checkpoint
  (``checkpoint.load_universal``).  Step ``s`` trains on the same ``effective_batch_size`` rows whatever the
  world size (only their split over ranks changes), so the run continues the same trajectory up to
  floating-point summation order (tested to 1e-5 for ZeRO-2 and ZeRO-3 with offload).  Two defects of
  DeepSpeed 0.19's ZeRO-3 universal loader are repaired after the load (:func:`repair_zero3_universal_load`).
  DeepSpeed cannot load one ZeRO stage's universal checkpoint into another, so a stage change is refused with a
  clear error.
* Worker failures: ``train.max_failures`` is Ray Train's ``FailureConfig``; a restarted worker group resumes from
  the latest checkpoint in the same ``fit()``.
* Outputs: ``output_dir`` (written by rank 0, atomically: temp dir + ``os.replace``) holds the HF checkpoint
  (safetensors), the tokenizer files copied from ``init_model`` and ``train_metrics.json``.  On a multi-node
  cluster ``output_dir`` and ``storage_dir`` must be on storage shared by the workers and the driver.
* Every worker reads the needed columns of the whole token table (ids, input_ids, loss_mask, weight); fine up to a
  few million short rows per node.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Protocol

import numpy as np

from raycurate.config.train import TrainConfig
from raycurate.stages.deepspeed_config import check_offload, deepspeed_config, grad_accum_steps

logger = logging.getLogger(__name__)

TRAINER_STATE_FILE = "trainer_state.json"
METRICS_FILE = "train_metrics.json"
_DDP_STATE_FILE = "ddp_state.pt"
_DS_TAG = "deepspeed"
FAULT_ENV = "RAYCURATE_FAULT_KILL"
_TOKENIZER_PREFIXES = ("tokenizer", "special_tokens_map", "added_tokens", "vocab", "merges", "chat_template")


# --------------------------------------------------------------------------------------------- data order


def steps_per_epoch(num_rows: int, effective_batch_size: int) -> int:
    """Optimizer steps in one epoch (the remainder of ``num_rows / effective_batch_size`` is not used).

    Raises:
        ValueError: When the table holds fewer rows than one effective batch.
    """
    steps = num_rows // effective_batch_size
    if steps == 0:
        raise ValueError(
            f"The training table has {num_rows} rows, fewer than one effective batch "
            f"(train.effective_batch_size={effective_batch_size}); lower effective_batch_size or add data."
        )
    return steps


def total_steps(num_rows: int, cfg: TrainConfig) -> int:
    """Optimizer steps of the whole run: ``epochs * steps_per_epoch``, capped by ``max_steps``."""
    steps = cfg.epochs * steps_per_epoch(num_rows, cfg.effective_batch_size)
    return steps if cfg.max_steps is None else min(steps, cfg.max_steps)


def epoch_order(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    """Row permutation of one epoch, a pure function of ``(seed, epoch)``.

    Returns:
        (num_rows,) int64 permutation.
    """
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


def micro_batch_rows(
    order: np.ndarray, world_size: int, micro_batch_size: int, accum: int
) -> np.ndarray:
    """Split an epoch's permutation into equal per-rank micro-batches.

    Args:
        order: (N,) row permutation of the epoch.
        world_size: Data-parallel ranks.
        micro_batch_size: Rows per micro-batch.
        accum: Micro-steps per optimizer step.

    Returns:
        (S, accum, world_size, micro_batch_size) row indices, ``S = N // (accum * world_size * micro_batch_size)``;
        ``[s, k, r]`` is rank ``r``'s micro-batch ``k`` of optimizer step ``s``.
    """
    per_step = accum * world_size * micro_batch_size
    steps = len(order) // per_step
    return order[: steps * per_step].reshape(steps, accum, world_size, micro_batch_size)


def cosine_with_warmup(step: int, warmup_steps: int, total: int) -> float:
    """LR multiplier of optimizer step ``step`` (0-based): linear warmup, then cosine decay towards 0.

    Warmup uses ``(step + 1) / (warmup_steps + 1)`` so the first step already learns.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    progress = (step - warmup_steps) / max(1, total - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


# --------------------------------------------------------------------------------------------- token table


@dataclass
class TokenTable:
    """The columns of the token-level table that training needs, as flat numpy arrays (rows sorted by id).

    Attributes:
        ids: (N,) example ids.
        token_values: (sum of lengths,) concatenated ``input_ids``.
        mask_values: (sum of lengths,) concatenated ``loss_mask``.
        offsets: (N + 1,) row ``i`` spans ``[offsets[i], offsets[i + 1])``.
        weights: (N,) float32 per-example weights (1.0 when the table has no ``weight`` column).
    """

    ids: np.ndarray
    token_values: np.ndarray
    mask_values: np.ndarray
    offsets: np.ndarray
    weights: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids (T_i,), loss_mask (T_i,)) of row ``i``."""
        lo, hi = self.offsets[i], self.offsets[i + 1]
        return self.token_values[lo:hi], self.mask_values[lo:hi]


def _flat_list_column(column: Any) -> tuple[np.ndarray, np.ndarray]:
    array = column.combine_chunks()
    lengths = array.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return array.flatten().to_numpy(zero_copy_only=False), offsets


def load_token_table(path: str) -> TokenTable:
    """Read ``id``, ``input_ids``, ``loss_mask`` and (if present) ``weight`` from a parquet file or directory.

    Raises:
        ValueError: When a required column is missing or a row's ``loss_mask`` is not aligned with its ids.
    """
    import pyarrow.compute as pc
    import pyarrow.dataset as pds

    dataset = pds.dataset(path, format="parquet")
    names = dataset.schema.names
    missing = [c for c in ("id", "input_ids", "loss_mask") if c not in names]
    if missing:
        raise ValueError(
            f"Token table {path} lacks columns {missing} (found {names}); train on the output of the tokenize "
            "stage (id, input_ids, prompt_len, loss_mask, weight)."
        )
    columns = ["id", "input_ids", "loss_mask"] + (["weight"] if "weight" in names else [])
    table = dataset.to_table(columns=columns).sort_by("id")
    tokens, offsets = _flat_list_column(table.column("input_ids"))
    masks, mask_offsets = _flat_list_column(table.column("loss_mask"))
    if not np.array_equal(offsets, mask_offsets):
        raise ValueError(f"Token table {path}: loss_mask and input_ids differ in length in some rows; re-tokenize.")
    if "weight" in names:
        weights = pc.fill_null(table.column("weight"), 1.0).to_numpy().astype(np.float32)
    else:
        weights = np.ones(table.num_rows, dtype=np.float32)
    return TokenTable(
        ids=np.asarray(table.column("id").to_pylist(), dtype=object),
        token_values=tokens.astype(np.int64),
        mask_values=masks.astype(np.int8),
        offsets=offsets,
        weights=weights,
    )


def collate(table: TokenTable, rows: np.ndarray, pad_id: int = 0) -> dict[str, Any]:
    """Right-pad the given rows into a batch.

    Args:
        table: The token table.
        rows: (B,) row indices.
        pad_id: Token id written at padded positions (they are masked out of attention and loss).

    Returns:
        ``input_ids`` (B, T) int64, ``attention_mask`` (B, T) int64, ``loss_mask`` (B, T) int8,
        ``weight`` (B,) float32 torch tensors; T = longest row.
    """
    import torch

    pairs = [table.row(int(i)) for i in rows]
    width = max(len(ids) for ids, _ in pairs)
    input_ids = np.full((len(pairs), width), pad_id, dtype=np.int64)
    attention = np.zeros((len(pairs), width), dtype=np.int64)
    loss_mask = np.zeros((len(pairs), width), dtype=np.int8)
    for b, (ids, mask) in enumerate(pairs):
        input_ids[b, : len(ids)] = ids
        attention[b, : len(ids)] = 1
        loss_mask[b, : len(ids)] = mask
    return {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(attention),
        "loss_mask": torch.from_numpy(loss_mask),
        "weight": torch.from_numpy(table.weights[np.asarray(rows, dtype=np.int64)]),
    }


def sft_loss(logits: Any, batch: dict[str, Any]) -> Any:
    """Default loss: per-example masked mean token loss, weighted per example (``sum w_i l_i / B``).

    Args:
        logits: (B, T, V) model outputs.
        batch: Output of :func:`collate` on the logits' device.

    Returns:
        () scalar loss.
    """
    from raycurate.algorithms.losses import example_losses, weighted_batch_loss

    per_example = example_losses(logits, batch["input_ids"], batch["loss_mask"])  # (B,)
    return weighted_batch_loss(per_example, batch["weight"])


# --------------------------------------------------------------------------------------------- engines


LossFn = Callable[[Any, dict[str, Any]], Any]


def load_model(init_model: str, dtype: Any) -> Any:
    """Load a causal LM from a local HF checkpoint directory, ready for training (no KV cache)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(init_model, dtype=dtype, local_files_only=True,
                                                 trust_remote_code=False)
    model.config.use_cache = False
    model.train()
    return model


def _param_groups(model: Any, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only; biases and norm scales (1-D) are not decayed."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.ndim >= 2]
    no_decay = [p for p in trainable if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]  # adapters have no 1-D parameters; DeepSpeed drops empty groups


def _optimizer_and_schedule(model: Any, cfg: TrainConfig, run_steps: int) -> tuple[Any, Any]:
    import torch

    optimizer = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr)
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
        self.optimizer, self.scheduler = _optimizer_and_schedule(self.module, cfg, run_steps)

    def train_micro_batch(self, batch: dict[str, Any], loss_fn: LossFn, is_boundary: bool) -> Any:
        """Forward + backward of one micro-batch; optimizer step when ``is_boundary``. Returns the loss (detached)."""
        import torch

        sync = contextlib.nullcontext()
        if not is_boundary and hasattr(self.wrapped, "no_sync"):
            sync = self.wrapped.no_sync()
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)
        with sync:
            with autocast:
                logits = self.wrapped(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss = loss_fn(logits, batch)
            (loss / self.accum).backward()
        if is_boundary:
            if self.cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def save(self, ckpt_dir: str, rank: int) -> None:
        """Rank 0 writes model, optimizer and scheduler state (replicated on every rank)."""
        import torch

        if rank == 0:
            state = {
                "model": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
            }
            torch.save(state, os.path.join(ckpt_dir, _DDP_STATE_FILE))

    def load(self, ckpt_dir: str, session: TrainSession | None = None) -> None:
        """Restore model, optimizer and scheduler (full state: any world size can load it)."""
        import torch

        state = torch.load(os.path.join(ckpt_dir, _DDP_STATE_FILE), map_location=self.device, weights_only=True)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        resync_schedule(self.scheduler, self.cfg.lr)

    def full_state_dict(self, session: TrainSession | None = None) -> dict[str, Any] | None:
        """The full model state dict (every rank holds it)."""
        return self.module.state_dict()


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
        optimizer, scheduler = _optimizer_and_schedule(model, cfg, run_steps)
        self.zero_stage, self.peak_lr, self.load_universal = cfg.zero_stage, cfg.lr, load_universal
        self.export_dtype = torch.bfloat16 if bf16 else torch.float32
        config = deepspeed_config(cfg, world, bf16, on_gpu=device.type == "cuda", load_universal=load_universal)
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=config,
            dist_init_required=False,  # Ray Train already created the process group
        )
        self.module = self.engine.module

    def train_micro_batch(self, batch: dict[str, Any], loss_fn: LossFn, is_boundary: bool) -> Any:
        """Forward + backward of one micro-batch; DeepSpeed steps at its accumulation boundary."""
        if self.engine.is_gradient_accumulation_boundary() != is_boundary:
            raise RuntimeError(
                "DeepSpeed's micro-step count disagrees with the training loop's accumulation boundary; "
                "gradient_accumulation_steps in the DeepSpeed config must equal the loop's."
            )
        logits = self.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = loss_fn(logits, batch)
        self.engine.backward(loss)  # scales by 1 / gradient_accumulation_steps
        self.engine.step()
        return loss.detach()

    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def save(self, ckpt_dir: str, rank: int) -> None:
        """Collective: every rank writes its own ZeRO shard files into ``ckpt_dir`` (convertible to universal)."""
        from raycurate.stages.deepspeed_config import UNIVERSAL_CLIENT_STATE

        self.engine.save_checkpoint(ckpt_dir, tag=_DS_TAG, client_state=dict(UNIVERSAL_CLIENT_STATE))

    def load(self, ckpt_dir: str, session: TrainSession | None = None) -> None:
        """Collective: restore weights, optimizer and scheduler; via a universal checkpoint when built for one."""
        if not self.load_universal:
            self._load_tag(ckpt_dir, _DS_TAG)
            return
        if session is None:
            raise ValueError("a universal-checkpoint resume needs the session (to convert once per node)")
        with universal_checkpoint(ckpt_dir, session) as universal_dir:
            self._load_tag(universal_dir, _DS_TAG)

    def _load_tag(self, ckpt_dir: str, tag: str) -> None:
        weight_decays = [group["weight_decay"] for group in self.scheduler.optimizer.param_groups]
        load_path, _ = self.engine.load_checkpoint(
            ckpt_dir, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
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


def repair_zero3_universal_load(zero_optimizer: Any, weight_decays: list[float]) -> None:
    """Undo two defects of DeepSpeed 0.19's ZeRO-3 universal-checkpoint loader (``load_hp_checkpoint_state_from_
    checkpoint_dir_stage3``), so a resume on another worker count continues the exact trajectory.

    * It stores *one* ``step`` tensor object in the optimizer state of every fp32 sub-group; torch's AdamW
      increments ``step`` in place once per sub-group, so the shared counter advanced several times per optimizer
      step and every later bias correction was wrong (measured: weights off by ~5% of a step after 2 steps).
    * It copies the first parameter group's hyper-parameters into every group, so the no-decay group (norms,
      biases) would get the decay group's ``weight_decay``.

    Args:
        zero_optimizer: ``DeepSpeedEngine.optimizer`` (``DeepSpeedZeroOptimizer_Stage3``) after the load.
        weight_decays: Per parameter group, the weight decay the run was built with.
    """
    import torch

    base = zero_optimizer.optimizer
    for flat in getattr(zero_optimizer, "fp32_partitioned_groups_flat", []):
        state = base.state.get(flat, {})
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    for group, weight_decay in zip(base.param_groups, weight_decays):
        group["weight_decay"] = weight_decay


def consolidate_zero_checkpoint(ckpt_dir: str, dtype: Any = None) -> dict[str, Any]:
    """Full model state dict from a checkpoint folder holding every rank's ZeRO shards (``zero_to_fp32``).

    Args:
        ckpt_dir: A checkpoint folder this stage reported (``<ckpt_dir>/deepspeed/*_optim_states.pt``).
        dtype: Cast every tensor to this dtype (None keeps fp32).

    Returns:
        Parameter name -> tensor (frozen parameters included), on CPU.
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, tag=_DS_TAG)
    return {k: v if dtype is None else v.to(dtype) for k, v in state.items()}


def _node_private_dir(session: TrainSession) -> str:
    """Collective: a fresh private folder (``mkdtemp``: unpredictable name, mode 0700, never an existing one) made
    by local rank 0 of each node; every rank gets its own node's folder."""
    import socket

    import torch.distributed as dist

    mine = tempfile.mkdtemp(prefix="raycurate-universal-") if session.local_rank == 0 else None
    if not dist.is_initialized():
        assert mine is not None
        return mine
    host = socket.gethostname()
    entries: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(entries, (host, mine))
    return next(path for node, path in entries if node == host and path is not None)


def convert_to_universal(ckpt_dir: str, dest_parent: str) -> str:
    """Convert ``<ckpt_dir>/deepspeed`` with DeepSpeed's ``ds_to_universal`` into ``<dest_parent>/deepspeed``.

    The conversion runs in a subprocess (the CLI is DeepSpeed's stable interface) into a temp folder that is
    renamed into place, so a crash never leaves a half-converted checkpoint.

    Returns:
        ``dest_parent`` (load it with ``tag="deepspeed"`` and ``checkpoint.load_universal``).
    """
    import subprocess
    import sys

    final = os.path.join(dest_parent, _DS_TAG)
    if os.path.isdir(final):
        return dest_parent
    os.makedirs(dest_parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".universal-", dir=dest_parent)
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
               os.path.join(ckpt_dir, _DS_TAG), "--output_folder", os.path.join(tmp, _DS_TAG),
               "--num_extract_workers", "1", "--num_merge_workers", "1", "--no_strict"]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR":
                          os.environ.get("DS_ACCELERATOR", "cpu")})
    if done.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"ds_to_universal failed on {ckpt_dir} (exit {done.returncode}); resume with the worker "
                           f"count and ZeRO stage that wrote it instead.\n{done.stderr[-4000:]}")
    os.replace(os.path.join(tmp, _DS_TAG), final)
    shutil.rmtree(tmp, ignore_errors=True)
    return dest_parent


@contextlib.contextmanager
def universal_checkpoint(ckpt_dir: str, session: TrainSession) -> Iterator[str]:
    """Collective: local rank 0 of each node converts ``ckpt_dir`` to a universal checkpoint; yields its folder."""
    import torch.distributed as dist

    dest = _node_private_dir(session)
    if session.local_rank == 0:
        logger.info("converting %s to a universal checkpoint in %s", ckpt_dir, dest)
        convert_to_universal(ckpt_dir, dest)
    if dist.is_initialized():
        dist.barrier()
    try:
        yield dest
    finally:
        if dist.is_initialized():
            dist.barrier()
        if session.local_rank == 0:
            shutil.rmtree(dest, ignore_errors=True)


def read_trainer_state(ckpt_dir: str | None) -> TrainState | None:
    """The ``trainer_state.json`` of a checkpoint folder, or None for a fresh run."""
    if ckpt_dir is None:
        return None
    with open(os.path.join(ckpt_dir, TRAINER_STATE_FILE)) as f:
        return TrainState(**json.load(f))


def needs_universal_resume(saved: TrainState | None, cfg: TrainConfig, world_size: int) -> bool:
    """Whether resuming ``saved`` needs a universal checkpoint: DeepSpeed ZeRO-1/2/3 shards written by another
    worker count (DDP and ZeRO-0 checkpoints hold full, unpartitioned state that any worker count loads).

    Raises:
        ValueError: The checkpoint was written with another ZeRO stage (DeepSpeed 0.19's universal loader fails
            on that).
    """
    if saved is None or cfg.engine != "deepspeed" or saved.world_size == 0:  # 0: written before this was recorded
        return False
    if saved.zero_stage is not None and saved.zero_stage != cfg.zero_stage:
        raise ValueError(f"the checkpoint being resumed was written with ZeRO-{saved.zero_stage}; resume it with "
                         f"train.zero_stage={saved.zero_stage} (not {cfg.zero_stage}), or delete the stage's "
                         "_scratch folder to train from scratch")
    return cfg.zero_stage != 0 and saved.world_size != world_size


def build_resumed_engine(job: Any, run_steps: int, session: TrainSession,
                         ckpt_dir: str | None) -> tuple[Any, int, int, TrainState]:
    """Build the engine for ``job`` and restore it from ``ckpt_dir`` (None: a fresh run).

    Returns:
        (engine, trainable parameter count, pad token id, the restored :class:`TrainState`).
    """
    saved = read_trainer_state(ckpt_dir)
    universal = needs_universal_resume(saved, job.cfg, session.world_size)
    if universal and session.rank == 0:
        logger.info("resuming a checkpoint written by %d workers on %d workers (ZeRO-%d universal checkpoint)",
                    saved.world_size, session.world_size, job.cfg.zero_stage)
    engine, trainable, pad_id = build_model_engine(job, run_steps, session.device, load_universal=universal)
    if ckpt_dir is None:
        return engine, trainable, pad_id, TrainState()
    engine.load(ckpt_dir, session)
    return engine, trainable, pad_id, saved


def build_model_engine(job: Any, run_steps: int, device: Any, *, load_universal: bool = False) -> tuple[Any, int, int]:
    """Load ``job.init_model``, attach ``job.adapter`` and wrap it in the configured engine.

    Args:
        job: An :class:`SFTJob`-like object (``init_model``, ``adapter``, ``cfg``).
        run_steps: Optimizer steps of the whole run (the LR schedule's length).
        device: The worker's torch device.
        load_universal: Build DeepSpeed for a universal-checkpoint resume.

    Returns:
        (engine, trainable parameter count, pad token id).
    """
    import torch

    from raycurate.models.adapters import apply_adapter, trainable_parameters

    cfg = job.cfg
    bf16 = _use_bf16(cfg, device)
    load_dtype = torch.bfloat16 if bf16 and cfg.engine == "deepspeed" and device.type == "cuda" else torch.float32
    model = apply_adapter(load_model(job.init_model, load_dtype), job.adapter)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    engine = build_engine(model, cfg, run_steps, device, bf16, load_universal=load_universal)
    return engine, trainable_parameters(model), pad_id


def build_engine(model: Any, cfg: TrainConfig, run_steps: int, device: Any, bf16: bool, *,
                 load_universal: bool = False) -> Any:
    """The engine named by ``cfg.engine`` (``deepspeed`` or ``ddp``)."""
    if cfg.engine == "deepspeed":
        return DeepSpeedEngine(model, cfg, run_steps, device, bf16, load_universal=load_universal)
    if cfg.engine == "ddp":
        return DDPEngine(model, cfg, run_steps, device, bf16)
    raise ValueError(f"train.engine={cfg.engine!r} is unknown; use one of ['ddp', 'deepspeed'].")


# --------------------------------------------------------------------------------------------- session + loop


class TrainSession(Protocol):
    """What the training loop needs from its runtime (Ray Train, or an in-process test double)."""

    rank: int
    local_rank: int
    world_size: int
    device: Any

    def restore_dir(self) -> ContextManager[str | None]:
        """Directory of the checkpoint to resume from, or None for a fresh run."""

    def latest_checkpoint_dir(self) -> ContextManager[str | None]:
        """Directory of the newest checkpoint (every rank's files): the last one reported, else the restored one."""

    def report(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
        """Report metrics (and this rank's checkpoint files); a barrier over ranks."""


class RaySession:
    """:class:`TrainSession` on Ray Train V2 (``ray.train.get_context/get_checkpoint/report``)."""

    def __init__(self) -> None:
        import ray.train
        import ray.train.torch

        context = ray.train.get_context()
        self.rank = context.get_world_rank()
        self.local_rank = context.get_local_rank()
        self.world_size = context.get_world_size()
        self.device = ray.train.torch.get_device()

    @contextlib.contextmanager
    def restore_dir(self) -> Iterator[str | None]:
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            yield None
            return
        with checkpoint.as_directory() as path:
            yield path

    @contextlib.contextmanager
    def latest_checkpoint_dir(self) -> Iterator[str | None]:
        import ray.train

        reported = ray.train.get_all_reported_checkpoints()
        checkpoint = reported[-1].checkpoint if reported else ray.train.get_checkpoint()
        if checkpoint is None:
            yield None
            return
        with checkpoint.as_directory() as path:
            yield path

    def report(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
        import ray.train

        if checkpoint_dir is None:
            ray.train.report(metrics)
            return
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(checkpoint_dir),
            checkpoint_dir_name=f"checkpoint_step_{metrics['step']:08d}",
            delete_local_checkpoint_after_upload=True,
        )


@dataclass
class TrainState:
    """Progress that survives a resume (saved as ``trainer_state.json`` in every checkpoint)."""

    step: int = 0
    loss_per_step: list[float] = field(default_factory=list)
    lr_per_step: list[float] = field(default_factory=list)
    tokens: int = 0
    supervised_tokens: int = 0
    examples: int = 0
    seconds: float = 0.0
    world_size: int = 0  # of the run that wrote the checkpoint (0: unknown)
    zero_stage: int | None = None  # likewise; None for DDP


@dataclass
class SFTJob:
    """Everything a worker needs (pickled to the Ray Train workers)."""

    train_table: str
    init_model: str
    output_dir: str
    cfg: TrainConfig
    use_gpu: bool
    cpus_per_worker: float
    adapter: dict | None = None  # raycurate.models.adapters spec; None trains every parameter


def _use_bf16(cfg: TrainConfig, device: Any) -> bool:
    return cfg.bf16 if cfg.bf16 is not None else device.type == "cuda"


def _all_reduce_sum(values: list[float], device: Any) -> list[float]:
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor.tolist()


def _should_checkpoint(done: int, run_steps: int, per_epoch: int, every: int | None) -> bool:
    if done == run_steps:
        return True
    return done % every == 0 if every is not None else done % per_epoch == 0


def write_trainer_state(ckpt_dir: str, state: TrainState, session: TrainSession, cfg: TrainConfig) -> None:
    """``trainer_state.json``, stamped with the world size and ZeRO stage that wrote the checkpoint."""
    state.world_size = session.world_size
    state.zero_stage = cfg.zero_stage if cfg.engine == "deepspeed" else None
    with open(os.path.join(ckpt_dir, TRAINER_STATE_FILE), "w") as f:
        json.dump(dataclasses.asdict(state), f)


def maybe_inject_fault(session: TrainSession, step: int) -> None:
    """Fault injection for failure tests: ``RAYCURATE_FAULT_KILL=rank:step:marker`` hard-kills that rank once
    after that optimizer step (the marker file records that it already happened, so the restart survives).

    Before dying it waits until Ray Train has committed every checkpoint reported so far: Ray Train registers a
    report asynchronously, and a worker lost right after a report restarts from the previous committed one.
    """
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    kill_rank, kill_step, marker = spec.split(":", 2)
    rank = session.rank
    if rank == int(kill_rank) and step == int(kill_step) and not os.path.exists(marker):
        with session.latest_checkpoint_dir():
            pass
        with open(marker, "w") as f:
            f.write(f"killed rank {rank} after step {step}\n")
        logger.warning("fault injection: killing rank %d after step %d", rank, step)
        os._exit(1)


def _save_checkpoint(engine: Any, session: TrainSession, state: TrainState, metrics: dict[str, Any],
                     cfg: TrainConfig) -> None:
    ckpt_dir = tempfile.mkdtemp(prefix=f"raycurate-ckpt-r{session.rank}-")
    engine.save(ckpt_dir, session.rank)
    if session.rank == 0:
        write_trainer_state(ckpt_dir, state, session, cfg)
    has_files = bool(os.listdir(ckpt_dir))
    session.report(metrics, ckpt_dir if has_files else None)
    shutil.rmtree(ckpt_dir, ignore_errors=True)


def _to_device(batch: dict[str, Any], device: Any) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _copy_tokenizer_files(init_model: str, dest: str) -> list[str]:
    copied = []
    for name in sorted(os.listdir(init_model)):
        src = os.path.join(init_model, name)
        if os.path.isfile(src) and (name.startswith(_TOKENIZER_PREFIXES) or name.endswith(".model")):
            shutil.copy2(src, os.path.join(dest, name))
            copied.append(name)
    return copied


def _save_merged(job: SFTJob, state_dict: dict[str, Any], dest: str) -> None:
    """Rebuild the adapted model on CPU from ``init_model``, load the trained state, save adapter + merged model."""
    import torch

    from raycurate.models.adapters import apply_adapter, export_model, save_adapter

    model = apply_adapter(load_model(job.init_model, torch.float32), job.adapter)
    model.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=True)
    save_adapter(model, job.adapter, os.path.join(dest, "adapter"))
    export_model(model, job.adapter).save_pretrained(dest)


def export_hf(engine: Any, job: SFTJob, metrics: dict[str, Any], session: TrainSession) -> None:
    """Write the trained model (safetensors), tokenizer files and metrics to ``job.output_dir`` atomically.

    Call it after the final checkpoint was reported: ZeRO-1/2/3 weights are consolidated from its shards
    (``zero_to_fp32``).  Only rank 0 writes.  With an adapter the checkpoint is the merged model (a plain HF
    checkpoint), and a LoRA adapter is also saved alone under ``adapter/``.
    """
    from raycurate.models.adapters import adapter_kind

    state_dict = engine.full_state_dict(session)
    if session.rank != 0:
        return
    output_dir = os.path.abspath(job.output_dir)
    parent = os.path.dirname(output_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(output_dir)}.tmp-", dir=parent)
    if adapter_kind(job.adapter) == "full":
        engine.module.save_pretrained(tmp, state_dict=state_dict)
    else:
        _save_merged(job, state_dict, tmp)
    _copy_tokenizer_files(job.init_model, tmp)
    with open(os.path.join(tmp, METRICS_FILE), "w") as f:
        json.dump(metrics, f, indent=1)
    old = None
    if os.path.exists(output_dir):
        old = f"{output_dir}.old-{uuid.uuid4().hex[:8]}"
        os.replace(output_dir, old)
    os.replace(tmp, output_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _metrics(job: SFTJob, state: TrainState, start_step: int, run_steps: int, per_epoch: int,
             world: int, seconds_this_run: float, trainable: int) -> dict[str, Any]:
    from raycurate.models.adapters import adapter_kind

    return {
        "step": state.step,
        "steps": state.step,
        "start_step": start_step,
        "total_steps": run_steps,
        "steps_per_epoch": per_epoch,
        "epoch": state.step / per_epoch,
        "loss": state.loss_per_step[-1] if state.loss_per_step else None,
        "loss_per_step": list(state.loss_per_step),
        "lr_per_step": list(state.lr_per_step),
        "tokens": state.tokens,
        "supervised_tokens": state.supervised_tokens,
        "examples": state.examples,
        "seconds": state.seconds,
        "seconds_this_run": seconds_this_run,
        "engine": job.cfg.engine,
        "zero_stage": job.cfg.zero_stage if job.cfg.engine == "deepspeed" else None,
        "world_size": world,
        "adapter": adapter_kind(job.adapter),
        "trainable_parameters": trainable,
    }


def train_loop(job: SFTJob, session: TrainSession, loss_fn: LossFn = sft_loss) -> dict[str, Any]:
    """The per-worker SFT loop: build, restore, train to ``total_steps``, checkpoint, export.

    Args:
        job: Inputs, outputs and config.
        session: Runtime (rank, world size, device, checkpoint restore/report).
        loss_fn: ``(logits (B, T, V), batch) -> ()`` loss of one micro-batch.

    Returns:
        The final metrics (same on every rank; rank 0 also writes them to ``output_dir``).
    """
    import torch

    cfg, device = job.cfg, session.device
    torch.manual_seed(cfg.seed + session.rank)
    table = load_token_table(job.train_table)
    accum = grad_accum_steps(cfg, session.world_size)
    per_epoch = steps_per_epoch(len(table), cfg.effective_batch_size)
    run_steps = total_steps(len(table), cfg)
    with session.restore_dir() as ckpt_dir:
        engine, trainable, pad_id, state = build_resumed_engine(job, run_steps, session, ckpt_dir)
    if state.step > run_steps:
        raise ValueError(f"the checkpoint being resumed is at step {state.step}, beyond this run's {run_steps} steps; "
                         "raise train.max_steps, or delete the stage's _scratch folder to train from scratch")
    start_step, started = state.step, time.perf_counter()
    if session.rank == 0:
        logger.info("SFT: %d rows, %d steps/epoch, steps %d -> %d, accum %d, world %d, engine %s, %d trainable "
                    "parameters", len(table), per_epoch, start_step, run_steps, accum, session.world_size, cfg.engine,
                    trainable)

    schedule, schedule_epoch = None, -1
    for step in range(start_step, run_steps):
        epoch, step_in_epoch = divmod(step, per_epoch)
        if epoch != schedule_epoch:
            order = epoch_order(len(table), cfg.seed, epoch)
            schedule, schedule_epoch = micro_batch_rows(order, session.world_size, cfg.micro_batch_size, accum), epoch
        step_started, step_lr = time.perf_counter(), engine.lr()
        loss_sum, tokens, supervised = 0.0, 0, 0
        for k in range(accum):
            batch = collate(table, schedule[step_in_epoch, k, session.rank], pad_id)
            tokens += int(batch["attention_mask"].sum())
            supervised += int((batch["loss_mask"][:, 1:] != 0).sum())
            loss = engine.train_micro_batch(_to_device(batch, device), loss_fn, is_boundary=k == accum - 1)
            loss_sum += float(loss)
        loss_total, tokens, supervised = _all_reduce_sum([loss_sum, tokens, supervised], device)
        state.step = step + 1
        state.loss_per_step.append(loss_total / (accum * session.world_size))
        state.lr_per_step.append(step_lr)
        state.tokens += int(tokens)
        state.supervised_tokens += int(supervised)
        state.examples += cfg.effective_batch_size
        state.seconds += time.perf_counter() - step_started
        if session.rank == 0 and (state.step % cfg.log_every_steps == 0 or state.step == run_steps):
            logger.info("step %d/%d loss %.4f lr %.3g", state.step, run_steps, state.loss_per_step[-1],
                        state.lr_per_step[-1])
        if _should_checkpoint(state.step, run_steps, per_epoch, cfg.checkpoint_every_steps):
            metrics = _metrics(job, state, start_step, run_steps, per_epoch, session.world_size,
                               time.perf_counter() - started, trainable)
            _save_checkpoint(engine, session, state, metrics, cfg)
        maybe_inject_fault(session, state.step)

    metrics = _metrics(job, state, start_step, run_steps, per_epoch, session.world_size,
                       time.perf_counter() - started, trainable)
    export_hf(engine, job, metrics, session)
    session.report(metrics, None)
    return metrics


def prepare_worker(job: Any) -> None:
    """Per-worker set-up of every training loop: logging and (on CPU) the worker's thread count."""
    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not job.use_gpu:
        torch.set_num_threads(max(1, int(job.cpus_per_worker)))


def _ray_worker_entry(config: dict[str, Any]) -> None:
    """``train_loop_per_worker`` for ``TorchTrainer``."""
    prepare_worker(config["job"])
    train_loop(config["job"], RaySession())


# --------------------------------------------------------------------------------------------- driver


def _worker_env(use_gpu: bool) -> dict[str, str]:
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if not use_gpu:
        env["DS_ACCELERATOR"] = "cpu"
    for name in ("TORCH_EXTENSIONS_DIR", FAULT_ENV):
        if name in os.environ:
            env[name] = os.environ[name]
    return env


def run_sft(train_table: str, init_model: str, output_dir: str, cfg: TrainConfig, *,
            storage_dir: str, name: str, adapter: dict | None = None) -> dict[str, Any]:
    """Fine-tune ``init_model`` on a token-level table with Ray Train; resumes ``storage_dir/name`` if it exists.

    Args:
        train_table: Parquet file or directory in the token-level table format.
        init_model: Local HF checkpoint directory (model, optionally tokenizer files).
        output_dir: Where the trained HF checkpoint, tokenizer files and ``train_metrics.json`` go.
        cfg: Training config.
        storage_dir: Ray Train storage (checkpoints); re-running with the same ``storage_dir`` and ``name``
            resumes from the latest checkpoint there.
        name: Ray Train run name.
        adapter: Adapter spec (:mod:`raycurate.models.adapters`): LoRA, P2D head deltas, or None (full).

    Returns:
        The metrics of ``train_metrics.json``: ``loss_per_step``, ``steps``, ``start_step``, ``tokens``,
        ``supervised_tokens``, ``seconds``, ...
    """
    grad_accum_steps(cfg, cfg.num_workers)  # fail on the driver, before any worker starts
    check_offload(cfg)
    if not os.path.isdir(init_model):
        raise FileNotFoundError(f"init_model={init_model} is not a directory; pass a local HF checkpoint dir.")
    use_gpu, cpus = worker_resources(cfg)
    job = SFTJob(os.path.abspath(train_table), os.path.abspath(init_model), os.path.abspath(output_dir),
                 cfg, use_gpu, cpus, adapter)
    launch_trainer(_ray_worker_entry, {"job": job}, cfg, use_gpu, cpus, storage_dir=storage_dir, name=name)
    with open(os.path.join(job.output_dir, METRICS_FILE)) as f:
        return json.load(f)


def worker_resources(cfg: TrainConfig) -> tuple[bool, float]:
    """(use GPUs, CPUs per worker) of a training run on the current Ray cluster (started when needed)."""
    from raycurate.stages.runtime import actor_cpus, cluster_cpus, cluster_gpus, init_ray

    init_ray()
    use_gpu = cfg.use_gpu if cfg.use_gpu is not None else cluster_gpus() >= 1
    return use_gpu, actor_cpus(cfg.cpus_per_worker, cfg.num_workers, cluster_cpus())


def launch_trainer(entry: Callable[[dict], None], loop_config: dict[str, Any], cfg: TrainConfig, use_gpu: bool,
                   cpus: float, *, storage_dir: str, name: str) -> None:
    """Run ``entry`` on ``cfg.num_workers`` Ray Train workers (TorchTrainer); resumes ``storage_dir/name``."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    resources: dict[str, float] = {"CPU": cpus}
    if use_gpu:
        resources["GPU"] = 1
    trainer = TorchTrainer(
        entry,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=use_gpu, resources_per_worker=resources),
        run_config=RunConfig(
            name=name,
            storage_path=os.path.abspath(storage_dir),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints),
            failure_config=FailureConfig(max_failures=cfg.max_failures),
            worker_runtime_env={"env_vars": _worker_env(use_gpu)},
        ),
    )
    trainer.fit()
