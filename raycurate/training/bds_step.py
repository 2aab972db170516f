"""One BDS optimizer step on one rank (:func:`bds_step`: theta step on the penalty-weighted loss, then the identical
omega step) and its schedule: the batch split, the rows of step k and this rank's share of them.

Settings come from :class:`~raycurate.config.bilevel.BilevelConfig` and theta's :class:`TrainConfig`; the loop is
:mod:`raycurate.training.bds_loop`, the math :mod:`raycurate.algorithms.bilevel` / :mod:`~raycurate.algorithms.bmo`,
the decisions docs/bilevel.md and docs/design.md ("Layers").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from raycurate.algorithms import bilevel, bmo
from raycurate.config.bilevel import BilevelConfig
from raycurate.config.train import TrainConfig
from raycurate.training.batches import TokenTable, batch_token_losses, to_device
from raycurate.training.bds_online import OnlineResponses, collate_slots
from raycurate.training.bds_state import OmegaState
from raycurate.training.collectives import all_gather_pairs
from raycurate.training.deepspeed_config import grad_accum_steps
from raycurate.training.order import epoch_order

# --------------------------------------------------------------------------------------------- schedule


def bds_batches(cfg: TrainConfig, bds: BilevelConfig) -> tuple[int, int]:
    """(validation rows, candidate rows) per optimizer step over all workers: ``bilevel.val_batch`` (null: half of
    ``train.effective_batch_size``) and the rest of the effective batch."""
    val_batch = bds.val_batch if bds.val_batch is not None else cfg.effective_batch_size // 2
    return val_batch, cfg.effective_batch_size - val_batch


def check_bds_batches(cfg: TrainConfig, bds: BilevelConfig, world_size: int) -> int:
    """Validate the BDS settings and batch arithmetic; returns gradient-accumulation micro-steps per optimizer step.

    Raises:
        ValueError: With the settings to change when the batches do not tile the workers and micro-batches.
    """
    if bds.variant not in bilevel.OMEGA_VARIANTS:
        raise ValueError(f"bilevel.variant={bds.variant!r} is unknown; use one of {bilevel.OMEGA_VARIANTS}.")
    if bds.omega_optimizer not in bilevel.OMEGA_OPTIMIZERS:
        raise ValueError(f"bilevel.omega_optimizer={bds.omega_optimizer!r} is unknown; use one of "
                         f"{bilevel.OMEGA_OPTIMIZERS}.")
    if bds.omega_baseline not in bilevel.OMEGA_BASELINES:
        raise ValueError(f"bilevel.omega_baseline={bds.omega_baseline!r} is unknown; use one of "
                         f"{bilevel.OMEGA_BASELINES}.")
    if bds.importance not in bmo.IMPORTANCE_MODES:
        raise ValueError(f"bilevel.importance={bds.importance!r} is unknown; use one of {bmo.IMPORTANCE_MODES}.")
    if bds.generation_every < 1:
        raise ValueError(f"bilevel.generation_every={bds.generation_every} must be >= 1.")
    val_batch, cand_batch = bds_batches(cfg, bds)
    if val_batch < 1 or cand_batch < 1:
        raise ValueError(f"bilevel.val_batch={val_batch} validation rows leave {cand_batch} candidate rows of "
                         f"train.effective_batch_size={cfg.effective_batch_size}; both must be >= 1.")
    if bds.omega_optimizer in bilevel.SPARSE_OPTIMIZERS and cand_batch < 2:
        raise ValueError(f"bilevel.omega_optimizer={bds.omega_optimizer!r} centres each sampled row on the others of "
                         f"its batch, so it needs >= 2 candidate rows per step (got {cand_batch}); lower "
                         "bilevel.val_batch or use omega_optimizer=sgd.")
    if val_batch % world_size or cand_batch % world_size:
        raise ValueError(
            f"{val_batch} validation (bilevel.val_batch) and {cand_batch} candidate rows per step must be multiples "
            f"of num_workers={world_size} so every rank trains on an equal slice of each."
        )
    return grad_accum_steps(cfg, world_size)


def bds_steps_per_epoch(num_candidates: int, cand_batch: int) -> int:
    """Optimizer steps in one pass over the candidates.

    Raises:
        ValueError: When there are fewer candidates than one candidate batch.
    """
    steps = num_candidates // cand_batch
    if steps == 0:
        raise ValueError(f"The candidate table has {num_candidates} rows, fewer than the {cand_batch} candidate rows "
                         "of one step; raise bilevel.val_batch or add candidates.")
    return steps


def bds_total_steps(num_candidates: int, cfg: TrainConfig, bds: BilevelConfig) -> int:
    """Optimizer steps of the run: ``epochs * steps_per_epoch``, capped by ``max_steps``."""
    steps = cfg.epochs * bds_steps_per_epoch(num_candidates, bds_batches(cfg, bds)[1])
    return steps if cfg.max_steps is None else min(steps, cfg.max_steps)


def step_rows(step: int, num_val: int, num_cand: int, val_batch: int, cand_batch: int,
              seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The global validation and candidate rows of optimizer step ``step`` (a pure function of seed and step).

    Returns:
        (val_batch,) validation row indices and (cand_batch,) candidate row indices.
    """
    per_epoch = bds_steps_per_epoch(num_cand, cand_batch)
    epoch, s = divmod(step, per_epoch)
    cand = epoch_order(num_cand, seed, epoch)[s * cand_batch:(s + 1) * cand_batch]
    val = np.random.default_rng([seed, 1, step]).choice(num_val, val_batch, replace=num_val < val_batch)
    return val.astype(np.int64), cand.astype(np.int64)


