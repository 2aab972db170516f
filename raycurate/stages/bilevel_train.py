"""BDS (bilevel data selection) on Ray Train, offline or online (BMO): theta and the data logits omega learned together.

Run it::

    from raycurate.config.train import TrainConfig
    from raycurate.stages.bilevel_train import BDSSettings, run_bds
    metrics = run_bds("runs/x/tokenize/candidates.parquet", "runs/x/tokenize/validation.parquet", "models/base",
                      "runs/x/bds/model", TrainConfig(lr=5e-6, effective_batch_size=8), BDSSettings(),
                      storage_dir="runs/x/ray_train", name="bds")

The worker loop reuses the shared training machinery (:mod:`raycurate.training`: token tables, engines, sessions,
the checkpoint writer, ``export_hf``, omega state and online responses) and the pure math of
:mod:`raycurate.algorithms.bilevel`.  One optimizer step k (paper eq. 5; docs/bilevel.md):

1. Sample a validation batch (``val_batch`` rows) and a candidate batch (``cand_batch`` rows) with generators seeded
   by ``(seed, step)`` / ``(seed, epoch)`` -- the same global rows on every rank; rank r trains on the r-th equal
   slice of each.
2. theta step on ``L_val + gamma_k * mean_b(sigma_b l_b)``: one forward/backward over ``[val rows; cand rows]``
   through the engine's per-example weighted loss (``sum_i w_i l_i / B``, B = val_batch + cand_batch), with
   ``w = B / val_batch`` on validation rows and ``w = gamma_k sigma_i B / cand_batch`` on candidate rows.
3. omega step: the candidates' losses at theta^{k+1} (a no-grad forward of the same rows after the step; variant
   ``exact``) or at theta^k from step 2's forward (variant ``detached``, BIPOST's cheaper form); the
   ``(index, loss)`` pairs of all ranks are all-gathered in rank order, and every rank applies the same float64
   :func:`~raycurate.algorithms.bilevel.update_omega` (``omega_optimizer``: ``sgd``, ``sparse_sgd``,
   ``sparse_adam`` or the paper's dense ``adam``), so omega is bit-identical everywhere (checked at every
   checkpoint and at the end; a mismatch is an error).

Decisions:

* An epoch is one pass over the candidates: ``steps_per_epoch = N // cand_batch`` (the remainder waits for the next
  epoch's permutation, as in SFT); gamma_k follows :func:`~raycurate.algorithms.bilevel.gamma_schedule` of that epoch.
  Validation rows are drawn without replacement within a step, independently per step.
* ``val_batch + cand_batch`` must equal ``train.effective_batch_size`` and each must be a multiple of the number of
  workers, so the engines' micro-batch and accumulation arithmetic stays that of SFT.
* Checkpoints hold the engine state, ``trainer_state.json`` and, written by rank 0, ``omega_state.npz`` (omega, its
  Adam moments and per-row step counts, the per-epoch omega history, each row's first-sample step and latest
  omega loss, a digest of the candidate ids) and ``bds_state.json`` (per-step curves); resume is bit for bit.
* Outputs in ``output_dir``: the HF model (merged, plus ``adapter/``, when an adapter was trained), tokenizer files,
  ``train_metrics.json`` and ``weights.parquet`` with one row per (candidate, snapshot): ``id``, ``omega``,
  ``sigma``, ``rank`` (1 = largest weight; ties by id order), ``epoch`` and ``step`` of the snapshot,
  ``first_step`` (the 0-based step at which the row was first sampled, -1 if not yet) and ``loss`` (the row's
  latest omega loss, NaN if not yet sampled; the sampling-order diagnostics), at every epoch end and the last step.
* Online BMO (Algorithm 1): a :class:`GenerationHook` returns G responses (with generation-time log-probs) for
  the masked questions every ``generation_every`` steps; from then on a sampled masked question trains on them as
  one slot -- loss ``1/G sum_g r_g l_g`` with importance weights ``r`` (``importance``: per-token clipped ratio or
  per-question self-normalised, :func:`~raycurate.algorithms.bmo.grouped_response_losses`), slot weight
  ``gamma_k sigma_i B / cand_batch`` (eq. 9, 10a) -- and the omega step uses the unweighted mean of its
  responses' losses (eq. 10c).  The masked set is the set of questions of the latest generation round (fixed or
  dynamic is the hook's choice); the responses are checkpointed (``online_responses.parquet``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, cast

import numpy as np

from raycurate.algorithms import bilevel, bmo
from raycurate.config.train import TrainConfig
from raycurate.stages.train import check_launcher, launch_trainer, worker_resources
from raycurate.training.batches import TokenTable, batch_token_losses, load_token_table, stack_tables, to_device
from raycurate.training.bds_online import (
    ONLINE_STATE_FILE,
    OnlineResponses,
    collate_slots,
    load_online,
    online_from_rows,
    prompt_ids,
    save_online,
)
from raycurate.training.bds_state import (
    BDS_STATE_FILE,
    OMEGA_STATE_FILE,
    WEIGHTS_FILE,
    BDSCurves,
    OmegaState,
    ids_digest,
    load_omega_state,
    save_omega_state,
    write_weights,
)
from raycurate.training.checkpoint import TrainState, save_checkpoint
from raycurate.training.collectives import all_gather_pairs, all_reduce_sum, gathered_omega_digests
from raycurate.training.deepspeed_config import grad_accum_steps
from raycurate.training.export import METRICS_FILE, export_hf, run_metrics
from raycurate.training.order import CheckpointClock, epoch_order, should_checkpoint
from raycurate.training.protocol import TrainSession
from raycurate.training.session import build_resumed_engine, prepare_worker

logger = logging.getLogger(__name__)

@dataclass
class BDSSettings:
    """Bilevel settings of one BDS run (theta's own settings live in :class:`TrainConfig`; paper lr 5e-6).

    Attributes:
        omega_lr: Step size of the data logits (paper: Adam, 1e-4; SGD needs about cand_batch / gamma).
        omega_optimizer: One of :data:`raycurate.algorithms.bilevel.OMEGA_OPTIMIZERS`; ``"adam"`` is the paper's
            dense Adam, which records the sampling order (docs/bilevel.md, "The omega optimizer").
        omega_baseline: Baseline of the sparse optimizers (:data:`raycurate.algorithms.bilevel.OMEGA_BASELINES`).
        omega_betas: Adam betas of the data logits.
        omega_eps: Adam eps of the data logits.
        rho0: rho of epoch 0; gamma = rho / (1 - rho).
        rho_step: rho added after every epoch.
        rho_max: Cap on rho.
        val_batch: Validation rows per optimizer step (all workers).
        cand_batch: Candidate rows per optimizer step (all workers); val_batch + cand_batch = effective batch.
        variant: ``"exact"`` (omega sees candidate losses at theta^{k+1}) or ``"detached"`` (at theta^k).
        seed: Seed of the row sampling.
        generation_every: K_gen for online BMO (needs a generation hook); None = offline.
        importance: Importance weights of generated responses: ``"clip"`` (per token) or ``"self_normalize"``.
        importance_clip: Ratio bound of ``"clip"`` (ratios are truncated to [1/clip, clip]).
    """

    omega_lr: float = 100.0
    omega_optimizer: str = "sparse_sgd"
    omega_baseline: str = "median"
    omega_betas: tuple[float, float] = (0.9, 0.999)
    omega_eps: float = 1e-8
    rho0: float = 0.1
    rho_step: float = 0.1
    rho_max: float = 0.9
    val_batch: int = 4
    cand_batch: int = 4
    variant: str = "exact"
    seed: int = 0
    generation_every: int | None = None
    importance: str = "clip"
    importance_clip: float = 2.0


@dataclass
class BDSJob:
    """Everything a worker needs (pickled to the Ray Train workers)."""

    candidate_table: str
    validation_table: str
    init_model: str
    output_dir: str
    cfg: TrainConfig
    bds: BDSSettings = field(default_factory=BDSSettings)
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    adapter: dict[str, Any] | None = None


class GenerationHook(Protocol):
    """Online BMO extension point (Algorithm 1, lines 5-7), called on every rank before 0-based step ``s`` when
    ``(s + 1) % bds.generation_every == 0`` (the paper's ``k mod K_gen = 0`` with ``k = s + 1``).

    An implementation picks the masked questions (:func:`~raycurate.algorithms.bmo.masked_questions_fixed`, or
    ``masked_questions_dynamic(data_weights(omega), R)``), builds their requests with :func:`generation_requests`,
    asks the generation actor pool (:mod:`raycurate.stages.generation`) for G responses each from the current
    policy (``module``: save its adapter where the actors can read it) and returns the pool's rows
    (``question_id``, ``response_ids``, ``token_logprobs``, ...) -- the same rows on every rank, e.g. generated on
    rank 0 and shared with :func:`~raycurate.training.collectives.broadcast_from_rank0` -- or None to keep the
    previous responses.  The loop then trains every masked question on its latest responses (eq. 9-10); see
    :class:`~raycurate.training.bds_online.OnlineResponses`.
    """

    def __call__(self, step: int, omega: np.ndarray, module: Any) -> list[dict] | None:
        """Generate for the masked questions; return the generation pool's rows or None."""


# --------------------------------------------------------------------------------------------- schedule


def check_bds_batches(cfg: TrainConfig, bds: BDSSettings, world_size: int) -> int:
    """Validate the batch arithmetic; returns gradient-accumulation micro-steps per optimizer step.

    Raises:
        ValueError: With the settings to change when the batches do not tile the workers and micro-batches.
    """
    if bds.variant not in bilevel.OMEGA_VARIANTS:
        raise ValueError(f"bds.variant={bds.variant!r} is unknown; use one of {bilevel.OMEGA_VARIANTS}.")
    if bds.omega_optimizer not in bilevel.OMEGA_OPTIMIZERS:
        raise ValueError(f"bds.omega_optimizer={bds.omega_optimizer!r} is unknown; use one of "
                         f"{bilevel.OMEGA_OPTIMIZERS}.")
    if bds.omega_baseline not in bilevel.OMEGA_BASELINES:
        raise ValueError(f"bds.omega_baseline={bds.omega_baseline!r} is unknown; use one of {bilevel.OMEGA_BASELINES}.")
    if bds.importance not in bmo.IMPORTANCE_MODES:
        raise ValueError(f"bds.importance={bds.importance!r} is unknown; use one of {bmo.IMPORTANCE_MODES}.")
    if bds.generation_every is not None and bds.generation_every < 1:
        raise ValueError(f"bds.generation_every={bds.generation_every} must be >= 1 (or null for offline BDS).")
    if bds.val_batch < 1 or bds.cand_batch < 1:
        raise ValueError(f"bds.val_batch={bds.val_batch} and bds.cand_batch={bds.cand_batch} must both be >= 1.")
    if bds.omega_optimizer in bilevel.SPARSE_OPTIMIZERS and bds.cand_batch < 2:
        raise ValueError(f"bds.omega_optimizer={bds.omega_optimizer!r} centres each sampled row on the others of its "
                         f"batch, so it needs bds.cand_batch >= 2 (got {bds.cand_batch}); raise the candidate batch "
                         "or use omega_optimizer=sgd.")
    if bds.val_batch + bds.cand_batch != cfg.effective_batch_size:
        raise ValueError(
            f"bds.val_batch + bds.cand_batch = {bds.val_batch} + {bds.cand_batch} must equal "
            f"train.effective_batch_size={cfg.effective_batch_size} (one BDS step trains on both batches); "
            "change one side."
        )
    if bds.val_batch % world_size or bds.cand_batch % world_size:
        raise ValueError(
            f"bds.val_batch={bds.val_batch} and bds.cand_batch={bds.cand_batch} must be multiples of "
            f"num_workers={world_size} so every rank trains on an equal slice of each."
        )
    return grad_accum_steps(cfg, world_size)


def bds_steps_per_epoch(num_candidates: int, cand_batch: int) -> int:
    """Optimizer steps in one pass over the candidates.

    Raises:
        ValueError: When there are fewer candidates than one candidate batch.
    """
    steps = num_candidates // cand_batch
    if steps == 0:
        raise ValueError(f"The candidate table has {num_candidates} rows, fewer than bds.cand_batch={cand_batch}; "
                         "lower cand_batch or add candidates.")
    return steps


def bds_total_steps(num_candidates: int, cfg: TrainConfig, bds: BDSSettings) -> int:
    """Optimizer steps of the run: ``epochs * steps_per_epoch``, capped by ``max_steps``."""
    steps = cfg.epochs * bds_steps_per_epoch(num_candidates, bds.cand_batch)
    return steps if cfg.max_steps is None else min(steps, cfg.max_steps)


def step_rows(step: int, num_val: int, num_cand: int, bds: BDSSettings) -> tuple[np.ndarray, np.ndarray]:
    """The global validation and candidate rows of optimizer step ``step`` (a pure function of seed and step).

    Returns:
        (val_batch,) validation row indices and (cand_batch,) candidate row indices.
    """
    per_epoch = bds_steps_per_epoch(num_cand, bds.cand_batch)
    epoch, s = divmod(step, per_epoch)
    cand = epoch_order(num_cand, bds.seed, epoch)[s * bds.cand_batch:(s + 1) * bds.cand_batch]
    val = np.random.default_rng([bds.seed, 1, step]).choice(num_val, bds.val_batch, replace=num_val < bds.val_batch)
    return val.astype(np.int64), cand.astype(np.int64)


def rank_slice(rows: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Rank ``rank``'s contiguous equal share of ``rows`` (len(rows) must be a multiple of world_size)."""
    return rows.reshape(world_size, -1)[rank]


def generation_requests(table: TokenTable, rows: np.ndarray) -> list[Any]:
    """:class:`raycurate.stages.generation.GenerationRequest` for candidate rows (question id = example id)."""
    from raycurate.stages.generation import GenerationRequest

    return [GenerationRequest(str(table.ids[i]), prompt_ids(table, int(i)).tolist()) for i in rows]


# --------------------------------------------------------------------------------------------- one step


@dataclass
class StepContext:
    """What one BDS step needs; built once per worker.

    Attributes:
        table: Validation rows ``[0, num_val)``, then candidate rows ``[num_val, num_val + num_cand)``.
        online: Latest generated responses of the masked questions (online BMO), or None (offline BDS).
    """

    engine: Any
    table: TokenTable
    num_val: int
    num_cand: int
    cfg: TrainConfig
    bds: BDSSettings
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

    bds, per_epoch = ctx.bds, bds_steps_per_epoch(ctx.num_cand, ctx.bds.cand_batch)
    gamma = bilevel.gamma_schedule(step // per_epoch, bds.rho0, bds.rho_step, bds.rho_max)
    val, cand = step_rows(step, ctx.num_val, ctx.num_cand, bds)
    my_val, my_cand = rank_slice(val, ctx.rank, ctx.world_size), rank_slice(cand, ctx.rank, ctx.world_size)
    total = bds.val_batch + bds.cand_batch
    sigma = bilevel.data_weights(omega_state.omega)
    cand_slots = candidate_slots(ctx, my_cand)
    slots = [int(v) for v in my_val] + cand_slots
    weights = np.concatenate([np.full(len(my_val), total / bds.val_batch),
                              gamma * sigma[my_cand] * total / bds.cand_batch]).astype(np.float32)

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
    betas = cast("tuple[float, float]", tuple(bds.omega_betas))
    omega, adam = bilevel.update_omega(bds.omega_optimizer, omega_state.omega, all_idx, all_losses, gamma,
                                       omega_state.adam, bds.omega_lr, betas, bds.omega_eps, bds.omega_baseline)
    stats = StepStats(loss_sum, float(val_losses.sum()), float(cand_losses.sum()), tokens, supervised,
                      float(all_losses.mean()), gamma, sum(not isinstance(x, int) for x in cand_slots))
    return dataclasses.replace(omega_state, omega=omega, adam=adam).observe(step, all_idx, all_losses), stats


# --------------------------------------------------------------------------------------------- loop


@dataclass
class LoopState:
    """Everything a checkpoint restores besides the engine."""

    train: TrainState
    omega: OmegaState
    curves: BDSCurves
    online: OnlineResponses | None = None


def restore_loop_state(path: str | None, train: TrainState, n: int, digest: str) -> LoopState:
    """The loop state of checkpoint folder ``path`` (None: a fresh run); ``train`` was read with the engine."""
    if path is None:
        return LoopState(train, OmegaState.fresh(n), BDSCurves())
    with open(os.path.join(path, BDS_STATE_FILE)) as f:
        curves = BDSCurves(**json.load(f))
    online_path = os.path.join(path, ONLINE_STATE_FILE)
    online = load_online(online_path) if os.path.exists(online_path) else None
    return LoopState(train, load_omega_state(os.path.join(path, OMEGA_STATE_FILE), digest), curves, online)


def _loop_state_writer(loop: LoopState, digest: str) -> Callable[[str], None]:
    """What rank 0 adds to a BDS checkpoint besides the engine and ``trainer_state.json``."""

    def write(ckpt_dir: str) -> None:
        with open(os.path.join(ckpt_dir, BDS_STATE_FILE), "w") as f:
            json.dump(dataclasses.asdict(loop.curves), f)
        save_omega_state(os.path.join(ckpt_dir, OMEGA_STATE_FILE), loop.omega, digest)
        if loop.online is not None:
            save_online(os.path.join(ckpt_dir, ONLINE_STATE_FILE), loop.online)

    return write


def _check_in_sync(digests: list[str], step: int) -> None:
    if len(set(digests)) != 1:
        raise RuntimeError(f"omega diverged across workers at step {step} (digests {digests}); this is a bug in the "
                           "BDS loop, please report it with the run's config.")


def _bds_metrics(job: BDSJob, loop: LoopState, digests: list[str], start_step: int, run_steps: int,
                 per_epoch: int, world: int, seconds: float, trainable: int) -> dict[str, Any]:
    metrics = run_metrics(job, loop.train, start_step, run_steps, per_epoch, world, seconds, trainable)
    sigma = bilevel.data_weights(loop.omega.omega)
    metrics.update({
        "method": "bds_online" if loop.online is not None else "bds",
        "variant": job.bds.variant,
        "omega_optimizer": job.bds.omega_optimizer,
        "omega_baseline": job.bds.omega_baseline,
        **{k: list(v) for k, v in dataclasses.asdict(loop.curves).items()},
        "masked_questions": len(loop.online.sequences) if loop.online is not None else 0,
        "omega_digests": digests,
        "sigma_min": float(sigma.min()),
        "sigma_max": float(sigma.max()),
    })
    return metrics


def _maybe_generate(hook: GenerationHook | None, ctx: StepContext, loop: LoopState, step: int,
                    cand_table: TokenTable) -> None:
    """Algorithm 1, lines 5-7: every K_gen steps, new responses (and pi_old) for the masked questions."""
    every = ctx.bds.generation_every
    if hook is None or not every or (step + 1) % every != 0:
        return
    rows = hook(step, loop.omega.omega.copy(), ctx.engine.module)
    if rows is not None:
        loop.online = ctx.online = online_from_rows(rows, cand_table, step)
    loop.curves.generation_steps.append(step)


def bds_train_loop(job: BDSJob, session: TrainSession, generation_hook: GenerationHook | None = None) -> dict:
    """The per-worker BDS loop: build, restore, alternate theta and omega steps, checkpoint, export.

    Args:
        job: Inputs, outputs and settings.
        session: Runtime (rank, world size, device, checkpoint restore/report).
        generation_hook: Online BMO: called every ``bds.generation_every`` steps (see :class:`GenerationHook`).

    Returns:
        The final metrics (same on every rank; rank 0 also writes them and ``weights.parquet`` to ``output_dir``).
    """
    import torch

    cfg, bds, device = job.cfg, job.bds, session.device
    accum = check_bds_batches(cfg, bds, session.world_size)
    torch.manual_seed(cfg.seed + session.rank)
    val_table, cand_table = load_token_table(job.validation_table), load_token_table(job.candidate_table)
    per_epoch = bds_steps_per_epoch(len(cand_table), bds.cand_batch)
    run_steps = bds_total_steps(len(cand_table), cfg, bds)
    digest = ids_digest(cand_table.ids)
    with session.restore_dir() as ckpt_dir:
        engine, trainable, pad_id, train_state = build_resumed_engine(job, run_steps, session, ckpt_dir)
        loop = restore_loop_state(ckpt_dir, train_state, len(cand_table), digest)
    state, curves = loop.train, loop.curves
    if state.step > run_steps:
        raise ValueError(f"the checkpoint being resumed is at step {state.step}, beyond this run's {run_steps} steps; "
                         "raise train.max_steps, or delete the run's checkpoints to train from scratch")
    ctx = StepContext(engine, stack_tables(val_table, cand_table), len(val_table), len(cand_table), cfg, bds,
                      session.rank, session.world_size, device, pad_id, accum, loop.online)
    start_step, started = state.step, time.perf_counter()
    if session.rank == 0:
        logger.info("BDS (%s): %d candidates, %d validation rows, %d steps/epoch, steps %d -> %d, world %d",
                    bds.variant, len(cand_table), len(val_table), per_epoch, start_step, run_steps, session.world_size)
    clock = CheckpointClock(cfg.checkpoint_every_minutes)  # plus the step cadence: a long epoch resumes mid-way
    for step in range(start_step, run_steps):
        _maybe_generate(generation_hook, ctx, loop, step, cand_table)
        step_started, step_lr = time.perf_counter(), engine.lr()
        loop.omega, stats = bds_step(ctx, loop.omega, step)
        loss_sum, val_sum, cand_sum, tokens, supervised, online, clock_due = all_reduce_sum(
            [stats.loss_sum, stats.val_loss_sum, stats.cand_loss_sum, stats.tokens, stats.supervised,
             stats.online_slots, clock.due_flag()], device)
        state.step = step + 1
        state.loss_per_step.append(loss_sum / (accum * session.world_size))
        state.lr_per_step.append(step_lr)
        state.tokens += int(tokens)
        state.supervised_tokens += int(supervised)
        state.examples += bds.val_batch + bds.cand_batch
        state.seconds += time.perf_counter() - step_started
        curves.gamma_per_step.append(stats.gamma)
        curves.val_loss_per_step.append(val_sum / bds.val_batch)
        curves.cand_loss_per_step.append(cand_sum / bds.cand_batch)
        curves.omega_loss_per_step.append(stats.omega_loss_mean)
        curves.online_questions_per_step.append(int(online))
        if state.step % per_epoch == 0 or state.step == run_steps:
            loop.omega = loop.omega.snapshot(step // per_epoch, state.step)
        if session.rank == 0 and (state.step % cfg.log_every_steps == 0 or state.step == run_steps):
            logger.info("step %d/%d loss %.4f val %.4f cand %.4f gamma %.3f", state.step, run_steps,
                        state.loss_per_step[-1], curves.val_loss_per_step[-1], curves.cand_loss_per_step[-1],
                        stats.gamma)
        if should_checkpoint(state.step, run_steps, per_epoch, cfg.checkpoint_every_steps) or clock_due > 0:
            digests = gathered_omega_digests(loop.omega.omega, device)
            _check_in_sync(digests, state.step)
            metrics = _bds_metrics(job, loop, digests, start_step, run_steps, per_epoch, session.world_size,
                                   time.perf_counter() - started, trainable)
            save_checkpoint(engine, session, loop.train, metrics, cfg, _loop_state_writer(loop, digest))
            clock.saved()

    digests = gathered_omega_digests(loop.omega.omega, device)
    _check_in_sync(digests, state.step)
    metrics = _bds_metrics(job, loop, digests, start_step, run_steps, per_epoch, session.world_size,
                           time.perf_counter() - started, trainable)
    metrics["weights_file"] = WEIGHTS_FILE  # relative: an absolute path named the stage's temporary folder
    export_hf(engine, job, metrics, session)
    if session.rank == 0:
        write_weights(job.output_dir, cand_table.ids, loop.omega)
    session.report(metrics, None)
    return metrics


def bds_entry(config: dict[str, Any], session: TrainSession) -> None:
    """Worker entry of ``launch_trainer`` for BDS: ``config`` holds ``job`` and (or None) ``generation_hook``."""
    prepare_worker(config["job"])
    bds_train_loop(config["job"], session, config.get("generation_hook"))


# --------------------------------------------------------------------------------------------- driver


def run_bds(candidate_table: str, validation_table: str, init_model: str, output_dir: str, cfg: TrainConfig,
            bds_cfg: BDSSettings, *, storage_dir: str, name: str, adapter: dict[str, Any] | None = None,
            generation_hook: GenerationHook | None = None) -> dict:
    """Learn omega and fine-tune ``init_model`` with BDS on Ray Train (online BMO with a generation hook).

    Args:
        candidate_table: Token table (parquet file or directory) of the low-quality candidates.
        validation_table: Token table of the high-quality validation set (the upper level).
        init_model: Local HF checkpoint directory.
        output_dir: Where the HF model, tokenizer files, ``train_metrics.json`` and ``weights.parquet`` go.
        cfg: theta's training config (engine, workers, lr, micro/effective batch, epochs, ...).
        bds_cfg: Bilevel settings.
        storage_dir: Checkpoint storage; a run resumes from the latest checkpoint in ``storage_dir/name``.
        name: Ray Train run name.
        adapter: ``raycurate.models.adapters`` spec (e.g. ``{"kind": "lora", "r": 16, "alpha": 16}``), or None
            for full fine-tuning.
        generation_hook: Online BMO (with ``bds_cfg.generation_every``): a picklable :class:`GenerationHook`
            (e.g. holding a generation pool's actor handles), shipped to every worker.

    Returns:
        The metrics of ``train_metrics.json`` (SFT's plus ``gamma_per_step``, ``val_loss_per_step``,
        ``cand_loss_per_step``, ``omega_loss_per_step``, ``omega_digests``, ``weights_file`` (relative), ...).
    """
    check_launcher(cfg)  # fail on the driver, before any worker starts
    check_bds_batches(cfg, bds_cfg, cfg.num_workers)
    if not os.path.isdir(init_model):
        raise FileNotFoundError(f"init_model={init_model} is not a directory; pass a local HF checkpoint dir.")
    use_gpu, cpus = worker_resources(cfg)
    job = BDSJob(os.path.abspath(candidate_table), os.path.abspath(validation_table), os.path.abspath(init_model),
                 os.path.abspath(output_dir), cfg, bds_cfg, use_gpu, cpus, adapter)
    launch_trainer(bds_entry, {"job": job, "generation_hook": generation_hook}, cfg, use_gpu, cpus,
                   storage_dir=storage_dir, name=name)
    with open(os.path.join(job.output_dir, METRICS_FILE)) as f:
        return json.load(f)