def rank_slice(rows: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Rank ``rank``'s contiguous equal share of ``rows`` (len(rows) must be a multiple of world_size)."""
    return rows.reshape(world_size, -1)[rank]


# --------------------------------------------------------------------------------------------- one step


@dataclass
class StepContext:
    """What one BDS step needs; built once per worker.

    Attributes:
        table: Validation rows ``[0, num_val)``, then candidate rows ``[num_val, num_val + num_cand)``.
        bds: The bilevel settings (``bilevel:``); the batch split is :func:`bds_batches` of ``cfg`` and them.
        online: Latest generated responses of the masked questions (online BMO), or None (offline BDS).
    """

    engine: Any
    table: TokenTable
    num_val: int
    num_cand: int
    cfg: TrainConfig
    bds: BilevelConfig
    rank: int
    world_size: int
    device: Any
    pad_id: int
    accum: int
    online: OnlineResponses | None = None


@dataclass
class StepStats:
    """This rank's sums over one step (all-reduced by the loop)."""

    loss_sum: float
    val_loss_sum: float
    cand_loss_sum: float
    tokens: int
    supervised: int
    omega_loss_mean: float
    gamma: float
    online_slots: int


class _LossRecorder:
    """The SFT loss ``sum_s w_s l_s / S`` over question slots that also keeps each slot's detached plain loss.

    A slot is one row (``l`` = its mean token loss) or, in a batch from :func:`collate_slots` with generated
    sequences, a masked question (``l`` = its importance-weighted loss, the kept loss the unweighted mean).
    """

    def __init__(self, mode: str, clip: float) -> None:
        self.mode, self.clip = mode, clip
        self.per_slot: list[Any] = []

    def __call__(self, per_token: Any, batch: dict[str, Any]) -> Any:
        """Keep each slot's plain loss from (B, T) per-position losses; return the weighted batch loss."""
        from raycurate.algorithms.losses import mean_supervised_loss, weighted_batch_loss

        if "slot" not in batch:
            per_example = mean_supervised_loss(per_token, batch["loss_mask"])  # (B,)
            self.per_slot.append(per_example.detach().float().cpu())
            return weighted_batch_loss(per_example, batch["weight"])
        weighted, plain = bmo.grouped_response_losses(
            per_token, batch["loss_mask"], batch["old_logp"], batch["generated"], batch["slot"],
            len(batch["weight"]), self.mode, self.clip)  # (S,), (S,)
        self.per_slot.append(plain.float().cpu())
        return weighted_batch_loss(weighted, batch["weight"])

    def losses(self) -> np.ndarray:
        import torch

        return torch.cat(self.per_slot).numpy()


def no_grad_losses(ctx: StepContext, slots: list[Any]) -> np.ndarray:
    """Plain losses of question slots under the current weights (eval mode, no graph), micro-batched.

    Returns:
        (len(slots),) float32 losses: a row's mean token loss, a masked question's mean over its responses.
    """
    import torch

    module = ctx.engine.module
    bf16 = bool(getattr(ctx.engine, "bf16", False))
    recorder = _LossRecorder(ctx.bds.importance, ctx.bds.importance_clip)
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            for lo in range(0, len(slots), ctx.cfg.micro_batch_size):
                batch = to_device(collate_slots(ctx.table, slots[lo:lo + ctx.cfg.micro_batch_size], ctx.pad_id),
                                   ctx.device)
                with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=bf16):
                    # Logits of the supervised window only: the prompt side needs no vocabulary projection here.
                    per_token = batch_token_losses(module, batch)  # (B, T)
                recorder(per_token, batch)
    finally:
        module.train(was_training)
    return recorder.losses()


def candidate_slots(ctx: StepContext, cand: np.ndarray) -> list[Any]:
    """Slots of candidate rows: the table row, or a masked question's generated responses."""
    online = ctx.online.sequences if ctx.online is not None else {}
    return [online.get(int(c), ctx.num_val + int(c)) for c in cand]


def bds_step(ctx: StepContext, omega_state: OmegaState, step: int) -> tuple[OmegaState, StepStats]:
    """One BDS step on this rank: theta step on the weighted loss, then the (identical) omega step.

    Args:
        ctx: Per-worker context.
        omega_state: omega before the step (identical on every rank).
        step: 0-based optimizer step.

    Returns:
        (omega state after the step, this rank's step statistics).
    """
    import torch

    bds, (val_batch, cand_batch) = ctx.bds, bds_batches(ctx.cfg, ctx.bds)
    per_epoch = bds_steps_per_epoch(ctx.num_cand, cand_batch)
    gamma = bilevel.gamma_schedule(step // per_epoch, bds.rho0, bds.rho_step, bds.rho_max)
    val, cand = step_rows(step, ctx.num_val, ctx.num_cand, val_batch, cand_batch, bds.seed)
    my_val, my_cand = rank_slice(val, ctx.rank, ctx.world_size), rank_slice(cand, ctx.rank, ctx.world_size)
    total = val_batch + cand_batch
    sigma = bilevel.data_weights(omega_state.omega)
    cand_slots = candidate_slots(ctx, my_cand)
    slots = [int(v) for v in my_val] + cand_slots
    weights = np.concatenate([np.full(len(my_val), total / val_batch),
                              gamma * sigma[my_cand] * total / cand_batch]).astype(np.float32)

    recorder, micro = _LossRecorder(bds.importance, bds.importance_clip), ctx.cfg.micro_batch_size
    loss_sum, tokens, supervised = 0.0, 0, 0
    for k in range(ctx.accum):
        batch = collate_slots(ctx.table, slots[k * micro:(k + 1) * micro], ctx.pad_id)
        batch["weight"] = torch.from_numpy(weights[k * micro:(k + 1) * micro])
        tokens += int(batch["attention_mask"].sum())
        supervised += int((batch["loss_mask"][:, 1:] != 0).sum())
        loss = ctx.engine.train_micro_batch(to_device(batch, ctx.device), recorder, is_boundary=k == ctx.accum - 1)
        loss_sum += float(loss)
    slot_losses = recorder.losses()  # (len(slots),) at theta^k
    val_losses, cand_losses = slot_losses[:len(my_val)], slot_losses[len(my_val):]

    # eq. 5b / 10c: omega's coefficient is the candidate loss at theta^{k+1} (exact) or at theta^k (detached).
    omega_losses = no_grad_losses(ctx, cand_slots) if bds.variant == "exact" else cand_losses
    all_idx, all_losses = all_gather_pairs(my_cand, omega_losses, ctx.device)
    omega, adam = bilevel.update_omega(bds.omega_optimizer, omega_state.omega, all_idx, all_losses, gamma,
                                       omega_state.adam, bds.omega_lr, bilevel.OMEGA_ADAM_BETAS,
                                       bilevel.OMEGA_ADAM_EPS, bds.omega_baseline)
    stats = StepStats(loss_sum, float(val_losses.sum()), float(cand_losses.sum()), tokens, supervised,
                      float(all_losses.mean()), gamma, sum(not isinstance(x, int) for x in cand_slots))
    return dataclasses.replace(omega_state, omega=omega, adam=adam).observe(step, all_idx, all_losses), stats
